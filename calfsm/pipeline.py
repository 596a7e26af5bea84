"""The sans-thread core of the executor: queues, in-flight accounting and the four steps.

Theory of operation
-------------------
A job flows through four *steps*, each a method that does one bounded piece of work,
returns what happened and never sleeps or reads a wall clock (time comes only from the
driver's injected clock):

``admit``     validate once -> exact sub-model -> KV reservation -> buffer lease
``prepare``   copy inputs, set slices, CSRs and KV sequence -> submit queue
``submit``    (the only caller of ``infer``) cancel/deadline check -> infer -> Submitted
``complete``  (the only caller of ``wait``, holding no lock) wait -> status -> output
              check -> BF16->FP32 into the target -> KV commit -> undo slices ->
              the job's continuation (a stream's next step to the submitter) ->
              resolve -> return the lease (spec 6.5's order)

Who drives the steps is not this module's business: :mod:`calfsm.runtime` runs them on a
submitter and a completion thread, :class:`calfsm.scheduler.StepScheduler` one at a time
from a seed. Admission is one path for both: :meth:`Pipeline.admit` with
``wait=False`` tries; with ``wait=True`` (the caller's thread in threaded mode) the KV
coordinator and the pool wait for capacity inside the same step, FIFO, bounded by the
admission deadline. The pipeline tells its driver that something changed through
:class:`Hooks` (the thread runtime rings doorbells there; step mode needs nothing).

Every failure releases what was taken in reverse order. Before ``infer()`` succeeded a
lease goes back to the pool and the KV reservation rolls back; after it, only the
completion or recovery path touches them, and a failure leaves the KV ``Unknown`` and the
slot quarantined (the device may have written them). Every accepted job ends exactly once,
through :meth:`JobHandle._resolve`.

Lock order: lifecycle -> the runtime's condition -> device (``_device_lock``) -> queues
(``_lock``); the KV coordinator's, the pool's, a handle's and the fault policy's locks
are leaves (nothing is taken while holding one). No runtime call is made holding the
queue lock;
``wait`` is called holding no lock at all. The device lock is held only around one
``infer`` (and its generation check) and the reading of a finished output: recovery
passes through it once after leaving Ready, so no submit can race a reset.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from calfsm.drivers.base import Driver, EngineSlot, JobTag
from calfsm.epoch import WARMUP_SEQ
from calfsm.errors import (
    CalfsmError,
    CalrtCode,
    Cancelled,
    DeadlineExceeded,
    ErrorCategory,
    ExecutorBroken,
    Internal,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
    from_calrt,
)
from calfsm.job import InferenceResult, JobContext, JobHandle, Request
from calfsm.kv import SeqState
from calfsm.lifecycle import Lifecycle
from calfsm.lograte import RateLimitedLog
from calfsm.machines.job import JOB_MACHINE, JobState
from calfsm.machines.lifecycle import LifecycleState
from calfsm.observe import JobAccepted, JobEnded, Observers
from calfsm.recovery import Decision, FaultPolicy, Verdict
from calfsm.request import check_request
from calfsm.service import ServiceModel
from calfsm.staging import check_output, read_output

__all__ = ["COUNTERS", "Hooks", "Pipeline", "PipelineTimeouts"]

log = logging.getLogger("calfsm.pipeline")
#: the warnings a fault storm repeats, a burst per minute each (calfsm/lograte.py)
_limited = RateLimitedLog(log)

_fire = JOB_MACHINE.fire
_fire_if = JOB_MACHINE.fire_if_declared
_READY = LifecycleState.READY

#: the counters :meth:`Pipeline.counts` reports, each bumped under the queue lock
COUNTERS = ("accepted", "succeeded", "failed", "cancelled", "quarantined", "discarded",
            "stale_completions", "recoveries", "requeued")


class Hooks:
    """How the pipeline tells whoever drives it that work is there. The defaults do
    nothing (step mode: the scheduler looks for itself)."""

    def work_queued(self) -> None:
        """A job was queued for submit, or an in-flight slot came free."""

    def job_submitted(self) -> None:
        """A job is waiting for its completion."""

    def job_parked(self) -> None:
        """A job waits for admission (KV or a buffer), or capacity may have come free:
        the admission step should run."""

    def device_freed(self, hand_off: bool) -> None:
        """Called under the queue lock when a job left the device; ``hand_off``: a queued
        job can be submitted at once."""

    def after_device_freed(self) -> None:
        """Called by the step that freed the device, outside every lock."""

    def after_work_queued(self) -> None:
        """Called by the step that queued a job, outside every lock."""

    def changed(self) -> None:
        """Queues or in-flight accounting changed (drains and recovery wait for this).
        Called outside the queue lock, so it may take locks of its own."""


class PipelineTimeouts:
    """The timeouts of :class:`~calfsm.executor.ExecutorConfig` the steps use."""

    __slots__ = ("admission_s", "default_deadline_s", "max_waiting", "queue_s",
                 "zombie_wait_s")

    def __init__(self, *, admission_s: float, queue_s: float,
                 default_deadline_s: float, zombie_wait_s: float,
                 max_waiting: int | None = None) -> None:
        self.max_waiting = max_waiting
        self.admission_s = admission_s
        self.queue_s = queue_s
        self.default_deadline_s = default_deadline_s
        self.zombie_wait_s = zombie_wait_s


class Pipeline:
    """Queues, in-flight accounting and the admit/prepare/submit/complete steps."""

    def __init__(self, driver: Driver, life: Lifecycle, faults: FaultPolicy, *,
                 timeouts: PipelineTimeouts, service: ServiceModel, max_inflight: int,
                 engines: tuple[EngineSlot, ...], apply: Callable[[Verdict], None],
                 drain: Callable[[str], bool]) -> None:
        self.driver = driver
        self.clock = driver.clock
        self.life = life
        self.faults = faults
        self.t = timeouts
        #: expected and measured step costs: the execution timeout, the estimates
        self.service = service
        self.max_inflight = max_inflight
        self.engines = engines
        self._apply = apply             # the lifecycle carries out a policy decision
        self._drain = drain             # ... and starts a drain for a suspect device
        self.hooks = Hooks()
        self.observers = Observers()    # told of every job's end (metrics, dump sink)
        self._lock = threading.Lock()
        self._device_lock = threading.Lock()      # a submit vs a reset of the device
        self._submit_q: deque[JobContext] = deque()
        self._complete_q: deque[JobContext] = deque()
        self._parked: deque[JobContext] = deque()   # waiting for KV/buffer (no thread)
        #: the parked head the admission step took out to admit: the step owns it (a
        #: cancel only flags it, a drain does not take it) until it is queued or failed
        self._admitting: JobContext | None = None
        self._completing = 0        # jobs out of the complete queue, step not yet done
        self._deferred: deque[Callable[[], None]] = deque()   # work to run outside locks
        self._staged: list[JobContext] = []         # streams' next steps, prepared ahead
        self._on_device: list[JobContext] = []      # submitted, wait not returned
        self._inflight = 0
        #: ping/pong: the job each fixed engine runs now (one per engine, spec 6.4);
        #: empty with one in flight on the AUTO engine
        self._engine_busy: dict[EngineSlot, JobContext] = {}
        self._waiting = 0                           # accepted, not submitted nor ended
        self._broken: str | None = None
        self._ids = itertools.count(1)
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._errors_by_category: dict[str, int] = {}
        now = self.clock.now()
        self._heartbeat = {"submitter": now, "completion": now}

    # ---- observation ---------------------------------------------------------------
    @property
    def inflight(self) -> int:
        return self._inflight

    @property
    def broken(self) -> str | None:
        """Why the pipeline stopped for good (a worker died), or None."""
        return self._broken

    def counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """(counters, errors by category), a consistent snapshot."""
        with self._lock:
            return dict(self._counts), dict(self._errors_by_category)

    def count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def depths(self) -> tuple[int, int]:
        """(in flight, waiting: accepted and not yet on the device)."""
        with self._lock:
            return self._inflight, self._waiting

    def heartbeat(self, worker: str) -> float:
        return self._heartbeat[worker]

    def beat(self, worker: str) -> None:
        """A worker is alive and looking for work (clock time)."""
        self._heartbeat[worker] = self.clock.now()

    def completion_idle_s(self) -> float | None:
        """Seconds since the completion side last made progress while jobs are on the
        device (None: nothing on the device)."""
        if self._inflight == 0:
            return None
        return self.clock.now() - self._heartbeat["completion"]

    def on_device(self) -> list[JobContext]:
        with self._lock:
            return list(self._on_device)

    def oldest_on_device(self) -> tuple[float, JobContext | None]:
        """(clock seconds the oldest job on the device has been there, that job), or
        (0.0, None) when the device holds none."""
        with self._lock:
            job = self._on_device[0] if self._on_device else None
        if job is None:
            return 0.0, None
        return max(0.0, self.clock.now() - job.timings.submitted), job

    def idle_on_device(self) -> bool:
        """No job holds the device (submitted or about to be)."""
        with self._lock:
            return not self._on_device and self._inflight <= len(self._on_device)

    def idle(self) -> bool:
        """Nothing waits, is queued, on the device or waiting for its completion, and no
        deferred work is left."""
        with self._lock:
            return not (self._parked or self._submit_q or self._complete_q
                        or self._on_device or self._deferred or self._staged
                        or self._admitting or self._completing)

    def has_parked(self) -> bool:
        return bool(self._parked)

    def can_admit(self) -> bool:
        """A job waits for admission and the device takes work (not Ready: the parked
        jobs wait for the next generation)."""
        return bool(self._parked) and self.life.state == _READY

    def has_deferred(self) -> bool:
        return bool(self._deferred)

    def defer(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` later on the admission side, holding no lock (a stream's replay
        once the device is Ready, a sequence's release): callbacks that must not run
        inside a lifecycle transition or a completion."""
        with self._lock:
            self._deferred.append(fn)
        self.hooks.job_parked()

    def run_deferred(self) -> bool:
        """Run one deferred function; False if there was none."""
        with self._lock:
            if not self._deferred:
                return False
            fn = self._deferred.popleft()
        try:
            fn()
        except Exception:
            log.exception("deferred work %r raised", fn)
        self.hooks.changed()            # idle counts deferred work
        return True

    def has_completions(self) -> bool:
        return bool(self._complete_q)

    def has_queued(self) -> bool:
        return bool(self._submit_q)

    def admission_fingerprint(self) -> int:
        """Changes whenever something that could let a parked job proceed changed (KV
        books, pool, generation, the parked jobs themselves)."""
        epoch = self.life.epoch
        return hash((len(self._parked), epoch.kv.stats() if epoch else None,
                     epoch.pool.stats() if epoch else None, self.life.generation))

    def admission_wait_s(self) -> float | None:
        """How long the admission step may sleep: until the first parked job's admission
        deadline (None: nothing parked)."""
        now = self.clock.now()
        with self._lock:
            if not self._parked:
                return None
            first = min(self._admission_deadline(j, now) for j in self._parked)
        return None if math.isinf(first) else max(0.0, first - now)

    def expire_parked(self) -> None:
        """Fail every parked job past its admission deadline."""
        now = self.clock.now()
        with self._lock:
            late = [j for j in self._parked if self._admission_deadline(j, now) <= now]
            for j in late:
                self._parked.remove(j)
        for j in late:
            self._failed_to_start(j, DeadlineExceeded(
                "admission deadline passed", **_ctx(j, "admission")))

    def next_deadline(self) -> float:
        """Earliest deadline a parked or queued job waits for."""
        now = self.clock.now()
        with self._lock:
            dl = [self._admission_deadline(j, now) for j in self._parked]
            dl += [j.queue_deadline for j in self._submit_q]
        return min(dl, default=math.inf)

    # ---- request side: accept -> admit -> prepare ----------------------------------
    def accept(self, request: Request, canceller: Callable[[JobContext], None], *,
               continuing: bool = False, staging: bool = False) -> JobContext:
        """Gate, then make the job and its handle; raises only for a closed or non-Ready
        executor, a full wait queue (or a bad ``request`` type). Every accepted job has
        one outcome. ``continuing``: a running stream's next step (see JobContext).
        Observers hear of the job (job_accepted) or of the refusal (job_refused) here,
        holding no lock; ``staging``: a step prepared ahead, announced only when it is
        released (:meth:`release_staged`), and a refusal is not the caller's."""
        try:
            job = self._make_job(request, canceller, continuing)
        except CalfsmError as e:
            if not staging:
                self.observers.job_refused(e, request)
            raise
        if staging:
            job.announced = False           # at its release, if it is released
        else:
            self._announce(job, request, staged=False)
        return job

    def _announce(self, job: JobContext, request: Request, *, staged: bool) -> None:
        """job_accepted for ``job`` (``request``: a staged step's real one)."""
        job.announced = True
        if self.observers.accepts:
            self.observers.job_accepted(JobAccepted(
                job.job_id, job.seq_id, job.generation, job.kind, request,
                job.timings.accepted, staged))

    def _make_job(self, request: Request, canceller: Callable[[JobContext], None],
                  continuing: bool) -> JobContext:
        if not isinstance(request, Request):
            raise InvalidArgument(f"enqueue takes a Request, got {type(request).__name__}",
                                  stage="request")
        if self._broken is not None:
            raise ExecutorBroken(f"executor is broken: {self._broken}", stage="admission")
        self.life.gate(continuing=continuing)
        self._admit_waiting(request, continuing)
        now = self.clock.now()
        deadline_s = request.deadline_s if request.deadline_s is not None \
            else self.t.default_deadline_s
        job = JobContext(
            job_id=next(self._ids), request=request, generation=self.life.generation,
            seq_id=request.seq_id, kind=request.kind, past_len=request.past_len,
            token_count=request.token_count,
            deadline=now + deadline_s if deadline_s > 0 else now)
        job.engine = request.engine
        job.timings.accepted = now
        job.continuing = continuing
        job.unready_mark = self.life.unready_s(now)
        job.epoch = self.life.epoch
        job.handle = JobHandle(job, canceller)
        job.waiting = True
        self.count("accepted")
        return job

    def _admit_waiting(self, request: Request, continuing: bool) -> None:
        """The bounded wait queue: refuse new work at once, with a Retry-After estimate
        from the measured service time, when ``max_waiting`` jobs already wait (429 now
        instead of a 504 later). A running stream's next step (``continuing``) is never
        refused here: its stream was admitted, and its steps wait their turn."""
        limit = self.t.max_waiting
        with self._lock:
            if continuing or limit is None or self._waiting < limit:
                self._waiting += 1
                return
            depth = self._waiting
        est = max(0.001, (depth + self._inflight) * self.service.decode_service_s())
        raise ResourceExhausted(
            f"{depth} jobs already wait for the device (max_waiting {limit})",
            stage="admission", seq_id=request.seq_id, retry_after_s=round(est, 3))

    def _leave_waiting(self, job: JobContext) -> None:
        if job.waiting:
            job.waiting = False
            with self._lock:
                self._waiting -= 1

    def validate(self, job: JobContext) -> None:
        """Spec 6.3 checks 1-6, once, before any resource is taken."""
        ctx = _ctx(job, None)
        if job.deadline <= job.timings.accepted:
            raise DeadlineExceeded("deadline already past at enqueue", stage="validate",
                                   **ctx)
        req = job.request
        check_request(req, job.epoch.contract(job.kind), seq_limit=WARMUP_SEQ,
                      context=dict(ctx, stage="validate"))
        if req.engine is not EngineSlot.AUTO and req.engine not in self.engines:
            raise InvalidArgument(f"engine {req.engine.name} not in use", stage="validate",
                                  **ctx)

    def start(self, job: JobContext, *, wait: bool) -> None:
        """Validate, admit and prepare ``job``; every failure goes to its handle.

        ``wait=False``: a job that cannot be admitted now is parked (FIFO) for
        :meth:`admit_parked`; ``wait=True``: admission waits for capacity in this call."""
        try:
            self.validate(job)
            if wait:
                self.admit(job, wait=True)
                self.prepare(job)
                return
            with self._lock:
                parked = bool(self._parked)
                if parked:
                    self._parked.append(job)
            if parked:
                self.hooks.job_parked()
                return
            if self.admit(job, wait=False):
                self.prepare(job)
            else:
                with self._lock:
                    self._parked.append(job)
                self.hooks.job_parked()
        except CalfsmError as e:
            self._failed_to_start(job, e)
        except Exception as e:          # a bug must not strand an accepted job
            log.error("unexpected error preparing job %s", job.job_id, exc_info=e,
                      extra=_ctx(job, "prepare"))
            self._failed_to_start(job, Internal(
                f"unexpected {type(e).__name__} while preparing: {e}",
                category=ErrorCategory.UNKNOWN, **_ctx(job, "prepare")))

    def _failed_to_start(self, job: JobContext, e: CalfsmError) -> None:
        """A job that never reached the submit queue fails; a device error met on the
        way is shown to the fault policy like one met at submit."""
        life = self.life
        stale = job.epoch is not None and (job.epoch.retired or job.epoch is not life.epoch)
        if isinstance(e, Cancelled) and not job.cancel_requested and not life.closing:
            # admission gave up because the device left Ready, not because of a cancel
            if self._broken is not None:
                e = ExecutorBroken(f"executor is broken: {self._broken}",
                                   **_ctx(job, "admission"))
            else:
                e = Unavailable(f"device is {life.state} ({life.reason or 'recovering'})",
                                retry_after_s=life.retry_after_s, **_ctx(job, "admission"))
        elif stale and not isinstance(e, Cancelled):
            # the device was reset under this preparation: say so, not "bad state"
            e = Unavailable(f"the device was reset while the job was prepared ({e})",
                            retry_after_s=life.retry_after_s,
                            calrt_code=e.calrt_code, **_ctx(job, e.stage or "prepare"))
        try:
            if e.calrt_code is not None and not stale and not isinstance(e, Cancelled):
                self._apply(self.faults.decide(e, self.clock.now()))  # before the caller
        finally:
            self.fail_before_submit(job, e)

    def _admission_deadline(self, job: JobContext, now: float) -> float:
        """``min(deadline, accepted + admission budget)``, the budget extended by the time
        the executor spent out of Ready since the job was accepted: a job that waited
        through a recovery is not charged for it (its own deadline still holds). While
        the executor is not Ready only the job's own deadline can pass, and a running
        stream's next step (``continuing``) is bounded by its own deadline alone: its
        stream was admitted, and a step that waits its turn must not fail it."""
        if job.continuing or self.life.state != _READY:
            return job.deadline
        paused = self.life.unready_s(now) - job.unready_mark
        return min(job.deadline, job.timings.accepted + self.t.admission_s + paused)

    def admit(self, job: JobContext, *, wait: bool) -> bool:
        """KV reservation, then a buffer lease. ``wait=False``: False when either must
        wait (what was taken is kept for the next try); raises on errors."""
        epoch = job.epoch
        deadline = self._admission_deadline(job, self.clock.now())
        if not wait and self.clock.now() >= deadline:
            raise DeadlineExceeded("admission deadline passed", **_ctx(job, "admission"))
        engine = self._engine_for(job)
        if wait:
            cancelled = self._cancel_probe(job)
            job.kv = epoch.kv.reserve(job.seq_id, job.past_len, job.token_count, deadline,
                                      job_id=job.job_id, cancelled=cancelled)
            _fire(job, "admit")
            job.lease = epoch.pool.acquire_wait(job.kind, deadline, cancelled=cancelled,
                                                clock=self.clock, engine=engine)
        else:
            if job.kv is None:
                job.kv = epoch.kv.try_reserve(job.seq_id, job.past_len, job.token_count,
                                              job_id=job.job_id)
                if job.kv is None:
                    return False
                _fire(job, "admit")
            try:
                job.lease = epoch.pool.acquire(job.kind, engine)
            except ResourceExhausted:
                return False
        job.timings.admitted = self.clock.now()
        return True

    def _engine_for(self, job: JobContext) -> EngineSlot:
        """The engine a job's buffers come from: the request's own choice, else AUTO (the
        pool lends from the engine with the most free slots, so ping/pong stays even;
        the submitter runs one job per engine at a time, see :meth:`claim`)."""
        return job.engine

    def _cancel_probe(self, job: JobContext) -> Callable[[], bool]:
        life = self.life
        return lambda: job.cancel_requested or life.closing or life.state != _READY \
            or self._broken is not None

    def prepare(self, job: JobContext) -> None:
        """Copy inputs, set slices, CSRs and KV sequence; push to the submit queue."""
        _fire(job, "prepare")
        lease = job.lease
        lease.bind(job_id=job.job_id, seq_id=job.seq_id)
        t0 = self.clock.now()
        lease.load(job.seq_id, job.request.tokens, job.request.positions)
        now = self.clock.now()
        job.timings.h2d_ms = (now - t0) * 1e3
        self._queue(job, now, "prepare")

    def _queue(self, job: JobContext, now: float, stage: str) -> None:
        """A prepared job joins the submit queue (its queue deadline starts now), unless
        it was cancelled or the executor is closing: then Cancelled."""
        job.timings.queued = now
        job.queue_deadline = job.deadline if job.continuing \
            else min(job.deadline, now + self.t.queue_s)
        with self._lock:
            queued = not (job.cancel_requested or self.life.closing)
            if queued:
                _fire(job, "enqueue")
                self._submit_q.append(job)
                self.hooks.work_queued()
        if not queued:
            raise Cancelled("cancelled before submit", **_ctx(job, stage))
        self.hooks.after_work_queued()

    def admit_parked(self) -> bool:
        """Try to admit the head parked job (FIFO). True if it moved (or failed).

        The head is taken out while it is admitted (``_admitting``), so a cancel or a
        drain meanwhile cannot fail it under this step's hands: the step looks at the
        cancel flag and the lifecycle once admission returns, and fails the job itself
        (the soak found the race: a cancel landing mid-admission fired ``admit`` on a
        failed job)."""
        with self._lock:
            if not self._parked or self._admitting is not None \
                    or self.life.state != _READY:
                return False            # not Ready: parked jobs wait for the generation
            job = self._admitting = self._parked.popleft()
        try:
            if job.cancel_requested or self.life.closing:
                raise Cancelled("cancelled while waiting for admission",
                                **_ctx(job, "admission"))
            if job.epoch is not self.life.epoch:
                self._rebind(job)       # held through a recovery: the new generation's
            admitted = self.admit(job, wait=False)
            with self._lock:
                self._admitting = None
                cancelled = job.cancel_requested or self.life.closing
                gone = cancelled or self.life.state != _READY
                if not admitted and not gone:
                    self._parked.appendleft(job)      # still the head: try again later
                    return False
            if gone and not cancelled and self._holdable(job):
                self._hold([job])       # a drain began meanwhile: wait for the next one
                return True
            if gone:
                raise Cancelled("cancelled while waiting for admission",
                                **_ctx(job, "admission"))
            self.prepare(job)
        except Exception as e:
            with self._lock:
                if self._admitting is job:
                    self._admitting = None
            if not isinstance(e, CalfsmError):
                log.error("unexpected error admitting job %s", job.job_id, exc_info=e,
                          extra=_ctx(job, "admission"))
                e = Internal(f"unexpected {type(e).__name__} while admitting: {e}",
                             category=ErrorCategory.UNKNOWN, **_ctx(job, "admission"))
            self._failed_to_start(job, e)
        return True

    # ---- overlap: a stream's next step, prepared ahead ------------------------------
    def stage(self, request: Request, canceller: Callable[[JobContext], None]
              ) -> JobContext | None:
        """Prepare a stream's next step while the one before runs: lease a slot and
        write its inputs (the token is a placeholder), reserving no KV and queueing
        nothing. None, with nothing taken, when no slot is free now, a job waits for
        admission (a slot taken ahead must never starve it: first come, first served),
        or the executor is not Ready: the step then takes the ordinary path when its
        token is known."""
        epoch = self.life.epoch
        if epoch is None or not self.life.ready or self._broken is not None \
                or self._parked or self._admitting is not None:
            return None
        try:
            lease = epoch.pool.acquire(request.kind, request.engine)
        except (ResourceExhausted, Unavailable):
            return None
        try:
            job = self.accept(request, canceller, continuing=True, staging=True)
        except CalfsmError:
            epoch.pool.release(lease)
            return None
        job.lease = lease
        try:
            if job.epoch is not epoch:
                raise Unavailable("the generation changed while staging",
                                  **_ctx(job, "stage"))
            self.validate(job)
            _fire(job, "stage")
            lease.bind(job_id=job.job_id, seq_id=job.seq_id)
            lease.load(job.seq_id, request.tokens, request.positions)
        except CalfsmError as e:
            self._failed_to_start(job, e)
            return None
        with self._lock:
            self._staged.append(job)
        return job

    def release_staged(self, job: JobContext, request: Request) -> bool:
        """The token of a staged step is known: write it, reserve the step's KV and
        queue it for submit. False if the step is gone (a drain or close took it: it has
        its outcome). A step whose KV must wait goes the ordinary way (parked)."""
        with self._lock:
            if job not in self._staged:
                return False
            self._staged.remove(job)
        job.timings.released = self.clock.now()
        # it runs (or ends) from here: a job accepted, with its real request
        self._announce(job, request if isinstance(request, Request) else job.request,
                       staged=True)
        try:
            # the real request is checked as any request is, and must be the step that
            # was staged (its sequence, kind and position): a caller's bad argument never
            # reaches the device, let alone resets it
            ctx = _ctx(job, "stage")
            if not isinstance(request, Request):
                raise InvalidArgument(f"release_staged takes a Request, got "
                                      f"{type(request).__name__}", **ctx)
            staged = job.request
            if (request.seq_id, request.kind, request.past_len, request.token_count) != (
                    staged.seq_id, staged.kind, staged.past_len, staged.token_count):
                raise InvalidArgument(
                    f"the released request (sequence {request.seq_id}, {request.kind.value} "
                    f"at {request.past_len}) is not the staged step (sequence "
                    f"{staged.seq_id}, {staged.kind.value} at {staged.past_len})", **ctx)
            check_request(request, job.epoch.contract(job.kind), seq_limit=WARMUP_SEQ,
                          context=ctx)
            job.request = request
            job.lease.write_inputs(request.tokens, request.positions)
            if self.life.state != _READY or job.epoch is not self.life.epoch:
                raise Unavailable(f"device is {self.life.state}",
                                  retry_after_s=self.life.retry_after_s,
                                  **_ctx(job, "stage"))
            kv = job.epoch.kv.try_reserve(job.seq_id, job.past_len, job.token_count,
                                          job_id=job.job_id)
            if kv is None:          # KV must wait: give the slot back, take the queue
                lease, job.lease = job.lease, None
                lease.undo_slices()
                job.epoch.pool.release(lease)
                _fire(job, "unstage")
                self.start(job, wait=False)
                return True
            job.kv = kv
            _fire(job, "admit")
            job.timings.admitted = now = self.clock.now()
            _fire(job, "prepare")
            self._queue(job, now, "stage")
        except CalfsmError as e:
            self._failed_to_start(job, e)
        except Exception as e:
            self._failed_to_start(job, Internal(
                f"unexpected {type(e).__name__} releasing a staged step: {e}",
                category=ErrorCategory.UNKNOWN, **_ctx(job, "stage")))
        return True

    def discard_staged(self, job: JobContext, err: CalfsmError) -> None:
        """A staged step that will not run (its stream ended): everything comes back."""
        with self._lock:
            if job not in self._staged:
                return
            self._staged.remove(job)
        self.fail_before_submit(job, err, outcome="discarded")

    # ---- cancel --------------------------------------------------------------------
    def cancel(self, job: JobContext) -> None:
        """Stop a job. Whoever owns it sees the flag at its next step boundary; a job
        still waiting in the submit queue or for admission is finished here at once."""
        removed = False
        with self._lock:
            job.cancel_requested = True
            if job.state == JobState.QUEUED and job in self._submit_q:
                self._submit_q.remove(job)
                removed = True
            elif job in self._parked:
                self._parked.remove(job)
                removed = True
        self.hooks.changed()
        if removed:
            self.fail_before_submit(job, Cancelled("cancelled before submit",
                                                   **_ctx(job, "cancel")))
        elif job.epoch is not None:
            job.epoch.kv.wake_all()
            job.epoch.pool.wake_all()

    def take_waiting(self) -> list[JobContext]:
        """Remove and return every job that has not reached the device."""
        with self._lock:
            jobs = list(self._parked) + list(self._submit_q) + self._staged
            self._parked.clear()
            self._submit_q.clear()
            self._staged = []
        self.hooks.changed()
        return jobs

    def fail_waiting(self, err: CalfsmError) -> None:
        """Fail every job that has not reached the device (each with its own copy)."""
        for job in self.take_waiting():
            self.fail_before_submit(job, _copy(err))

    def hold_waiting(self, err: CalfsmError) -> None:
        """The device is about to be reset (a drain): what has not reached it waits for
        the next generation where it can run there, and fails with ``err`` where it
        cannot. A job that starts its sequence afresh (``past_len == 0``: a prefill of a
        new prompt, a stream's first step or its replay) gives back what it took in this
        generation and is parked again, ahead of anything newer. A job that continues a
        sequence's KV (a stream's next step) cannot run after a reset, which loses that
        KV: it fails, retryable, and its stream resumes. A step staged ahead is
        discarded the same way."""
        held = []
        for job in self.take_waiting():
            if self._holdable(job):
                held.append(job)
            else:
                self.fail_before_submit(job, _copy(err))
        self._hold(held)

    def _holdable(self, job: JobContext) -> bool:
        return job.past_len == 0 and job.state != JobState.STAGED \
            and not job.cancel_requested and not job.ended and self._broken is None

    def _hold(self, jobs: list[JobContext]) -> None:
        """Give back what ``jobs`` took in their generation (they never ran) and park them
        at the head, in the order they were accepted, for the next generation."""
        kept = []
        for job in jobs:
            kv_error = self._give_back(job)
            if kv_error is not None:        # the books are closed: it cannot wait
                _fire_if(job, "fail")
                self._finish(job, kv_error, "failed")
                self._apply(self.faults.decide(kv_error, self.clock.now()))
                continue
            job.kv = None
            _fire_if(job, "hold")
            job.queue_deadline = math.inf
            kept.append(job)
        kept.sort(key=lambda j: j.job_id)
        with self._lock:
            self._parked.extendleft(reversed(kept))
        if kept:
            self.hooks.job_parked()
            self.hooks.changed()

    def _rebind(self, job: JobContext) -> None:
        """A job held through a recovery joins the current generation: checked against
        its contract again (a model switch may have changed it), and its sequence, whose
        KV the reset lost, starts afresh, as the job itself does (``past_len == 0``)."""
        epoch = job.epoch = self.life.epoch
        job.generation = self.life.generation
        self.validate(job)
        if epoch.kv.sequence_state(job.seq_id) is SeqState.UNKNOWN:
            epoch.kv.reset_sequence(job.seq_id)

    def wake_waiters(self) -> None:
        """Wake every job blocked for admission, so it sees a changed lifecycle."""
        epoch = self.life.epoch
        if epoch is not None:
            epoch.kv.wake_all()
            epoch.pool.wake_all()
        self.hooks.changed()

    # ---- submit --------------------------------------------------------------------
    def submittable(self) -> bool:
        """A job is queued whose engine is free, an in-flight slot is free and the device
        takes work."""
        return bool(self._submit_q) and self._inflight < self.max_inflight \
            and self.life.state == _READY and self._next_claim() is not None

    def _next_claim(self) -> int | None:
        """Index of the first queued job whose engine runs nothing now (ping/pong: one
        job per fixed engine), or None. Jobs of one sequence never wait side by side, so
        taking a later job first reorders only independent sequences."""
        busy = self._engine_busy
        if not busy:
            return 0 if self._submit_q else None
        for i, job in enumerate(list(self._submit_q)):   # a copy: callers may not lock
            lease = job.lease
            if lease is None or lease.slot.engine not in busy:
                return i
        return None

    def submittable_now(self) -> bool:
        """Submittable, and no error back-off in force."""
        return self.submittable() and self.faults.backoff_until <= self.clock.now()

    def take_expired(self) -> list[JobContext]:
        """Remove and return the queued jobs whose queue deadline passed."""
        with self._lock:
            if not self._submit_q:
                return []
            now = self.clock.now()
            expired = [j for j in self._submit_q if j.queue_deadline <= now]
            for j in expired:
                self._submit_q.remove(j)
        if expired:
            self.hooks.changed()
        return expired

    def fail_queue_deadline(self, job: JobContext) -> None:
        """The queue deadline passed before ``infer`` succeeded: not submitted, so the
        KV reservation rolls back and the lease returns (spec 9.1)."""
        self.fail_before_submit(job, DeadlineExceeded(
            "queue deadline passed before submit", **_ctx(job, "queue")))

    def claim(self) -> JobContext | None:
        """Pop the head of the submit queue with an in-flight slot, if it may go now."""
        with self._lock:
            self._heartbeat["submitter"] = self.clock.now()
            if not self.submittable_now():
                return None
            i = self._next_claim()
            if i is None:
                return None
            if i == 0:
                job = self._submit_q.popleft()
            else:
                job = self._submit_q[i]
                del self._submit_q[i]
            self._inflight += 1
            job.holds_inflight = True
            engine = job.lease.slot.engine if job.lease is not None else EngineSlot.AUTO
            if engine is not EngineSlot.AUTO:
                self._engine_busy[engine] = job
            return job

    def submit_wait_s(self) -> float | None:
        """How long a submitter with nothing to claim may sleep: until the first queue
        deadline or the end of a back-off (None: nothing queued)."""
        with self._lock:
            if not self._submit_q:
                return None
            now = self.clock.now()
            first = min(j.queue_deadline for j in self._submit_q) - now
        backoff = self.faults.backoff_until - now
        return max(0.0, min(first, backoff) if backoff > 0 else first)

    def submit(self, job: JobContext) -> None:
        """The only caller of ``infer`` (spec 6.4). Holds an in-flight slot on entry."""
        if job.cancel_requested or self.life.closing:
            self.release_inflight(job)
            self.fail_before_submit(job, Cancelled("cancelled before submit",
                                                   **_ctx(job, "submit")))
            return
        if self.clock.now() >= job.queue_deadline:
            self.release_inflight(job)
            self.fail_queue_deadline(job)
            return
        epoch = job.epoch
        slot = job.lease.slot
        tag = JobTag(job.job_id, job.seq_id, job.generation)
        handle = epoch.handles[job.kind]
        with self._device_lock:     # no reset between this check and the job on the device
            if epoch is not self.life.epoch or epoch.retired \
                    or self.life.state != _READY:
                rc = None
            elif slot.engine is EngineSlot.AUTO:
                rc = self.driver.infer(handle, slot.inp, slot.out, tag=tag)
            else:
                rc = self.driver.infer_fixed(handle, slot.inp, slot.out, slot.engine,
                                             tag=tag)
            if rc == 0:
                job.timings.submitted = now = self.clock.now()
                job.execution_deadline = now + self.service.execution_timeout_s(
                    job.kind, job.token_count)
                self._leave_waiting(job)
                job.lease.mark_on_device()
                epoch.kv.mark_submitted(job.kv)
                with self._lock:
                    _fire(job, "submit")
                    self._on_device.append(job)
                    self._complete_q.append(job)
                    self.hooks.job_submitted()
                return
        if rc is None:
            self.release_inflight(job)
            if self._holdable(job) and not self.life.closing:
                self._hold([job])       # the device left Ready under it: next generation
                return
            self.fail_before_submit(job, Unavailable(
                f"device left Ready ({self.life.state}) before the job was submitted",
                retry_after_s=self.life.retry_after_s, **_ctx(job, "submit")))
            return
        self._submit_failed(job, from_calrt(rc, "submit", **_ctx(job, None)))

    def _submit_failed(self, job: JobContext, err: CalfsmError) -> None:
        """``infer`` returned an error. Busy and request errors prove the graph did not
        run: roll back (FI05), or requeue when the policy says so. Device or unknown
        errors leave the KV Unknown (FI06)."""
        not_run = err.category in (ErrorCategory.TRANSIENT, ErrorCategory.REQUEST,
                                   ErrorCategory.PROGRAMMING, ErrorCategory.LIFECYCLE)
        now = self.clock.now()
        verdict = self.faults.decide(err, now, requeues=job.requeues if not_run else None)
        if verdict.until > now and err.retry_after_s is None:
            err.retry_after_s = round(verdict.until - now, 6)   # e.g. DEVICE_BUSY
        if verdict.decision is Decision.REQUEUE:
            job.requeues += 1
            with self._lock:
                self._submit_q.appendleft(job)
                self._counts["requeued"] += 1
            self.release_inflight(job)
            log.info("job %s requeued after %s", job.job_id, err.message,
                     extra=err.context())
            return
        self.release_inflight(job)
        self._apply(verdict)                # a drain begins before the caller hears
        if not_run:
            self.fail_before_submit(job, err)
        else:
            self._withhold(job, str(err))
            _fire(job, "fail")
            self._finish(job, err, "failed")

    def device_barrier(self) -> None:
        """Wait for a submit in progress to finish. Called by recovery after the
        lifecycle left Ready: from then on no ``infer`` can reach the device until the
        new generation is Ready, so a reset never races a submit."""
        with self._device_lock:
            pass

    def run_step(self, job: JobContext, stage: str, step: Callable[[JobContext], None]
                 ) -> None:
        """One step of one job; an unexpected exception never strands the job (or stops
        the thread running it): see :meth:`step_crashed`."""
        try:
            step(job)
        except Exception as e:
            self.step_crashed(job, stage, e)

    def release_inflight(self, job: JobContext) -> None:
        """The job no longer occupies the device: off the on-device list, its in-flight
        slot given back (idempotent), whoever drives the pipeline told."""
        with self._lock:
            if job in self._on_device:
                self._on_device.remove(job)
            if job.holds_inflight:
                job.holds_inflight = False
                self._inflight -= 1
                for engine, holder in list(self._engine_busy.items()):
                    if holder is job:
                        del self._engine_busy[engine]
                self.hooks.device_freed(not self.life.closing and self.submittable_now())
                if self._submit_q or self.life.closing:
                    self.hooks.work_queued()
        self.hooks.changed()

    # ---- complete ------------------------------------------------------------------
    def next_completion(self) -> JobContext | None:
        """Pop the oldest submitted job whose Wait is due; run it with
        :meth:`run_completion`."""
        with self._lock:
            if not self._complete_q:
                return None
            self._completing += 1
            return self._complete_q.popleft()

    def drop_completion(self, job: JobContext) -> None:
        """Give up a job :meth:`next_completion` gave out without completing it (a
        shutdown abandoning a zombie the device never let go)."""
        with self._lock:
            self._completing -= 1
        self.hooks.changed()

    def run_completion(self, job: JobContext) -> None:
        """The complete step of a job :meth:`next_completion` gave out. Until it returns
        (the job resolved, its callbacks run) the pipeline is not idle: a stream's
        one-shot sequence is released from those callbacks."""
        try:
            self.run_step(job, "complete", self.complete)
        finally:
            with self._lock:
                self._completing -= 1
            self.hooks.changed()

    def completion_timeout_s(self, job: JobContext) -> float:
        """How long the Wait of ``job`` may block (its execution deadline; a slice for a
        job already given up)."""
        if job.ended:
            return self.t.zombie_wait_s
        return max(0.0, job.execution_deadline - self.clock.now())

    def complete(self, job: JobContext) -> None:
        """The only caller of ``wait`` (spec 6.5); holds no lock while waiting."""
        if job.lease is None:       # abandoned by a shutdown that could not drain it
            return
        slot = job.lease.slot
        zombie = job.ended         # already failed by its execution deadline
        t0 = self.clock.now()
        rc = self.driver.wait(slot.out, self.completion_timeout_s(job))
        t1 = self.clock.now()
        self._heartbeat["completion"] = t1
        job.timings.device_wait_ms += (t1 - t0) * 1e3
        if rc == CalrtCode.TIMEOUT:
            if not zombie:
                self._execution_timeout(job)
            if self.life.state == LifecycleState.FAILED and not self.life.closing:
                log.error("abandoning job %s on a failed device; its buffers stay "
                          "quarantined until the process exits", job.job_id,
                          extra=_ctx(job, "wait"))
                return
            with self._lock:               # keep waiting: the device still owns it
                self._complete_q.append(job)
                self.hooks.job_submitted()
            return
        self.release_inflight(job)         # the device is free: the next job goes first
        self.hooks.after_device_freed()
        job.lease.mark_off_device()
        if zombie:
            self._late_completion(job, rc)
            return
        contract = slot.contract
        undo_error: CalfsmError | None = None
        with self._device_lock:     # no reset between the fence check and device calls
            current = job.epoch is self.life.epoch and not job.epoch.retired
            if current and rc == 0:
                reading = read_output(self.driver, slot.out, contract)
                try:                # input slices are done with: the job ran (see below)
                    job.lease.undo_slices()
                except CalfsmError as e:    # the slot goes to quarantine on return (FI15)
                    undo_error = e
        if undo_error is not None:
            log.warning("undo_slices failed after the job ran: %s", undo_error,
                        extra=undo_error.context())
        if not current:
            self._late_completion(job, rc)
            return
        _fire(job, "complete")
        try:
            if rc != 0:
                raise from_calrt(rc, "wait", **_ctx(job, None))
            t2 = self.clock.now()
            logits = check_output(reading, slot.logits_bf16, contract, job.token_count,
                                  job.request.target, _ctx(job, None))
            job.timings.d2h_ms = (self.clock.now() - t2) * 1e3
        except CalfsmError as e:
            self._completion_failed(job, e)
            return
        # Spec 6.5 orders KV commit -> undo slices -> resolve -> return the lease. The
        # slices were undone above, in the same device-lock section as the output reads
        # (one lock trip per job): the commit is host bookkeeping of a KV the device has
        # already written, and the undo touches only this slot's tensor views, so the two
        # commute. The result is resolved before the lease goes back, as the spec says.
        t3 = self.clock.now()
        try:
            job.epoch.kv.commit(job.kv)
        except CalfsmError as e:
            # the books are closed and the sequence is Unknown (e.g. a rewinding prefill
            # whose trim failed): the logits are right, but the caller must not go on
            # with a sequence whose KV nobody vouches for
            self._kv_commit_failed(job, e)
            return
        self._continue(job, logits)
        now = self.clock.now()
        job.timings.completed = now
        job.timings.postprocess_ms = (now - t3) * 1e3
        lease, job.lease = job.lease, None
        self._leave_waiting(job)
        if JOB_MACHINE.fire(job, "succeed"):
            self.count("succeeded")
            result = InferenceResult(job.job_id, job.seq_id, job.generation, job.kind,
                                     job.token_count, logits, job.timings)
            if self.observers.jobs:
                self._observe(job, "succeeded", result, None)
            job.handle._resolve(result, None)
        else:                                       # cancelled after submit (FI12)
            _fire(job, "fail")
            err = Cancelled("cancelled after submit; the job ran, its result was dropped",
                            **_ctx(job, "complete"))
            self._count_outcome("cancelled", err)
            if self.observers.jobs:
                self._observe(job, "cancelled", None, err)
            job.handle._resolve(None, err)
        job.epoch.pool.release(lease)
        self.hooks.job_parked()         # a slot and KV came free: admission may go on
        self.service.observe(job.kind, job.token_count, job.timings.queued, t1)
        self.faults.succeeded()

    def _continue(self, job: JobContext, logits: Any) -> None:
        """Run the job's continuation (a stream's next step: sample, then hand the step
        prepared ahead to the submitter) before the job resolves: the device gets its
        next step before the caller's callbacks run. A continuation that raises is a bug
        of its owner, logged; its stream then goes on the ordinary way."""
        cont, job.continuation = job.continuation, None
        if cont is None or job.cancel_requested:
            return
        try:
            cont(job, logits)
        except Exception:
            log.exception("the continuation of job %s raised", job.job_id,
                          extra=_ctx(job, "continue"))

    def _kv_commit_failed(self, job: JobContext, err: CalfsmError) -> None:
        """The job ran and its slot is clean, but its KV could not be committed."""
        lease, job.lease = job.lease, None
        _fire(job, "fail")
        self._apply(self.faults.decide(err, self.clock.now()))   # before the caller hears
        self._finish(job, err, "failed")
        job.epoch.pool.release(lease)

    def _completion_failed(self, job: JobContext, err: CalfsmError) -> None:
        """Wait error, CCU exception, bad or non-finite output: the job fails, the KV is
        Unknown (the device ran), the slot is quarantined, the fault policy decides."""
        # the raw output, for observers (a dump sink): the slot is quarantined below, so
        # its host arrays stay as the device left them
        output = job.lease.slot.logits_bf16 if self.observers.jobs else None
        self._withhold(job, str(err))
        _fire(job, "quarantine")
        self._apply(self.faults.decide(err, self.clock.now()))   # before the caller hears
        self._finish(job, err, "quarantined", output=output)

    def _execution_timeout(self, job: JobContext) -> None:
        """Wait timed out past the execution deadline (FI07): no logits, KV Unknown,
        the buffers stay with the device (quarantined, kept alive), admission stops and
        recovery decides; the job's caller is told now."""
        err = DeadlineExceeded("execution deadline passed; the job may still be running "
                               "on the device", category=ErrorCategory.TRANSIENT,
                               calrt_code=int(CalrtCode.TIMEOUT), **_ctx(job, "wait"))
        job.epoch.kv.mark_unknown(job.kv, "execution timeout")
        _fire(job, "quarantine")
        self._drain(f"execution deadline passed for job {job.job_id}")  # before the caller
        self._finish(job, err, "quarantined")

    def _late_completion(self, job: JobContext, rc: int) -> None:
        """Wait returned for a job already failed by its execution deadline, or for a job
        of a retired generation (FI14): resolve only its own job, touch nothing of the
        current generation (no KV, no pool slot, no metric of it)."""
        old = job.epoch
        if old is not self.life.epoch or old.retired:
            self.count("stale_completions")
            _limited.warning("stale_completion", "stale completion of generation %s fenced",
                             job.generation, extra={
                "job_id": job.job_id, "seq_id": job.seq_id, "generation": job.generation,
                "calrt_code": rc, "stage": "stale_completion"})
        self._withhold(job, "completion after the job was given up or its generation reset")
        if not job.ended:
            _fire_if(job, "quarantine")
            self._finish(job, Unavailable(
                f"completion of generation {job.generation} arrived after a reset; "
                "result discarded", **_ctx(job, "stale_completion")), "quarantined")

    # ---- ending a job --------------------------------------------------------------
    def fail_before_submit(self, job: JobContext, err: CalfsmError, *,
                           outcome: str | None = None) -> None:
        """Fail a job the device never ran: undo slices, return the lease, roll back KV.
        ``outcome``: the counter it ends in (default: cancelled or failed)."""
        if isinstance(err, Cancelled):
            _fire_if(job, "cancel")
        kv_error = self._give_back(job)
        _fire_if(job, "fail")
        self._finish(job, err, outcome or (
            "cancelled" if isinstance(err, Cancelled) else "failed"))
        self.hooks.job_parked()         # what it held came free
        self.hooks.changed()            # it left the waiting books: idle may hold now
        if kv_error is not None:
            self._apply(self.faults.decide(kv_error, self.clock.now()))

    def _give_back(self, job: JobContext) -> CalfsmError | None:
        """What a job the device never ran took goes back: slices undone (a failed undo
        is logged and quarantines the slot on return, FI15), the lease returned, the KV
        rolled back. Returns the rollback's error (the books are closed and the sequence
        is Unknown), else None."""
        epoch = job.epoch
        if job.lease is not None:
            try:
                job.lease.undo_slices()
            except CalfsmError as e:
                log.warning("undo_slices failed while giving a job's slot back: %s", e,
                            extra=e.context())
            lease, job.lease = job.lease, None
            epoch.pool.release(lease)
        if job.kv is not None and job.kv.state == "Reserved":
            try:
                epoch.kv.rollback(job.kv)
            except CalfsmError as e:
                log.warning("KV rollback failed while giving a job's KV back: %s", e,
                            extra=e.context())
                return e
        return None

    def _withhold(self, job: JobContext, reason: str) -> None:
        """The device may have run (or may still run) the job: never claim a rollback.
        An open KV reservation becomes Unknown and the slot is quarantined, both in the
        job's own generation (a retired one is fenced: no device call)."""
        if job.kv is not None and job.kv.state in ("Reserved", "Submitted"):
            job.epoch.kv.mark_unknown(job.kv, reason)
        if job.lease is not None:
            job.epoch.pool.quarantine(job.lease, reason)
            job.lease = None

    def _finish(self, job: JobContext, err: CalfsmError, outcome: str, *,
                output: Any = None) -> None:
        err.with_context(**_ctx(job, None))
        job.timings.completed = self.clock.now()
        self._leave_waiting(job)
        self._count_outcome(outcome, err)
        if isinstance(err, Cancelled):
            pass
        elif err.http_status < 500:     # the caller's side (400, 429): not a fault here
            log.debug("job failed: %s", err.message, extra=err.context())
        else:
            _limited.warning("job_failed", "job failed: %s", err.message,
                             extra=err.context())
        if not job.ended:
            if self.observers.jobs:
                self._observe(job, outcome, None, err, output)
            job.handle._resolve(None, err)

    def _observe(self, job: JobContext, outcome: str, result: InferenceResult | None,
                 err: CalfsmError | None, output: Any = None) -> None:
        """Tell the observers a job ended, before its handle resolves (holding no lock):
        a caller that has the outcome finds it counted."""
        self.observers.job_ended(JobEnded(
            job.job_id, job.seq_id, job.generation, job.kind, outcome, job.timings,
            job.request, result, err, output, job.announced))

    def _count_outcome(self, outcome: str, err: CalfsmError) -> None:
        cat = err.category.value
        with self._lock:
            self._counts[outcome] += 1
            if outcome != "discarded":      # not an error: a step that was not needed
                self._errors_by_category[cat] = self._errors_by_category.get(cat, 0) + 1

    def step_crashed(self, job: JobContext, stage: str, exc: BaseException) -> None:
        """An unexpected exception in a submit or completion step (a bug, or a driver
        raising where it must return a code). Never stuck: the job fails with Internal,
        its in-flight slot comes back if it still held one, its slot and KV are treated
        as suspect, and the generation is recovered like after an unknown error."""
        log.error("unexpected error in the %s step of job %s", stage, job.job_id,
                  exc_info=exc, extra=_ctx(job, stage))
        self.release_inflight(job)
        err = Internal(f"unexpected {type(exc).__name__} in {stage}: {exc}",
                       category=ErrorCategory.UNKNOWN, **_ctx(job, stage))
        try:
            self._withhold(job, str(err))
        except Exception:
            log.exception("cleaning up after the crashed step of job %s", job.job_id)
        # the device's recovery begins before the job's caller is told: one that has the
        # error finds the executor draining, not still Ready on the suspect generation
        self._apply(self.faults.decide(err, self.clock.now()))
        if not job.ended:
            if not _fire_if(job, "quarantine"):
                _fire_if(job, "fail")
            self._finish(job, err, "failed")

    def break_(self, reason: str) -> None:
        """A worker died: admit nothing more and fail every job that has not ended, so
        nobody waits forever. Jobs on the device keep their (quarantined) buffers."""
        self._broken = reason
        with self._lock:
            stuck = list(self._complete_q) + list(self._on_device)
            self._complete_q.clear()
        for job in self.take_waiting():
            self.fail_before_submit(job, ExecutorBroken(
                f"executor is broken: {reason}", **_ctx(job, "broken")))
        self.abandon(stuck, lambda job: ExecutorBroken(f"executor is broken: {reason}",
                                                       **_ctx(job, "broken")))
        self.wake_waiters()             # callers blocked in admission give up now

    def abandon(self, jobs: list[JobContext],
                error: Callable[[JobContext], CalfsmError]) -> None:
        """Give up jobs the device still holds (shutdown past its timeout, a dead
        worker): each is resolved with ``error(job)``, its KV marked Unknown and its slot
        quarantined; a Wait that returns later finds nothing to do."""
        for job in dict.fromkeys(jobs):
            if job.ended:
                continue
            self._withhold(job, "abandoned on the device")
            if not _fire_if(job, "quarantine"):
                _fire_if(job, "fail")
            self._finish(job, error(job), "quarantined")
        self.hooks.changed()

    # ---- step mode -----------------------------------------------------------------
    def expire_waiting(self) -> None:
        """Fail every parked job past its admission deadline and every queued job past
        its queue deadline."""
        self.expire_parked()
        for j in self.take_expired():
            self.run_step(j, "queue", self.fail_queue_deadline)

    def submit_next(self) -> bool:
        """Expire, then submit the head of the queue if an in-flight slot is free (on a
        virtual clock a back-off is jumped over). True if anything moved."""
        expired = self.take_expired()
        for j in expired:
            self.run_step(j, "queue", self.fail_queue_deadline)
        if expired:
            return True
        if self.submittable() and self.faults.backoff_until > self.clock.now() \
                and self.clock.virtual:
            self.clock.advance_to(self.faults.backoff_until)
        job = self.claim()
        if job is None:
            return False
        self.run_step(job, "submit", self.submit)
        return True

    def complete_next(self) -> bool:
        job = self.next_completion()
        if job is None:
            return False
        self.run_completion(job)
        return True


def _copy(err: CalfsmError) -> CalfsmError:
    """A fresh error of the same kind and message, for one of many jobs."""
    return type(err)(err.message, category=err.category, stage=err.stage,
                     retry_after_s=err.retry_after_s)


def _ctx(job: JobContext, stage: str | None) -> dict[str, Any]:
    ctx: dict[str, Any] = {"job_id": job.job_id, "seq_id": job.seq_id,
                           "generation": job.generation}
    if stage is not None:
        ctx["stage"] = stage
    return ctx
