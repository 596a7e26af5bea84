"""DeviceExecutor: the public face of the pipeline (spec sections 5, 6, 9).

The executor wires four parts, each the one owner of its state:

- :class:`~calfsm.engine.lifecycle.Lifecycle` — the lifecycle record, its lock and the
  admission gate; :class:`~calfsm.engine.lifecycle.DeviceLifecycle` runs start-up, recovery,
  model switch and rollback;
- :class:`~calfsm.engine.pipeline.Pipeline` — the sans-thread core: queues, in-flight
  accounting and the admit / prepare / submit / complete steps;
- :class:`~calfsm.engine.recovery.FaultPolicy` — an error in, a decision out, from the one
  error table;
- a runtime (:mod:`calfsm.runtime.drive`) — worker threads, or nothing at all in step mode
  (``ExecutorConfig(threaded=False)``), where :class:`~calfsm.runtime.stepper.StepScheduler`
  drives the same steps through :attr:`DeviceExecutor.steps`.

The data flow, invariants, lock order and the machines are described in
``docs/architecture.md``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import attrs

from calfsm.config import ExecutorConfig, ExecutorStats, Health
from calfsm.drivers.base import Calbin, Driver
from calfsm.engine.epoch import WARMUP_SEQ, Epoch
from calfsm.engine.face import JobFace
from calfsm.engine.job import InferenceResult, JobContext, JobHandle, Request
from calfsm.engine.kv import SeqState
from calfsm.engine.lifecycle import DeviceLifecycle, Lifecycle, epoch_builder
from calfsm.engine.observe import Observers
from calfsm.engine.pipeline import COUNTERS, Pipeline, PipelineTimeouts
from calfsm.engine.recovery import FaultPolicy
from calfsm.engine.stepcost import ServiceModel
from calfsm.errors import (
    CalfsmError,
    Cancelled,
    ExecutorClosed,
    ResourceExhausted,
    Unavailable,
)
from calfsm.generate.arguments import check_n
from calfsm.generate.front import Front
from calfsm.generate.liverequests import LiveRequests, RequestInfo
from calfsm.generate.livestreams import LiveStreams
from calfsm.generate.promptcache import PromptCache, PromptCacheStats
from calfsm.generate.sampling import SamplingParams
from calfsm.generate.sequence import Sequence, SequenceAllocator
from calfsm.generate.stream import Stream, judge_stream, max_new_tokens
from calfsm.generate.tokenizer import Tokenizer, check_tokenizer, encode_prompt
from calfsm.manifest import Manifest, TaskKind
from calfsm.plan.batching import plan_batching
from calfsm.plan.buckets import plan_buckets
from calfsm.plan.inflight import plan_inflight
from calfsm.runtime.drive import StepRuntime, Steps, ThreadRuntime
from calfsm.runtime.stepper import StepScheduler
from calfsm.runtime.sync import THREADS
from calfsm.runtime.waits import wait_admitted, wait_for_state
from calfsm.telemetry.dump import DumpSink
from calfsm.util.lazy import asyncio_module

__all__ = ["DeviceExecutor", "ExecutorConfig", "ExecutorStats", "Health"]

log = logging.getLogger("calfsm.executor")

class DeviceExecutor:
    """Runs inference jobs on one device through a driver. Use as a context manager.

    Blocking calls: the constructor (start-up and warm-up), :meth:`close`,
    :meth:`recover` (returns at once), :meth:`switch_model`, :meth:`wait_lifecycle` and,
    in threaded mode, :meth:`enqueue` (it waits for admission). From asyncio, run them
    in a worker thread (``asyncio.to_thread``); ``await handle`` never blocks the loop.

    ``tokenizer`` (a :class:`~calfsm.generate.tokenizer.Tokenizer`, e.g.
    :class:`~calfsm.generate.tokenizer.ByteTokenizer` or
    :class:`~calfsm.generate.tokenizer.HFTokenizer`):
    streams then take text prompts and stop strings, and their events carry text.
    ``tracer`` (an OpenTelemetry ``Tracer``): a span tree per generation request
    (:mod:`calfsm.telemetry.tracing`, :attr:`request_tracer`); None: no tracing, at no cost.
    """

    def __init__(self, driver: Driver, manifest: Manifest,
                 config: ExecutorConfig | None = None, *, calbin: Calbin | None = None,
                 tokenizer: Tokenizer | None = None, tracer: Any = None) -> None:
        #: the streams' text: prompts, event text, stop strings (None: token ids only)
        self.tokenizer = None if tokenizer is None else check_tokenizer(tokenizer)
        self.driver = driver
        self.config = cfg = config or ExecutorConfig()
        self.clock = driver.clock
        plan = plan_inflight(cfg.max_inflight, driver, evidence_dir=cfg.evidence_dir)
        batching = plan_batching(manifest, driver, requested=cfg.max_batch,
                                 evidence_dir=cfg.evidence_dir)
        shapes = plan_buckets(manifest, driver, evidence_dir=cfg.evidence_dir)
        self._notes: tuple[str, ...] = tuple(p.note for p in (plan, batching, shapes)
                                             if p.note)
        for note in self._notes:
            log.warning("%s", note, extra={"stage": "config"})
        if plan.proof:
            log.info("two in flight on Ping/Pong: %s", plan.proof, extra={"stage": "config"})
        if batching.proof:
            log.info("continuous batching, %d rows per step: %s", batching.max_rows,
                     batching.proof, extra={"stage": "config"})
        if shapes.proof:
            log.info("shape buckets: %s", shapes.proof, extra={"stage": "config"})
        #: rows one device step carries at most (1: no batching; calfsm/plan/batching.py)
        self.max_batch = batching.max_rows
        engines = plan.engines
        # the engine's locks and latch waits are the runtime's, in both modes (step mode
        # is called from callers' threads too)
        self._life = life = Lifecycle(self.clock, THREADS)
        self.faults = FaultPolicy(cfg.recovery, sync=THREADS)
        #: what a step is expected to cost (hang detection) and costs (admission)
        self.service = ServiceModel(manifest.timing,
                                    execution_timeout_s=cfg.execution_timeout_s)
        #: the live streams and jobs by request id (abort, requests)
        self.live_requests = LiveRequests(self.clock)
        #: the live streams and the admission estimate for a new one
        self.live_streams = LiveStreams(self.service, self.clock,
                                        slack=cfg.admission_slack,
                                        enabled=cfg.admission_estimate)
        self._pipeline = Pipeline(
            driver, life, self.faults, max_inflight=plan.max_inflight, engines=engines,
            timeouts=PipelineTimeouts(
                admission_s=cfg.admission_timeout_s, queue_s=cfg.queue_timeout_s,
                default_deadline_s=cfg.default_deadline_s,
                zombie_wait_s=cfg.recovery.zombie_wait_s, max_waiting=cfg.max_waiting,
                priority_aging_s=cfg.priority_aging_s),
            service=self.service, apply=self._apply, drain=self._drain,
            max_rows=batching.max_rows,
            # a window is wall time: on a virtual clock nobody advances it never ends
            batch_window_s=cfg.batch_window_s
            if cfg.threaded and not getattr(self.clock, "virtual", False) else 0.0)
        #: the engine's job-level face, and what the sequences and streams share above
        #: it: the generation API is built on these, never on this facade
        self._jobs = JobFace(self._pipeline, life)
        self._front = Front(self._jobs, live_requests=self.live_requests,
                            live_streams=self.live_streams, tokenizer=self.tokenizer)
        self._control = DeviceLifecycle(
            driver, life, self.faults, self._pipeline, warmup=cfg.warmup,
            service=self.service,
            build=epoch_builder(driver, max_inflight=plan.max_inflight,
                                slots_per_engine=cfg.slots_per_engine,
                                token_budget=cfg.token_budget, engines=engines,
                                sync=THREADS, batch_rows=batching.max_rows,
                                buckets=shapes.buckets))
        self._runtime = (ThreadRuntime if cfg.threaded else StepRuntime)(
            self._pipeline, self._control, life)
        self._sequences = SequenceAllocator(min(cfg.max_sequences, WARMUP_SEQ))
        #: one-shot streams' sequences kept warm for the next prompt (None: off)
        self._cache = None if cfg.prompt_cache is None else PromptCache(
            cfg.prompt_cache, self, defer=self._pipeline.admission.defer)
        if self._cache is not None:
            # device KV refused: cached sequences yield; a reset or recovery empties it
            self._pipeline.kv_room = self._cache.need_room
            life.on_change(self._cache.lifecycle_changed)
        #: the dump sink when ``config.dump`` enables it (spec S12), else None
        self.dump_sink = DumpSink(cfg.dump) if cfg.dump is not None else None
        if self.dump_sink is not None:
            self.add_observer(self.dump_sink)
        #: the OpenTelemetry spans of each request when ``tracer`` (an OpenTelemetry
        #: ``Tracer``; ``pip install calfsm[tracing]``) is given, else None: an observer
        #: (calfsm/telemetry/tracing.py), so tracing off costs nothing
        self.request_tracer = None
        if tracer is not None:
            from calfsm.telemetry.tracing import RequestTracer
            self.request_tracer = RequestTracer(self, tracer)
        self._control.start(manifest, calbin or Calbin.from_manifest(manifest))
        self._runtime.start()
        if self._cache is not None:
            self._cache.lifecycle_changed()     # Ready in generation 1: it may keep now

    # the core acts on the lifecycle's procedures, which are built after it (they use
    # the pipeline): through these two, never through the public recover() (a subclass
    # or an observer of that must not see, or change, the core's own drains)
    def _apply(self, verdict: Any) -> None:
        self._control.apply(verdict)

    def _drain(self, reason: str) -> bool:
        return self._control.begin_drain(reason)

    # ---- jobs ----------------------------------------------------------------------
    def enqueue(self, request: Request) -> JobHandle:
        """Validate, admit and prepare a job; return its handle.

        In threaded mode this blocks the calling thread until the job is admitted (KV
        and a buffer, in the one FIFO admission queue) or has ended, which its
        admission deadline bounds. Every failure is delivered through the handle —
        ``handle.result()`` raises it — so each enqueued job has exactly one outcome;
        only a closed, broken or non-Ready executor (and a request that is not a
        :class:`Request`) raise here directly.
        """
        job = self._front.accept(request)
        handle = job.handle         # the job drops it when it ends, maybe in start()
        self._jobs.start(job)
        if self.config.threaded:
            wait_admitted(self._pipeline.admission, job, handle)
        return handle

    def enqueue_nowait(self, request: Request, *, continuing: bool = False) -> JobHandle:
        """Like :meth:`enqueue`, but never blocks: a job that must wait for KV or a
        buffer is parked (holding no thread) and admitted in FIFO order when capacity
        comes free, bounded by its admission deadline. ``continuing``: the next step of
        a running stream (streams set it): never refused by ``max_waiting``, and still
        admitted while a graceful shutdown lets running streams finish."""
        return self._front.enqueue_nowait(request, continuing=continuing)

    def _rejected(self, err: CalfsmError, *, opening: bool = False) -> None:
        self._front.rejected(err, opening=opening)

    async def submit(self, request: Request) -> InferenceResult:
        """Run one job from asyncio without blocking the event loop. Cancelling the
        awaiting task cancels the job (before submit: nothing reaches the device; after:
        its result is dropped when it completes and every resource comes back)."""
        handle = self.enqueue_nowait(request)
        try:
            return await handle
        except asyncio_module().CancelledError:
            handle.cancel()
            raise

    def open_sequence(self) -> Sequence:
        """A sequence id of this executor's allocator, as a :class:`Sequence` (a sync and
        an async context manager that releases the KV on exit). When every id is taken,
        the prompt cache gives back its least recently used sequence first: a sequence
        kept warm for nobody never refuses one."""
        try:
            self._life.gate()
            seq_id = self._take_id()
        except CalfsmError as e:
            self._rejected(e, opening=True)
            raise
        try:
            epoch = self.epoch
            if epoch is not None and epoch.kv.sequence_state(seq_id) is SeqState.UNKNOWN:
                epoch.kv.reset_sequence(seq_id)  # lost in a reset while nobody held it
        except CalfsmError:
            self._sequences.give_back(seq_id)
            raise
        return Sequence(self._front, seq_id, self._sequences)

    @property
    def max_sequences(self) -> int:
        """Sequences open at once at most (``config.max_sequences`` within the device's
        id range): what ``generate(n=...)`` is judged against."""
        return self._sequences.limit

    def _take_id(self) -> int:
        while True:
            try:
                return self._sequences.take()
            except ResourceExhausted:
                if self._cache is None or not self._cache.evict_one():
                    raise

    def generate(self, prompt: list[int] | str, params: SamplingParams | None = None, *,
                 deadline_s: float | None = None, resume: bool = True,
                 max_resumes: int = 2, request_id: str | None = None,
                 n: int | None = None, parent: str | None = None,
                 priority: int = 0, arrival: float | None = None) -> Any:
        """One-shot generation on a fresh sequence, released when the stream ends (its
        id is free again by the time the stream's result is delivered). ``prompt``:
        token ids, or text with the executor's ``tokenizer``.

        ``request_id``: the stream's id (default: generated; ``stream.request_id``),
        what :meth:`abort` takes. ``n``: return a list of ``n`` streams of the same
        prompt instead of one stream, stream ``i`` drawing from ``params.seed + i`` (a
        seed of None: fresh entropy for each) with id ``request_id-i``; aborting
        ``request_id`` aborts them all. If one of them is refused, those already started
        are cancelled and the refusal is raised. ``parent``: an id that groups this
        stream with others the caller starts (a server's choices of one request):
        ``abort(parent)`` aborts them all.

        With the prompt cache on (``ExecutorConfig.prompt_cache``), the sequence comes
        from the cache when an entry shares a prefix with ``prompt``: its KV is truncated
        to that prefix and only the rest is prefilled (``result().usage.cached_tokens``);
        and when the stream ends with its KV intact, the sequence is kept warm instead
        of released. The tokens are those of a fresh sequence either way.

        ``deadline_s``: the stream's own deadline; a stream that cannot end in time by
        the measured service rate, or that would make a running one late, is refused at
        once (ResourceExhausted, with a Retry-After). ``resume``: after a device reset
        lost the sequence's KV, replay the prompt and the tokens so far on the new
        generation and go on, at most ``max_resumes`` times for this stream.
        ``priority``: every step's admission priority (higher first, aged while it
        waits; :attr:`calfsm.request.Request.priority`). ``arrival``: when the request
        arrived, on :attr:`clock` (a server's read of it, so the stream's ``ttft_s`` and
        the metrics count from where the client's clock starts); default: the stream's
        creation.

        What can be judged against the model alone is judged first, before anything is
        taken (:mod:`calfsm.generate.arguments`): ``n`` against ``max_sequences`` and
        :data:`~calfsm.generate.arguments.MAX_N`, the prompt's ids against the vocabulary and its
        length against the context, ``params.max_tokens`` against the context left after
        the prompt (``params`` None: the default ``max_tokens`` clipped to it). Such a
        refusal is an :class:`InvalidArgument` raised here, never a retryable 429."""
        try:
            prompt, params = self._judged(prompt, params, n, priority)
        except CalfsmError as e:
            self._rejected(e)
            raise
        if n is None:
            return self._generate(prompt, params, deadline_s, resume, max_resumes,
                                  request_id, parent, priority, arrival)
        parent, ids = self.live_requests.reserve_parent(request_id, n)
        streams: list[Stream] = []
        try:
            for i, rid in enumerate(ids):
                own = params if params.seed is None else attrs.evolve(
                    params, seed=params.seed + i)
                streams.append(self._generate(prompt, own, deadline_s, resume,
                                              max_resumes, rid, parent, priority, arrival))
        except BaseException:
            for s in streams:
                s.cancel()
            raise
        return streams

    def _judged(self, prompt: Any, params: Any, n: Any, priority: Any
                ) -> tuple[Any, SamplingParams]:
        """``generate``'s arguments judged before anything is taken (O(1) beyond the
        prompt): the prompt's token ids (text encoded once, for every stream of ``n``)
        and the parameters (None: the default clipped to the context left)."""
        if n is not None:
            check_n(n, self.max_sequences)
        epoch = self.epoch
        if epoch is None:           # not configured: the lifecycle gate refuses it
            if isinstance(prompt, str):
                prompt = encode_prompt(self.tokenizer, prompt)
            return prompt, params if params is not None else SamplingParams()
        checked, params = judge_stream(prompt, params, self.tokenizer, priority,
                                       epoch.model)
        return checked.tokens, params     # typed once: the streams take it as is

    def _generate(self, prompt: Any, params: SamplingParams, deadline_s: Any,
                  resume: bool, max_resumes: int, request_id: str | None,
                  parent: str | None, priority: int, arrival: float | None = None
                  ) -> Stream:
        cache = self._cache
        try:        # the estimate first: a refusal costs no sequence and no buffers
            key = None if cache is None else cache.key(prompt)
            self._admit_stream(prompt, params, deadline_s,
                               cached=0 if key is None else cache.match(key))
        except CalfsmError as e:
            self._rejected(e)
            raise
        hit = None
        if key is not None:
            try:
                self._life.gate()
            except CalfsmError as e:
                self._rejected(e, opening=True)
                raise
            hit = cache.take(key)
        seq, cached = hit if hit is not None else (self.open_sequence(), 0)
        try:
            return Stream(seq, prompt, params, deadline_s=deadline_s, resume=resume,
                          max_resumes=max_resumes, close_sequence=True, admitted=True,
                          request_id=request_id, parent=parent, priority=priority,
                          keeper=cache, cached=cached, arrival=arrival)
        except BaseException as e:
            seq.close()
            if isinstance(e, CalfsmError):
                self._rejected(e)
            raise

    def abort(self, request_id: str) -> bool:
        """Cancel the live stream or job ``request_id`` (or every stream of an ``n > 1``
        generate) wherever it is, by the rules of ``cancel``: waiting or staged, nothing
        reaches the device; on the device, it runs to its end and its result is dropped.
        False if no live request has that id (unknown, or already ended)."""
        return self.live_requests.abort(request_id)

    def requests(self) -> list[RequestInfo]:
        """The live streams and jobs, oldest first: id, kind, state, age, tokens so far."""
        return self.live_requests.snapshot()

    def _admit_stream(self, prompt: Any, params: Any, deadline_s: Any, *,
                      cached: int = 0) -> None:
        """The admission estimate of a one-shot stream, before anything is taken for it
        (what the Stream checks itself is left to it: a malformed prompt, params or
        deadline skips the estimate and is refused there). ``cached``: prompt tokens
        the prompt cache would not prefill."""
        epoch = self.epoch
        if epoch is None or not isinstance(params, SamplingParams):
            return
        try:
            n = len(prompt)
        except TypeError:
            return
        if deadline_s is None:
            deadline = math.inf
        elif isinstance(deadline_s, int | float) and not isinstance(deadline_s, bool) \
                and deadline_s > 0:
            deadline = self.clock.now() + deadline_s
        else:
            return
        max_new = max_new_tokens(params, epoch.contract(TaskKind.DECODE).max_seq, 0, n)
        self.live_streams.admit(prompt_tokens=n - cached, max_new=max_new,
                                deadline=deadline)

    def decode_sync(self, request: Request, timeout: float | None = None) -> InferenceResult:
        """Synchronous compatibility entry (spec 6.1): enqueue and wait for the result."""
        handle = self.enqueue(request)
        self._runtime.wait(handle, timeout)
        return handle.result(timeout)

    def reset_sequence(self, seq_id: int) -> None:
        """Forget a sequence's KV (required after it went Unknown); it starts at 0."""
        self._jobs.reset_sequence(seq_id)

    # ---- lifecycle -----------------------------------------------------------------
    def recover(self, reason: str = "recovery requested") -> bool:
        """Drain and reset the device now, as after a device fault (an operator's
        "restart the accelerator"). False if the executor is not Ready."""
        return self._control.begin_drain(reason)

    def switch_model(self, manifest: Manifest, calbin: Calbin | None = None,
                     timeout: float = 10.0) -> None:
        """Drain, configure ``manifest``/``calbin`` as a new generation and warm it; on an
        artifact or lifecycle error roll back to the last known-good model (which keeps
        serving) and raise the error naming the artifact problem."""
        self._control.switch_model(manifest, calbin, self._runtime.wait_drained, timeout)

    def wait_lifecycle(self, *states: str, timeout: float | None = None) -> str:
        """Block until the lifecycle is in one of ``states`` (e.g. ``"Ready"`` after a
        recovery, or ``"Failed"``); returns the state. Raises DeadlineExceeded on timeout.
        Step mode: drive the scheduler instead."""
        return wait_for_state(self._life, states, timeout)

    def close(self, timeout: float | None = None, *, grace_s: float | None = None
              ) -> None:
        """Shut down: stop taking new work, let running streams finish for ``grace_s``
        (default ``config.shutdown_grace_s``, 0: none), then cut the ones left (each ends
        ``error`` with a retryable :class:`ExecutorClosed`), cancel queued jobs, drain
        submitted ones and join the threads (FI13). Returns as soon as that is done.

        Bounded: after ``timeout`` (default ``config.shutdown_timeout_s``) of draining,
        jobs still on the device are resolved Unavailable, their buffers stay quarantined,
        and :class:`Unavailable` is raised so the caller knows the device did not drain.
        Safe to call twice.
        """
        timeout = self.config.shutdown_timeout_s if timeout is None else timeout
        grace = self.config.shutdown_grace_s if grace_s is None else grace_s
        if not self._life.begin_stop():
            return
        if self._cache is not None:
            self._cache.close()     # what it kept goes back; streams ending now release
        if grace > 0 and len(self.live_streams):
            sched = None if self.config.threaded else StepScheduler(self)
            self.live_streams.wait_empty(grace, None if sched is None
                                    else lambda: sched.step() is not None)
        retry = self._life.retry_after_s
        for stream in self.live_streams.live():     # cut first: each says why, as one
            stream.abort(ExecutorClosed("the executor shut down before the stream "
                                        "finished", stage="shutdown",
                                        seq_id=stream.sequence.seq_id,
                                        retry_after_s=retry))
        self._life.begin_close()
        self._runtime.begin_close(timeout)
        for job in self._pipeline.take_waiting():
            job.cancel_requested = True
            self._pipeline.outcomes.fail_before_submit(job, _shutdown_cancel(job, retry))
        self._pipeline.wake_waiters()
        while self._pipeline.admission.run_deferred():    # streams end, sequences are released
            pass
        self._runtime.join_recovery(timeout)   # a recovery stops at its next step
        undrained = self._runtime.drain(timeout)
        self._pipeline.abandon(undrained, lambda job: Unavailable(
            f"shutdown did not drain within {timeout} s; the device still holds the job",
            stage="shutdown", job_id=job.job_id, seq_id=job.seq_id,
            generation=job.generation))
        alive = self._runtime.stop(timeout)
        while self._pipeline.admission.run_deferred():    # what the drained jobs left to do
            pass
        self._life.fire_if_declared("close")
        if self.epoch is not None:
            self.epoch.kv.shutdown()
        if undrained or alive:
            raise Unavailable(
                f"shutdown did not drain within {timeout} s: {len(undrained)} job(s) still "
                f"on the device, threads alive: {alive}", stage="shutdown")

    def __enter__(self) -> DeviceExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- asyncio twins of the blocking calls (each runs in a worker thread) --------
    @classmethod
    async def create(cls, driver: Driver, manifest: Manifest,
                     config: ExecutorConfig | None = None, *,
                     calbin: Calbin | None = None,
                     tokenizer: Tokenizer | None = None, tracer: Any = None
                     ) -> DeviceExecutor:
        """Construct (start-up and warm-up) without blocking the event loop."""
        return await asyncio_module().to_thread(cls, driver, manifest, config, calbin=calbin,
                                                tokenizer=tokenizer, tracer=tracer)

    async def aclose(self, timeout: float | None = None, *, grace_s: float | None = None
                     ) -> None:
        await asyncio_module().to_thread(self.close, timeout, grace_s=grace_s)

    async def await_lifecycle(self, *states: str, timeout: float | None = None) -> str:
        return await asyncio_module().to_thread(self.wait_lifecycle, *states, timeout=timeout)

    async def aswitch_model(self, manifest: Manifest, calbin: Calbin | None = None,
                            timeout: float = 10.0) -> None:
        await asyncio_module().to_thread(self.switch_model, manifest, calbin, timeout)

    async def __aenter__(self) -> DeviceExecutor:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ---- observation ---------------------------------------------------------------
    def add_observer(self, observer: Any) -> None:
        """Tell ``observer`` (a :class:`calfsm.engine.observe.Observer`) of every job's and
        stream's end, and of requests refused at once; see :mod:`calfsm.engine.observe`.
        :class:`calfsm.telemetry.metrics.ExecutorMetrics` is one."""
        self._pipeline.observers.add(observer)

    def remove_observer(self, observer: Any) -> bool:
        """Stop telling ``observer``; False if it was not observing."""
        return self._pipeline.observers.remove(observer)

    @property
    def observers(self) -> Observers:
        """The observers of this executor (the streams report through it too)."""
        return self._pipeline.observers

    @property
    def epoch(self) -> Epoch | None:
        """The current generation's model handles, KV coordinator and buffer pool."""
        return self._life.epoch

    @property
    def lifecycle_state(self) -> str:
        return self._life.state

    @property
    def generation(self) -> int:
        return self._life.generation

    @property
    def failure_reason(self) -> str | None:
        return self._life.reason

    @property
    def lifecycle(self) -> Lifecycle:
        """The lifecycle's owner: state, generation, reason, history (read it here)."""
        return self._life

    def idle(self) -> bool:
        """No job waits for admission, is queued, in the submitter's hand, on the device
        or being completed, no deferred work is queued or running (a stream's next step
        being staged ahead may be a job that has yet to tell its end), and no drain,
        recovery or model switch is under way (a warm-up holds a slot of its own)."""
        return self._pipeline.idle() and not self._life.moving

    def wait_until(self, predicate: Callable[[], bool], timeout: float | None = None
                   ) -> bool:
        """Threaded mode: block until ``predicate()`` holds, re-checking whenever a job
        moves or the lifecycle changes; False on timeout. Step mode: drive the
        scheduler instead."""
        if not isinstance(self._runtime, ThreadRuntime):
            raise ValueError("a step-mode executor moves only when stepped")
        return self._runtime.wait_until(predicate, timeout)

    @property
    def steps(self) -> Steps:
        """The steppable interface of a step-mode executor (for StepScheduler)."""
        if not isinstance(self._runtime, StepRuntime):
            raise ValueError("a threaded executor is driven by its own threads")
        return self._runtime.steps

    def on_device(self) -> list[JobContext]:
        """Jobs submitted whose Wait has not returned (recovery and tests look at it)."""
        return self._pipeline.device.on_device()

    def prompt_cache_stats(self) -> PromptCacheStats | None:
        """The prompt cache's entries and counters (None when it is off)."""
        return None if self._cache is None else self._cache.stats()

    def stats(self) -> ExecutorStats:
        counts, by_category = self._pipeline.counts()
        inflight, queued = self._pipeline.depths()
        epoch = self.epoch
        return ExecutorStats(
            inflight=inflight, queued=queued, generation=self.generation,
            leased=epoch.pool.stats().leased if epoch else 0,
            errors_by_category=by_category, admitting=self._pipeline.admission.parked(),
            **{k: counts[k] for k in COUNTERS})

    def _graph_notes(self) -> tuple[str, ...]:
        """The shape buckets the current generation took out, each with why."""
        epoch = self._life.epoch
        if epoch is None or not epoch.graph_failures:
            return ()
        return tuple(f"shape bucket {name} taken out: {why}"
                     for name, why in epoch.graph_failures.items())

    def health(self) -> Health:
        """Liveness and readiness (spec section 9), cheap and safe from any thread.

        Runs the no-progress watchdog first, so a wedged device never reports ready.
        ``ready``: Ready, not shutting down, not broken, and no job on the device past
        half its execution timeout (a suspected hang). ``live``: False when only a
        restart helps — Failed, broken, or a job on the device longer than
        ``config.hang_after_s`` and its own execution timeout plus the drain's grace
        (the executor's own recovery did not get the device back). Draining and
        recovering are live (that is progress) but not ready."""
        self._control.check_progress()
        inflight, depth = self._pipeline.depths()
        life, p = self._life, self._pipeline
        age, oldest = p.device.oldest_on_device()
        suspect = oldest is not None and not oldest.ended and age > \
            self.service.suspect_after_s(oldest.kind, oldest.token_count)
        live_reason = None
        if p.broken is not None:
            live_reason = f"executor broken: {p.broken}"
        elif life.state == "Failed":
            live_reason = f"executor failed: {life.reason}"
        elif oldest is not None and age > max(
                self.config.hang_after_s,
                self.service.execution_timeout_s(oldest.kind, oldest.token_count)
                + self.config.recovery.grace_period_s):
            live_reason = (f"no device progress: job {oldest.job_id} on the device for "
                           f"{age:.3f} s (hang_after_s {self.config.hang_after_s:g})")
        ready = life.ready and p.broken is None and not suspect
        if ready:
            ready_reason = None
        elif p.broken is not None:
            ready_reason = live_reason
        elif life.closing or life.stopping:
            ready_reason = "shutting down"
        elif life.state != "Ready":
            ready_reason = f"{life.state}: {life.reason}" if life.reason else life.state
        else:
            ready_reason = (f"suspected hang: job {oldest.job_id} on the device for "
                            f"{age:.3f} s, over half its execution timeout")
        return Health(
            state=life.state, ready=ready,
            generation=life.generation, inflight=inflight, queue_depth=depth,
            submitter_heartbeat=p.heartbeat("submitter"),
            completion_heartbeat=p.heartbeat("completion"), reason=life.reason,
            max_inflight=p.max_inflight, max_batch=self.max_batch,
            notes=self._notes + self._graph_notes(),
            broken=p.broken,
            live=live_reason is None, live_reason=live_reason, oldest_job_s=age,
            hang_suspected=suspect, ready_reason=ready_reason)

    def __repr__(self) -> str:
        return (f"<DeviceExecutor {self.driver.name} gen={self.generation} "
                f"{self.lifecycle_state}>")


def _shutdown_cancel(job: JobContext, retry_after_s: float) -> Cancelled:
    """Not the caller's cancel: another replica may serve it, hence the retry-after."""
    return Cancelled("cancelled by shutdown", stage="shutdown", job_id=job.job_id,
                     seq_id=job.seq_id, generation=job.generation,
                     retry_after_s=retry_after_s)


def step_port(executor: DeviceExecutor) -> JobFace:
    """The engine's job face ``executor`` builds its sequences on, for tests and tools
    that drive a staged step directly (what its sequences' streams do)."""
    return executor._jobs
