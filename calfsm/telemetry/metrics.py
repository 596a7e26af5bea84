"""Prometheus metrics of one executor, for any embedding (``pip install calfsm[metrics]``).

::

    from calfsm.telemetry.metrics import ExecutorMetrics
    m = ExecutorMetrics(executor)                 # or registry=prometheus_client.REGISTRY
    prometheus_client.generate_latest(m.registry)  # what /metrics serves
    m.close()                                     # detach (idempotent)

Two sources, so a scrape costs the executor nothing it does not already keep:

- **events** (:class:`~calfsm.engine.observe.Observer`): the histograms and the per-event
  counters are fed when a job or a stream ends, from the job's own
  :class:`~calfsm.engine.job.JobTimings` and the stream's
  :class:`~calfsm.generate.stream.GenerationResult` (spec 10.3: per-job timings, aggregated into
  histograms when the request ends). They count from the moment the metrics attach.
- **the executor's own books**, read at scrape time by a custom collector:
  ``executor.stats()`` (the job, error, recovery and stale-completion counters, since
  the executor started), the lifecycle, the buffer pool and the KV coordinator of the
  current generation. A scrape never runs the no-progress watchdog of
  ``executor.health()``.

Names follow Prometheus' conventions and vLLM's serving set: a ``calfsm_`` prefix (the
``namespace``), base units (seconds), ``_total`` on counters, labels with few values.
``docs/metrics.md`` lists every metric with its labels and meaning.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

try:
    from prometheus_client import CollectorRegistry, Counter, Histogram
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
except ImportError as e:        # pragma: no cover - the extra is part of dev
    raise ImportError("calfsm.telemetry.metrics needs prometheus-client: "
                      "pip install 'calfsm[metrics]'") from e

from calfsm.engine.observe import JOB_OUTCOMES, REJECTION_REASONS, DeviceStep, JobEnded, Observer
from calfsm.errors import ErrorCategory, ResourceExhausted
from calfsm.generate.promptcache import EVICTION_CAUSES, PromptCacheStats
from calfsm.generate.stream import FinishReason
from calfsm.machines.lifecycle import LifecycleState
from calfsm.manifest import TaskKind

if TYPE_CHECKING:
    from calfsm.clock import Clock
    from calfsm.config import ExecutorStats
    from calfsm.engine.epoch import Epoch
    from calfsm.engine.lifecycle import Lifecycle
    from calfsm.generate.stream import GenerationResult, Stream

__all__ = ["DEVICE_BUCKETS", "E2E_BUCKETS", "REJECTIONS", "TPOT_BUCKETS", "TTFT_BUCKETS",
           "ExecutorMetrics"]

#: time to first token (seconds): a prefill on the device, plus any wait for it
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
#: time per output token (seconds): one decode step, as the stream's consumer sees it
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04,
                0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
#: a whole request (seconds)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0,
               30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)
#: the parts of one job (seconds): admission, queue, device
DEVICE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025,
                  0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: rows per batch job: every count up to 8, then powers of two
BATCH_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64)

#: the ``reason`` label of ``calfsm_rejections_total``: the refusals at the door
#: (:data:`calfsm.engine.observe.REJECTION_REASONS`) and a job larger than the whole KV budget
REJECTIONS = (*REJECTION_REASONS, "kv_budget")


class Observed(Protocol):
    """What the metrics read of the executor they observe (a
    :class:`~calfsm.executor.DeviceExecutor`): telemetry sits below the façade, so it
    names the façade by what it offers instead of importing it."""

    clock: Clock

    @property
    def epoch(self) -> Epoch | None: ...
    @property
    def lifecycle(self) -> Lifecycle: ...
    @property
    def lifecycle_state(self) -> str: ...
    def prompt_cache_stats(self) -> PromptCacheStats | None: ...
    def stats(self) -> ExecutorStats: ...
    def add_observer(self, observer: Any) -> None: ...
    def remove_observer(self, observer: Any) -> bool: ...


class ExecutorMetrics(Observer):
    """The metrics of ``executor`` in ``registry`` (a new ``CollectorRegistry`` when
    None). Attaching is an ``executor.add_observer``; :meth:`close` undoes it and takes
    the metrics out of the registry, so another executor's metrics may take the names."""

    def __init__(self, executor: Observed, registry: CollectorRegistry | None = None,
                 namespace: str = "calfsm") -> None:
        self.registry = CollectorRegistry() if registry is None else registry
        self.namespace = namespace
        self._executor: Observed | None = executor
        self._clock = executor.clock
        self._lock = threading.Lock()
        #: the streams seen starting, by request id: when their first prefill was
        #: admitted (None until it was)
        self._running: dict[str, float | None] = {}
        ns = namespace

        def hist(name: str, doc: str, buckets: tuple[float, ...],
                 labels: tuple[str, ...] = ()) -> Histogram:
            return Histogram(name, doc, labels, namespace=ns, buckets=buckets,
                             registry=None)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels, namespace=ns, registry=None)

        self.ttft = hist("time_to_first_token_seconds",
                         "Time from a request's arrival to its first token.", TTFT_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds",
                         "Time between two consecutive tokens of a stream (one "
                         "observation per gap).", TPOT_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds",
                        "Time from a request's arrival to its end, whatever the reason.",
                        E2E_BUCKETS)
        # the split of a request's time (vLLM separates queue time from TTFT the same
        # way): front + queue + prefill = TTFT, and + decode = e2e
        self.front_time = hist("request_front_time_seconds",
                               "Time from a request's arrival to its stream's creation "
                               "(the server's read, parse and tokenization).", E2E_BUCKETS)
        self.request_queue = hist("request_queue_time_seconds",
                                  "Time from a stream's creation to its prefill's "
                                  "admission (the wait for KV and a buffer slot).",
                                  TTFT_BUCKETS)
        self.prefill_time = hist("request_prefill_time_seconds",
                                 "Time from a stream's prefill's admission to its first "
                                 "token.", TTFT_BUCKETS)
        self.decode_time = hist("request_decode_time_seconds",
                                "Time from a stream's first token to its end.",
                                E2E_BUCKETS)
        self.queue_time = hist("job_queue_time_seconds",
                               "Time a job waited in the submit queue (prepared to "
                               "submitted), for jobs that reached the device.",
                               DEVICE_BUCKETS, ("kind",))
        self.admission_wait = hist("job_admission_wait_seconds",
                                   "Time a job waited for its KV reservation and a "
                                   "buffer slot, for jobs that were admitted.",
                                   DEVICE_BUCKETS, ("kind",))
        self.device_time = hist("job_device_time_seconds",
                                "Time the completion side waited for the device to "
                                "finish a job (its Wait), for jobs that reached it.",
                                DEVICE_BUCKETS, ("kind",))
        self.job_latency = hist("job_latency_seconds",
                                "Time from a job's acceptance to its end, every job but "
                                "a discarded prepared step.", DEVICE_BUCKETS, ("kind",))
        self.finished = counter("requests_finished",
                                "Streams ended, by finish reason.", ("finish_reason",))
        self.rejections = counter("rejections",
                                  "Requests refused at once, by reason.", ("reason",))
        self.resumes = counter("resumes",
                               "Stream replays after a device reset lost their KV.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of ended streams.")
        self.generation_tokens = counter("generation_tokens",
                                         "Tokens delivered by ended streams.")
        self.batch_rows = hist("batch_rows",
                               "Rows (streams' steps) per device job of a batch graph "
                               "(continuous batching; one observation per job).",
                               BATCH_BUCKETS, ("kind",))
        self.padding_rows = counter("batch_padding_rows",
                                    "Rows of batch graph jobs that carried nothing (the "
                                    "graph's max_batch minus the rows it ran).", ("kind",))
        self.graph_steps = counter("graph_steps",
                                   "Device jobs by graph (shape buckets: which compiled "
                                   "graph each step ran on).", ("graph",))
        self.graph_rows = counter("graph_rows",
                                  "Rows (streams' steps) the jobs of each graph carried.",
                                  ("graph",))
        self.graph_padded_rows = counter("graph_padded_rows",
                                         "Rows of each graph's jobs that carried nothing.",
                                         ("graph",))
        for r in FinishReason:
            self.finished.labels(r.value)
        for r in REJECTIONS:
            self.rejections.labels(r)
        self._metrics = (self.ttft, self.tpot, self.e2e, self.front_time,
                         self.request_queue, self.prefill_time, self.decode_time,
                         self.queue_time,
                         self.admission_wait, self.device_time, self.job_latency,
                         self.finished, self.rejections, self.resumes, self.prompt_tokens,
                         self.generation_tokens, self.batch_rows, self.padding_rows,
                         self.graph_steps, self.graph_rows, self.graph_padded_rows)
        self._by_kind: dict[Any, tuple[Any, Any, Any, Any]] = {}
        self._collector = _BooksCollector(self)
        registered: list[Any] = []
        try:
            for m in (*self._metrics, self._collector):
                self.registry.register(m)
                registered.append(m)
            executor.add_observer(self)
        except BaseException:
            for m in registered:
                self.registry.unregister(m)
            raise

    @property
    def executor(self) -> Observed | None:
        """The executor observed (None after :meth:`close`)."""
        return self._executor

    def close(self) -> None:
        """Stop observing and leave the registry. Idempotent."""
        with self._lock:
            ex, self._executor = self._executor, None
        if ex is None:
            return
        ex.remove_observer(self)
        for m in (*self._metrics, self._collector):
            self.registry.unregister(m)

    def running_streams(self) -> int:
        """Streams seen starting that have not ended."""
        return len(self._running)

    # ---- the observer --------------------------------------------------------------
    def _children(self, kind: Any) -> tuple[Any, Any, Any, Any]:
        children = self._by_kind.get(kind)
        if children is None:
            label = kind.value
            children = self._by_kind[kind] = (
                self.admission_wait.labels(label), self.queue_time.labels(label),
                self.device_time.labels(label), self.job_latency.labels(label))
        return children

    def job_ended(self, event: JobEnded) -> None:
        outcome = event.outcome
        if outcome == "discarded":
            return
        t = event.timings
        admission, queue, device, latency = self._children(event.kind)
        start = t.released or t.accepted
        if t.admitted:
            admission.observe(max(0.0, t.admitted - start))
        if t.submitted:
            queue.observe(max(0.0, t.submitted - t.queued))
            device.observe(t.device_wait_ms * 1e-3)
        latency.observe(max(0.0, t.completed - start), _exemplar(event.request_id))
        if event.kind is not TaskKind.DECODE and event.request_id in self._running \
                and self._running[event.request_id] is None \
                and (outcome == "succeeded" or t.admitted > 0):
            self._running[event.request_id] = t.admitted    # a stream's first prefill
        if outcome == "failed" and isinstance(event.error, ResourceExhausted):
            self.rejections.labels("kv_budget").inc()   # larger than the whole budget

    def stream_started(self, stream: Stream) -> None:
        with self._lock:
            self._running[stream.request_id] = None

    def stream_resumed(self, stream: Stream) -> None:
        self.resumes.inc()

    def stream_ended(self, stream: Stream, result: GenerationResult) -> None:
        with self._lock:
            admitted = self._running.pop(stream.request_id, None)
        self.finished.labels(result.finish_reason.value).inc()
        exemplar = _exemplar(stream.request_id)
        arrival, started, now = stream.arrival, stream.started, self._clock.now()
        self.front_time.observe(max(0.0, started - arrival))
        if result.ttft_s is not None:
            self.ttft.observe(result.ttft_s, exemplar)
            first = arrival + result.ttft_s
            if admitted is not None:
                self.request_queue.observe(max(0.0, admitted - started))
                self.prefill_time.observe(max(0.0, first - admitted))
            self.decode_time.observe(max(0.0, now - first))
        for gap in result.inter_token_s:
            self.tpot.observe(gap)
        self.e2e.observe(max(0.0, now - arrival), exemplar)
        self.prompt_tokens.inc(result.usage.prompt_tokens)
        self.generation_tokens.inc(result.usage.completion_tokens)

    def request_rejected(self, error: Any, reason: str) -> None:
        self.rejections.labels(reason).inc()

    def device_step(self, step: DeviceStep) -> None:
        self.batch_rows.labels(step.kind.value).observe(step.rows)
        if step.capacity > step.rows:
            self.padding_rows.labels(step.kind.value).inc(step.capacity - step.rows)
        if step.graph:
            self.graph_steps.labels(step.graph).inc()
            self.graph_rows.labels(step.graph).inc(step.rows)
            self.graph_padded_rows.labels(step.graph).inc(step.capacity - step.rows)


