"""FaultPolicy: a classified error in, a decision out, read from the one error table
(``calfsm.errors.ACTIONS``) — unit-tested without an executor; then two decisions carried
out end to end (an artifact error rolls the model back; a busy device requeues)."""

from __future__ import annotations

import functools
import math

import pytest

from calfsm.drivers.base import OutputStatus
from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.engine.job import Request
from calfsm.engine.readback import is_row_failure, row_failure
from calfsm.engine.recovery import Decision, FaultPolicy, RecoveryPolicy
from calfsm.errors import (
    ACTIONS,
    CODE_TABLE,
    CalfsmError,
    CalrtCode,
    ErrorCategory,
    InvalidArgument,
    RecoveryAction,
    from_calrt,
)
from calfsm.runtime.stepper import StepScheduler
from calfsm.runtime.sync import THREADS
from tests.helpers.executor import TINY, make_executor, outcome, renamed

SEQ = 5

#: what each recovery action of the table means for the device (spec section 8),
#: written out here independently of calfsm.engine.recovery
BY_ACTION = {
    RecoveryAction.RECORD_MANIFEST_DIFF: Decision.CONTINUE,
    RecoveryAction.NO_RESET: Decision.CONTINUE,
    RecoveryAction.DRAIN_CHECK_GENERATION: Decision.DRAIN_AND_RESET,
    RecoveryAction.QUARANTINE_RESET: Decision.DRAIN_AND_RESET,
    RecoveryAction.TAINT_GENERATION: Decision.DRAIN_AND_RESET,
    RecoveryAction.ROLLBACK_MODEL: Decision.ROLL_BACK,
    RecoveryAction.OPERATOR_FIX: Decision.STOP,
    RecoveryAction.BACKOFF_THEN_DRAIN: Decision.BACK_OFF,
}

#: the decision of each category, as the issue states it
BY_CATEGORY = {
    ErrorCategory.REQUEST: Decision.CONTINUE,
    ErrorCategory.PROGRAMMING: Decision.CONTINUE,
    ErrorCategory.ARTIFACT: Decision.ROLL_BACK,
    ErrorCategory.COMPATIBILITY: Decision.STOP,
    ErrorCategory.DEVICE: Decision.DRAIN_AND_RESET,
    ErrorCategory.UNKNOWN: Decision.DRAIN_AND_RESET,
    ErrorCategory.LIFECYCLE: Decision.DRAIN_AND_RESET,
    ErrorCategory.TRANSIENT: Decision.BACK_OFF,
}


def _err(category: ErrorCategory) -> CalfsmError:
    return CalfsmError(f"a {category.value} error", category=category, stage="test")


def _busy() -> CalfsmError:
    return from_calrt(int(CalrtCode.DEVICE_BUSY), "submit")


def test_every_category_has_a_stated_decision():
    assert set(BY_CATEGORY) == set(ErrorCategory)


@pytest.mark.parametrize("category", list(ErrorCategory), ids=lambda c: c.value)
def test_decide_follows_the_error_table(category):
    policy = FaultPolicy(RecoveryPolicy(), sync=THREADS)
    verdict = policy.decide(_err(category), now=0.0)
    assert verdict.decision is BY_ACTION[ACTIONS[category].action]      # the table ...
    assert verdict.decision is BY_CATEGORY[category]                     # ... says this
    assert category.value in verdict.reason


@pytest.mark.parametrize("code", sorted(CODE_TABLE), ids=lambda c: c.name)
def test_decide_classifies_every_calrt_code_by_its_category(code):
    err = from_calrt(int(code), "submit")
    decision = FaultPolicy(sync=THREADS).decide(err, now=0.0).decision
    assert decision is BY_CATEGORY[CODE_TABLE[code][0]]


@pytest.mark.parametrize("category", [c for c in ErrorCategory
                                      if c is not ErrorCategory.TRANSIENT],
                         ids=lambda c: c.value)
def test_only_transient_errors_spend_the_budget_or_pause(category):
    policy = FaultPolicy(RecoveryPolicy(error_budget=1, budget_refill_per_s=0.0), sync=THREADS)
    for _ in range(3):
        verdict = policy.decide(_err(category), now=0.0, requeues=0)
        assert verdict.decision is BY_CATEGORY[category]     # never REQUEUE or BACK_OFF
    assert policy.backoff_until == 0.0
    assert policy.decide(_busy(), now=0.0).decision is Decision.BACK_OFF   # budget intact


def test_transient_backs_off_until_the_budget_is_spent_then_drains():
    policy = FaultPolicy(RecoveryPolicy(error_budget=3, budget_refill_per_s=0.0), sync=THREADS)
    for _ in range(3):
        assert policy.decide(_busy(), now=0.0).decision is Decision.BACK_OFF
    verdict = policy.decide(_busy(), now=0.0)
    assert verdict.decision is Decision.DRAIN_AND_RESET
    assert "budget" in verdict.reason


