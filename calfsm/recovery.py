"""Fault control and recovery (spec sections 8 and 9).

Theory of operation
-------------------
Every classified error a job meets is shown to the :class:`FaultController`, which applies
the action of its category (:data:`calfsm.errors.ACTIONS`):

- request, artifact-at-request-time and programming errors fail the job only and never
  count against the device;
- transient errors (timeout, busy) spend an error budget, a token bucket: while it lasts
  the submitter backs off (bounded, exponential); when it runs out the device drains;
- device and unknown errors (and a non-finite output, a CCU exception, an execution
  timeout, a device that makes no progress) drain at once;
- compatibility errors stop admission for good, with the reason (``Failed``).

Recovery walks the lifecycle machine ``Ready -> Draining -> Recovering -> Configuring ->
Warming -> Ready``: admission stops (new requests get Unavailable with a retry-after
hint), queued jobs fail Unavailable (or are held, by policy), jobs on the device keep
their buffers until their Wait returns or the grace period ends, then the strongest reset
the driver declares is issued, the old epoch is retired (its KV coordinator refuses work,
its slots are quarantined), a new epoch is built with generation + 1, and the warm-up
golden must pass before traffic resumes. No reset capability, a failed reset or a failed
warm-up: ``Failed``, with the reason; ``calfsm run`` then exits with a distinct status so
a supervisor restarts the process.

In threaded mode recovery runs on its own short-lived thread; in step mode the scheduler
runs it as one step once the drain condition holds, so interleavings stay exact.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

import attrs

from calfsm.drivers.base import Calbin, ResetKind
from calfsm.errors import (
    CalfsmError,
    ErrorCategory,
    FailedPrecondition,
    ManifestError,
    Unavailable,
    Unsupported,
)
from calfsm.machines.lifecycle import LifecycleState
from calfsm.manifest import Manifest

if TYPE_CHECKING:
    from calfsm.executor import DeviceExecutor
    from calfsm.job import JobContext

__all__ = ["FaultController", "RecoveryPolicy"]

log = logging.getLogger("calfsm.recovery")

#: strongest first: the reset that leaves the least state behind
_RESET_PREFERENCE = (ResetKind.FULL, ResetKind.CONFIGURATION, ResetKind.CCU)


@attrs.frozen
class RecoveryPolicy:
    """How the executor reacts to faults. Times are seconds on the driver's clock."""

    error_budget: float = 5.0            # transient errors tolerated in a burst
    budget_refill_per_s: float = 0.5     # ... refilled at this rate
    backoff_base_s: float = 0.005
    backoff_max_s: float = 0.2
    grace_period_s: float = 1.0          # jobs on the device may finish before the reset
    zombie_wait_s: float = 0.25          # wait slice for a job past its execution deadline
    hold_queued: bool = False            # keep queued jobs across recovery instead of failing
    progress_timeout_s: float = 30.0     # no completion progress with work on the device
    retry_after_s: float = 1.0           # hint in Unavailable errors while recovering
    auto_recover: bool = True
    max_attempts: int = 3                # resets tried before giving up (Failed)


class _ShuttingDown(Exception):
    """Raised inside a recovery when ``close()`` began: close() owns the lifecycle now."""


