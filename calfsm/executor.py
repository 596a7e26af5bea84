"""DeviceExecutor: the request / submit / completion pipeline (spec sections 5, 6, 9).

Theory of operation
-------------------
The executor alone owns the driver, the configured model (an :class:`~calfsm.epoch.Epoch`:
model handles, KV coordinator and buffer pool of one generation) and the lifecycle.
A job flows through four *steps*, each a plain method that does one bounded piece of
work and never sleeps:

``_admit``      validate -> exact sub-model -> KV reservation + token budget -> buffer lease
``_prepare``    copy inputs, set slices, CSRs and KV sequence -> submit queue
``_submit``     (only caller of ``infer``) cancel/deadline check -> infer -> Submitted
``_complete``   (only caller of ``wait``, holding no lock) wait -> status -> output check
                -> BF16->FP32 into the target -> KV commit -> undo slices -> resolve
                -> return the lease

In threaded mode (default) the caller's thread runs admission and preparation
(blocking on KV and buffers with deadlines), a submitter thread runs ``_submit`` and a
completion thread runs ``_complete``. In step mode (``ExecutorConfig(threaded=False)``)
no thread is started and :class:`~calfsm.scheduler.StepScheduler` drives the *same*
steps one at a time on the simulated device's virtual clock, so tests explore
interleavings exactly and replay them from a seed.

Every failure releases what was taken in reverse order. Before ``infer()`` succeeded a
lease goes back to the pool and the KV reservation rolls back; after it, only the
completion or recovery path touches them, and a failure leaves the KV ``Unknown`` and the
slot quarantined (the device may have written them).

Lock order: lifecycle (``_life_lock``) -> admission (inside the KV coordinator) -> pool
-> device (``_device_lock``) -> queues (``_lock``, with ``_cond`` for drains and
lifecycle waits). No runtime call is made holding the lifecycle or queue lock; ``wait``
is called holding no lock at all. The device lock is held only around one ``infer`` (and
its generation check): recovery passes through it once after leaving Ready, so no submit
can race a reset.

Hand-offs: the submitter and the completion thread sleep on their own
:class:`~calfsm.doorbell.Doorbell` (a C-level wake-up) and re-check the queues after
each ring, so a hand-off wakes only the thread that has work. When the completion thread
frees the device and a queued job can go at once, it lets the submitter call ``infer``
before it post-processes (bounded): with the GIL the device would otherwise idle for the
whole post-processing. Code on the per-token path avoids numpy calls and Python-level
locking where a scalar or a plain lock does: on a small VM, code run right after a
thread wakes costs several times its warm time, and every job wakes three threads.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from calfsm.doorbell import Doorbell
from calfsm.drivers.base import Calbin, Driver, EngineSlot, JobTag, OutputStatus
from calfsm.epoch import WARMUP_SEQ, Epoch, build_epoch
from calfsm.errors import (
    CalfsmError,
    CalrtCode,
    Cancelled,
    DeadlineExceeded,
    ErrorCategory,
    Internal,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
    check,
    from_calrt,
)
from calfsm.job import InferenceResult, JobContext, JobHandle, Request
from calfsm.logits import extract_logits
from calfsm.machines.job import JOB_MACHINE, JobState
from calfsm.machines.lifecycle import LIFECYCLE_MACHINE, LifecycleState
from calfsm.manifest import Manifest, TaskKind
from calfsm.recovery import FaultController, RecoveryPolicy

__all__ = ["DeviceExecutor", "ExecutorConfig", "ExecutorStats", "Health"]

log = logging.getLogger("calfsm.executor")

_fire = JOB_MACHINE.fire

#: longest the completion thread lets the submitter go first (a stuck submit must not
#: hold completions up)
_YIELD_TO_SUBMITTER_S = 0.002


@attrs.frozen
class ExecutorConfig:
    """Knobs of one executor. Times are seconds on the driver's clock."""

    max_inflight: int = 1
    threaded: bool = True
    admission_timeout_s: float = 10.0
    queue_timeout_s: float = 10.0
    execution_timeout_s: float = 10.0
    default_deadline_s: float = 60.0
    slots_per_engine: int = 2           # one on the device, one being prepared
    token_budget: int | None = None
    shutdown_timeout_s: float = 10.0
    warmup: bool = True
    recovery: RecoveryPolicy = attrs.field(factory=RecoveryPolicy)

    def __attrs_post_init__(self) -> None:
        if self.max_inflight < 1:
            raise InvalidArgument(f"max_inflight must be >= 1, got {self.max_inflight}",
                                  stage="config")
        if self.slots_per_engine < 1:
            raise InvalidArgument("slots_per_engine must be >= 1", stage="config")
        for name in ("admission_timeout_s", "queue_timeout_s", "execution_timeout_s",
                     "default_deadline_s", "shutdown_timeout_s"):
            if not getattr(self, name) > 0:
                raise InvalidArgument(f"{name} must be > 0, got {getattr(self, name)}",
                                      stage="config")


@attrs.define(slots=True)
class _Lifecycle:
    """The lifecycle machine's model: state plus what a supervisor needs to know."""

    state: str = LifecycleState.UNCONFIGURED.value
    generation: int = 0
    reason: str | None = None
    known_good: Any = None            # (manifest, calbin) of the last generation that warmed
    retry_after_s: float = 1.0


@attrs.frozen
class ExecutorStats:
    """Counters since start; a snapshot."""

    accepted: int
    succeeded: int
    failed: int
    cancelled: int
    quarantined: int
    stale_completions: int
    recoveries: int
    inflight: int
    queued: int
    generation: int
    leased: int
    errors_by_category: dict[str, int]