def test_the_budget_refills_over_time():
    policy = FaultPolicy(RecoveryPolicy(error_budget=2, budget_refill_per_s=1.0), sync=THREADS)
    assert [policy.decide(_busy(), now=0.0).decision for _ in range(3)] == [
        Decision.BACK_OFF, Decision.BACK_OFF, Decision.DRAIN_AND_RESET]
    assert policy.decide(_busy(), now=0.5).decision is Decision.DRAIN_AND_RESET  # 0.5 token
    assert policy.decide(_busy(), now=1.5).decision is Decision.BACK_OFF   # 1 more second
    assert policy.decide(_busy(), now=1.5).decision is Decision.DRAIN_AND_RESET
    # refill is capped at the budget: a long quiet spell buys error_budget pauses, no more
    assert [policy.decide(_busy(), now=1000.0).decision for _ in range(3)] == [
        Decision.BACK_OFF, Decision.BACK_OFF, Decision.DRAIN_AND_RESET]


def test_backoff_is_exponential_and_capped():
    policy = FaultPolicy(RecoveryPolicy(error_budget=10, budget_refill_per_s=0.0,
                                        backoff_base_s=0.01, backoff_max_s=0.05), sync=THREADS)
    untils = []
    for i in range(6):
        now = 10.0 * i                      # far apart: each pause is its own
        verdict = policy.decide(_busy(), now=now)
        assert verdict.decision is Decision.BACK_OFF
        assert policy.backoff_until == verdict.until
        untils.append(round(verdict.until - now, 9))
    assert untils == [0.01, 0.02, 0.04, 0.05, 0.05, 0.05]


def test_overlapping_pauses_never_shorten_the_backoff():
    policy = FaultPolicy(RecoveryPolicy(error_budget=10, backoff_base_s=0.1,
                                        backoff_max_s=1.0), sync=THREADS)
    first = policy.decide(_busy(), now=0.0).until
    second = policy.decide(_busy(), now=0.0).until
    assert (first, second) == (0.1, 0.2)
    policy.succeeded()                        # the next pause alone would end at 0.1
    assert policy.decide(_busy(), now=0.0).until == 0.2
    assert policy.backoff_until == 0.2


def test_success_restarts_the_backoff_streak():
    policy = FaultPolicy(RecoveryPolicy(error_budget=10, budget_refill_per_s=0.0,
                                        backoff_base_s=0.01, backoff_max_s=1.0), sync=THREADS)
    for _ in range(3):
        policy.decide(_busy(), now=0.0)
    assert policy.decide(_busy(), now=1.0).until == pytest.approx(1.08)  # streak 4
    policy.succeeded()
    assert policy.decide(_busy(), now=2.0).until == pytest.approx(2.01)  # streak 1 again


def test_a_rows_own_failure_fails_only_the_row_until_every_job_fails():
    """A row that ended DONE_CCU_EXCEPTION in a DONE_OK job (stage ``row``, category
    device) is not judged by the table's device row (quarantine, reset): only the row
    fails. It counts in the failure streak, so a generation failing every row of every
    job is still drained; any success in between starts the streak over."""
    row = row_failure(OutputStatus.DONE_CCU_EXCEPTION, 3, {"seq_id": SEQ})
    assert row.category is ErrorCategory.DEVICE and is_row_failure(row)
    assert FaultPolicy(sync=THREADS).decide(row, 0.0).decision \
        is Decision.DRAIN_AND_RESET  # the table
    policy = FaultPolicy(RecoveryPolicy(failure_streak=3), sync=THREADS)
    for _ in range(2):
        assert policy.row_failed(row).decision is Decision.CONTINUE
    policy.succeeded()                              # another row of the job ran well
    for _ in range(2):
        assert policy.row_failed(row).decision is Decision.CONTINUE
    verdict = policy.row_failed(row)
    assert verdict.decision is Decision.DRAIN_AND_RESET
    assert "fails every job" in verdict.reason and "row 3 of a batch job" in verdict.reason
    policy.reset()
    assert policy.row_failed(row).decision is Decision.CONTINUE
    never = FaultPolicy(RecoveryPolicy(failure_streak=0), sync=THREADS)
    assert all(never.row_failed(row).decision is Decision.CONTINUE for _ in range(20))
    assert not is_row_failure(from_calrt(int(CalrtCode.UNEXPECTED), "wait"))


def test_reset_restores_the_budget_and_clears_the_backoff():
    policy = FaultPolicy(RecoveryPolicy(error_budget=2, budget_refill_per_s=0.0,
                                        backoff_base_s=0.01), sync=THREADS)
    for _ in range(2):
        policy.decide(_busy(), now=0.0)
    assert policy.decide(_busy(), now=0.0).decision is Decision.DRAIN_AND_RESET
    policy.reset()
    assert policy.backoff_until == 0.0
    verdict = policy.decide(_busy(), now=5.0)
    assert verdict.decision is Decision.BACK_OFF
    assert verdict.until == pytest.approx(5.01)           # the streak started over too


