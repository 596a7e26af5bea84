"""The device lifecycle: its one record, its lock, the admission gate, and every
procedure that moves it — start-up, retry, recovery, model switch and rollback.

Theory of operation
-------------------
:class:`Lifecycle` owns the record the lifecycle machine runs on (state, generation,
reason, the current :class:`~calfsm.engine.epoch.Epoch`, the known-good models) and its lock;
nothing else writes it. Every transition goes through :meth:`Lifecycle.fire`, which calls
the change listeners (the thread runtime rings its doorbells there; a stream waiting to
resume hears of Ready there; a caller blocked in
:func:`calfsm.runtime.waits.wait_for_state` wakes there: the lifecycle itself never
waits).
Listeners never run with the lifecycle lock held: a transition made inside
:meth:`Lifecycle.locked` (a check-then-act) calls them when the outermost hold ends.

:class:`DeviceLifecycle` runs the procedures on a driver: ``Unconfigured -> Configuring ->
Warming -> Ready`` at start-up; after a fault ``Ready -> Draining -> Recovering ->
Configuring -> Warming -> Ready`` with generation + 1 and the warm-up golden before
traffic; a model switch ``Ready -> Draining -> Configuring``; ``rollback`` to the last
known-good model when a new artifact does not come up. It applies the decisions of the
fault policy (:mod:`calfsm.engine.recovery`) and reaches the job pipeline only through the
pipeline's public methods (fail what waits, is it drained, the device barrier).

It never starts a thread or sleeps: when a drain wants a recovery it tells the pipeline
(``recovery_wanted``, which tells whoever drives it: the thread runtime starts a recovery
thread; in step mode the scheduler runs :meth:`DeviceLifecycle.recover` as a step once
:meth:`recovery_due` holds).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import attrs

from calfsm.drivers.base import Calbin, Driver, EngineSlot, ResetKind
from calfsm.engine.epoch import Epoch, build_epoch, warm_up
from calfsm.engine.recovery import Decision, FaultPolicy, Verdict
from calfsm.engine.shapes import ShapeBuckets
from calfsm.engine.stepcost import ServiceModel
from calfsm.engine.sync import Sync
from calfsm.errors import (
    CalfsmError,
    ErrorCategory,
    ExecutorClosed,
    FailedPrecondition,
    ManifestError,
    Unavailable,
    Unsupported,
    check,
)
from calfsm.machines.lifecycle import LIFECYCLE_MACHINE, MOVING, LifecycleState
from calfsm.manifest import Manifest, TaskKind
from calfsm.util.lograte import RateLimitedLog

__all__ = ["HISTORY_KEPT", "DeviceLifecycle", "Lifecycle", "LifecycleRecord"]

log = logging.getLogger("calfsm.lifecycle")
#: the warnings a fault storm repeats, a burst per minute each (calfsm/util/lograte.py)
_limited = RateLimitedLog(log)

#: strongest first: the reset that leaves the least state behind
RESET_PREFERENCE = (ResetKind.FULL, ResetKind.CONFIGURATION, ResetKind.CCU)

_READY = LifecycleState.READY
#: how many notes :attr:`Lifecycle.history` keeps (a recovery makes two: its drain, its Ready)
HISTORY_KEPT = 1024


@attrs.define(slots=True)
class LifecycleRecord:
    """The lifecycle machine's model: state plus what a supervisor needs to know."""

    state: str = LifecycleState.UNCONFIGURED.value
    generation: int = 0
    reason: str | None = None
    retry_after_s: float = 1.0
    #: (manifest, calbin) of the generation that warmed last, and of the one before it
    known_good: Any = None
    previous_good: Any = None


