"""Liveness and readiness in the library, true under faults (issue 20, item 3).

``health().ready`` is False while a hang is suspected (a job on the device past half its
execution timeout), while draining, while recovering, and when the generation fails
every job (every CSR write rejected: the failure streak drains it, its warm-up fails
again, and it ends Failed rather than answering 500 forever). ``health().live`` is False
only when a restart is what helps: Failed, broken, or a device that held a job far past
its execution timeout. Listeners and observers never run under the lifecycle lock.
"""

from __future__ import annotations

import pytest

from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.engine.observe import Observer
from calfsm.engine.recovery import Decision, FaultPolicy, RecoveryPolicy
from calfsm.errors import (
    CalrtCode,
    ExecutorClosed,
    Internal,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
    from_calrt,
)
from calfsm.generate.sampling import SamplingParams
from calfsm.request import Request
from calfsm.runtime.stepper import StepScheduler
from calfsm.runtime.sync import THREADS
from tests.helpers.executor import HeldReset, drive, make_executor, make_sim

pytestmark = pytest.mark.timeout(60)


def _on_device(ex, sched):
    h = ex.enqueue_nowait(Request.decode(1, 5, 0))
    sched.run_until(lambda: h.state == "Submitted")
    return h


def test_a_suspected_hang_is_not_ready_and_a_long_one_is_not_live():
    """Step mode: a decode (execution timeout 1 s) held on the device while the virtual
    clock moves: ready until 0.5 s, then a suspected hang (live, not ready); past
    hang_after_s (5 s) not live; its completion then finds the timeout passed, the
    device is drained and reset, and the executor is ready and live again."""
    plan = FaultPlan.of(FaultRule("infer", "hang", seq_id=1))
    with make_executor("step", faults=plan) as ex:
        sched = StepScheduler(ex)
        h = _on_device(ex, sched)
        t0 = ex.clock.now()
        assert ex.health().ready
        ex.clock.advance_to(t0 + 0.4)
        assert ex.health().ready and not ex.health().hang_suspected
        ex.clock.advance_to(t0 + 0.6)
        health = ex.health()
        assert health.hang_suspected and not health.ready and health.live
        assert "suspected hang" in health.ready_reason
        assert health.oldest_job_s == pytest.approx(0.6)
        ex.clock.advance_to(t0 + 5.5)
        health = ex.health()
        assert not health.live and "no device progress" in health.live_reason
        sched.run_until(lambda: h.done() and ex.lifecycle_state == "Ready"
                        and ex.idle())
        health = ex.health()
        assert health.ready and health.live and health.generation == 2


def test_draining_and_recovering_are_live_but_not_ready():
    inner = make_sim("threaded")
    held = HeldReset(inner)
    held.gate.clear()
    with make_executor("threaded", driver=held) as ex:
        assert ex.recover("test")
        assert held.resetting.wait(10)
        health = ex.health()
        assert health.state == "Recovering" and not health.ready and health.live
        assert health.ready_reason.startswith("Recovering")
        held.gate.set()
        ex.wait_lifecycle("Ready", timeout=10)
        assert ex.health().ready


def test_a_device_that_rejects_every_csr_write_ends_failed_not_500_forever(mode):
    """From the first job on, every set_csr is refused NOT_FOUND, for CSRs the device
    declared: a device fault (not a request error). The first such job drains the
    generation (issue 34: not eight 500s first); the next one's warm-up is refused too,
    and the executor ends Failed: not live, not ready, and requests are refused with a
    503 without Retry-After (restart the process)."""
    plan = FaultPlan.of(FaultRule("set_csr", "code", nth=5, every=1,
                                  code=int(CalrtCode.NOT_FOUND)))
    with make_executor(mode, faults=plan) as ex:
        errors = []
        for i in range(20):
            try:
                h = ex.enqueue_nowait(Request.prefill(i, [1, 2, 3]))
            except Unavailable as e:
                errors.append(e)
                break
            drive(ex, h.done)
            errors.append(h.exception(0))
        drive(ex, lambda: ex.lifecycle_state == "Failed", timeout=30)
        assert len(errors) == 2 and not isinstance(errors[0], Internal), errors
        assert errors[0].http_status == 503 and errors[0].calrt_code == CalrtCode.NOT_FOUND
        health = ex.health()
        assert not health.live and not health.ready and health.state == "Failed"
        with pytest.raises(Unavailable) as info:
            ex.enqueue_nowait(Request.prefill(30, [1, 2, 3]))
        assert info.value.http_status == 503 and info.value.retry_after_s is None


def test_the_failure_streak_counts_device_codes_in_a_row_only():
    policy = FaultPolicy(RecoveryPolicy(failure_streak=3), sync=THREADS)
    csr = from_calrt(int(CalrtCode.NOT_FOUND), "set_csr")
    assert csr.category.value == "request"
    assert policy.decide(csr, 0.0).decision is Decision.CONTINUE
    assert policy.decide(csr, 0.0).decision is Decision.CONTINUE
    policy.succeeded()                                   # a success in between
    assert policy.decide(csr, 0.0).decision is Decision.CONTINUE
    assert policy.decide(csr, 0.0).decision is Decision.CONTINUE
    verdict = policy.decide(csr, 0.0)
    assert verdict.decision is Decision.DRAIN_AND_RESET
    assert "fails every job" in verdict.reason
    policy.reset()
    # a caller's bad request (no device code) and KV exhaustion never count
    for _ in range(5):
        assert policy.decide(InvalidArgument("bad"), 0.0).decision is Decision.CONTINUE
        full = ResourceExhausted("kv", calrt_code=int(CalrtCode.ALLOC_FAILED))
        assert policy.decide(full, 0.0).decision is Decision.CONTINUE
    assert FaultPolicy(RecoveryPolicy(failure_streak=0), sync=THREADS).decide(csr, 0.0).decision \
        is Decision.CONTINUE


def test_listeners_and_observers_never_run_under_the_lifecycle_lock(mode):
    """A recovery (drain, reset, configure, warm, ready) and a stream that waits through
    it and ends: every lifecycle listener and every observer call finds the lock free."""
    seen: list[tuple[str, bool]] = []

    with make_executor(mode) as ex:
        life = ex.lifecycle

        def listener() -> None:
            seen.append(("listener", life.holds_lock()))

        class Watch(Observer):
            def stream_ended(self, stream, result):
                seen.append(("stream_ended", life.holds_lock()))

            def stream_resumed(self, stream):
                seen.append(("stream_resumed", life.holds_lock()))

            def job_ended(self, event):
                seen.append(("job_ended", life.holds_lock()))

            def job_accepted(self, event):
                seen.append(("job_accepted", life.holds_lock()))

            def job_refused(self, error, request):
                seen.append(("job_refused", life.holds_lock()))

        life.on_change(listener)
        ex.add_observer(Watch())
        stream = ex.generate([1, 2, 3], SamplingParams(max_tokens=6))
        assert ex.recover("test")
        drive(ex, lambda: stream.done() and ex.lifecycle_state == "Ready", timeout=30)
        assert stream.result(0).error is None
    with pytest.raises(ExecutorClosed):        # refused by the lifecycle's gate
        ex.enqueue_nowait(Request.decode(1, 5, 0))
    kinds = {k for k, _ in seen}
    assert {"listener", "stream_ended", "job_ended"} <= kinds, kinds
    assert {"job_accepted", "job_refused"} <= kinds, kinds
    assert not [k for k, held in seen if held], seen
