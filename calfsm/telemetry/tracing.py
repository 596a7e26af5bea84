"""OpenTelemetry spans of each generation request (``pip install calfsm[tracing]``).

::

    from opentelemetry.sdk.trace import TracerProvider
    ex = DeviceExecutor(driver, manifest, tracer=provider.get_tracer("calfsm"))
    # or, on a running executor:  RequestTracer(ex, tracer) ... .close()

A :class:`RequestTracer` is an executor observer (:mod:`calfsm.engine.observe`): the
executor does not know it, and without one nothing of this module runs (tracing off
costs nothing). Each stream (``executor.generate``) becomes one span, parented by the
OpenTelemetry context current when it was started (a server's incoming W3C
``traceparent``, an embedder's own span), with children that tile its time::

    calfsm.request          arrival -> end          (finish reason, tokens, error)
    |- calfsm.admission     arrival -> prefill admitted   (queue wait, KV reserved)
    |- calfsm.prefill       admitted -> first token  (prompt cache hit, reused tokens)
    |- calfsm.recovery      a device fault before the first token -> the resume
    |- calfsm.prefill       the replay after a resume (calfsm.replay = true)
    `- calfsm.decode        first token -> end       (tokens, steps, rows per step)

and events on the request span: ``calfsm.device_fault`` (a job of the stream failed on
the device: its generation, error, CalRT code), ``calfsm.recovery`` (the executor is
Ready again on a new generation) and ``calfsm.resume`` (the stream replays its history
there). A request refused at once (429/503, ``request_rejected``) is a request span with
one failed ``calfsm.admission`` child naming the reason, the Retry-After and the
admission estimate's message.

Times are the executor's clock, mapped once to the wall clock (a virtual clock's
spans are as long as its virtual time). The spans are ended on the executor's threads:
give the tracer a ``BatchSpanProcessor`` (bounded queue, its own export thread), so a
slow or dead collector drops spans and never holds a request.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol

try:
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind, Status, StatusCode
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError as e:        # pragma: no cover - the extra is part of dev
    raise ImportError("calfsm.telemetry.tracing needs opentelemetry: "
                      "pip install 'calfsm[tracing]'") from e

from calfsm.engine.observe import DeviceStep, JobEnded, Observer, StreamView
from calfsm.errors import CalfsmError, ErrorCategory
from calfsm.manifest import TaskKind

__all__ = ["RequestTracer", "otlp_tracer_provider"]

#: job errors that are the device's (a fault event on the request span)
_DEVICE = frozenset({ErrorCategory.DEVICE, ErrorCategory.TRANSIENT, ErrorCategory.UNKNOWN,
                     ErrorCategory.ARTIFACT})
_W3C = TraceContextTextMapPropagator()


class Traced(Protocol):
    """What the tracer reads of its executor (a :class:`~calfsm.executor.DeviceExecutor`)."""

    clock: Any

    @property
    def epoch(self) -> Any: ...
    def add_observer(self, observer: Any) -> None: ...
    def remove_observer(self, observer: Any) -> bool: ...


class _Live:
    """One traced stream: its spans and where it is."""

    __slots__ = ("cached", "ctx", "decode", "open", "phase", "replay_at", "root", "rows",
                 "seq_id", "steps", "steps_at")

    def __init__(self, root: Any, ctx: Any, seq_id: int, cached: int) -> None:
        self.root = root
        self.ctx = ctx                  # the context whose span is root
        self.seq_id = seq_id
        self.cached = cached
        self.open: Any = None           # the child span open now (admission, recovery)
        self.phase = "admission"        # admission | recovering | replay | decode
        self.decode: Any = None
        self.replay_at = 0.0
        self.steps = 0                  # decode steps that succeeded
        self.rows = 0                   # device rows and jobs when the decode began
        self.steps_at = 0


class RequestTracer(Observer):
    """The spans of ``executor``'s requests, made with ``tracer`` (an OpenTelemetry
    ``Tracer``). Attaching is an ``executor.add_observer``; :meth:`close` undoes it."""

    def __init__(self, executor: Traced, tracer: Any) -> None:
        self.tracer = tracer
        self._executor: Traced | None = executor
        clock = executor.clock
        self._now = clock.now
        #: the executor's clock seconds -> wall-clock nanoseconds
        self._offset = time.time_ns() - int(clock.now() * 1e9)
        self._lock = threading.Lock()
        self._live: dict[str, _Live] = {}
        self._by_seq: dict[int, _Live] = {}
        self._rows = 0                  # every batch graph job's rows, and the jobs
        self._jobs = 0
        #: the per-job events, observed only while a traced request is live: an
        #: unsampled (or idle) tracer costs the per-token path nothing
        self._tap = _JobTap(self)
        self._tapped = False
        executor.add_observer(self)

    def close(self) -> None:
        """Stop tracing (spans of streams still running are not ended). Idempotent."""
        with self._lock:
            ex, self._executor = self._executor, None
            if ex is not None and self._tapped:
                ex.remove_observer(self._tap)
                self._tapped = False
        if ex is not None:
            ex.remove_observer(self)

    def _ns(self, t: float) -> int:
        return int(t * 1e9) + self._offset

    def traceparent(self, request_id: str) -> str | None:
        """The W3C ``traceparent`` of the live stream ``request_id``'s span (what a
        server answers with), None if it is not traced (ended, or not sampled)."""
        live = self._live.get(request_id)
        if live is None:
            return None
        carrier: dict[str, str] = {}
        _W3C.inject(carrier, context=live.ctx)
        return carrier.get("traceparent")

    def live_requests(self) -> int:
        """Streams traced now (started, not ended)."""
        return len(self._live)

    # ---- the observer --------------------------------------------------------------
    def stream_started(self, stream: StreamView) -> None:
        arrival, started = stream.arrival, stream.started
        seq_id = stream.sequence.seq_id
        root = self.tracer.start_span("calfsm.request", kind=SpanKind.INTERNAL,
                                      start_time=self._ns(arrival))
        if not root.is_recording():
            return                      # not sampled: nothing to keep
        root.set_attributes({
            "calfsm.request_id": stream.request_id, "calfsm.seq_id": seq_id,
            "gen_ai.operation.name": "text_completion",
            "gen_ai.request.max_tokens": stream.params.max_tokens,
            "gen_ai.usage.input_tokens": len(stream.prompt),
            "calfsm.prompt_cache.cached_tokens": stream.cached})
        ctx = trace.set_span_in_context(root)
        live = _Live(root, ctx, seq_id, stream.cached)
        live.open = self.tracer.start_span(
            "calfsm.admission", context=ctx, start_time=self._ns(arrival),
            attributes={"calfsm.front_s": max(0.0, started - arrival)})
        with self._lock:
            self._live[stream.request_id] = live
            self._by_seq[seq_id] = live
            if not self._tapped and self._executor is not None:
                self._executor.add_observer(self._tap)
                self._tapped = True

    def _job_ended(self, event: JobEnded) -> None:
        live = self._live.get(event.request_id)     # type: ignore[arg-type]
        if live is None:
            return
        if event.kind is TaskKind.DECODE and event.outcome == "succeeded":
            live.steps += 1             # the per-token path: one count (one thread a job)
            return
        t = event.timings
        with self._lock:
            if event.kind is not TaskKind.DECODE:
                self._prefill_ended(live, event, t)
            if event.outcome in ("failed", "quarantined") and event.error is not None \
                    and event.error.category in _DEVICE:
                err = event.error
                live.root.add_event("calfsm.device_fault", _error_attrs(err) | {
                    "calfsm.generation": event.generation, "calfsm.job_kind": event.kind.value,
                    "calfsm.job_id": event.job_id}, timestamp=self._ns(t.completed))

    def _prefill_ended(self, live: _Live, event: JobEnded, t: Any) -> None:
        """A prefill of the stream ended: its first (closing the admission) or a replay."""
        ok = event.outcome == "succeeded"
        if live.phase == "admission":
            # (a virtual clock's time 0 is a time too: a job that ran was admitted)
            was_admitted = ok or t.admitted > 0 or t.submitted > 0
            admitted = t.admitted if was_admitted else t.completed
            span = live.open
            live.open = None
            span.set_attributes({
                "calfsm.admission.wait_s": max(0.0, admitted - (t.released or t.accepted)),
                "calfsm.kv.reserved_tokens": event.request.token_count,
                "calfsm.kv.past_tokens": event.request.past_len or 0})
            if not was_admitted:
                span.set_status(Status(StatusCode.ERROR, "never admitted"))
            span.end(self._ns(admitted))
            if not was_admitted:
                self._recovering(live, event, t)
                return
            start, replay = t.admitted, False
        elif live.phase == "replay":
            start, replay = live.replay_at, True
        else:
            return                      # a replay while decoding: the decode span covers it
        span = self.tracer.start_span(
            "calfsm.prefill", context=live.ctx, start_time=self._ns(start), attributes={
                "calfsm.replay": replay, "calfsm.prefill.tokens": event.request.token_count,
                "calfsm.prompt_cache.hit": live.cached > 0 and not replay,
                "calfsm.prompt_cache.reused_tokens": 0 if replay else live.cached,
                "calfsm.device_s": t.device_wait_ms * 1e-3,
                "calfsm.queue_s": max(0.0, t.submitted - t.queued) if t.submitted else 0.0,
                "calfsm.generation": event.generation})
        if not ok:
            span.set_status(Status(StatusCode.ERROR, event.outcome))
        span.end(self._ns(t.completed))
        if not ok:
            self._recovering(live, event, t)
            return
        live.phase = "decode"
        live.rows, live.steps_at = self._rows, self._jobs
        live.decode = self.tracer.start_span("calfsm.decode", context=live.ctx,
                                             start_time=self._ns(t.completed))

    def _recovering(self, live: _Live, event: JobEnded, t: Any) -> None:
        """The stream's prefill failed before its first token: until it resumes (or
        ends), its time is the recovery's."""
        live.phase = "recovering"
        live.open = self.tracer.start_span(
            "calfsm.recovery", context=live.ctx, start_time=self._ns(t.completed),
            attributes={"calfsm.failed_generation": event.generation})

    def stream_resumed(self, stream: StreamView) -> None:
        live = self._live.get(stream.request_id)
        if live is None:
            return
        now = self._now()
        epoch = self._executor.epoch if self._executor is not None else None
        generation = epoch.generation if epoch is not None else -1
        with self._lock:
            live.root.add_event("calfsm.recovery", {"calfsm.generation": generation},
                                timestamp=self._ns(now))
            live.root.add_event("calfsm.resume", {
                "calfsm.generation": generation,
                "calfsm.replay_tokens": len(stream.prompt) + max(0, live.steps),
                "calfsm.phase": live.phase}, timestamp=self._ns(now))
            if live.phase == "recovering":
                span, live.open = live.open, None
                span.set_attribute("calfsm.generation", generation)
                span.end(self._ns(now))
                live.phase, live.replay_at = "replay", now

    def stream_ended(self, stream: StreamView, result: Any) -> None:
        with self._lock:
            live = self._live.pop(stream.request_id, None)
            if live is None:
                return
            if self._by_seq.get(live.seq_id) is live:
                del self._by_seq[live.seq_id]
            if not self._live and self._tapped and self._executor is not None:
                self._executor.remove_observer(self._tap)
                self._tapped = False
        end = self._ns(self._now())
        error = result.error
        if live.open is not None:           # ended before its first token
            if error is not None:
                live.open.set_status(Status(StatusCode.ERROR, error.message))
            live.open.end(end)
        if live.decode is not None:
            steps = self._jobs - live.steps_at
            live.decode.set_attributes({
                "calfsm.decode.tokens": result.usage.completion_tokens,
                "calfsm.decode.steps": live.steps,
                # no batch graph job while it decoded: each decode was a job of one row
                "calfsm.decode.rows_per_step":
                    (self._rows - live.rows) / steps if steps else 1.0})
            live.decode.end(end)
        root = live.root
        attrs: dict[str, Any] = {
            "gen_ai.response.finish_reasons": (result.finish_reason.value,),
            "gen_ai.usage.output_tokens": result.usage.completion_tokens,
            "calfsm.resumes": result.resumes}
        if result.ttft_s is not None:
            attrs["calfsm.ttft_s"] = result.ttft_s
        root.set_attributes(attrs)
        if error is not None:
            root.set_attributes(_error_attrs(error))
            root.set_status(Status(StatusCode.ERROR, error.message))
        root.end(end)

    def request_rejected(self, error: CalfsmError, reason: str) -> None:
        now = self._ns(self._now())
        live = self._by_seq.get(error.seq_id) if error.seq_id is not None else None
        if live is not None and live.phase == "admission" and live.open is not None:
            # a stream's first step refused at once (a full wait queue): its end follows
            live.open.add_event("calfsm.rejected", _error_attrs(error) | {
                "calfsm.rejection.reason": reason}, timestamp=now)
            return
        root = self.tracer.start_span("calfsm.request", kind=SpanKind.INTERNAL,
                                      start_time=now)
        if not root.is_recording():
            return
        ctx = trace.set_span_in_context(root)
        attrs = _error_attrs(error) | {"calfsm.rejection.reason": reason}
        child = self.tracer.start_span("calfsm.admission", context=ctx, start_time=now,
                                       attributes=attrs)
        if error.stage == "capacity":       # the admission estimate, in its words
            child.set_attribute("calfsm.admission.estimate", error.message)
        for span in (child, root):
            span.set_status(Status(StatusCode.ERROR, error.message))
        child.end(now)
        root.set_attributes(attrs)
        root.end(now)

    def _device_step(self, step: DeviceStep) -> None:
        self._rows += step.rows
        self._jobs += 1


