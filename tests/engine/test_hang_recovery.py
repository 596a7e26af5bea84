"""A hang or device fault fails (or resumes) only what was on the device (issue 20, item 1).

- One hung job among 32 streams: the hang is caught by an execution timeout sized from
  the step's expected time (about 1 s for a 10 ms decode, not 10 s), so the 31 others,
  whose steps wait behind it, are within their admission and queue budgets: every
  stream, the hung one included, resumes on the next generation and ends with the
  reference tokens.
- Work waiting when a drain begins that starts its sequence afresh is held for the next
  generation instead of failing, and the time the executor spends out of Ready is not
  charged to its admission budget (its own deadline still holds).
- The execution timeout: derived from the manifest's timing, raised by the warm-up's
  measurement, fixed when configured.
"""

from __future__ import annotations

import pytest

from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.drivers.sim import LatencyModel, SimDriver
from calfsm.engine.stepcost import ServiceModel, WarmupTiming
from calfsm.errors import DeadlineExceeded
from calfsm.generate.sampling import SamplingParams
from calfsm.generate.streams import FinishReason
from calfsm.manifest import TaskKind
from calfsm.request import Request
from calfsm.runtime.stepper import StepScheduler
from calfsm.tools.direct import golden_prompts
from tests.helpers.executor import TINY, HeldReset, drive, make_executor, make_sim
from tests.helpers.streams import direct_runner

pytestmark = pytest.mark.timeout(120)

N_STREAMS = 32
N_TOKENS = 12
PROMPTS = [p for p in golden_prompts() if len(p) <= 256][:N_STREAMS]
GREEDY = SamplingParams(max_tokens=N_TOKENS)


@pytest.fixture(scope="module")
def want() -> list[list[int]]:
    runner = direct_runner()
    return [runner.generate(0, p, N_TOKENS) for p in PROMPTS]


def test_one_hung_job_among_32_streams_fails_none_of_the_others(mode, want):
    """Sequence 7's fourth step hangs: the device is drained and reset once; every
    stream (each on a sequence of its own, ids 0..31) ends ``length`` with the reference
    tokens, the hung one included, and nothing ends with a deadline."""
    assert len(PROMPTS) == N_STREAMS
    plan = FaultPlan.of(FaultRule("infer", "hang", seq_id=7, nth=4))
    with make_executor(mode, faults=plan) as ex:
        streams = [ex.generate(p, GREEDY) for p in PROMPTS]
        drive(ex, lambda: all(s.done() for s in streams), timeout=60)
        results = [s.result(0) for s in streams]
        assert [r.finish_reason for r in results] == [FinishReason.LENGTH] * N_STREAMS, \
            [(i, r.finish_reason, r.error) for i, r in enumerate(results) if r.error]
        assert [list(r.tokens) for r in results] == want
        assert ex.stats().recoveries == 1
        assert results[7].resumes == 1
        assert ex.health().ready


def test_a_fresh_job_waiting_at_a_drain_runs_on_the_next_generation(mode):
    """A prefill queued behind a job that hangs is not failed by the drain: it gives
    back its slot and KV, waits through the reset and runs on generation 2."""
    plan = FaultPlan.of(FaultRule("infer", "hang", seq_id=1, nth=1))
    with make_executor(mode, faults=plan, max_inflight=1, slots_per_engine=1) as ex:
        hung = ex.enqueue_nowait(Request.prefill(1, [1, 2, 3]))
        waiting = ex.enqueue_nowait(Request.prefill(2, [4, 5, 6]))
        drive(ex, lambda: waiting.done() and hung.done(), timeout=30)
        assert isinstance(hung.exception(0), DeadlineExceeded)
        result = waiting.result(0)
        assert result.generation == 2 and result.token_count == 3
        assert ex.stats().recoveries == 1