@attrs.frozen
class Health:
    """What a load balancer and a supervisor ask (spec section 9)."""

    state: str
    ready: bool
    generation: int
    inflight: int
    queue_depth: int
    submitter_heartbeat: float
    completion_heartbeat: float
    reason: str | None


class DeviceExecutor:
    """Runs inference jobs on one device through a driver. Use as a context manager."""

    def __init__(self, driver: Driver, manifest: Manifest,
                 config: ExecutorConfig | None = None, *, calbin: Calbin | None = None
                 ) -> None:
        self.driver = driver
        self.config = config or ExecutorConfig()
        self.clock = driver.clock
        self._calbin = calbin or Calbin.from_manifest(manifest)
        self._manifest = manifest
        self._life = _Lifecycle()
        self._life_lock = threading.RLock()
        # One lock guards the queues and counters. The two pipeline threads each sleep on
        # their own doorbell (a C-level wake-up), so a hand-off wakes only the thread
        # that has work, through the shortest path CPython has; ``_cond`` is for
        # everything else: drains, lifecycle waits, recovery.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._submit_bell = Doorbell()          # a job queued, a slot freed, a state change
        self._complete_bell = Doorbell()        # a job submitted, or a state change
        self._submitted_bell = Doorbell()       # the submitter finished a submit attempt
        self._device_lock = threading.Lock()      # a submit vs a reset of the device
        self._submit_q: deque[JobContext] = deque()
        self._complete_q: deque[JobContext] = deque()
        self._parked: deque[JobContext] = deque()               # step mode: awaiting KV/buffer
        self._on_device: list[JobContext] = []                  # submitted, wait not returned
        self._inflight = 0
        self._closing = False
        self._closed = False
        self._close_deadline = math.inf
        self._ids = itertools.count(1)
        self._counts: dict[str, int] = {k: 0 for k in (
            "accepted", "succeeded", "failed", "cancelled", "quarantined",
            "stale_completions", "recoveries")}
        self._errors_by_category: dict[str, int] = {}
        self._heartbeat = {"submitter": self.clock.now(), "completion": self.clock.now()}
        self._threads: list[threading.Thread] = []
        self.faults = FaultController(self, self.config.recovery)
        self.epoch: Epoch | None = None
        caps = driver.capabilities()
        self._engines: tuple[EngineSlot, ...] = (EngineSlot.AUTO,)
        if self.config.max_inflight > 1:
            if not (caps.parallel_mode and caps.fixed_engine_slots and caps.engine_slots >= 2):
                raise Unavailable(
                    f"max_inflight={self.config.max_inflight} needs parallel mode and fixed "
                    f"engine slots, which driver {driver.name!r} does not offer",
                    category=ErrorCategory.PROGRAMMING, stage="config")
            self._engines = (EngineSlot.PING, EngineSlot.PONG)
        self._start()

    # ------------------------------------------------------------------------------
    # start-up and shutdown
    # ------------------------------------------------------------------------------
    def _start(self) -> None:
        """Bring generation 1 up through the same bring-up recovery uses."""
        self._fire_life("start")
        try:
            if self.config.max_inflight > 1:
                check(self.driver.enable_parallel_mode(True), "enable_parallel_mode")
        except CalfsmError as e:
            self._fail_lifecycle(f"start-up failed: {e}")
            raise
        err = self.faults.configure_and_warm(self._manifest, self._calbin, generation=1)
        if err is not None:
            if not self._retry_startup(err):
                self._fail_lifecycle(f"start-up failed: {err}")
                raise err
            if self._life.state != LifecycleState.READY:
                raise Unavailable(f"start-up failed: {self._life.reason}",
                                  category=err.category, stage="startup") from err
        if self.config.threaded:
            for name, target in (("submitter", self._submitter_loop),
                                 ("completion", self._completion_loop)):
                t = threading.Thread(target=target, name=f"calfsm-{name}", daemon=True)
                t.start()
                self._threads.append(t)

    def _retry_startup(self, err: CalfsmError) -> bool:
        """A device-side failure while first configuring or warming: go through the
        recovery path (reset, new generation, warm-up) for the remaining attempts. An
        artifact or compatibility problem (FI01) is final at once. False: not retried."""
        attempts = self.config.recovery.max_attempts - 1
        kind = self.faults.reset_kind()
        if err.category in (ErrorCategory.ARTIFACT, ErrorCategory.COMPATIBILITY) \
                or attempts < 1 or kind is None or self._life.state not in (
                    LifecycleState.CONFIGURING, LifecycleState.WARMING):
            return False
        log.warning("start-up attempt failed, resetting: %s", err, extra=err.context())
        if self.epoch is not None:
            self.epoch.retire()
        self._fire_life("retry")
        self.faults.bring_up(self._manifest, self._calbin, kind, attempts=attempts)
        return True

    def _build_epoch(self, manifest: Manifest, calbin: Calbin, generation: int, *,
                     configure: bool = True) -> Epoch:
        """Configure and build one generation with this executor's settings."""
        return build_epoch(
            self.driver, manifest, calbin, generation, configure=configure,
            max_inflight=self.config.max_inflight,
            slots_per_engine=self.config.slots_per_engine,
            token_budget=self.config.token_budget, engines=self._engines, clock=self.clock)

    def _install(self, epoch: Epoch) -> None:
        """Make ``epoch`` the current generation (the only place the number moves)."""
        with self._life_lock:
            self.epoch = epoch
            self._life.generation = epoch.generation

    def __enter__(self) -> DeviceExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, timeout: float | None = None) -> None:
        """Cancel queued jobs, drain submitted ones, join the threads (FI13).

        Bounded: after ``timeout`` (default ``config.shutdown_timeout_s``) of draining,
        jobs still on the device are resolved Unavailable, their buffers stay quarantined,
        and :class:`Unavailable` is raised so the caller knows the device did not drain.
        Safe to call twice.
        """
        timeout = self.config.shutdown_timeout_s if timeout is None else timeout
        with self._life_lock:
            if self._closed:
                return
            self._closing = True
            self._close_deadline = time.monotonic() + timeout
        with self._lock:
            queued = list(self._submit_q)
            self._submit_q.clear()
            parked = list(self._parked)
            self._parked.clear()
            self._notify_all_locked()
        for job in parked + queued:
            job.cancel_requested = True
            self._fail_before_submit(job, Cancelled("cancelled by shutdown", stage="shutdown"))
        if self.epoch is not None:
            self.epoch.kv.wake_all()
        self.faults.join(timeout)          # a recovery in progress stops at its next step
        undrained = self._drain(timeout)
        for t in self._threads:
            t.join(timeout=max(0.1, timeout))
        alive = [t.name for t in self._threads if t.is_alive()]
        with self._life_lock:
            if self._life.state not in (LifecycleState.FAILED, LifecycleState.CLOSED):
                self._fire_life("close")
            self._closed = True
        if self.epoch is not None:
            self.epoch.kv.shutdown()
        if undrained or alive:
            raise Unavailable(
                f"shutdown did not drain within {timeout} s: {len(undrained)} job(s) still "
                f"on the device, threads alive: {alive}", stage="shutdown")

    def _drain(self, timeout: float) -> list[JobContext]:
        """Let submitted jobs finish (threads running) or finish them here (step mode)."""
        deadline = time.monotonic() + timeout
        if not self.config.threaded:
            while self._complete_q or self._submit_q:
                if time.monotonic() > deadline:
                    break
                if not self._complete_next() and not self._submit_next():
                    break
        else:
            with self._lock:
                self._cond.wait_for(lambda: not self._complete_q and not self._on_device
                                    and not self._submit_q,
                                    timeout=timeout)
        with self._lock:
            return list(self._on_device)

    # ------------------------------------------------------------------------------
    # lifecycle helpers
    # ------------------------------------------------------------------------------
    def _fire_life(self, trigger: str) -> bool:
        """Every lifecycle transition goes through here, so waiters are always woken."""
        with self._life_lock:
            fired = LIFECYCLE_MACHINE.fire(self._life, trigger)
        with self._lock:
            self._notify_all_locked()
        return fired

    def _notify_all_locked(self) -> None:
        """Wake every waiter of the queue lock (rare events: lifecycle, shutdown)."""
        self._cond.notify_all()
        self._submit_bell.ring()
        self._complete_bell.ring()

    def _fail_lifecycle(self, reason: str) -> None:
        with self._life_lock:
            self._life.reason = reason
            if LIFECYCLE_MACHINE.may(self._life, "fail"):
                self._fire_life("fail")
        log.error("executor failed: %s", reason,
                  extra={"generation": self._life.generation, "stage": "lifecycle"})

    def wait_lifecycle(self, *states: str, timeout: float | None = None) -> str:
        """Block until the lifecycle is in one of ``states`` (e.g. ``"Ready"`` after a
        recovery, or ``"Failed"``); returns the state. Raises DeadlineExceeded on timeout.
        Step mode: drive the scheduler instead."""
        with self._lock:
            if not self._cond.wait_for(lambda: self._life.state in states, timeout):
                raise DeadlineExceeded(
                    f"lifecycle still {self._life.state} after {timeout} s, wanted "
                    f"{' or '.join(states)}", stage="lifecycle",
                    generation=self._life.generation)
            return self._life.state

    def recover(self, reason: str = "recovery requested") -> bool:
        """Drain and reset the device now, as after a device fault (an operator's
        "restart the accelerator"). False if the executor is not Ready."""
        return self.faults.begin_drain(reason)

    @property
    def lifecycle_state(self) -> str:
        return self._life.state

    @property
    def generation(self) -> int:
        return self._life.generation

    @property
    def failure_reason(self) -> str | None:
        return self._life.reason

    def _admission_gate(self) -> None:
        """Only Ready admits. Recovering: 503 with a retry-after hint; Failed: 503 without
        one (this process will not recover; a supervisor restarts it)."""
        life = self._life
        if self._closing:
            raise Unavailable("executor is closed", stage="admission",
                              generation=life.generation)
        if life.state != LifecycleState.READY:
            raise Unavailable(
                f"device is {life.state}" + (f": {life.reason}" if life.reason else ""),
                stage="admission", generation=life.generation,
                retry_after_s=None if life.state == LifecycleState.FAILED
                else life.retry_after_s)

    # ------------------------------------------------------------------------------
    # request side: enqueue -> admit -> prepare
    # ------------------------------------------------------------------------------
    def enqueue(self, request: Request) -> JobHandle:
        """Validate, admit and prepare a job; return its handle.

        In threaded mode this blocks the calling thread for KV admission and a buffer
        (bounded by the admission deadline). Every failure is delivered through the
        handle — ``handle.result()`` raises it — so each enqueued job has exactly one
        outcome; only a closed executor or a non-Ready device raise here directly.
        """
        self._admission_gate()
        job = self._accept(request)
        handle = JobHandle(job, self._cancel)
        job.handle = handle
        try:
            self._validate(job)
            if self.config.threaded:
                self._admit_blocking(job)
                self._prepare(job)
            elif self._parked or not self._try_admit(job):
                with self._lock:
                    self._parked.append(job)
            else:
                self._prepare(job)
        except CalfsmError as e:
            if job.epoch is not None and job.epoch.retired and not isinstance(e, Cancelled):
                # the device was reset under this preparation: say so, not "bad state"
                e = Unavailable(f"the device was reset while the job was prepared ({e})",
                                retry_after_s=self._life.retry_after_s,
                                calrt_code=e.calrt_code, **_ctx(job, e.stage or "prepare"))
            self._fail_before_submit(job, e)
        return handle

    def decode_sync(self, request: Request, timeout: float | None = None) -> InferenceResult:
        """Synchronous compatibility entry (spec 6.1): enqueue and wait for the result."""
        handle = self.enqueue(request)
        if not self.config.threaded:
            from calfsm.scheduler import StepScheduler
            StepScheduler(self).run_until(handle.done)
        return handle.result(timeout)

    def _accept(self, request: Request) -> JobContext:
        now = self.clock.now()
        deadline_s = request.deadline_s if request.deadline_s is not None \
            else self.config.default_deadline_s
        tokens = request.tokens
        n = 0 if tokens is None else len(tokens)
        past = request.past_len
        if past is None:
            past = int(request.positions[0]) if request.positions is not None and \
                len(request.positions) else 0
        job = JobContext(
            job_id=next(self._ids), request=request, generation=self._life.generation,
            seq_id=request.seq_id, kind=request.kind, past_len=past, token_count=n,
            deadline=now + deadline_s if deadline_s > 0 else now)
        job.engine = request.engine
        job.timings.accepted = now
        job.epoch = self.epoch
        self._counts["accepted"] += 1
        return job

    def _validate(self, job: JobContext) -> None:
        """Spec 6.3 checks 1-6, before any resource is taken."""
        req, ctx = job.request, _ctx(job, "validate")
        if job.deadline <= job.timings.accepted:
            raise DeadlineExceeded("deadline already past at enqueue", **ctx)
        contract = job.epoch.contract(job.kind)
        n = job.token_count
        if n <= 0:
            raise InvalidArgument("token_count must be > 0", **ctx)
        if job.past_len < 0:
            raise InvalidArgument(f"past_len must be >= 0, got {job.past_len}", **ctx)
        if job.past_len + n > contract.max_seq:
            raise InvalidArgument(
                f"past_len {job.past_len} + token_count {n} exceeds max_seq "
                f"{contract.max_seq}", **ctx)
        if req.seq_count != 1 or req.seq_count > contract.max_batch:
            raise InvalidArgument(f"the {job.kind.value} graph takes one sequence per job "
                                  f"(max_batch {contract.max_batch}), got {req.seq_count}",
                                  **ctx)
        if not 0 <= job.seq_id < WARMUP_SEQ:
            raise InvalidArgument(f"seq_id must be in [0, {WARMUP_SEQ}), got {job.seq_id}",
                                  **ctx)
        if req.positions is None:
            raise InvalidArgument("positions missing", **ctx)
        if len(req.positions) != n:
            raise InvalidArgument(
                f"{n} tokens but {len(req.positions)} positions", **ctx)
        if job.kind is TaskKind.DECODE and n != 1:
            raise InvalidArgument(f"a decode job carries one token, got {n}", **ctx)
        if n > contract.max_tokens:
            raise InvalidArgument(
                f"{n} tokens exceed tensor {contract.token_or_embed.name!r} "
                f"({contract.max_tokens} elements)", **ctx)
        pos = req.positions
        if pos.item(0) != job.past_len or (n > 1 and not np.array_equal(
                pos, np.arange(job.past_len, job.past_len + n))):
            raise InvalidArgument(
                f"positions must run {job.past_len}..{job.past_len + n - 1}", **ctx)
        toks = req.tokens
        vocab = contract.vocab
        if n == 1:          # a decode: no numpy reductions on the per-token path
            lo = hi = toks.item(0)
        else:
            lo, hi = int(toks.min()), int(toks.max())
        if lo < 0 or hi >= vocab:
            raise InvalidArgument(f"token ids must be in [0, {vocab})", **ctx)
        if req.target is not None:
            t = req.target
            if t.dtype != np.float32 or t.ndim != 1 or t.shape[0] < vocab \
                    or not t.flags.c_contiguous:
                raise InvalidArgument(
                    f"target must be a contiguous 1-D float32 array of >= {vocab} "
                    f"elements, got {t.dtype} {t.shape}", **ctx)
        if req.engine is not EngineSlot.AUTO and req.engine not in self._engines:
            raise InvalidArgument(f"engine {req.engine.name} not in use", **ctx)

    def _admission_deadline(self, job: JobContext) -> float:
        return min(job.deadline, job.timings.accepted + self.config.admission_timeout_s)

    def _admit_blocking(self, job: JobContext) -> None:
        epoch = job.epoch
        deadline = self._admission_deadline(job)
        cancelled = self._cancel_probe(job)
        job.kv = epoch.kv.reserve(job.seq_id, job.past_len, job.token_count, deadline,
                                  job_id=job.job_id, cancelled=cancelled)
        _fire(job, "admit")
        job.lease = epoch.pool.acquire_wait(job.kind, deadline, cancelled=cancelled,
                                            clock=self.clock, engine=self._engine_for(job))
        job.timings.admitted = self.clock.now()

    def _try_admit(self, job: JobContext) -> bool:
        """Non-blocking admission (step mode). False: must wait; raises on errors."""
        epoch = job.epoch
        if self.clock.now() >= self._admission_deadline(job):
            raise DeadlineExceeded("admission deadline passed", **_ctx(job, "admission"))
        if job.kv is None:
            job.kv = epoch.kv.try_reserve(job.seq_id, job.past_len, job.token_count,
                                          job_id=job.job_id)
            if job.kv is None:
                return False
            _fire(job, "admit")
        try:
            job.lease = epoch.pool.acquire(job.kind, self._engine_for(job))
        except ResourceExhausted:
            return False
        job.timings.admitted = self.clock.now()
        return True

    def _engine_for(self, job: JobContext) -> EngineSlot:
        """The engine a job's buffers come from: the request's own choice, else (ping/
        pong) alternating by job id so consecutive jobs use different engines."""
        if job.engine is not EngineSlot.AUTO:
            return job.engine
        return self._engines[job.job_id % len(self._engines)]

    def _cancel_probe(self, job: JobContext) -> Callable[[], bool]:
        return lambda: job.cancel_requested or self._closing

    def _prepare(self, job: JobContext) -> None:
        """Copy inputs, set slices, CSRs and KV sequence; push to the submit queue."""
        _fire(job, "prepare")
        lease = job.lease
        lease.bind(job_id=job.job_id, seq_id=job.seq_id)
        t0 = self.clock.now()
        lease.load(job.seq_id, job.request.tokens, job.request.positions)
        now = self.clock.now()
        job.timings.h2d_ms = (now - t0) * 1e3
        job.timings.queued = now
        job.queue_deadline = min(job.deadline, now + self.config.queue_timeout_s)
        with self._lock:
            if not (job.cancel_requested or self._closing):
                _fire(job, "enqueue")
                self._submit_q.append(job)
                self._submit_bell.ring()
                return
        raise Cancelled("cancelled before submit", **_ctx(job, "prepare"))

    # ------------------------------------------------------------------------------
    # cancel
    # ------------------------------------------------------------------------------
    def _cancel(self, job: JobContext) -> None:
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
            self._cond.notify_all()
        if removed:
            self._fail_before_submit(job, Cancelled("cancelled before submit",
                                                    **_ctx(job, "cancel")))
        elif job.epoch is not None:
            job.epoch.kv.wake_all()
            job.epoch.pool.wake_all()

    # ------------------------------------------------------------------------------
    # submitter
    # ------------------------------------------------------------------------------
    def _submitter_loop(self) -> None:
        while True:
            job, wait = None, None
            with self._lock:
                self._heartbeat["submitter"] = self.clock.now()
                expired = self._take_expired_locked()
                if not expired:
                    if self._can_submit_now_locked():
                        job = self._claim_head_locked()
                    elif self._closing and not self._submit_q:
                        return
                    else:
                        wait = self._next_queue_timeout_locked()
                        backoff = self.faults.backoff_until - self.clock.now()
                        if backoff > 0 and self._submit_q:
                            if self.clock.virtual:
                                self.clock.advance_to(self.faults.backoff_until)
                                continue
                            wait = backoff if wait is None else min(wait, backoff)
            for j in expired:
                self._fail_queue_deadline(j)
            if job is None:
                if not expired:                 # sleep outside the lock until rung
                    self._submit_bell.wait(wait)
                continue
            try:
                self._submit(job)
            except Exception as e:      # a bug must never stop the submitter thread
                self._step_crashed(job, "submit", e)
            finally:
                self._submitted_bell.ring()

    def _submittable_locked(self) -> bool:
        """A job is queued, an in-flight slot is free and the device takes work."""
        return bool(self._submit_q) and self._inflight < self.config.max_inflight \
            and self._life.state == LifecycleState.READY

    def _can_submit_now_locked(self) -> bool:
        """Submittable, and no error back-off in force (threaded mode waits it out)."""
        return self._submittable_locked() \
            and self.faults.backoff_until <= self.clock.now()

    def _claim_head_locked(self) -> JobContext:
        """Pop the head of the submit queue and give it an in-flight slot."""
        job = self._submit_q.popleft()
        self._inflight += 1
        job.holds_inflight = True
        return job

    def _fail_queue_deadline(self, job: JobContext) -> None:
        """The queue deadline passed before ``infer`` succeeded: not submitted, so the
        KV reservation rolls back and the lease returns (spec 9.1)."""
        self._fail_before_submit(job, DeadlineExceeded(
            "queue deadline passed before submit", **_ctx(job, "queue")))

    def _take_expired_locked(self) -> list[JobContext]:
        if not self._submit_q:
            return []
        now = self.clock.now()
        expired = [j for j in self._submit_q if j.queue_deadline <= now]
        for j in expired:
            self._submit_q.remove(j)
        if expired:
            self._cond.notify_all()         # a drain may wait for the queue to empty
        return expired

    def _next_queue_timeout_locked(self) -> float | None:
        """How long the submitter may sleep: until the first queue deadline (None: no
        job queued). On a virtual clock a short real-time tick, as deadlines move only
        when someone advances it."""
        if self.clock.virtual:
            return 0.05
        if not self._submit_q:
            return None
        return max(0.0, min(j.queue_deadline for j in self._submit_q) - self.clock.now())

    def _submit_next(self) -> bool:
        """Step mode: submit the head of the queue if an in-flight slot is free."""
        with self._lock:
            expired = self._take_expired_locked()
            job = None
            if not expired and self._submittable_locked():
                if self.faults.backoff_until > self.clock.now():
                    self.clock.advance_to(self.faults.backoff_until)
                job = self._claim_head_locked()
        for j in expired:
            self._fail_queue_deadline(j)
        if job is not None:
            self._submit(job)
        return bool(expired) or job is not None

    def _submit(self, job: JobContext) -> None:
        """The only caller of ``infer`` (spec 6.4). Holds an in-flight slot on entry."""
        if job.cancel_requested or self._closing:
            self._release_inflight(job)
            self._fail_before_submit(job, Cancelled("cancelled before submit",
                                                    **_ctx(job, "submit")))
            return
        if self.clock.now() >= job.queue_deadline:
            self._release_inflight(job)
            self._fail_queue_deadline(job)
            return
        epoch = job.epoch
        slot = job.lease.slot
        tag = JobTag(job.job_id, job.seq_id, job.generation)
        handle = epoch.handles[job.kind]
        with self._device_lock:     # no reset between this check and the job on the device
            if epoch is not self.epoch or epoch.retired \
                    or self._life.state != LifecycleState.READY:
                rc = None
            elif slot.engine is EngineSlot.AUTO:
                rc = self.driver.infer(handle, slot.inp, slot.out, tag=tag)
            else:
                rc = self.driver.infer_fixed(handle, slot.inp, slot.out, slot.engine,
                                             tag=tag)
            if rc == 0:
                job.timings.submitted = self.clock.now()
                job.lease.mark_on_device()
                epoch.kv.mark_submitted(job.kv)
                with self._lock:
                    _fire(job, "submit")
                    self._on_device.append(job)
                    self._complete_q.append(job)
                    self._complete_bell.ring()
                return
        self._release_inflight(job)
        if rc is None:
            self._fail_before_submit(job, Unavailable(
                f"device left Ready ({self._life.state}) before the job was submitted",
                retry_after_s=self._life.retry_after_s, **_ctx(job, "submit")))
            return
        self._submit_failed(job, from_calrt(rc, "submit", **_ctx(job, None)))

    def device_barrier(self) -> None:
        """Wait for a submit in progress to finish. Called by recovery after the
        lifecycle left Ready: from then on no ``infer`` can reach the device until the
        new generation is Ready, so a reset never races a submit."""
        with self._device_lock:
            pass

    def _step_crashed(self, job: JobContext, stage: str, exc: Exception) -> None:
        """An unexpected exception in a submit or completion step (a bug, or a driver
        raising where it must return a code). Never stuck: the job fails with Internal,
        its in-flight slot comes back if it still held one, its slot and KV are treated
        as suspect, and the generation is recovered like after an unknown error."""
        log.exception("unexpected error in the %s step of job %s", stage, job.job_id,
                      extra=_ctx(job, stage))
        self._release_inflight(job)
        err = Internal(f"unexpected {type(exc).__name__} in {stage}: {exc}",
                       category=ErrorCategory.UNKNOWN, **_ctx(job, stage))
        try:
            self._withhold(job, str(err))
        except Exception:
            log.exception("cleaning up after the crashed step of job %s", job.job_id)
        if job.handle is not None and not job.handle.done():
            for trigger in ("quarantine", "fail"):
                if JOB_MACHINE.may(job, trigger):
                    _fire(job, trigger)
                    break
            self._finish(job, err, "failed")
        self.faults.observe(err)

    def _submit_failed(self, job: JobContext, err: CalfsmError) -> None:
        """``infer`` returned an error. Busy and request errors prove the graph did not
        run: roll back (FI05). Device or unknown errors leave the KV Unknown (FI06)."""
        if err.category in (ErrorCategory.TRANSIENT, ErrorCategory.REQUEST,
                            ErrorCategory.PROGRAMMING, ErrorCategory.LIFECYCLE):
            self._fail_before_submit(job, err)
        else:
            self._finish_unknown(job, err)
        self.faults.observe(err)

    def _release_inflight(self, job: JobContext, *, yield_to_submitter: bool = False
                          ) -> None:
        """The job no longer occupies the device: off the on-device list, its in-flight
        slot given back (idempotent: a slot is returned once), the submitter woken.

        ``yield_to_submitter`` (the completion thread, threaded mode): if a queued job
        can go at once, sleep until the submitter has called ``infer`` (bounded) before
        returning. With the GIL, post-processing first would keep the submitter — and so
        the device — waiting for all of it; device time is the scarce resource."""
        hand_off = False
        with self._lock:
            if job in self._on_device:
                self._on_device.remove(job)
            if job.holds_inflight:
                job.holds_inflight = False
                self._inflight -= 1
                if yield_to_submitter and not self._closing \
                        and self._can_submit_now_locked():
                    self._submitted_bell.wait(0)    # only a submit after this ring counts
                    hand_off = True
                if self._submit_q or self._closing:
                    self._submit_bell.ring()
                if self._closing:
                    self._complete_bell.ring()
            self._cond.notify_all()         # drains and recovery wait for this
        if hand_off:
            self._submitted_bell.wait(_YIELD_TO_SUBMITTER_S)

    # ------------------------------------------------------------------------------
    # completion
    # ------------------------------------------------------------------------------
    def _completion_loop(self) -> None:
        while True:
            with self._lock:
                job = self._complete_q.popleft() if self._complete_q else None
                if job is None:
                    self._heartbeat["completion"] = self.clock.now()
                    if self._closing and ((self._inflight == 0 and not self._submit_q)
                                          or time.monotonic() > self._close_deadline):
                        return
                elif self._closing and time.monotonic() > self._close_deadline \
                        and job.handle.done():
                    return              # abandon a zombie: the device never let it go
            if job is None:                     # sleep outside the lock until rung
                self._complete_bell.wait(0.05 if self._closing else None)
                continue
            try:
                self._complete(job)
            except Exception as e:      # a bug must never stop the completion thread
                self._step_crashed(job, "complete", e)

    def _complete_next(self) -> bool:
        with self._lock:
            if not self._complete_q:
                return False
            job = self._complete_q.popleft()
        self._complete(job)
        return True

    def _complete(self, job: JobContext) -> None:
        """The only caller of ``wait`` (spec 6.5); holds no lock while waiting."""
        slot = job.lease.slot
        zombie = job.handle.done()         # already failed by its execution deadline
        if zombie:
            timeout = self.config.recovery.zombie_wait_s
        else:
            timeout = max(0.0, job.timings.submitted + self.config.execution_timeout_s
                          - self.clock.now())
        t0 = self.clock.now()
        rc = self.driver.wait(slot.out, timeout)
        t1 = self.clock.now()
        self._heartbeat["completion"] = t1
        job.timings.device_wait_ms += (t1 - t0) * 1e3
        if rc == CalrtCode.TIMEOUT:
            if not zombie:
                self._execution_timeout(job)
            if self._life.state == LifecycleState.FAILED and not self._closing:
                log.error("abandoning job %s on a failed device; its buffers stay "
                          "quarantined until the process exits", job.job_id,
                          extra=_ctx(job, "wait"))
                return
            with self._lock:               # keep waiting: the device still owns it
                self._complete_q.append(job)
                self._complete_bell.ring()
            return
        # the device is free: the next job goes first
        self._release_inflight(job, yield_to_submitter=self.config.threaded)
        job.lease.mark_off_device()
        if zombie:
            self._late_completion(job, rc)
            return
        contract = slot.contract
        with self._device_lock:     # no reset between the fence check and device calls
            current = job.epoch is self.epoch and not job.epoch.retired
            if current and rc == 0:
                status = self.driver.status(slot.out)
                code, produced = self.driver.output_bytes(slot.out, contract.logits.name)
                try:                        # input slices are done with: the job ran
                    job.lease.undo_slices()
                except CalfsmError as e:    # the slot goes to quarantine on return (FI15)
                    log.warning("undo_slices failed after the job ran: %s", e,
                                extra=e.context())
        if not current:
            self._late_completion(job, rc)
            return
        _fire(job, "complete")
        try:
            if rc != 0:
                raise from_calrt(rc, "wait", **_ctx(job, None))
            if status != OutputStatus.DONE_OK:
                raise Unavailable(f"device reported {status.name} although Wait succeeded",
                                  category=ErrorCategory.DEVICE, **_ctx(job, "status"))
            if code != 0:
                raise from_calrt(code, "output", **_ctx(job, None))
            target = job.request.target
            if target is None:
                target = np.empty(contract.vocab, dtype=np.float32)
            t2 = self.clock.now()
            logits = extract_logits(slot.logits_bf16, produced, contract, job.token_count,
                                    target)
            job.timings.d2h_ms = (self.clock.now() - t2) * 1e3
        except CalfsmError as e:
            self._completion_failed(job, e)
            return
        t3 = self.clock.now()
        job.epoch.kv.commit(job.kv)
        now = self.clock.now()
        job.timings.completed = now
        job.timings.postprocess_ms = (now - t3) * 1e3
        if JOB_MACHINE.fire(job, "succeed"):
            self._counts["succeeded"] += 1
            result = InferenceResult(job.job_id, job.seq_id, job.generation, job.kind,
                                     job.token_count, logits,
                                     job.timings)     # the job is over: no more writes
            self._release_lease(job)
            job.handle._resolve(result, None)
        else:                                   # cancelled after submit (FI12)
            _fire(job, "fail")
            self._counts["cancelled"] += 1
            self._release_lease(job)
            job.handle._resolve(None, Cancelled(
                "cancelled after submit; the job ran, its result was dropped",
                **_ctx(job, "complete")))
        self.faults.observe_success()

    def _completion_failed(self, job: JobContext, err: CalfsmError) -> None:
        """Wait error, CCU exception, bad or non-finite output: the job fails, the KV is
        Unknown (the device ran), the slot is quarantined, the fault controller decides."""
        self._withhold(job, str(err))
        _fire(job, "quarantine")
        self._finish(job, err, "quarantined")
        self.faults.observe(err)

    def _execution_timeout(self, job: JobContext) -> None:
        """Wait timed out past the execution deadline (FI07): no logits, KV Unknown,
        the buffers stay with the device (quarantined, kept alive), admission stops and
        recovery decides; the job's caller is told now."""
        err = DeadlineExceeded("execution deadline passed; the job may still be running "
                               "on the device", category=ErrorCategory.TRANSIENT,
                               calrt_code=int(CalrtCode.TIMEOUT), **_ctx(job, "wait"))
        job.epoch.kv.mark_unknown(job.kv, "execution timeout")
        _fire(job, "quarantine")
        self._finish(job, err, "quarantined")
        self.faults.execution_timeout(job, err)

    def _late_completion(self, job: JobContext, rc: int) -> None:
        """Wait returned for a job already failed by its execution deadline, or for a job
        of a retired generation (FI14): resolve only its own job, touch nothing of the
        current generation (no KV, no pool slot, no metric of it)."""
        old = job.epoch
        if old is not self.epoch or old.retired:
            with self._life_lock:
                self._counts["stale_completions"] += 1
            log.warning("stale completion of generation %s fenced", job.generation, extra={
                "job_id": job.job_id, "seq_id": job.seq_id, "generation": job.generation,
                "calrt_code": rc, "stage": "stale_completion"})
        self._withhold(job, "completion after the job was given up or its generation reset")
        if not job.handle.done():
            if JOB_MACHINE.may(job, "quarantine"):
                _fire(job, "quarantine")
            self._finish(job, Unavailable(
                f"completion of generation {job.generation} arrived after a reset; "
                "result discarded", **_ctx(job, "stale_completion")), "quarantined")

    # ------------------------------------------------------------------------------
    # ending a job
    # ------------------------------------------------------------------------------
    def _fail_before_submit(self, job: JobContext, err: CalfsmError) -> None:
        """Fail a job the device never ran: roll back KV, undo slices, return the lease."""
        if isinstance(err, Cancelled) and JOB_MACHINE.may(job, "cancel"):
            _fire(job, "cancel")
        epoch = job.epoch
        if job.lease is not None:
            try:
                job.lease.undo_slices()
            except CalfsmError as e:
                log.warning("undo_slices failed while failing a job: %s", e,
                            extra=e.context())
            self._release_lease(job)
        if job.kv is not None and job.kv.state == "Reserved":
            epoch.kv.rollback(job.kv)
        if JOB_MACHINE.may(job, "fail"):
            _fire(job, "fail")
        self._finish(job, err, "cancelled" if isinstance(err, Cancelled) else "failed")

    def _finish_unknown(self, job: JobContext, err: CalfsmError) -> None:
        """Fail a job whose submit outcome is ambiguous: KV Unknown, slot quarantined."""
        self._withhold(job, str(err))
        _fire(job, "fail")
        self._finish(job, err, "failed")

    def _withhold(self, job: JobContext, reason: str) -> None:
        """The device may have run (or may still run) the job: never claim a rollback.
        An open KV reservation becomes Unknown and the slot is quarantined, both in the
        job's own generation (a retired one is fenced: no device call)."""
        if job.kv is not None and job.kv.state in ("Reserved", "Submitted"):
            job.epoch.kv.mark_unknown(job.kv, reason)
        if job.lease is not None:
            job.epoch.pool.quarantine(job.lease, reason)
            job.lease = None

    def _release_lease(self, job: JobContext) -> None:
        lease, job.lease = job.lease, None
        if lease is not None:
            job.epoch.pool.release(lease)

    def _finish(self, job: JobContext, err: CalfsmError, outcome: str) -> None:
        err.with_context(**_ctx(job, None))
        job.timings.completed = self.clock.now()
        self._counts[outcome] += 1
        cat = err.category.value
        self._errors_by_category[cat] = self._errors_by_category.get(cat, 0) + 1
        if not isinstance(err, Cancelled):
            log.warning("job failed: %s", err.message, extra=err.context())
        if job.handle is not None and not job.handle.done():
            job.handle._resolve(None, err)

    # ------------------------------------------------------------------------------
    # step mode
    # ------------------------------------------------------------------------------
    def _admit_parked(self) -> bool:
        """Step mode: try to admit the head parked job (FIFO). True if it moved."""
        with self._lock:
            if not self._parked:
                return False
            job = self._parked[0]
        try:
            if job.cancel_requested or self._closing:
                raise Cancelled("cancelled while waiting for admission",
                                **_ctx(job, "admission"))
            if not self._try_admit(job):
                return False
            with self._lock:
                self._parked.popleft()
            self._prepare(job)
        except CalfsmError as e:
            with self._lock:
                if self._parked and self._parked[0] is job:
                    self._parked.popleft()
            self._fail_before_submit(job, e)
        return True

    def _expire_waiting(self) -> None:
        """Fail every parked job past its admission deadline and every queued job past
        its queue deadline (step mode; the threads do this in their own loops)."""
        now = self.clock.now()
        with self._lock:
            late = [j for j in self._parked if self._admission_deadline(j) <= now]
            for j in late:
                self._parked.remove(j)
            expired = self._take_expired_locked()
        for j in late:
            self._fail_before_submit(j, DeadlineExceeded(
                "admission deadline passed", **_ctx(j, "admission")))
        for j in expired:
            self._fail_queue_deadline(j)

    def _next_deadline(self) -> float:
        """Earliest deadline a parked or queued job waits for (step mode time jumps)."""
        with self._lock:
            dl = [self._admission_deadline(j) for j in self._parked]
            dl += [j.queue_deadline for j in self._submit_q]
        return min(dl, default=math.inf)

    # ------------------------------------------------------------------------------
    # observation
    # ------------------------------------------------------------------------------
    def stats(self) -> ExecutorStats:
        with self._lock:
            inflight, queued = self._inflight, len(self._submit_q) + len(self._parked)
        epoch = self.epoch
        return ExecutorStats(
            inflight=inflight, queued=queued, generation=self._life.generation,
            leased=epoch.pool.stats().leased if epoch else 0,
            errors_by_category=dict(self._errors_by_category), **self._counts)

    def health(self) -> Health:
        with self._lock:
            inflight, depth = self._inflight, len(self._submit_q) + len(self._parked)
        self.faults.check_progress()
        return Health(
            state=self._life.state, ready=self._life.state == LifecycleState.READY,
            generation=self._life.generation, inflight=inflight, queue_depth=depth,
            submitter_heartbeat=self._heartbeat["submitter"],
            completion_heartbeat=self._heartbeat["completion"], reason=self._life.reason)

    def switch_model(self, manifest: Manifest, calbin: Calbin | None = None,
                     timeout: float = 10.0) -> None:
        """Drain, configure ``manifest``/``calbin`` as a new generation and warm it; on an
        artifact or lifecycle error roll back to the last known-good model (which keeps
        serving) and raise the error naming the artifact problem."""
        self.faults.switch_model(manifest, calbin, timeout)

    def reset_sequence(self, seq_id: int) -> None:
        """Forget a sequence's KV (required after it went Unknown); it starts at 0."""
        self.epoch.kv.reset_sequence(seq_id)

    def __repr__(self) -> str:
        return (f"<DeviceExecutor {self.driver.name} gen={self._life.generation} "
                f"{self._life.state}>")


def _ctx(job: JobContext, stage: str | None) -> dict[str, Any]:
    ctx: dict[str, Any] = {"job_id": job.job_id, "seq_id": job.seq_id,
                           "generation": job.generation}
    if stage is not None:
        ctx["stage"] = stage
    return ctx