class _JobTap(Observer):
    """The tracer's per-job events (a job's end, a batch job's rows): registered while
    a traced request is live, so the per-token path pays for them only then."""

    def __init__(self, owner: RequestTracer) -> None:
        self._owner = owner

    def job_ended(self, event: JobEnded) -> None:
        self._owner._job_ended(event)

    def device_step(self, step: DeviceStep) -> None:
        self._owner._device_step(step)


def _error_attrs(err: CalfsmError) -> dict[str, Any]:
    attrs: dict[str, Any] = {"error.type": type(err).__name__,
                             "calfsm.error.category": err.category.value,
                             "http.response.status_code": err.http_status,
                             "calfsm.error.retryable": err.retryable}
    if err.retry_after_s is not None:
        attrs["calfsm.retry_after_s"] = err.retry_after_s
    if err.calrt_code is not None:
        attrs["calfsm.calrt_code"] = err.calrt_code
    return attrs


def otlp_tracer_provider(endpoint: str, *, service_name: str = "calfsm",
                         max_queue_size: int = 2048, export_timeout_s: float = 5.0) -> Any:
    """A ``TracerProvider`` exporting to the OTLP/HTTP collector at ``endpoint`` (e.g.
    ``http://127.0.0.1:4318/v1/traces``) through a ``BatchSpanProcessor``: spans wait
    in a bounded queue (``max_queue_size``; past it they are dropped) for the
    processor's own thread, so a slow or dead collector never holds a request. The
    sampler is the SDK's (``OTEL_TRACES_SAMPLER``; default: every trace, or as its
    parent was)."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as e:
        raise ImportError("OTLP export needs the tracing extra: "
                          "pip install 'calfsm[tracing]'") from e
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(
        OTLPSpanExporter(endpoint=endpoint, timeout=export_timeout_s),
        max_queue_size=max_queue_size, max_export_batch_size=min(512, max_queue_size),
        export_timeout_millis=export_timeout_s * 1e3))
    return provider