class FaultController:
    """Consumes classified errors and drives recovery for one executor."""

    def __init__(self, executor: DeviceExecutor, policy: RecoveryPolicy) -> None:
        self.ex = executor
        self.policy = policy
        self._tokens = policy.error_budget
        self._last_refill: float | None = None
        self._streak = 0
        self.backoff_until = 0.0
        self.recovery_pending = False
        self._drain_started = 0.0
        self._recovery_thread: threading.Thread | None = None
        self._switch_lock = threading.Lock()
        self.history: list[tuple[float, str, str]] = []   # (time, lifecycle state, reason)

    # ---- classification ------------------------------------------------------------
    def observe(self, err: CalfsmError) -> None:
        """Apply the service action of ``err``'s category."""
        cat = err.category
        if cat in (ErrorCategory.REQUEST, ErrorCategory.ARTIFACT, ErrorCategory.PROGRAMMING):
            return
        if cat is ErrorCategory.TRANSIENT:
            if self._spend():
                self._streak += 1
                delay = min(self.policy.backoff_max_s,
                            self.policy.backoff_base_s * 2 ** (self._streak - 1))
                self.backoff_until = max(self.backoff_until, self.ex.clock.now() + delay)
                return
            self.begin_drain(f"error budget exhausted by {type(err).__name__}: {err.message}")
            return
        if cat is ErrorCategory.COMPATIBILITY:
            self.ex._fail_lifecycle(f"incompatible device or runtime: {err.message}")
            self._fail_waiting(Unavailable(f"device stopped: {err.message}",
                                           category=ErrorCategory.COMPATIBILITY,
                                           stage="admission"))
            return
        # DEVICE, UNKNOWN, LIFECYCLE: the generation is suspect.
        self.begin_drain(f"{cat.value} error: {err}")

    def observe_success(self) -> None:
        self._streak = 0

    def execution_timeout(self, job: JobContext, err: CalfsmError) -> None:
        """A job outlived its execution deadline: the device may be wedged (FI07)."""
        self.begin_drain(f"execution deadline passed for job {job.job_id}")

    def check_progress(self) -> None:
        """Watchdog: work on the device and no completion progress past the threshold is
        a device fault, so a wedged device never looks healthy."""
        ex = self.ex
        if ex._inflight == 0 or ex.lifecycle_state != LifecycleState.READY:
            return
        idle = ex.clock.now() - ex._heartbeat["completion"]
        if idle > self.policy.progress_timeout_s:
            self.begin_drain(f"no completion progress for {idle:.3f} s with "
                             f"{ex._inflight} job(s) on the device")

    def _spend(self) -> bool:
        now = self.ex.clock.now()
        if self._last_refill is not None:
            self._tokens = min(self.policy.error_budget, self._tokens +
                               (now - self._last_refill) * self.policy.budget_refill_per_s)
        self._last_refill = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False

    # ---- drain ---------------------------------------------------------------------
    def begin_drain(self, reason: str) -> bool:
        """Stop admission and schedule recovery. False if already draining or failed."""
        ex = self.ex
        with ex._life_lock:
            if ex._life.state != LifecycleState.READY:
                return False
            ex._life.reason = reason
            ex._life.retry_after_s = self.policy.retry_after_s
            ex._fire_life("drain")
            self._note(reason)
            self._drain_started = ex.clock.now()
            self.recovery_pending = True
        log.warning("draining generation %s: %s", ex._life.generation, reason,
                    extra={"generation": ex._life.generation, "stage": "drain"})
        if not self.policy.hold_queued:
            self._fail_waiting(Unavailable(
                f"device is recovering: {reason}", stage="admission",
                retry_after_s=self.policy.retry_after_s))
        if ex.epoch is not None:
            ex.epoch.kv.wake_all()
        with ex._lock:
            ex._notify_all_locked()
        if ex.config.threaded and self.policy.auto_recover:
            t = threading.Thread(target=self._recover_when_drained, name="calfsm-recovery",
                                 daemon=True)
            self._recovery_thread = t
            t.start()
        return True

    def _fail_waiting(self, err: CalfsmError) -> None:
        """Fail every job that has not reached the device (queued or parked)."""
        ex = self.ex
        with ex._lock:
            jobs = list(ex._parked) + list(ex._submit_q)
            ex._parked.clear()
            ex._submit_q.clear()
        for job in jobs:
            e = Unavailable(err.message, category=err.category, stage=err.stage,
                            retry_after_s=err.retry_after_s)
            ex._fail_before_submit(job, e)

    def drained(self) -> bool:
        """No job on the device, or the grace period is over."""
        with self.ex._lock:
            return self._drained_locked()

    def _drained_locked(self) -> bool:
        ex = self.ex
        busy = bool(ex._on_device) or ex._inflight > len(ex._on_device)
        return not busy or ex.clock.now() - self._drain_started >= self.policy.grace_period_s

    def _recover_when_drained(self) -> None:
        ex = self.ex
        with ex._lock:
            while not self._drained_locked() and not ex._closing:
                if ex.clock.virtual:
                    ex._cond.wait(0.01)
                else:
                    remaining = self._drain_started + self.policy.grace_period_s \
                        - ex.clock.now()
                    ex._cond.wait(max(0.001, remaining))
        if not ex._closing:
            self.recover()

    def join(self, timeout: float) -> bool:
        """Wait for a recovery in progress to end (shutdown); False if it did not."""
        t = self._recovery_thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)
            return not t.is_alive()
        return True

    # ---- recovery ------------------------------------------------------------------
    def recover(self) -> bool:
        """Reset, rebuild with generation + 1, warm up. Returns True when Ready again."""
        ex = self.ex
        if not self.recovery_pending:
            return False
        self.recovery_pending = False
        kind = self.reset_kind()
        if kind is None:
            self._give_up("the driver offers no reset: restart the process")
            return False
        with ex._life_lock:
            if ex._life.state != LifecycleState.DRAINING or ex._closing:
                return False
            ex._fire_life("reset")
        ex.device_barrier()               # no submit in flight from here on
        old = ex.epoch
        lost = (list(old.kv.sequences()),
                f"its KV was lost in the reset of generation {old.generation}")
        old.retire()                      # destroy free buffers while handles are valid
        try:
            if not self.bring_up(old.manifest, old.calbin, kind, lost=lost):
                return False
        except _ShuttingDown:
            log.warning("recovery stopped: the executor is shutting down")
            return False
        with ex._life_lock:
            ex._counts["recoveries"] += 1
        log.warning("recovered: generation %s ready", ex.generation,
                    extra={"generation": ex.generation, "stage": "recovery"})
        return True

    def reset_kind(self) -> ResetKind | None:
        """The strongest reset the driver declares, or None."""
        caps = self.ex.driver.capabilities()
        return next((k for k in _RESET_PREFERENCE if caps.can_reset(k)), None)

    def bring_up(self, manifest: Manifest, calbin: Calbin, kind: ResetKind, *,
                 lost: tuple[list[int], str] | None = None,
                 attempts: int | None = None) -> bool:
        """From Recovering: reset, configure a new generation, run the warm-up golden.

        A failure for a device reason goes back to Recovering (``retry``) for another
        reset, at most ``attempts`` (default ``policy.max_attempts``) times in all; an
        artifact or compatibility error, a failed reset or the last attempt end Failed.
        """
        ex = self.ex
        attempts = self.policy.max_attempts if attempts is None else attempts
        for attempt in range(1, attempts + 1):
            rc = ex.driver.reset(kind)
            if rc != 0:
                self._give_up(f"reset {kind.value} failed with CalRT code {rc}")
                return False
            if kind is not ResetKind.FULL and lost is not None:
                for seq in lost[0]:               # the device kept them; nobody will
                    ex.driver.kv_release(seq, 0)
            self._step("reconfigure")
            generation = ex.generation + 1
            err = self.configure_and_warm(manifest, calbin, generation,
                                          configure=kind is not ResetKind.CCU, lost=lost)
            if err is None:
                return True
            if ex._closing:
                raise _ShuttingDown
            final = err.category in (ErrorCategory.ARTIFACT, ErrorCategory.COMPATIBILITY)
            if final or attempt == attempts:
                self._give_up(f"generation {generation} did not come up "
                              f"(attempt {attempt} of {attempts}): {err}")
                return False
            log.warning("bring-up attempt %s of %s failed, resetting again: %s", attempt,
                        attempts, err, extra=err.context())
            if ex.epoch is not None and not ex.epoch.retired:
                ex.epoch.retire()
            self._step("retry")
        return False

    def configure_and_warm(self, manifest: Manifest, calbin: Calbin, generation: int, *,
                           configure: bool = True,
                           lost: tuple[list[int], str] | None = None
                           ) -> CalfsmError | None:
        """Configuring -> Warming -> Ready with a new epoch: the one bring-up used by
        start-up, recovery, model switch and rollback. Returns the error if it did not
        come up. ``lost``: sequences whose KV the device no longer holds, and why; the
        new generation refuses them until reset."""
        ex = self.ex
        try:
            epoch = ex._build_epoch(manifest, calbin, generation, configure=configure)
            if lost is not None:
                epoch.kv.mark_lost(*lost)
            ex._install(epoch)
            self._step("configured")
            if ex.config.warmup:
                from calfsm.epoch import warm_up
                warm_up(ex.driver, epoch, ex.config.execution_timeout_s)
        except CalfsmError as e:
            return e
        with ex._life_lock:
            self._step("warmed")
            ex._life.known_good = (manifest, calbin)
            ex._life.reason = None
            self._note("ready")
        self._tokens = self.policy.error_budget
        self._streak = 0
        return None

    def _step(self, trigger: str) -> None:
        """Advance the lifecycle on the recovery path, unless shutdown began: then stop
        quietly (a shutdown during recovery is a shutdown, not a device failure)."""
        ex = self.ex
        with ex._life_lock:
            if ex._closing:
                raise _ShuttingDown
            ex._fire_life(trigger)

    def _give_up(self, reason: str) -> None:
        self.ex._fail_lifecycle(reason)
        self._note(reason)
        self._fail_waiting(Unavailable(f"device failed: {reason}", stage="admission",
                                       category=ErrorCategory.DEVICE))

    def _note(self, reason: str) -> None:
        self.history.append((self.ex.clock.now(), self.ex.lifecycle_state, reason))

    # ---- model switch --------------------------------------------------------------
    def switch_model(self, manifest: Manifest, calbin: Calbin | None = None,
                     timeout: float = 10.0) -> None:
        """Drain, configure the new artifact as a new generation and warm it; on an
        artifact or lifecycle error roll back to the last known-good generation, which
        keeps serving, and raise the error naming the artifact problem."""
        ex = self.ex
        calbin = calbin or Calbin.from_manifest(manifest)
        manifest.resolve(calbin.models)          # host-side check: no downtime if broken
        caps = ex.driver.capabilities()
        if not (caps.can_reset(ResetKind.CONFIGURATION) or caps.can_reset(ResetKind.FULL)):
            raise Unsupported("model switch needs a configuration or full reset, which "
                              f"driver {ex.driver.name!r} does not offer", stage="switch")
        with self._switch_lock:
            with ex._life_lock:
                if ex._life.state != LifecycleState.READY:
                    raise FailedPrecondition(f"cannot switch model while {ex._life.state}",
                                             stage="switch", generation=ex.generation)
                ex._life.reason = f"switching to {manifest.name or manifest.calbin_sha256}"
                ex._fire_life("drain")
                self._drain_started = ex.clock.now()
                self._note(ex._life.reason)
            self._fail_waiting(Unavailable("device is switching models", stage="admission",
                                           retry_after_s=self.policy.retry_after_s))
            ex.device_barrier()
            self._wait_drained(timeout)
            try:
                self._step("reconfigure")
                old = ex.epoch
                lost = (list(old.kv.sequences()),
                        f"its KV was lost in the switch away from generation "
                        f"{old.generation}")
                old.retire()
                kind = self._reconfigure_kind()
                rc = ex.driver.reset(kind)
                if rc != 0:
                    self._give_up(f"reset {kind.value} for model switch failed with code {rc}")
                    raise Unavailable(ex.failure_reason or "model switch failed",
                                      stage="switch")
                for seq in lost[0]:
                    ex.driver.kv_release(seq, 0)
                generation = ex.generation + 1
                err = self.configure_and_warm(manifest, calbin, generation, lost=lost)
                if err is not None:
                    self._rollback(err, generation + 1)
                    raise ManifestError(f"model switch rejected, rolled back to the last "
                                        f"known-good model: {err}", category=err.category,
                                        stage="switch", generation=ex.generation,
                                        calrt_code=err.calrt_code) from err
            except _ShuttingDown:
                raise Unavailable("the executor was closed during the model switch",
                                  stage="switch") from None
            self._note("ready after switch")

    def _reconfigure_kind(self) -> ResetKind:
        """The reset that drops a configuration: CONFIGURATION, else FULL (a switch
        checks one of them is offered before it starts)."""
        caps = self.ex.driver.capabilities()
        return ResetKind.CONFIGURATION if caps.can_reset(ResetKind.CONFIGURATION) \
            else ResetKind.FULL

    def _rollback(self, err: CalfsmError, generation: int) -> None:
        ex = self.ex
        log.error("model switch failed, rolling back: %s", err, extra=err.context())
        with ex._life_lock:
            if not ex._fire_life("rollback"):
                self._give_up(f"model switch failed and nothing to roll back to: {err}")
                return
        if ex.epoch is not None and not ex.epoch.retired:
            ex.epoch.retire()
        kind = self._reconfigure_kind()
        rc = ex.driver.reset(kind)
        if rc != 0:
            self._give_up(f"reset for rollback failed with code {rc}")
            return
        manifest, calbin = ex._life.known_good
        err = self.configure_and_warm(manifest, calbin, generation)
        if err is not None:
            self._give_up(f"rollback to the known-good model failed: {err}")

    def _wait_drained(self, timeout: float) -> None:
        ex = self.ex
        if not ex.config.threaded:
            while not self.drained():
                if not ex._complete_next():
                    break
            return
        with ex._lock:
            ex._cond.wait_for(self._drained_locked, timeout)