def test_time_out_of_ready_is_not_charged_to_a_waiting_jobs_admission_budget():
    """Step mode, virtual clock: a job parked for a buffer when a drain begins waits out
    a recovery that takes longer than its whole admission budget (the reset is held
    while the clock is moved on) and is still admitted afterwards."""
    inner = make_sim("step")
    held = HeldReset(inner)
    with make_executor("step", driver=held, admission_timeout_s=0.5, max_inflight=1,
                       slots_per_engine=1) as ex:
        sched = StepScheduler(ex)
        first = ex.enqueue_nowait(Request.prefill(1, [1, 2, 3]))
        parked = ex.enqueue_nowait(Request.prefill(2, [4, 5, 6]))
        sched.run_until(lambda: first.state == "Submitted")
        assert ex.recover("test")
        ex.clock.advance_to(ex.clock.now() + 5.0)      # ten admission budgets, not Ready
        sched.run_until(lambda: first.done() and parked.done())
        assert parked.exception(0) is None, parked.exception(0)
        assert parked.result(0).generation == 2


def test_a_held_jobs_own_deadline_still_holds():
    """...but the job's own deadline is not extended: it passes during the recovery."""
    with make_executor("step", max_inflight=1, slots_per_engine=1) as ex:
        sched = StepScheduler(ex)
        first = ex.enqueue_nowait(Request.prefill(1, [1, 2, 3]))
        parked = ex.enqueue_nowait(Request.prefill(2, [4, 5, 6], deadline_s=0.2))
        sched.run_until(lambda: first.state == "Submitted")
        assert ex.recover("test")
        ex.clock.advance_to(ex.clock.now() + 1.0)
        sched.run_until(parked.done)
        err = parked.exception(0)
        assert isinstance(err, DeadlineExceeded), err


# ---- the execution timeout ------------------------------------------------------------

def test_execution_timeout_is_ten_expected_steps_at_least_one_second():
    svc = ServiceModel(TINY.timing, execution_timeout_s=None)
    assert svc.execution_timeout_s(TaskKind.DECODE, 1) == 1.0          # 10 x 10 ms
    big = svc.execution_timeout_s(TaskKind.PREFILL_IDS, 8192)         # 10 ms + 1.64 s
    assert big == pytest.approx(10 * (0.010 + 8192 * 200e-6))
    assert svc.suspect_after_s(TaskKind.DECODE, 1) == 0.5


def test_a_configured_execution_timeout_is_used_as_given():
    svc = ServiceModel(TINY.timing, execution_timeout_s=3.0)
    assert svc.execution_timeout_s(TaskKind.PREFILL_IDS, 8192) == 3.0
    assert svc.execution_timeout_s(TaskKind.DECODE, 1) == 3.0


def test_a_slower_device_than_the_manifest_says_raises_the_expectation():
    """The warm-up measured 400 ms decodes: the hang detector waits 4 s, not 1 s (a
    slow device is not mistaken for a hung one); a faster one never lowers it."""
    svc = ServiceModel(TINY.timing, execution_timeout_s=None)
    svc.calibrate(WarmupTiming(3, 0.001, (0.001,)))
    assert svc.execution_timeout_s(TaskKind.DECODE, 1) == 1.0
    svc.calibrate(WarmupTiming(3, 0.5, (0.4,)))
    assert svc.execution_timeout_s(TaskKind.DECODE, 1) == pytest.approx(4.0)


def test_the_executor_calibrates_from_its_warm_up():
    """A simulated device twenty times slower than the manifest's timing (200 ms a
    decode): the executor's execution timeout for a decode follows the warm-up's
    measurement, 2 s."""
    drv = SimDriver(TINY, seed=0, latency=LatencyModel.fixed(decode_s=0.200))
    with make_executor("step", driver=drv) as ex:
        assert ex.service.execution_timeout_s(TaskKind.DECODE, 1) == pytest.approx(2.0)


def test_without_timing_a_manifest_is_assumed_slow():
    data = TINY.to_dict()
    data.pop("timing")
    untimed = type(TINY).from_dict(data)
    assert untimed.timing is None
    svc = ServiceModel(untimed.timing, execution_timeout_s=None)
    assert svc.expected_s(TaskKind.DECODE, 1) == pytest.approx(0.050)
