"""Admission: accept -> validate -> KV reservation -> buffer lease -> prepare.

The admission part owns the jobs that wait to be admitted (the parked queue, in
priority order, and the head the admission step has taken out to admit), the deferred
work that must run outside every lock, and the job ids. There is one admission queue,
for both runtimes and every caller: :meth:`Admission.admit` only tries (the KV books and
the pool grant now or refuse, and never wait), and a job that cannot be admitted now is
parked (:class:`~calfsm.engine.parked.ParkedQueue`: the highest priority first, aged by its
waiting time, first come first served among equals) for the admission step
(:meth:`Admission.admit_parked`), which tries the head again when capacity comes free
and fails what passed its admission deadline
(:meth:`Admission.expire_parked`). A caller that must block until its job is admitted
(the threaded :meth:`~calfsm.executor.DeviceExecutor.enqueue`) waits on the job
(:meth:`Admission.watch_admission`; the wait itself is the runtime's,
:func:`calfsm.runtime.waits.wait_admitted`), not on the books. A prepared job goes to the device
side's submit queue (:meth:`calfsm.engine.submission.Submission.queue`). A stream's next step
prepared ahead is :mod:`calfsm.engine.overlap`'s.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections import deque
from collections.abc import Callable

from calfsm.drivers.base import EngineSlot
from calfsm.engine.epoch import WARMUP_SEQ
from calfsm.engine.job import JobContext, JobHandle, Request
from calfsm.engine.kv import SeqState
from calfsm.engine.outcomes import Outcomes
from calfsm.engine.parked import ParkedQueue
from calfsm.engine.parts import READY, Core, job_ctx
from calfsm.engine.submission import Submission
from calfsm.errors import (
    CalfsmError,
    Cancelled,
    DeadlineExceeded,
    ErrorCategory,
    ExecutorBroken,
    Internal,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from calfsm.machines.job import JOB_MACHINE
from calfsm.request import check_request

__all__ = ["Admission"]

log = logging.getLogger("calfsm.pipeline")

#: the back-off of asking the device again for KV room it refused (seconds)
RETRY_MIN_S, RETRY_MAX_S = 0.001, 0.25

_fire = JOB_MACHINE.fire
_fire_if = JOB_MACHINE.fire_if_declared


class Admission:
    """The jobs waiting to be admitted, and the steps that admit them."""

    def __init__(self, core: Core, outcomes: Outcomes, device: Submission) -> None:
        self.core = core
        self.outcomes = outcomes
        self.device = device
        #: waiting for KV or a buffer slot (no thread), the highest priority first
        self._parked = ParkedQueue(core.t.priority_aging_s)
        #: the first admission deadline among the parked jobs, and what it was computed
        #: from: deadlines only move when the queue or the lifecycle does, so the
        #: admission step need not compute every one of them at every step
        self._parked_version = 0
        self._first: tuple[tuple[object, ...], float] = ((), math.inf)
        #: the parked head the admission step took out to admit: the step owns it (a
        #: cancel only flags it, a drain does not take it) until it is queued or failed
        self._admitting: JobContext | None = None
        self._deferred: deque[Callable[[], None]] = deque()   # work to run outside locks
        #: deferred functions taken off the queue and still running: busy until they
        #: return (one may be staging a step, a job whose end it has yet to tell)
        self._running = 0
        #: when the head is asked again after the device refused it KV room the books
        #: had (inf: no such wait), and the back-off that led there
        self._retry_at = math.inf
        self._retry_gap = 0.0
        self._ids = itertools.count(1)

    # ---- observation ---------------------------------------------------------------
    def busy(self) -> bool:
        """A job is parked or being admitted, or deferred work is left or running."""
        return bool(self._parked or self._deferred or self._admitting or self._running)

    def has_parked(self) -> bool:
        return self._parked.size > 0

    def capacity_freed(self) -> None:
        """The KV books or the pool gave something back: the admission step runs if a
        job waits for it (a cheap check on every token's commit; no wake-up otherwise)."""
        if self._parked.size:
            self.core.hooks.job_parked()

    def parked(self) -> int:
        """Jobs in the admission queue (the head being admitted now included)."""
        with self.core.lock:
            return len(self._parked) + (self._admitting is not None)

    def blocks_staging(self) -> bool:
        """A job waits for admission: a slot taken ahead must never starve it."""
        return self._parked.size > 0 or self._admitting is not None

    def can_admit(self) -> bool:
        """A job waits for admission and the device takes work (not Ready: the parked
        jobs wait for the next generation)."""
        return self._parked.size > 0 and self.core.life.state == READY

    def due(self) -> tuple[bool, bool, bool]:
        """What a step driver asks of admission at every step, in one look: (a parked
        job's admission deadline passed, :meth:`can_admit`, :meth:`has_deferred`). The
        clock is read only when a job is parked."""
        if not self._parked.size:
            return False, False, bool(self._deferred)
        now = self.core.clock.now()
        with self.core.lock:        # first_deadline(), with this one clock read
            first = min(self._first_deadline_locked(now), self._retry_at)
        return first <= now, self.core.life.state == READY, bool(self._deferred)

    def fingerprint(self) -> int:
        """Changes whenever something that could let a parked job proceed changed (KV
        books, pool, generation, the parked jobs themselves)."""
        life = self.core.life
        epoch = life.epoch
        return hash((len(self._parked), epoch.kv.stats() if epoch else None,
                     epoch.pool.stats() if epoch else None, life.generation))

    def first_deadline(self) -> float:
        """The earliest admission deadline among the parked jobs, or the time the head is
        asked again after a device refusal if that comes first (inf: none)."""
        if not self._parked:
            return math.inf
        now = self.core.clock.now()
        with self.core.lock:
            return min(self._first_deadline_locked(now), self._retry_at)

    def device_refused(self) -> None:
        """The device refused KV room the books had (``kv_apply`` said no): no end of a
        reservation need follow, so waiting for ``on_freed`` alone could wait forever
        once every other stream's step is parked behind the head. The head is asked
        again after a back-off instead (1 ms, doubling to 0.25 s; reset by a grant): a
        timer of the admission step, as its deadlines are."""
        with self.core.lock:
            self._retry_gap = min(RETRY_MAX_S, self._retry_gap * 2 or RETRY_MIN_S)
            self._retry_at = self.core.clock.now() + self._retry_gap

    def _first_deadline_locked(self, now: float) -> float:
        """Cached: a parked job's deadline is fixed while the lifecycle stays in one state
        (out of Ready it is the job's own; in Ready its budget's extension, the time spent
        out of Ready, does not grow), so it is recomputed only when the queue, the state
        or that time changed — not at every step over a thousand waiting jobs."""
        life = self.core.life
        ready = life.state == READY
        key = (self._parked_version, life.state, life.unready_s(now) if ready else None)
        cached_key, first = self._first
        if key != cached_key:
            first = min((self.deadline(j, now) for j in self._parked), default=math.inf)
            self._first = (key, first)
        return first

    def _parked_changed_locked(self) -> None:
        self._parked_version += 1

    def wait_s(self) -> float | None:
        """How long the admission step may sleep: until the first parked job's admission
        deadline (None: nothing parked)."""
        now = self.core.clock.now()
        first = self.first_deadline()
        if math.isinf(first):
            return None
        return max(0.0, first - now)

    # ---- deferred work -------------------------------------------------------------
    def has_deferred(self) -> bool:
        return bool(self._deferred)

    def defer(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` later on the admission side, holding no lock (a stream's replay
        once the device is Ready, a sequence's release): callbacks that must not run
        inside a lifecycle transition or a completion."""
        with self.core.lock:
            self._deferred.append(fn)
        if not self.core.hooks.quiet:
            self.core.hooks.job_parked()

    def run_deferred(self) -> bool:
        """Run one deferred function; False if there was none."""
        with self.core.lock:
            if not self._deferred:
                return False
            fn = self._deferred.popleft()
            self._running += 1
        try:
            fn()
        except Exception:
            log.exception("deferred work %r raised", fn)
        finally:
            with self.core.lock:
                self._running -= 1
        if not self.core.hooks.quiet:
            self.core.hooks.changed()   # idle counts deferred work
        return True

    # ---- accept --------------------------------------------------------------------
    def accept(self, request: Request, canceller: Callable[[JobContext], None], *,
               continuing: bool = False, staging: bool = False,
               request_id: str | None = None) -> JobContext:
        """Gate, then make the job and its handle; raises only for a closed or non-Ready
        executor, a full wait queue (or a bad ``request`` type). Every accepted job has
        one outcome. ``continuing``: a running stream's next step (see JobContext).
        Observers hear of the job (job_accepted) or of the refusal (job_refused) here,
        holding no lock; ``staging``: a step prepared ahead, announced only when it is
        released, and a refusal is not the caller's. ``request_id``: the job's (default:
        the request's own)."""
        try:
            job = self._make_job(request, canceller, continuing, request_id)
        except CalfsmError as e:
            if not staging:
                self.outcomes.observers.job_refused(e, request)
            raise
        if staging:
            job.announced = False           # at its release, if it is released
        else:
            self.outcomes.announce(job, request, staged=False)
        return job

    def _make_job(self, request: Request, canceller: Callable[[JobContext], None],
                  continuing: bool, request_id: str | None) -> JobContext:
        core = self.core
        if not isinstance(request, Request):
            raise InvalidArgument(f"enqueue takes a Request, got {type(request).__name__}",
                                  stage="request")
        if core.broken is not None:
            raise ExecutorBroken(f"executor is broken: {core.broken}", stage="admission")
        life = core.life
        life.gate(continuing=continuing)
        self.outcomes.enter_waiting(request, continuing, self.device.inflight)
        now = core.clock.now()
        deadline_s = request.deadline_s if request.deadline_s is not None \
            else core.t.default_deadline_s
        job = JobContext(
            job_id=next(self._ids), request=request, generation=life.generation,
            seq_id=request.seq_id, kind=request.kind, past_len=request.past_len,
            token_count=request.token_count,
            deadline=now + deadline_s if deadline_s > 0 else now,
            request_id=request_id or request.request_id)
        job.engine = request.engine
        job.timings.accepted = now
        job.continuing = continuing
        job.unready_mark = life.unready_s(now)
        job.epoch = life.epoch
        job.handle = JobHandle(job, canceller, self.core.sync)
        job.waiting = True
        self.outcomes.count("accepted")
        return job

    def validate(self, job: JobContext) -> None:
        """Spec 6.3 checks 1-6, once, before any resource is taken."""
        ctx = job_ctx(job, None)
        if job.deadline <= job.timings.accepted:
            raise DeadlineExceeded("deadline already past at enqueue", stage="validate",
                                   **ctx)
        req = job.request
        check_request(req, job.epoch.contract(job.kind), seq_limit=WARMUP_SEQ,
                      context=dict(ctx, stage="validate"))
        if req.engine is not EngineSlot.AUTO and req.engine not in self.core.engines:
            raise InvalidArgument(f"engine {req.engine.name} not in use", stage="validate",
                                  **ctx)

    # ---- start: validate, admit, prepare -------------------------------------------
    def start(self, job: JobContext) -> None:
        """Validate, admit and prepare ``job``; every failure goes to its handle. A job
        that cannot be admitted now, or that finds others parked, is parked for
        :meth:`admit_parked` at its place by priority (even one that outranks them all:
        only the admission step admits parked work, one job at a time)."""
        try:
            self.validate(job)
            with self.core.lock:
                # the head being admitted counts: were it refused and put back, a job
                # admitted meanwhile would have passed it
                parked = self._parked.size > 0 or self._admitting is not None
                if parked:
                    self._parked.push(job)
                    self._parked_changed_locked()
            if parked:
                self.core.hooks.job_parked()
                return
            if self.admit(job):
                self.prepare(job)
            else:
                with self.core.lock:    # it keeps a KV reservation it was granted
                    self._parked.push(job, begun=job.kv is not None)
                    self._parked_changed_locked()
                self.core.hooks.job_parked()
        except CalfsmError as e:
            self.failed_to_start(job, e)
        except Exception as e:          # a bug must not strand an accepted job
            log.error("unexpected error preparing job %s", job.job_id, exc_info=e,
                      extra=job_ctx(job, "prepare"))
            self.failed_to_start(job, Internal(
                f"unexpected {type(e).__name__} while preparing: {e}",
                category=ErrorCategory.UNKNOWN, **job_ctx(job, "prepare")))

    def failed_to_start(self, job: JobContext, e: CalfsmError) -> None:
        """A job that never reached the submit queue fails; a device error met on the
        way is shown to the fault policy like one met at submit."""
        core = self.core
        life = core.life
        stale = job.epoch is not None and (job.epoch.retired or job.epoch is not life.epoch)
        if isinstance(e, Cancelled) and not job.cancel_requested and not life.closing:
            # admission gave up because the device left Ready, not because of a cancel
            if core.broken is not None:
                e = ExecutorBroken(f"executor is broken: {core.broken}",
                                   **job_ctx(job, "admission"))
            else:
                e = Unavailable(f"device is {life.state} ({life.reason or 'recovering'})",
                                retry_after_s=life.retry_after_s,
                                **job_ctx(job, "admission"))
        elif stale and not isinstance(e, Cancelled):
            # the device was reset under this preparation: say so, not "bad state"
            e = Unavailable(f"the device was reset while the job was prepared ({e})",
                            retry_after_s=life.retry_after_s,
                            calrt_code=e.calrt_code, **job_ctx(job, e.stage or "prepare"))
        try:
            if e.calrt_code is not None and not stale and not isinstance(e, Cancelled):
                core.decide(e)          # before the caller hears
        finally:
            self.outcomes.fail_before_submit(job, e)

    def deadline(self, job: JobContext, now: float) -> float:
        """``min(deadline, accepted + admission budget)``, the budget extended by the time
        the executor spent out of Ready since the job was accepted: a job that waited
        through a recovery is not charged for it (its own deadline still holds). While
        the executor is not Ready only the job's own deadline can pass, and a running
        stream's next step (``continuing``) is bounded by its own deadline alone: its
        stream was admitted, and a step that waits its turn must not fail it."""
        life = self.core.life
        if job.continuing or life.state != READY:
            return job.deadline
        paused = life.unready_s(now) - job.unready_mark
        return min(job.deadline, job.timings.accepted + self.core.t.admission_s + paused)

    def admit(self, job: JobContext) -> bool:
        """KV reservation, then a buffer lease, now: False when either must wait (what
        was taken is kept for the next try); raises on errors."""
        clock = self.core.clock
        epoch = job.epoch
        now = clock.now()
        if now >= self.deadline(job, now):
            raise DeadlineExceeded("admission deadline passed",
                                   **job_ctx(job, "admission"))
        if job.kv is None:
            # a running stream's next step may follow its step before, still open
            job.kv = epoch.kv.try_reserve(job.seq_id, job.past_len, job.token_count,
                                          job_id=job.job_id, chain=job.continuing)
            if job.kv is None:
                return False
            _fire(job, "admit")
        try:
            # the request's engine, else AUTO: the pool lends from the engine with the
            # most free slots, so ping/pong stays even (one job per engine at a time)
            job.lease = epoch.pool.acquire(job.kind, job.engine)
        except ResourceExhausted:
            return False
        job.timings.admitted = clock.now()
        return True

    def admitting(self, job: JobContext) -> bool:
        """Whether ``job`` is still in the admission queue (parked, or being admitted)."""
        with self.core.lock:
            return self._admitting is job or job in self._parked

    def watch_admission(self, job: JobContext, handle: JobHandle,
                        wake: Callable[[], None]) -> float | None:
        """Arrange for ``wake()`` once ``job`` has left the admission queue: queued for
        the device, or ended (its handle resolves). None: it has left already (admitted
        at once, the common case, or ended), and ``wake`` is never called. Otherwise the
        real seconds a waiter may wait before :meth:`expire_admission` (inf: none): on a
        virtual clock, which nobody may be advancing, the admission deadline is also
        kept in real seconds (as many as the virtual ones left). The admission step ends
        every parked job in time, and a job's end always resolves its handle, so a
        waiter waits on the job, holding no lock (:func:`calfsm.runtime.waits.wait_admitted`)."""
        clock = self.core.clock
        with self.core.lock:
            if self._admitting is not job and job not in self._parked:
                return None
            job.on_admitted = wake
            limit = max(0.0, self.deadline(job, clock.now()) - clock.now()) \
                if clock.virtual else math.inf
        handle.add_done_callback(lambda _h: wake())    # at once if it has ended
        return limit

    def expire_admission(self, job: JobContext) -> bool:
        """A waiter's real-time admission limit passed (virtual clock not advanced): fail
        ``job`` if it is still parked. False: it is being admitted now, and that step
        ends its wait."""
        if not self.unpark(job):
            return False
        self.failed_to_start(job, DeadlineExceeded(
            "admission deadline passed (virtual clock not advanced)",
            **job_ctx(job, "admission")))
        return True

    def prepare(self, job: JobContext) -> None:
        """Copy inputs, set slices, CSRs and KV sequence; push to the submit queue."""
        clock = self.core.clock
        _fire(job, "prepare")
        lease = job.lease
        lease.bind(job_id=job.job_id, seq_id=job.seq_id)
        t0 = clock.now()
        lease.load(job.seq_id, job.request.tokens, job.request.positions)
        now = clock.now()
        job.timings.h2d_ms = (now - t0) * 1e3
        self.device.queue(job, now, "prepare")
        if job.on_admitted is not None:        # a caller blocks until it is admitted
            job.on_admitted()

    # ---- the parked queue ----------------------------------------------------------
    def admit_parked(self) -> bool:
        """Try to admit the head parked job (the highest effective priority: see
        :mod:`calfsm.engine.parked`). True if it moved (or failed).

        The head is taken out while it is admitted (``_admitting``), so a cancel or a
        drain meanwhile cannot fail it under this step's hands: the step looks at the
        cancel flag and the lifecycle once admission returns, and fails the job itself
        (the soak found the race: a cancel landing mid-admission fired ``admit`` on a
        failed job)."""
        core = self.core
        life = core.life
        with core.lock:
            if not self._parked or self._admitting is not None or life.state != READY:
                return False            # not Ready: parked jobs wait for the generation
            job = self._admitting = self._parked.pop()
            self._parked_changed_locked()
        try:
            if job.cancel_requested or life.closing:
                raise Cancelled("cancelled while waiting for admission",
                                **job_ctx(job, "admission"))
            if job.epoch is not life.epoch:
                self._rebind(job)       # held through a recovery: the new generation's
            admitted = self.admit(job)
            with core.lock:
                self._admitting = None
                cancelled = job.cancel_requested or life.closing
                gone = cancelled or life.state != READY
                if not admitted and not gone:
                    # back at its place (at the head if it keeps a KV reservation):
                    # it is tried again when capacity comes free
                    self._parked.push(job, begun=job.kv is not None)
                    self._parked_changed_locked()
                    return False
                if admitted:
                    self._retry_at, self._retry_gap = math.inf, 0.0
            if gone and not cancelled and core.holdable(job):
                self.hold([job])        # a drain began meanwhile: wait for the next one
                return True
            if gone:
                raise Cancelled("cancelled while waiting for admission",
                                **job_ctx(job, "admission"))
            self.prepare(job)
        except Exception as e:
            with core.lock:
                if self._admitting is job:
                    self._admitting = None
            if not isinstance(e, CalfsmError):
                log.error("unexpected error admitting job %s", job.job_id, exc_info=e,
                          extra=job_ctx(job, "admission"))
                e = Internal(f"unexpected {type(e).__name__} while admitting: {e}",
                             category=ErrorCategory.UNKNOWN, **job_ctx(job, "admission"))
            self.failed_to_start(job, e)
        return True

    def expire_parked(self) -> None:
        """Fail every parked job past its admission deadline (and end a device refusal's
        back-off that is over: the head is tried again now)."""
        now = self.core.clock.now()
        with self.core.lock:
            if self._retry_at <= now:
                self._retry_at = math.inf
            if self._first_deadline_locked(now) > now:
                return                  # none is late (the common step: no scan)
            late = [j for j in self._parked if self.deadline(j, now) <= now]
            for j in late:
                self._parked.remove(j)
            self._parked_changed_locked()
        for j in late:
            self.failed_to_start(j, DeadlineExceeded(
                "admission deadline passed", **job_ctx(j, "admission")))

    def unpark(self, job: JobContext) -> bool:
        """Take a cancelled job out of the parked queue; False if it is not there."""
        with self.core.lock:
            if self._parked.remove(job):
                self._parked_changed_locked()
                return True
        return False

    def take_parked(self) -> list[JobContext]:
        """Remove and return every parked job, in admission order."""
        with self.core.lock:
            jobs = self._parked.take_all()
            self._parked_changed_locked()
        return jobs

    def hold(self, jobs: list[JobContext]) -> None:
        """Give back what ``jobs`` took in their generation (they never ran) and park them
        again for the next generation, each at its place by priority and acceptance
        (ahead of anything accepted later at the same priority)."""
        core = self.core
        kept = []
        for job in jobs:
            kv_error = self.outcomes.give_back(job)
            if kv_error is not None:        # the books are closed: it cannot wait
                _fire_if(job, "fail")
                self.outcomes.finish(job, kv_error, "failed")
                core.decide(kv_error)
                continue
            job.kv = None
            _fire_if(job, "hold")
            job.queue_deadline = math.inf
            kept.append(job)
        with core.lock:
            for job in kept:
                self._parked.push(job)
            self._parked_changed_locked()
        if kept:
            core.hooks.job_parked()
            core.hooks.changed()

    def _rebind(self, job: JobContext) -> None:
        """A job held through a recovery joins the current generation: checked against
        its contract again (a model switch may have changed it), and its sequence, whose
        KV the reset lost, starts afresh, as the job itself does (``past_len == 0``)."""
        life = self.core.life
        epoch = job.epoch = life.epoch
        job.generation = life.generation
        self.validate(job)
        if epoch.kv.sequence_state(job.seq_id) is SeqState.UNKNOWN:
            epoch.kv.reset_sequence(job.seq_id)