class Lifecycle:
    """The one owner of the lifecycle record, its lock and the admission gate.

    ``sync`` gives the locks; the engine built around this lifecycle (its pipeline, its
    procedures) takes its own from the same one (:attr:`sync`)."""

    def __init__(self, clock: Any, sync: Sync) -> None:
        self.clock = clock
        #: the locks of this executor's engine, and the waits on its latches
        self.sync = sync
        self._rec = LifecycleRecord()
        self._lock = sync.rlock()
        #: how deep the thread holding ``locked()`` is in it, and whether a transition
        #: inside owes the listeners a call once it lets go (only the holder writes them)
        self._depth = 0
        self._owed = False
        #: read on every token's way, so plain attributes, not properties; only this
        #: class writes them: ``state`` mirrors the record after every trigger
        #: (:meth:`_moved`), ``epoch`` is set by :meth:`install`, ``closing`` by
        #: :meth:`begin_close`
        self.state: str = self._rec.state
        #: the current generation's resources (None before the first one is built), and
        #: its number (0 before the first): both set by :meth:`install` alone
        self.epoch: Epoch | None = None
        self.generation: int = self._rec.generation
        self.closing = False
        self._stopping = False
        #: clock seconds spent out of Ready since the first Ready, and since when the
        #: current stretch lasts (None: Ready now, or never was)
        self._unready_s = 0.0
        self._unready_since: float | None = None
        self._was_ready = False
        self._listeners: list[Callable[[], None]] = []
        #: (time, state, reason) of the latest notes: the last HISTORY_KEPT only, so a
        #: process that recovers for months does not keep every one
        self.history: collections.deque[tuple[float, str, str]] = collections.deque(
            maxlen=HISTORY_KEPT)

    # ---- reading -------------------------------------------------------------------
    @property
    def record(self) -> LifecycleRecord:
        """The machine's model (listeners of LIFECYCLE_MACHINE see this object)."""
        return self._rec

    @property
    def reason(self) -> str | None:
        return self._rec.reason

    @property
    def retry_after_s(self) -> float:
        return self._rec.retry_after_s

    @property
    def stopping(self) -> bool:
        """A graceful shutdown began: no new work; running streams go on (``close``)."""
        return self._stopping

    @property
    def ready(self) -> bool:
        return self._rec.state == _READY and not self.closing and not self._stopping

    @property
    def moving(self) -> bool:
        """A drain, reset, bring-up or model switch is under way: the lifecycle will
        leave this state on its own, and its procedures may hold slots meanwhile."""
        return self._rec.state in MOVING

    def unready_s(self, now: float) -> float:
        """Clock seconds spent out of Ready (draining, recovering, warming) since the
        first Ready, up to ``now``. A waiting job is not charged for them: its admission
        budget is extended by what this grew while it waited."""
        since = self._unready_since
        return self._unready_s if since is None else self._unready_s + (now - since)

    @property
    def known_good(self) -> Any:
        return self._rec.known_good

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the record's lock, for a check-then-act that must see no transition
        between (re-entrant). The listeners of a transition made inside are called when
        the outermost hold ends, outside the lock."""
        with self._lock:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                owed = self._owed and self._depth == 0
                if owed:
                    self._owed = False
        if owed:
            self._changed()

    def holds_lock(self) -> bool:
        """Whether the calling thread holds the lifecycle lock (tests hold listeners and
        observers to running without it)."""
        return self.sync.holds(self._lock)

    # ---- moving --------------------------------------------------------------------
    def on_change(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` after every transition and on close (outside the lock)."""
        self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[], None]) -> None:
        """Stop calling ``listener`` (a no-op if it is not registered)."""
        try:
            self._listeners.remove(listener)
        except ValueError:
            pass

    def fire(self, trigger: str) -> bool:
        """Fire a lifecycle trigger; every transition goes through here."""
        with self.locked():
            fired = LIFECYCLE_MACHINE.fire(self._rec, trigger)
            self._moved()
        return fired

    def fire_if_declared(self, trigger: str) -> bool:
        """Fire ``trigger`` if it is declared from the current state (under one lock)."""
        with self.locked():
            fired = LIFECYCLE_MACHINE.fire_if_declared(self._rec, trigger)
            self._moved()
        return fired

    def _moved(self) -> None:
        """Under the lock, after a trigger: keep the out-of-Ready clock, and owe the
        listeners (waiters among them) a call once the outermost hold ends."""
        self._owed = True
        self.state = state = self._rec.state
        ready = state == _READY
        if ready:
            if self._unready_since is not None:
                self._unready_s += self.clock.now() - self._unready_since
                self._unready_since = None
            self._was_ready = True
        elif self._was_ready and self._unready_since is None:
            self._unready_since = self.clock.now()

    def drain(self, reason: str, retry_after_s: float) -> bool:
        """Ready -> Draining with ``reason``. False if not Ready (or closing)."""
        with self.locked():
            if self._rec.state != _READY or self.closing:
                return False
            self._rec.reason = reason
            self._rec.retry_after_s = retry_after_s
            self.fire("drain")
            self.note(reason)
        return True

    def fail(self, reason: str) -> None:
        """Any live state -> Failed with ``reason`` (a supervisor restarts the process)."""
        with self.locked():
            self._rec.reason = reason
            self.fire_if_declared("fail")
            self.note(reason)
        log.error("executor failed: %s", reason,
                  extra={"generation": self._rec.generation, "stage": "lifecycle"})

    def install(self, epoch: Epoch) -> None:
        """Make ``epoch`` the current generation (the only place the number moves)."""
        with self._lock:
            self.epoch = epoch
            self._rec.generation = self.generation = epoch.generation

    def warmed(self, manifest: Manifest, calbin: Calbin) -> None:
        """Warming -> Ready: this model is the known-good one now."""
        with self.locked():
            self.fire("warmed")
            rec = self._rec
            if rec.known_good is not None and rec.known_good[0] is not manifest:
                rec.previous_good = rec.known_good
            rec.known_good = (manifest, calbin)
            rec.reason = None
            self.note("ready")

    def previous_good(self) -> Any:
        """(manifest, calbin) warmed before the current known-good one, or None."""
        return self._rec.previous_good

    def reject_current(self) -> Any:
        """The current model met an artifact error: the one before it is the known-good
        one again (and there is none before that). Returns it."""
        with self._lock:
            rec = self._rec
            rec.known_good, rec.previous_good = rec.previous_good, None
            return rec.known_good

    def begin_stop(self) -> bool:
        """Stop admitting new work (a graceful shutdown's first phase): new requests get
        :class:`ExecutorClosed` with a retry-after hint, the next steps of running
        streams are still admitted. False if a shutdown already began."""
        with self.locked():
            if self._stopping or self.closing:
                return False
            self._stopping = True
            self._owed = True
        return True

    def begin_close(self) -> bool:
        """Stop admission for good. False if close already began."""
        with self.locked():
            if self.closing:
                return False
            self.closing = True
            self._owed = True
        return True

    def note(self, reason: str) -> None:
        self.history.append((self.clock.now(), self._rec.state, reason))

    def _changed(self) -> None:
        for listener in tuple(self._listeners):
            listener()

    # ---- admission gate ------------------------------------------------------------
    def gate(self, *, continuing: bool = False) -> None:
        """Only Ready admits. Closed: :class:`ExecutorClosed` (misuse); shutting down:
        the same with a retry-after hint, except for the next step of a running stream
        (``continuing``), which a graceful shutdown lets finish; Recovering: 503 with a
        retry-after hint; Failed: 503 without one (restart the process)."""
        rec = self._rec
        if self.closing or (self._stopping and not continuing):
            raise ExecutorClosed(
                "executor is " + ("closed" if self.closing else "shutting down"),
                stage="admission", generation=rec.generation,
                retry_after_s=rec.retry_after_s)
        if rec.state != _READY:
            raise Unavailable(
                f"device is {rec.state}" + (f": {rec.reason}" if rec.reason else ""),
                stage="admission", generation=rec.generation,
                retry_after_s=None if rec.state == LifecycleState.FAILED
                else rec.retry_after_s)


