"""A task kind whose buffer slots are all quarantined is recovered, never starved.

A quarantined slot is lent again only by a new generation. Short outputs are output
faults (category unknown: each one drains and resets, like a NaN); quarantines by errors
that alone only fail or flag their job (a slice whose undo failed, FI15) are counted by
the pool, and the one that takes a kind's last usable slot drains and resets too: jobs
waiting for that kind get a retryable 503 at once, and the next generation serves them.
"""

from __future__ import annotations

import functools
import threading

import numpy as np

from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.engine.job import Request
from calfsm.engine.recovery import Decision, FaultPolicy
from calfsm.errors import CalrtCode, ErrorCategory
from calfsm.machines.job import JobState
from calfsm.manifest import TaskKind
from calfsm.runtime.stepper import StepScheduler
from calfsm.runtime.sync import THREADS
from tests.helpers.buffers import make_pool
from tests.helpers.executor import (
    GatedDriver,
    eventually,
    finish,
    make_executor,
    make_sim,
    outcome,
)
from tests.helpers.streams import direct_runner

SEQ = 5
PREFILL = TaskKind.PREFILL_IDS


_outcome = functools.partial(outcome, seed=3)


def _recovered(ex, generation):
    if ex.config.threaded:
        assert ex.wait_until(lambda: ex.generation >= generation
                             and ex.lifecycle_state == "Ready", 20)
    else:
        StepScheduler(ex, seed=4).run_until(
            lambda: ex.generation >= generation and ex.lifecycle_state == "Ready")
    assert ex.lifecycle_state == "Ready", ex.failure_reason


def _serves_like_the_reference(ex):
    """A prefill and a decode on a fresh sequence equal the direct path bit for bit."""
    ref = direct_runner()
    want_prefill = ref.prefill(40, [7, 8, 9])
    want_decode = ref.decode(40, 11, 3)
    got_prefill = finish(ex, ex.enqueue(Request.prefill(40, [7, 8, 9])))
    got_decode = finish(ex, ex.enqueue(Request.decode(40, 11, 3)))
    np.testing.assert_array_equal(got_prefill.logits, want_prefill)
    np.testing.assert_array_equal(got_decode.logits, want_decode)


def _nothing_stuck(ex):
    st = ex.stats()
    assert st.inflight == 0 and st.queued == 0 and st.leased == 0, st
    assert ex.stats().admitting == 0


# ---- the pool counts, the policy decides -------------------------------------------------

def test_pool_reports_once_when_the_last_slot_of_a_kind_is_quarantined():
    _, pool = make_pool(slots_per_engine=2)
    told: list[tuple[TaskKind, str]] = []
    pool.on_exhausted = lambda kind, reason: told.append((kind, reason))
    assert pool.usable(PREFILL) == 2
    first, second = pool.acquire(PREFILL), pool.acquire(PREFILL)
    decode = pool.acquire(TaskKind.DECODE)
    pool.quarantine(first, "wait timed out")
    assert told == [] and pool.usable(PREFILL) == 1
    second.slice("input_ids", 0, 4)
    assert pool.release(second) is False          # FI15: quarantined on return
    assert pool.usable(PREFILL) == 0
    assert [k for k, _ in told] == [PREFILL]
    assert "every prefill_ids buffer slot of generation 0 is quarantined" in told[0][1]
    assert "slices applied" in told[0][1]
    assert pool.release(decode) is True           # another kind is not affected
    assert pool.usable(TaskKind.DECODE) == 2 and len(told) == 1


def test_retired_pool_reports_nothing():
    _, pool = make_pool()
    told: list[TaskKind] = []
    pool.on_exhausted = lambda kind, reason: told.append(kind)
    lease = pool.acquire(PREFILL)
    pool.retire()
    assert pool.release(lease) is False           # retired, not an exhaustion
    assert told == [] and pool.usable(PREFILL) == 0


def test_policy_drains_an_exhausted_kind_without_spending_the_budget():
    policy = FaultPolicy(sync=THREADS)
    for _ in range(20):
        verdict = policy.slots_exhausted(PREFILL, "every slot is quarantined")
        assert verdict.decision is Decision.DRAIN_AND_RESET
        assert "no usable prefill_ids buffer slot left" in verdict.reason


# ---- through the executor -----------------------------------------------------------------