def _unlabelled(kind: type, name: str, doc: str, value: float | None) -> Metric:
    """A family of ``kind`` with one sample of ``value`` (none while it is None)."""
    m = kind(name, doc)
    if value is not None:
        m.add_metric([], value)
    return m


def _prompt_cache_families(ns: str, pc: PromptCacheStats | None) -> Iterator[Metric]:
    """The prompt cache's counters and gauges (no samples while it is off)."""
    def family(kind: type, name: str, doc: str, value: float | None) -> Metric:
        return _unlabelled(kind, ns + "prompt_cache_" + name, doc, value)

    yield family(CounterMetricFamily, "hits", "Generates that took a cached sequence and "
                 "prefilled only the rest of their prompt.", pc and pc.hits)
    yield family(CounterMetricFamily, "misses", "Generates (prompt cache on) that found "
                 "no cached prefix to reuse.", pc and pc.misses)
    yield family(CounterMetricFamily, "reused_tokens", "Prompt tokens the hits did not "
                 "prefill (their KV came from the cache).", pc and pc.reused_tokens)
    evictions = CounterMetricFamily(ns + "prompt_cache_evictions",
                                    "Cached sequences released, by cause.",
                                    labels=["cause"])
    if pc is not None:
        for cause in EVICTION_CAUSES:
            evictions.add_metric([cause], pc.evictions[cause])
    yield evictions
    yield family(GaugeMetricFamily, "sequences", "Sequences the prompt cache keeps warm.",
                 pc and pc.sequences)
    yield family(GaugeMetricFamily, "tokens", "Tokens of KV the cached sequences hold.",
                 pc and pc.tokens)