class PipelineControl(Protocol):
    """What the lifecycle's procedures use of the job pipeline
    (:class:`~calfsm.engine.pipeline.Pipeline` is it; the pipeline sits above this module, so
    it is named by what it offers, not imported)."""

    max_inflight: int

    @property
    def inflight(self) -> int: ...

    def fail_waiting(self, err: CalfsmError) -> None: ...

    def hold_waiting(self, err: CalfsmError) -> None: ...

    def wake_waiters(self) -> None: ...

    def recovery_wanted(self) -> None: ...

    def capacity_freed(self) -> None: ...

    def kv_full(self) -> None: ...

    def device_barrier(self) -> None: ...

    def idle_on_device(self) -> bool: ...

    def completion_idle_s(self) -> float | None: ...

    def count(self, name: str) -> None: ...


class _ShuttingDown(Exception):
    """Raised inside a procedure when ``close()`` began: close owns the lifecycle now."""


class DeviceLifecycle:
    """Start-up, recovery, model switch and rollback of one device, applying the fault
    policy's decisions. Sans-thread: waits are the runtime's, through the pipeline."""

    def __init__(self, driver: Driver, life: Lifecycle, policy: FaultPolicy,
                 pipeline: PipelineControl, *, build: Callable[..., Epoch],
                 warmup: bool, service: ServiceModel) -> None:
        self.driver = driver
        self.life = life
        self.faults = policy
        self.policy = policy.policy
        self.pipeline = pipeline
        self._build = build
        self._warmup = warmup
        self._service = service
        #: a drain wants a recovery that has not run yet (an attribute: the step
        #: scheduler looks at it on every step, issue 35 item 4)
        self.recovery_pending = False
        self._roll_back = False
        self._drain_started = 0.0
        self._switch_lock = life.sync.lock()

    # ---- decisions -----------------------------------------------------------------
    def apply(self, verdict: Verdict) -> None:
        """Carry out a policy decision for the device (the job's own fate is decided by
        whoever met the error)."""
        d = verdict.decision
        if d in (Decision.CONTINUE, Decision.BACK_OFF, Decision.REQUEUE):
            return
        if d is Decision.STOP:
            self.life.fail(f"incompatible device or runtime: {verdict.reason}")
            self.pipeline.fail_waiting(Unavailable(
                f"device stopped: {verdict.reason}", category=ErrorCategory.COMPATIBILITY,
                stage="admission"))
            return
        self.begin_drain(verdict.reason, roll_back=d is Decision.ROLL_BACK)

    def begin_drain(self, reason: str, *, roll_back: bool = False) -> bool:
        """Stop admission and schedule recovery. False if not Ready."""
        life = self.life
        with life.locked():
            if not life.drain(reason, self.policy.retry_after_s):
                return False
            self._drain_started = life.clock.now()
            self.recovery_pending = True
            self._roll_back = roll_back
        _limited.warning("drain", "draining generation %s: %s", life.generation, reason,
                         extra={"generation": life.generation, "stage": "drain"})
        # what has not reached the device waits for the next generation, or fails now,
        # retryable, where it cannot run there (a sequence's KV the reset will lose)
        self.pipeline.hold_waiting(Unavailable(
            f"device is recovering: {reason}", stage="admission",
            retry_after_s=self.policy.retry_after_s))
        self.pipeline.wake_waiters()
        if self.policy.auto_recover:
            self.pipeline.recovery_wanted()
        return True

    def slots_exhausted(self, kind: TaskKind, reason: str) -> None:
        """The pool has no usable slot of ``kind`` left (all quarantined): the fault
        policy decides (drain and reset), so that kind's jobs never wait in vain."""
        self.apply(self.faults.slots_exhausted(kind, reason))

    def check_progress(self) -> None:
        """Watchdog: work on the device and no completion progress past the threshold is
        a device fault, so a wedged device never looks healthy."""
        if not self.life.ready:
            return
        idle = self.pipeline.completion_idle_s()
        if idle is not None and idle > self.policy.progress_timeout_s:
            self.begin_drain(f"no completion progress for {idle:.3f} s with "
                             f"{self.pipeline.inflight} job(s) on the device")

    # ---- recovery ------------------------------------------------------------------
    @property
    def grace_deadline(self) -> float | None:
        """Clock time the drain stops waiting for the device (None: nothing pending)."""
        return self._drain_started + self.policy.grace_period_s if self.recovery_pending else None

    def drained(self) -> bool:
        """No job on the device, or the grace period of the drain is over."""
        return self.pipeline.idle_on_device() \
            or self.life.clock.now() - self._drain_started >= self.policy.grace_period_s

    def recovery_due(self) -> bool:
        """A recovery is pending, the lifecycle is Draining and the device drained."""
        return self.recovery_pending and self.life.state == LifecycleState.DRAINING \
            and self.drained()

    def recover(self) -> bool:
        """Reset, rebuild with generation + 1, warm up. True when Ready again."""
        life = self.life
        if not self.recovery_pending:
            return False
        self.recovery_pending = False
        kind = self.reset_kind()
        if kind is None:
            self.give_up("the driver offers no reset: restart the process")
            return False
        with life.locked():
            if life.state != LifecycleState.DRAINING or life.closing:
                return False
            life.fire("reset")
        self.pipeline.device_barrier()          # no submit in flight from here on
        old = life.epoch
        lost = (list(old.kv.sequences()),
                f"its KV was lost in the reset of generation {old.generation}")
        old.retire()                            # destroy free buffers while handles live
        model = (old.manifest, old.calbin)
        if self._roll_back and life.previous_good() is not None:
            model = life.reject_current()       # this generation's artifact is refused
            log.warning("rolling back to the last known-good model after an artifact "
                        "error", extra={"generation": old.generation, "stage": "rollback"})
        try:
            if not self.bring_up(*model, kind, lost=lost,
                                 on_ready=lambda: self.pipeline.count("recoveries")):
                return False
        except _ShuttingDown:
            log.warning("recovery stopped: the executor is shutting down")
            return False
        _limited.warning("recovered", "recovered: generation %s ready", life.generation,
                         extra={"generation": life.generation, "stage": "recovery"})
        return True

    def reset_kind(self) -> ResetKind | None:
        """The strongest reset the driver declares, or None."""
        caps = self.driver.capabilities()
        return next((k for k in RESET_PREFERENCE if caps.can_reset(k)), None)

    def bring_up(self, manifest: Manifest, calbin: Calbin, kind: ResetKind, *,
                 lost: tuple[list[int], str] | None = None,
                 attempts: int | None = None, configure: bool = False,
                 on_ready: Callable[[], None] | None = None) -> bool:
        """From Recovering: reset, configure a new generation, run the warm-up golden.

        A failure for a device reason goes back to Recovering (``retry``) for another
        reset, at most ``attempts`` (default ``policy.max_attempts``) times in all; an
        artifact or compatibility error, a failed reset or the last attempt end Failed.
        ``configure``: configure even after a CCU reset (which keeps a configuration,
        if there ever was one: not so when start-up failed to configure). ``on_ready``:
        see :meth:`configure_and_warm`.
        """
        life = self.life
        attempts = self.policy.max_attempts if attempts is None else attempts
        for attempt in range(1, attempts + 1):
            rc = self.driver.reset(kind)
            if rc != 0:
                self.give_up(f"reset {kind.value} failed with CalRT code {rc}")
                return False
            generation = life.generation + 1
            try:
                self._release_lost(kind, lost)
            except CalfsmError as e:
                err = e
            else:
                self._step("reconfigure")
                err = self.configure_and_warm(
                    manifest, calbin, generation,
                    configure=configure or kind is not ResetKind.CCU, lost=lost,
                    on_ready=on_ready)
            if err is None:
                return True
            if life.closing:
                raise _ShuttingDown
            final = err.category in (ErrorCategory.ARTIFACT, ErrorCategory.COMPATIBILITY)
            if final or attempt == attempts:
                self.give_up(f"generation {generation} did not come up "
                              f"(attempt {attempt} of {attempts}): {err}")
                return False
            _limited.warning("bring_up", "bring-up attempt %s of %s failed, resetting "
                             "again: %s", attempt, attempts, err, extra=err.context())
            if life.epoch is not None and not life.epoch.retired:
                life.epoch.retire()
            if life.state == LifecycleState.CONFIGURING or \
                    life.state == LifecycleState.WARMING:
                self._step("retry")
        return False

    def _release_lost(self, kind: ResetKind, lost: tuple[list[int], str] | None) -> None:
        """After a reset that keeps KV (not FULL), release what nobody will use again.
        Every code is checked: a device that cannot release KV did not come back."""
        if kind is ResetKind.FULL or lost is None:
            return
        for seq in lost[0]:
            check(self.driver.kv_release(seq, 0), "kv_release", seq_id=seq)

    def configure_and_warm(self, manifest: Manifest, calbin: Calbin, generation: int, *,
                           configure: bool = True,
                           lost: tuple[list[int], str] | None = None,
                           on_ready: Callable[[], None] | None = None
                           ) -> CalfsmError | None:
        """Configuring -> Warming -> Ready with a new epoch: the one bring-up used by
        start-up, recovery, model switch and rollback. Returns the error if it did not
        come up. ``lost``: sequences whose KV the device no longer holds, and why; the
        new generation refuses them until reset. ``on_ready()`` books the bring-up
        (a recovery counts itself) just before Ready is announced.

        The books move before the state does: whoever sees the new generation Ready (a
        waiter, a listener, a reader of ``stats()``) finds it counted and the old
        generation's error budget and back-off gone."""
        life = self.life
        try:
            epoch = self._build(manifest, calbin, generation, configure=configure)
            if lost is not None:
                epoch.kv.mark_lost(*lost)
            life.install(epoch)
            self._step("configured")
            self._enable_parallel()
            if self._warmup:
                self._service.calibrate(warm_up(self.driver, epoch, self._service))
            epoch.pool.on_exhausted = _on_exhausted(self)
            # KV or a slot back: the admission queue's head may go on
            epoch.kv.on_freed = epoch.pool.on_freed = self.pipeline.capacity_freed
            # the device refused KV: what is kept warm for nobody yields (prompt cache)
            epoch.kv.on_full = self.pipeline.kv_full
        except CalfsmError as e:
            return e
        self.faults.reset()
        with life.locked():
            if life.closing:
                raise _ShuttingDown
            if on_ready is not None:
                on_ready()
            life.warmed(manifest, calbin)
        return None

    def _enable_parallel(self) -> None:
        """Two in flight (ping/pong) needs the device's parallel mode, which a reset may
        turn off: switch it on for every generation before its warm-up, so the golden
        runs the way traffic will (spec 6.4). A device that refuses did not come up."""
        if self.pipeline.max_inflight > 1:
            check(self.driver.enable_parallel_mode(True), "enable_parallel_mode",
                  generation=self.life.generation)

    def _step(self, trigger: str) -> None:
        """Advance the lifecycle on a procedure, unless shutdown began: then stop quietly
        (a shutdown during recovery is a shutdown, not a device failure)."""
        with self.life.locked():
            if self.life.closing:
                raise _ShuttingDown
            self.life.fire(trigger)

    def give_up(self, reason: str) -> None:
        """End Failed with ``reason`` and fail every job that has not reached the device."""
        self.life.fail(reason)
        self.pipeline.fail_waiting(Unavailable(f"device failed: {reason}",
                                               stage="admission",
                                               category=ErrorCategory.DEVICE))

    # ---- start-up ------------------------------------------------------------------
    def start(self, manifest: Manifest, calbin: Calbin) -> None:
        """Bring generation 1 up; retry a device-side failure through the recovery path.
        Raises the classified error when the executor cannot start."""
        life = self.life
        life.fire("start")
        err = self.configure_and_warm(manifest, calbin, generation=1)
        if err is None:
            return
        if not self._retry_startup(err, manifest, calbin):
            self.give_up(f"start-up failed: {err}")
            raise err
        if life.state != _READY:
            raise Unavailable(f"start-up failed: {life.reason}", category=err.category,
                              stage="startup") from err

    def _retry_startup(self, err: CalfsmError, manifest: Manifest, calbin: Calbin) -> bool:
        """A device-side failure while first configuring or warming: go through the
        recovery path for the remaining attempts. An artifact or compatibility problem
        (FI01) is final at once. False: not retried."""
        attempts = self.policy.max_attempts - 1
        kind = self.reset_kind()
        if err.category in (ErrorCategory.ARTIFACT, ErrorCategory.COMPATIBILITY) \
                or attempts < 1 or kind is None or self.life.state not in (
                    LifecycleState.CONFIGURING, LifecycleState.WARMING):
            return False
        log.warning("start-up attempt failed, resetting: %s", err, extra=err.context())
        if self.life.epoch is not None:
            self.life.epoch.retire()
        self.life.fire("retry")
        self.bring_up(manifest, calbin, kind, attempts=attempts, configure=True)
        return True

    # ---- model switch --------------------------------------------------------------
    def switch_model(self, manifest: Manifest, calbin: Calbin | None,
                     wait_drained: Callable[[float], None], timeout: float) -> None:
        """Drain, configure the new artifact as a new generation and warm it; on an
        artifact or lifecycle error roll back to the last known-good generation, which
        keeps serving, and raise the error naming the artifact problem."""
        life = self.life
        calbin = calbin or Calbin.from_manifest(manifest)
        manifest.resolve(calbin.models)          # host-side check: no downtime if broken
        caps = self.driver.capabilities()
        if not (caps.can_reset(ResetKind.CONFIGURATION) or caps.can_reset(ResetKind.FULL)):
            raise Unsupported("model switch needs a configuration or full reset, which "
                              f"driver {self.driver.name!r} does not offer", stage="switch")
        with self._switch_lock:
            reason = f"switching to {manifest.name or manifest.calbin_sha256}"
            with life.locked():
                if not life.drain(reason, self.policy.retry_after_s):
                    raise FailedPrecondition(f"cannot switch model while {life.state}",
                                             stage="switch", generation=life.generation)
                self._drain_started = life.clock.now()
            self.pipeline.hold_waiting(Unavailable(
                "device is switching models", stage="admission",
                retry_after_s=self.policy.retry_after_s))
            self.pipeline.device_barrier()
            wait_drained(timeout)
            try:
                self._switch(manifest, calbin)
            except _ShuttingDown:
                raise ExecutorClosed("the executor was closed during the model switch",
                                     stage="switch") from None
            life.note("ready after switch")

    def _switch(self, manifest: Manifest, calbin: Calbin) -> None:
        life = self.life
        self._step("reconfigure")
        old = life.epoch
        lost = (list(old.kv.sequences()),
                f"its KV was lost in the switch away from generation {old.generation}")
        old.retire()
        kind = self._reconfigure_kind()
        rc = self.driver.reset(kind)
        if rc != 0:
            self.give_up(f"reset {kind.value} for model switch failed with code {rc}")
            raise Unavailable(life.reason or "model switch failed", stage="switch")
        generation = life.generation + 1
        try:
            self._release_lost(kind, lost)
        except CalfsmError as e:
            err: CalfsmError | None = e
        else:
            err = self.configure_and_warm(manifest, calbin, generation, lost=lost)
        if err is not None:
            self._rollback(err, generation + 1, lost)
            raise ManifestError(f"model switch rejected, rolled back to the last "
                                f"known-good model: {err}", category=err.category,
                                stage="switch", generation=life.generation,
                                calrt_code=err.calrt_code) from err

    def _reconfigure_kind(self) -> ResetKind:
        """The reset that drops a configuration: CONFIGURATION, else FULL (a switch
        checks one of them is offered before it starts)."""
        caps = self.driver.capabilities()
        return ResetKind.CONFIGURATION if caps.can_reset(ResetKind.CONFIGURATION) \
            else ResetKind.FULL

    def _rollback(self, err: CalfsmError, generation: int,
                  lost: tuple[list[int], str]) -> None:
        life = self.life
        log.error("model switch failed, rolling back: %s", err, extra=err.context())
        if not life.fire("rollback"):
            self.give_up(f"model switch failed and nothing to roll back to: {err}")
            return
        if life.epoch is not None and not life.epoch.retired:
            life.epoch.retire()
        kind = self._reconfigure_kind()
        rc = self.driver.reset(kind)
        if rc != 0:
            self.give_up(f"reset for rollback failed with code {rc}")
            return
        try:        # the old sequences' KV may still be on the device: nobody owns it
            self._release_lost(kind, lost)
        except CalfsmError as e:
            self.give_up(f"rollback could not release the old sequences' KV: {e}")
            return
        manifest, calbin = life.known_good
        again = self.configure_and_warm(manifest, calbin, generation, lost=lost)
        if again is not None:
            self.give_up(f"rollback to the known-good model failed: {again}")