def test_repeated_short_outputs_recover_and_the_next_jobs_are_right(mode):
    plan = FaultPlan.of(FaultRule("infer", "short_output", seq_id=SEQ, n_bytes=64,
                                  every=1, count=3))
    with make_executor(mode, faults=plan) as ex:
        for n in range(3):
            err = _outcome(ex, ex.enqueue(Request.prefill(SEQ, [1, 2, 3])))
            assert err is not None and err.calrt_code == CalrtCode.SHAPE_MISMATCH
            assert err.category is ErrorCategory.UNKNOWN and err.stage == "output"
            _recovered(ex, 2 + n)
            ex.reset_sequence(SEQ)                # its KV went with the reset
        assert ex.stats().recoveries == 3
        assert ex.epoch.pool.usable(PREFILL) == ex.epoch.pool.stats().total // 3
        assert _outcome(ex, ex.enqueue(Request.prefill(SEQ, [1, 2, 3]))) is None
        _serves_like_the_reference(ex)
        _nothing_stuck(ex)
    assert ex.stats().leased == 0


def _exhaust_with_a_waiter(ex, gated):
    """Quarantine every prefill slot by failed slice undos (the jobs themselves succeed)
    while one more prefill waits for a buffer; returns the waiter's handle."""
    slots = ex.epoch.pool.usable(PREFILL)
    for n in range(slots - 1):
        assert _outcome(ex, ex.enqueue(Request.prefill(SEQ, [1, 2], past_len=2 * n))) is None
    assert ex.epoch.pool.usable(PREFILL) == 1 and ex.lifecycle_state == "Ready"
    gated.gate.clear()                            # the last slot's job stays on the device
    gated.submitted.clear()
    last = ex.enqueue_nowait(Request.prefill(SEQ, [1, 2], past_len=2 * (slots - 1)))
    if ex.config.threaded:
        assert gated.submitted.wait(5)
    else:
        StepScheduler(ex, seed=5).run_until(lambda: last.state == JobState.SUBMITTED)
    waiter = ex.enqueue_nowait(Request.prefill(SEQ + 1, [4, 5, 6]))
    assert not waiter.done()
    gated.gate.set()
    assert _outcome(ex, last) is None             # ran; its slot is quarantined on return
    return waiter


def test_last_usable_slot_quarantined_drains_and_recovers(mode):
    rule = FaultRule("undo_slice", "code", seq_id=SEQ, every=1)
    gated = GatedDriver(make_sim(mode, faults=FaultPlan.of(rule)))
    with make_executor(mode, driver=gated) as ex:
        waiter = _exhaust_with_a_waiter(ex, gated)
        # the waiter starts its sequence afresh: the drain holds it for the next
        # generation, where it runs (issue 20: a recovery fails only what it must)
        assert _outcome(ex, waiter) is None
        assert waiter.result(0).generation == 2
        _recovered(ex, 2)
        reasons = [r for _, _, r in ex.lifecycle.history]
        assert any("every prefill_ids buffer slot of generation 1 is quarantined" in r
                   for r in reasons), reasons
        assert ex.health().ready
        ex.reset_sequence(SEQ)
        assert _outcome(ex, ex.enqueue(Request.prefill(SEQ + 1, [4, 5, 6]))) is None
        _serves_like_the_reference(ex)
        _nothing_stuck(ex)
    assert ex.stats().leased == 0


def test_blocked_admission_is_answered_when_the_kind_is_exhausted():
    """Threaded ``enqueue`` blocks its caller for a buffer: the drain answers it too. Its
    job waits in the one admission queue like a parked one, so, starting its sequence
    afresh, it is held for the next generation and runs there (issue 20: a recovery
    fails only what it must), as in
    :func:`test_last_usable_slot_quarantined_drains_and_recovers`; its caller returns
    once it is admitted there."""
    rule = FaultRule("undo_slice", "code", seq_id=SEQ, every=1)
    gated = GatedDriver(make_sim("threaded", faults=FaultPlan.of(rule)))
    with make_executor("threaded", driver=gated) as ex:
        slots = ex.epoch.pool.usable(PREFILL)
        for n in range(slots - 1):
            assert _outcome(ex, ex.enqueue(Request.prefill(SEQ, [1], past_len=n))) is None
        gated.gate.clear()
        last = ex.enqueue(Request.prefill(SEQ, [1], past_len=slots - 1))
        assert gated.submitted.wait(5)
        handles = []
        caller = threading.Thread(target=lambda: handles.append(
            ex.enqueue(Request.prefill(SEQ + 1, [4, 5, 6]))))
        caller.start()
        assert eventually(lambda: ex.stats().admitting == 1, 5)
        gated.gate.set()
        caller.join(10)
        assert not caller.is_alive() and handles
        assert handles[0].exception(10) is None
        assert handles[0].result(0).generation == 2
        assert last.exception(10) is None
        _recovered(ex, 2)
        _nothing_stuck(ex)
