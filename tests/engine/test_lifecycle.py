"""The device lifecycle on its own (issue 21, item 5): :class:`~calfsm.engine.lifecycle.Lifecycle`
as a bare record on a virtual clock, and :class:`~calfsm.engine.lifecycle.DeviceLifecycle`
driving a simulated driver with a fake pipeline (the :class:`PipelineControl` protocol,
recording what it is asked), with no executor, no runtime and no thread."""

from __future__ import annotations

import pytest

from calfsm.clock import VirtualClock
from calfsm.drivers.base import Calbin, EngineSlot
from calfsm.drivers.sim import SimDriver
from calfsm.engine.lifecycle import HISTORY_KEPT, DeviceLifecycle, Lifecycle, epoch_builder
from calfsm.engine.recovery import Decision, FaultPolicy, RecoveryPolicy, Verdict
from calfsm.engine.stepcost import ServiceModel
from calfsm.errors import CalfsmError, DeadlineExceeded, ExecutorClosed, Unavailable
from calfsm.runtime.sync import THREADS
from calfsm.runtime.waits import wait_for_state
from tests.helpers.executor import TINY, calls


def _ready(life: Lifecycle) -> None:
    """Unconfigured -> Configuring -> Warming -> Ready, with no device behind it."""
    life.fire("start")
    life.fire("configured")
    life.warmed(TINY, Calbin.from_manifest(TINY))


# ---- Lifecycle: the record, the gate, the listeners ----------------------------------

def test_only_ready_admits_and_each_other_state_says_why():
    life = Lifecycle(VirtualClock(), THREADS)
    with pytest.raises(Unavailable, match="Unconfigured"):
        life.gate()
    _ready(life)
    life.gate()                                     # Ready: nothing raised
    assert life.ready and life.known_good[0] is TINY
    assert life.drain("a test drains", retry_after_s=2.5)
    assert not life.drain("twice", retry_after_s=1.0)   # only from Ready
    with pytest.raises(Unavailable) as e:
        life.gate()
    assert "Draining" in str(e.value) and e.value.retry_after_s == 2.5
    life.fail("gave up")
    with pytest.raises(Unavailable) as e:
        life.gate()
    assert life.state == "Failed" and e.value.retry_after_s is None   # restart it


def test_a_graceful_stop_admits_only_a_running_streams_next_step_and_close_none():
    life = Lifecycle(VirtualClock(), THREADS)
    _ready(life)
    assert life.begin_stop() and not life.begin_stop()
    with pytest.raises(ExecutorClosed, match="shutting down"):
        life.gate()
    life.gate(continuing=True)                      # a running stream goes on
    assert life.begin_close() and not life.begin_close()
    with pytest.raises(ExecutorClosed, match="closed"):
        life.gate(continuing=True)
    assert life.closing and not life.ready


def test_listeners_run_after_the_transition_and_never_under_the_lock():
    life = Lifecycle(VirtualClock(), THREADS)
    seen: list[tuple[str, bool]] = []
    life.on_change(lambda: seen.append((life.state, life.holds_lock())))
    life.fire("start")
    assert seen == [("Configuring", False)]
    with life.locked():                             # a check-then-act: owed, not called
        life.fire("configured")
        assert seen == [("Configuring", False)]
    assert seen == [("Configuring", False), ("Warming", False)]
    life.warmed(TINY, Calbin.from_manifest(TINY))
    life.drain("drain", 1.0)
    life.fail("fail")
    assert [s for s, _ in seen] == ["Configuring", "Warming", "Ready", "Draining", "Failed"]
    assert not any(locked for _, locked in seen)


def test_time_out_of_ready_is_counted_from_the_first_ready_only():
    clock = VirtualClock()
    life = Lifecycle(clock, THREADS)
    life.fire("start")
    clock.advance(5.0)                              # start-up is not out-of-Ready time
    life.fire("configured")
    life.warmed(TINY, Calbin.from_manifest(TINY))
    assert life.unready_s(clock.now()) == 0.0
    clock.advance(1.0)
    life.drain("reset", 1.0)
    clock.advance(2.0)
    assert life.unready_s(clock.now()) == 2.0       # still counting
    life.fire("reset")
    life.fire("reconfigure")
    life.fire("configured")
    clock.advance(1.5)
    life.warmed(TINY, Calbin.from_manifest(TINY))
    clock.advance(10.0)
    assert life.unready_s(clock.now()) == 3.5       # stopped at Ready


def test_the_history_keeps_the_latest_transitions_only():
    """A process that recovers for months must not keep every transition: the history
    keeps the last HISTORY_KEPT notes, newest last."""
    clock = VirtualClock()
    life = Lifecycle(clock, THREADS)
    _ready(life)
    cycles = HISTORY_KEPT // 2 + 10          # each notes its drain and its Ready
    for i in range(cycles):
        clock.advance(1.0)
        life.drain(f"recovery {i}", 1.0)
        life.fire("reset")
        life.fire("reconfigure")
        life.fire("configured")
        life.warmed(TINY, Calbin.from_manifest(TINY))
    history = list(life.history)
    assert len(history) == HISTORY_KEPT
    assert [(state, why) for _, state, why in history[-2:]] == [
        ("Draining", f"recovery {cycles - 1}"), ("Ready", "ready")]
    times = [t for t, _, _ in history]
    assert times == sorted(times)