def _on_exhausted(owner: DeviceLifecycle) -> Callable[[TaskKind, str], None]:
    """The pool's exhaustion hook, holding its owner weakly: the lifecycle holds the
    epoch that holds the pool, and a pool must not hold them back (no reference cycle)."""
    ref = weakref.ref(owner)

    def exhausted(kind: TaskKind, reason: str) -> None:
        life = ref()
        if life is not None:
            life.slots_exhausted(kind, reason)
    return exhausted


def epoch_builder(driver: Driver, *, max_inflight: int, slots_per_engine: int,
                  token_budget: int | None, engines: tuple[EngineSlot, ...],
                  sync: Sync, batch_rows: int = 1,
                  buckets: ShapeBuckets | None = None) -> Callable[..., Epoch]:
    """``build(manifest, calbin, generation, configure=True)`` with one executor's
    settings. ``buckets`` (the shape buckets its evidence proved) apply to a manifest
    holding every one of those graphs; another (a model switch) runs one graph."""
    def build(manifest: Manifest, calbin: Calbin, generation: int, *,
              configure: bool = True) -> Epoch:
        keys = {g.exact_name: g.key for g in manifest.graphs(TaskKind.DECODE)}
        fits = buckets is not None and all(keys.get(g.exact_name) == g.key
                                           for g in buckets.graphs)
        return build_epoch(driver, manifest, calbin, generation, configure=configure,
                           max_inflight=max_inflight, slots_per_engine=slots_per_engine,
                           token_budget=token_budget, engines=engines, sync=sync,
                           batch_rows=batch_rows, buckets=buckets if fits else None)
    return build