@pytest.mark.parametrize(("requeues", "max_requeues", "decision"), [
    (None, 2, Decision.BACK_OFF),       # the device may have run it: never put back
    (0, 0, Decision.BACK_OFF),          # requeue is off by default
    (0, 2, Decision.REQUEUE),
    (1, 2, Decision.REQUEUE),
    (2, 2, Decision.BACK_OFF),          # its retries are used up
])
def test_requeue_only_when_allowed_and_below_the_limit(requeues, max_requeues, decision):
    policy = FaultPolicy(RecoveryPolicy(max_requeues=max_requeues, error_budget=5), sync=THREADS)
    verdict = policy.decide(_busy(), now=0.0, requeues=requeues)
    assert verdict.decision is decision
    assert verdict.until > 0.0                             # a requeue waits out the pause


def test_a_requeue_spends_the_budget_like_a_backoff():
    policy = FaultPolicy(RecoveryPolicy(max_requeues=5, error_budget=2,
                                        budget_refill_per_s=0.0), sync=THREADS)
    assert [policy.decide(_busy(), now=0.0, requeues=0).decision for _ in range(3)] == [
        Decision.REQUEUE, Decision.REQUEUE, Decision.DRAIN_AND_RESET]


@pytest.mark.parametrize("field", [
    "error_budget", "budget_refill_per_s", "backoff_base_s", "backoff_max_s",
    "grace_period_s", "zombie_wait_s", "progress_timeout_s", "retry_after_s",
    "max_attempts", "max_requeues"])
@pytest.mark.parametrize("value", [-1, -0.5, math.nan], ids=["-1", "-0.5", "nan"])
def test_recovery_policy_refuses_negative_and_nan(field, value):
    with pytest.raises(InvalidArgument) as e:
        RecoveryPolicy(**{field: value})
    assert f"RecoveryPolicy.{field}" in str(e.value)


def test_recovery_policy_takes_zero():
    policy = RecoveryPolicy(error_budget=0, grace_period_s=0, max_requeues=0)
    assert FaultPolicy(policy, sync=THREADS).decide(_busy(), now=0.0).decision \
        is Decision.DRAIN_AND_RESET


# ---- decisions carried out by an executor ---------------------------------------------


_outcome = functools.partial(outcome, seed=3)


def _settle(ex, predicate):
    if not ex.config.threaded:
        StepScheduler(ex, seed=4).run_until(
            lambda: ex.lifecycle_state in ("Ready", "Failed") and ex.idle() and predicate())
        return
    assert ex.wait_until(
        lambda: ex.lifecycle_state in ("Ready", "Failed") and predicate(), 20)


def test_an_artifact_error_rolls_back_to_the_last_known_good_model(mode):
    """After a switch to a second model, an artifact-category code at submit (the table:
    reject the generation, roll back) brings the previous model up again."""
    plan = FaultPlan.of(FaultRule("infer", "code", seq_id=SEQ,
                                  code=int(CalrtCode.INVALID_VALUE)))
    with make_executor(mode, faults=plan, recovery=RecoveryPolicy(grace_period_s=0.01)) as ex:
        new = renamed(TINY, "_v2")
        ex.switch_model(new)
        assert ex.epoch.manifest is new and ex.generation == 2
        err = _outcome(ex, ex.enqueue(Request.prefill(SEQ, [1, 2, 3])))
        assert err.category is ErrorCategory.ARTIFACT
        assert err.calrt_code == CalrtCode.INVALID_VALUE
        _settle(ex, lambda: ex.generation == 3)
        assert ex.lifecycle_state == "Ready", ex.failure_reason
        assert ex.epoch.manifest is TINY                  # the old model, not a retry of new
        assert ex.stats().recoveries == 1
        assert _outcome(ex, ex.enqueue(Request.prefill(SEQ + 1, [1, 2, 3]))) is None


def test_a_busy_submit_is_requeued_and_succeeds(mode):
    plan = FaultPlan.of(FaultRule("infer", "code", seq_id=SEQ,
                                  code=int(CalrtCode.DEVICE_BUSY)))
    with make_executor(mode, faults=plan,
                       recovery=RecoveryPolicy(max_requeues=2)) as ex:
        h = ex.enqueue(Request.prefill(SEQ, [1, 2, 3]))
        assert _outcome(ex, h) is None
        assert h.result(0).token_count == 3
        st = ex.stats()
        assert st.requeued == 1 and st.succeeded == 1 and st.failed == 0, st
        assert ex.lifecycle_state == "Ready" and ex.generation == 1
