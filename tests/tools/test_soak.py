"""Seeded soak, kept short: 1000 injected cancels, timeouts and errors through the
executor. Afterwards the golden still passes, or the executor is Failed with a reason —
never stuck, and never a lost job (every enqueued job has exactly one outcome)."""

from __future__ import annotations

import logging
import random

import pytest

from calfsm.drivers import refmodel
from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.engine.job import Request
from calfsm.engine.recovery import RecoveryPolicy
from calfsm.errors import CalfsmError, CalrtCode, Unavailable
from calfsm.executor import DeviceExecutor, ExecutorConfig
from calfsm.machines.job import JOB_MACHINE
from calfsm.runtime.stepper import StepScheduler
from tests.helpers.executor import TINY, make_sim

INJECTED = 1000
SEQS = 4
VOCAB = TINY.submodel(TINY.kinds[0]).vocab


def _plan() -> FaultPlan:
    """Periodic timeouts and errors on the workload's sequences (the warm-up golden's
    own sequence is spared, so a recovery can succeed and the soak goes on)."""
    rules = []
    for seq in range(SEQS):
        rules += [
            FaultRule("wait", "code", seq_id=seq, nth=3 + seq, every=11,
                      code=int(CalrtCode.TIMEOUT)),
            FaultRule("infer", "code", seq_id=seq, nth=5 + seq, every=13,
                      code=int(CalrtCode.DEVICE_BUSY)),
            FaultRule("infer", "code", seq_id=seq, nth=7 + seq, every=29,
                      code=int(CalrtCode.DEVICE_UNAVAILABLE)),
            FaultRule("infer", "ccu_exception", seq_id=seq, nth=9 + seq, every=31),
            FaultRule("infer", "nan", seq_id=seq, nth=11 + seq, every=37),
            FaultRule("infer", "hang", seq_id=seq, nth=13 + seq, every=41),
            FaultRule("set_csr", "code", seq_id=seq, nth=2 + seq, every=23,
                      code=int(CalrtCode.NOT_FOUND)),
        ]
    return FaultPlan(tuple(rules), "soak")


def _injected(driver) -> int:
    return sum(driver.faults_fired())


def _golden_passes(ex: DeviceExecutor, sched: StepScheduler) -> None:
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    seq = SEQS + 1
    h = ex.enqueue(Request.prefill(seq, prompt))
    sched.run_until(h.done)
    got = [h.result().greedy()]
    want_h = refmodel.chain(prompt)[-1]
    want = [refmodel.greedy(refmodel.logits_bf16(want_h, VOCAB))]
    pos = len(prompt)
    for _ in range(4):
        h = ex.enqueue(Request.decode(seq, got[-1], pos))
        sched.run_until(h.done)
        got.append(h.result().greedy())
        want_h = refmodel.step(want_h, want[-1], pos)
        want.append(refmodel.greedy(refmodel.logits_bf16(want_h, VOCAB)))
        pos += 1
    assert got == want


@pytest.mark.parametrize("seed", [11, 12])
def test_soak_1000_injected_cancels_timeouts_errors(seed, caplog):
    caplog.set_level(logging.CRITICAL)         # thousands of expected failure lines
    rng = random.Random(seed)
    driver = make_sim("step", faults=_plan(), trace=False)
    policy = RecoveryPolicy(grace_period_s=0.05, zombie_wait_s=0.05, error_budget=50,
                            budget_refill_per_s=50.0)
    ex = DeviceExecutor(driver, TINY, ExecutorConfig(
        threaded=False, execution_timeout_s=0.2, admission_timeout_s=1.0,
        queue_timeout_s=1.0, recovery=policy))
    sched = StepScheduler(ex, seed=seed)
    handles = []
    cancels = 0
    rounds = 0
    try:
        while _injected(driver) + cancels < INJECTED:
            rounds += 1
            assert rounds < 20_000, "soak made no progress"
            if ex.lifecycle_state == "Failed":
                break
            seq = rng.randrange(SEQS)
            try:
                length = ex.epoch.kv.sequence_length(seq)
                if length == 0 or rng.random() < 0.2:
                    ex.reset_sequence(seq)
                    h = ex.enqueue(Request.prefill(
                        seq, [rng.randrange(VOCAB) for _ in range(rng.randint(1, 24))]))
                else:
                    h = ex.enqueue(Request.decode(seq, rng.randrange(VOCAB), length))
            except Unavailable:
                sched.run_until(lambda: ex.lifecycle_state in ("Ready", "Failed"))
                continue
            except CalfsmError:
                # reset refused while that sequence has a job open: step and go on
                sched.step()
                continue
            handles.append(h)
            if rng.random() < 0.3:
                for _ in range(rng.randint(0, 3)):
                    sched.step()
                if h.cancel():
                    cancels += 1
            for _ in range(rng.randint(0, 6)):
                sched.step()
        sched.run_until_idle()
        sched.run_until(lambda: ex.lifecycle_state in ("Ready", "Failed"))
        assert _injected(driver) + cancels >= INJECTED or ex.lifecycle_state == "Failed"
        # never a lost job: each has exactly one outcome, and it is terminal
        for h in handles:
            assert h.done(), h
            assert JOB_MACHINE.is_terminal(h.state), h
            assert (h._result is None) != (h._error is None)
        if ex.lifecycle_state == "Failed":
            assert ex.failure_reason
        else:
            assert ex.generation > 1                     # it did recover, more than once
            _golden_passes(ex, sched)
    finally:
        ex.close(timeout=5)
    assert ex.epoch.pool.stats().leased == 0