class _BooksCollector:
    """The gauges and the executor's own counters, read when Prometheus scrapes."""

    def __init__(self, owner: ExecutorMetrics) -> None:
        self._owner = owner

    def describe(self) -> list[Metric]:
        return list(self._families(None))

    def collect(self) -> Iterator[Metric]:
        ex = self._owner.executor
        if ex is None:
            return iter(())
        return self._families(ex)

    def _families(self, ex: Observed | None) -> Iterator[Metric]:
        ns = self._owner.namespace + "_"
        stats = ex.stats() if ex is not None else None
        epoch = ex.epoch if ex is not None else None
        pool = epoch.pool.stats() if epoch is not None else None
        kv = epoch.kv.stats() if epoch is not None else None

        def gauge(name: str, doc: str, value: float | None) -> Metric:
            return _unlabelled(GaugeMetricFamily, ns + name, doc, value)

        def total(name: str, doc: str, value: float | None) -> Metric:
            return _unlabelled(CounterMetricFamily, ns + name, doc, value)

        jobs = CounterMetricFamily(ns + "jobs", "Jobs ended, by outcome.",
                                   labels=["outcome"])
        errors = CounterMetricFamily(ns + "errors",
                                     "Jobs ended with an error (cancels included), by "
                                     "error category.", labels=["category"])
        if stats is not None:
            for outcome in JOB_OUTCOMES:
                jobs.add_metric([outcome], getattr(stats, outcome))
            by_cat = stats.errors_by_category
            for cat in ErrorCategory:
                errors.add_metric([cat.value], by_cat.get(cat.value, 0))
        yield jobs
        yield errors
        yield total("jobs_accepted", "Jobs accepted.", stats and stats.accepted)
        yield total("jobs_requeued", "Jobs put back after a transient submit error.",
                    stats and stats.requeued)
        yield total("recoveries", "Device recoveries (drain, reset, new generation).",
                    stats and stats.recoveries)
        yield total("stale_completions", "Completions of a retired generation, dropped.",
                    stats and stats.stale_completions)

        yield gauge("num_requests_running", "Streams generating now (seen starting).",
                    self._owner.running_streams() if ex is not None else None)
        yield gauge("num_requests_waiting",
                    "Jobs accepted and not yet on the device (what max_waiting bounds).",
                    stats and stats.queued)
        yield gauge("jobs_inflight", "Jobs on the device.", stats and stats.inflight)
        yield gauge("buffers_leased", "Buffer slots lent to jobs (current generation).",
                    pool and pool.leased)
        yield gauge("buffers_quarantined",
                    "Buffer slots quarantined, never lent again (current generation).",
                    pool and pool.quarantined)
        yield gauge("buffers_total", "Buffer slots (current generation).",
                    pool and pool.total)
        yield gauge("kv_tokens_used", "KV tokens held by open reservations.",
                    kv and kv.budget_used)
        yield gauge("kv_token_budget", "KV tokens the reservations may hold at once.",
                    kv and kv.token_budget)
        yield gauge("kv_usage_ratio", "kv_tokens_used / kv_token_budget (0 to 1).",
                    kv and (kv.budget_used / kv.token_budget if kv.token_budget else 0.0))
        yield gauge("generation", "The device's model generation (+1 per recovery).",
                    stats and stats.generation)
        yield from _prompt_cache_families(ns, ex.prompt_cache_stats() if ex else None)
        yield gauge("ready", "1 while the lifecycle is Ready and admission open, else 0.",
                    None if ex is None else float(ex.lifecycle.ready))
        state = GaugeMetricFamily(ns + "lifecycle_state",
                                  "The lifecycle state, one-hot: 1 for the current one.",
                                  labels=["state"])
        if ex is not None:
            now = ex.lifecycle_state
            for s in LifecycleState:
                state.add_metric([s.value], float(s.value == now))
        yield state


#: OpenMetrics bounds an exemplar's label names and values to 128 characters in all
_EXEMPLAR_ROOM = 128 - len("request_id")


def _exemplar(request_id: str | None) -> dict[str, str] | None:
    """The exemplar naming the request an observation came from (shown in the
    OpenMetrics exposition: ``Accept: application/openmetrics-text``)."""
    return None if request_id is None else {"request_id": request_id[:_EXEMPLAR_ROOM]}