def test_wait_for_a_state_that_does_not_come_raises_deadline_exceeded():
    life = Lifecycle(VirtualClock(), THREADS)
    assert wait_for_state(life, ("Unconfigured",), 0.0) == "Unconfigured"
    with pytest.raises(DeadlineExceeded, match="still Unconfigured"):
        wait_for_state(life, ("Ready",), 0.0)


# ---- DeviceLifecycle with a fake pipeline --------------------------------------------

class FakePipeline:
    """The :class:`~calfsm.engine.lifecycle.PipelineControl` a DeviceLifecycle uses, recording
    what it is asked; ``on_device`` says whether a job holds the device."""

    max_inflight = 1

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.errors: list[CalfsmError] = []
        self.counted: list[str] = []
        self.on_device = False
        self.recoveries_wanted = 0

    def recovery_wanted(self) -> None:
        self.recoveries_wanted += 1

    @property
    def inflight(self) -> int:
        return int(self.on_device)

    def fail_waiting(self, err: CalfsmError) -> None:
        self.asked.append("fail_waiting")
        self.errors.append(err)

    def hold_waiting(self, err: CalfsmError) -> None:
        self.asked.append("hold_waiting")
        self.errors.append(err)

    def wake_waiters(self) -> None:
        self.asked.append("wake_waiters")

    def capacity_freed(self) -> None:
        pass

    def kv_full(self) -> None:
        pass                        # nothing here keeps KV warm for nobody

    def device_barrier(self) -> None:
        self.asked.append("device_barrier")

    def idle_on_device(self) -> bool:
        return not self.on_device

    def completion_idle_s(self) -> float | None:
        return 0.0 if self.on_device else None

    def count(self, name: str) -> None:
        self.counted.append(name)


class Control:
    """A DeviceLifecycle on a SimDriver (virtual clock) and a :class:`FakePipeline`."""

    def __init__(self, **policy: float) -> None:
        self.driver = SimDriver(TINY, seed=0, trace=True)
        self.clock = self.driver.clock
        self.life = Lifecycle(self.clock, THREADS)
        self.pipeline = FakePipeline()
        self.device = DeviceLifecycle(
            self.driver, self.life, FaultPolicy(RecoveryPolicy(**policy), sync=THREADS),
            self.pipeline,
            build=epoch_builder(self.driver, max_inflight=1, slots_per_engine=2,
                                token_budget=None, engines=(EngineSlot.AUTO,), sync=THREADS),
            warmup=True, service=ServiceModel(TINY.timing, execution_timeout_s=None))



def test_start_configures_warms_and_reaches_ready_on_generation_1():
    c = Control()
    c.device.start(TINY, Calbin.from_manifest(TINY))
    assert c.life.state == "Ready" and c.life.generation == 1
    assert c.life.epoch is not None and c.life.epoch.generation == 1
    assert len(calls(c.driver, "configure")) == 1
    assert len(calls(c.driver, "infer")) == 2       # the warm-up golden: prefill, decode
    assert c.pipeline.asked == []                   # nothing waited: nothing asked


def test_a_drain_holds_the_waiting_work_then_recovery_brings_up_generation_2():
    c = Control(grace_period_s=1.0)
    c.device.start(TINY, Calbin.from_manifest(TINY))
    first = c.life.epoch
    c.pipeline.on_device = True
    assert c.device.begin_drain("a test fault")
    assert not c.device.begin_drain("again")        # only from Ready
    assert c.life.state == "Draining" and c.pipeline.recoveries_wanted == 1
    assert c.pipeline.asked == ["hold_waiting", "wake_waiters"]
    assert isinstance(c.pipeline.errors[0], Unavailable)
    assert not c.device.recovery_due()              # a job still holds the device ...
    c.clock.advance(1.0)
    assert c.device.recovery_due()                  # ... until the grace period ends
    c.pipeline.on_device = False
    assert c.device.recover()
    assert c.life.state == "Ready" and c.life.generation == 2
    assert first.retired and c.life.epoch is not first
    assert "device_barrier" in c.pipeline.asked and c.pipeline.counted == ["recoveries"]
    assert [call["kind"] for call in calls(c.driver, "reset")] == ["full"]
    assert not c.device.recover()                   # nothing pending any more


def test_a_stop_decision_fails_the_device_and_every_waiting_job():
    c = Control()
    c.device.start(TINY, Calbin.from_manifest(TINY))
    c.device.apply(Verdict(Decision.CONTINUE, "only the job fails"))
    assert c.life.state == "Ready" and c.pipeline.asked == []
    c.device.apply(Verdict(Decision.STOP, "runtime too old"))
    assert c.life.state == "Failed" and "runtime too old" in c.life.reason
    assert c.pipeline.asked == ["fail_waiting"]
    assert isinstance(c.pipeline.errors[0], Unavailable)
    assert c.pipeline.recoveries_wanted == 0 and not c.device.recovery_due()
