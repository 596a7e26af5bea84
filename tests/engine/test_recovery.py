"""Fault control and recovery, end to end: FI06, FI07, FI08, FI10 and FI14 in step and
threaded mode, the error budget, no-reset and failed-reset escalation, model switches."""

from __future__ import annotations

import functools
import json

import attrs
import numpy as np
import pytest

from calfsm.clock import SteppedRealClock
from calfsm.drivers.base import Calbin, Capabilities, ResetKind
from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.engine.epoch import WARMUP_SEQ
from calfsm.engine.job import Request
from calfsm.engine.recovery import RecoveryPolicy
from calfsm.errors import (
    CalfsmError,
    CalrtCode,
    DeadlineExceeded,
    ErrorCategory,
    Internal,
    ManifestError,
    Unavailable,
)
from calfsm.machines.job import JobState
from calfsm.manifest import TaskKind
from calfsm.runtime.stepper import StepScheduler
from tests.helpers.executor import (
    TINY,
    GatedDriver,
    calls,
    make_executor,
    make_sim,
    outcome,
    prefill,
    renamed,
    settle,
)

SEQ = 5



_job = functools.partial(prefill, seq=SEQ)


_prefill = _job     # the name the kv_release tests (once in test_defects.py) use


def _recovered_and_serving(ex, generation=2):
    settle(ex, lambda: ex.generation >= generation)
    assert ex.lifecycle_state == "Ready", ex.failure_reason
    assert ex.generation == generation
    r = outcome(ex, ex.enqueue(_job(seq=SEQ + 1)))
    assert r is None, r                         # new jobs succeed on the new generation
    assert ex.stats().recoveries == generation - 1


def _warmups(ex):
    """Warm-up jobs the device ran (infer on the warm-up sequence), from the trace."""
    n = 0
    for line in ex.driver.trace_lines() if hasattr(ex.driver, "trace_lines") else \
            ex.driver._inner.trace_lines():
        e = json.loads(line)
        if e.get("call") == "infer" and WARMUP_SEQ in (e.get("tag") or [None, None])[1:2]:
            n += 1
    return n


def test_fi06_submit_unavailable_stops_admission_and_recovers(mode):
    plan = FaultPlan.of(FaultRule("infer", "code", seq_id=SEQ,
                                  code=int(CalrtCode.DEVICE_UNAVAILABLE)))
    with make_executor(mode, faults=plan,
                       recovery=RecoveryPolicy(grace_period_s=0.05)) as ex:
        h = ex.enqueue(_job())
        if mode == "step":
            sched = StepScheduler(ex)
            sched.run_until(h.done)
            assert ex.lifecycle_state == "Draining"       # admission stopped at once
            with pytest.raises(Unavailable) as e:
                ex.enqueue(_job(seq=9))
            assert e.value.retry_after_s is not None and e.value.http_status == 503
        err = h.exception(20)
        assert err.calrt_code == CalrtCode.DEVICE_UNAVAILABLE
        assert err.category is ErrorCategory.DEVICE
        _recovered_and_serving(ex)
        assert h.state == JobState.FAILED
        assert _warmups(ex) == 4                         # golden re-run on generation 2


def test_fi07_wait_timeout_quarantines_no_logits_and_recovers(mode):
    plan = FaultPlan.of(FaultRule("infer", "hang", seq_id=SEQ))
    with make_executor(mode, faults=plan, execution_timeout_s=0.2,
                       recovery=RecoveryPolicy(grace_period_s=0.2, zombie_wait_s=0.05)) as ex:
        h = ex.enqueue(_job())
        err = outcome(ex, h)
        assert isinstance(err, DeadlineExceeded) and err.stage == "wait"
        assert h.state == JobState.QUARANTINED
        old = h.context.epoch
        assert h.context.kv.state == "Unknown"
        _recovered_and_serving(ex)
        assert old.retired and old is not ex.epoch
        assert old.pool.stats().quarantined >= 1        # its slot never came back
        assert ex.stats().inflight == 0                  # the reset released the device


def test_fi08_ccu_exception_although_wait_succeeded_fails_and_recovers(mode):
    plan = FaultPlan.of(FaultRule("infer", "ccu_exception", seq_id=SEQ))
    with make_executor(mode, faults=plan,
                       recovery=RecoveryPolicy(grace_period_s=0.05)) as ex:
        h = ex.enqueue(_job())
        err = outcome(ex, h)
        assert isinstance(err, Unavailable) and err.stage == "status"
        assert "DONE_CCU_EXCEPTION" in str(err)
        assert h.state == JobState.QUARANTINED
        _recovered_and_serving(ex)


@pytest.mark.parametrize("effect", ["nan", "inf"])
def test_fi10_non_finite_logits_isolate_generation_and_rerun_golden(mode, effect):
    plan = FaultPlan.of(FaultRule("infer", effect, seq_id=SEQ, index=17))
    with make_executor(mode, faults=plan,
                       recovery=RecoveryPolicy(grace_period_s=0.05)) as ex:
        warm_before = _warmups(ex)
        h = ex.enqueue(_job())
        err = outcome(ex, h)
        assert isinstance(err, Internal) and err.category is ErrorCategory.UNKNOWN
        assert "17" in str(err)                          # says where
        _recovered_and_serving(ex)
        assert _warmups(ex) == warm_before + 2           # the golden ran again


def test_a_new_generation_is_booked_before_anyone_sees_it_ready(mode):
    """Whoever sees generation 2 Ready (a lifecycle listener, a caller woken by the
    state change) finds its recovery counted and the error budget of generation 1
    gone: the books move before the state is announced. The FI10 test above read
    ``stats().recoveries`` right after it saw Ready and ran a job, and on a loaded
    machine, where the recovery thread lost the CPU between announcing Ready and
    counting, found 0."""
    busy = FaultPlan.of(FaultRule("infer", "code", seq_id=SEQ, nth=1, every=1,
                                  code=int(CalrtCode.DEVICE_BUSY)))
    policy = RecoveryPolicy(error_budget=1, budget_refill_per_s=0.0, grace_period_s=0.01)
    seen = []
    with make_executor(mode, faults=busy, recovery=policy) as ex:
        def told() -> None:
            if ex.lifecycle_state == "Ready" and ex.generation == 2:
                seen.append((ex.stats().recoveries, ex.faults.backoff_until))
        ex.lifecycle.on_change(told)
        outcome(ex, ex.enqueue(_job()))
        assert ex.faults.backoff_until > 0               # generation 1 backs off
        outcome(ex, ex.enqueue(_job()))                  # the budget is gone: recover
        settle(ex, lambda: ex.generation == 2)
        assert seen and all(got == (1, 0.0) for got in seen), seen


def test_the_executor_is_not_idle_while_a_recovery_is_under_way(mode):
    """From the drain to Ready again the lifecycle moves on its own and its warm-up
    holds a slot: ``idle()`` says False all the way, so a caller that waits for idle and
    then reads the books finds every lease back (the soak once read ``leased 1`` after
    ``idle()`` said True)."""
    seen = []
    with make_executor(mode, recovery=RecoveryPolicy(grace_period_s=0.0)) as ex:
        def told() -> None:
            if ex.lifecycle_state not in ("Ready", "Failed", "Closed"):
                seen.append((ex.lifecycle_state, ex.idle()))
        ex.lifecycle.on_change(told)
        assert ex.idle()
        assert ex.recover("test: a recovery with nothing running")
        if mode == "step":
            assert ex.lifecycle_state == "Draining" and not ex.idle()
        settle(ex, lambda: ex.generation == 2 and ex.lifecycle_state == "Ready")
        assert ex.idle() and ex.stats().leased == 0
    states = [state for state, _ in seen]
    assert {"Draining", "Recovering", "Configuring", "Warming"} <= set(states), states
    assert not any(idle for _, idle in seen), seen


def test_fi14_stale_completion_after_reset_touches_nothing_new(mode):
    plan = FaultPlan.of(FaultRule("infer", "stale", seq_id=SEQ))
    inner = make_sim(mode, faults=plan)
    # step mode: the test thread runs every step, so it simply does not run the
    # completion step until after the reset; threaded: hold the completion thread
    gated = GatedDriver(inner) if mode == "threaded" else inner
    ex = make_executor(mode, driver=gated, recovery=RecoveryPolicy(grace_period_s=0.0))
    try:
        h = ex.enqueue(_job()) if mode == "step" else None
        if mode == "step":
            sched = StepScheduler(ex)
            sched.run_until(lambda: h.state == JobState.SUBMITTED)
            assert ex.recover("test: reset under a running job")
            assert sched.steps.recover()               # grace 0: reset now, job pending
        else:
            gated.gate.clear()
            h = ex.enqueue(_job())
            assert gated.submitted.wait(5)
            assert ex.recover("test: reset under a running job")
            ex.wait_lifecycle("Ready", "Failed", timeout=20)
        assert ex.lifecycle_state == "Ready" and ex.generation == 2
        new = ex.epoch
        kv_before, pool_before = new.kv.stats(), new.pool.stats()
        if mode == "threaded":
            gated.gate.set()
        err = outcome(ex, h)
        assert isinstance(err, Unavailable) and "after a reset" in str(err)
        assert ex.stats().stale_completions == 1
        # nothing of generation 2 moved: no KV, no pool slot
        assert new.kv.stats() == kv_before and new.pool.stats() == pool_before
        assert new.kv.sequence_length(SEQ) == 0
        assert h.context.epoch is not new and h.context.generation == 1
        refused = outcome(ex, ex.enqueue(_job(seq=SEQ)))
        assert refused is not None and "lost in the reset" in str(refused)
        ex.reset_sequence(SEQ)
        r = outcome(ex, ex.enqueue(_job(seq=SEQ)))
        assert r is None                                 # the sequence works again
    finally:
        if mode == "threaded":
            gated.gate.set()
        ex.close()


def test_transient_errors_back_off_within_budget_then_drain(mode):
    busy = FaultPlan.of(FaultRule("infer", "code", seq_id=SEQ, nth=1, every=1,
                                  code=int(CalrtCode.DEVICE_BUSY)))
    policy = RecoveryPolicy(error_budget=3, budget_refill_per_s=0.0, grace_period_s=0.01)
    with make_executor(mode, faults=busy, recovery=policy) as ex:
        for i in range(3):
            err = outcome(ex, ex.enqueue(_job()))
            assert err.calrt_code == CalrtCode.DEVICE_BUSY, i
            assert ex.lifecycle_state == "Ready"          # budget lasts: back off only
        assert ex.faults.backoff_until > 0
        err = outcome(ex, ex.enqueue(_job()))
        assert err.calrt_code == CalrtCode.DEVICE_BUSY
        settle(ex, lambda: ex.generation == 2)
        assert ex.generation == 2                         # budget gone: drained and reset


def test_no_reset_capability_ends_failed_with_reason(mode):
    plan = FaultPlan.of(FaultRule("infer", "ccu_exception", seq_id=SEQ))
    drv = make_sim(mode, faults=plan, capabilities=Capabilities())
    with make_executor(mode, driver=drv, recovery=RecoveryPolicy(grace_period_s=0.01)) as ex:
        outcome(ex, ex.enqueue(_job()))
        settle(ex)
        assert ex.lifecycle_state == "Failed"
        assert "no reset" in ex.failure_reason
        with pytest.raises(Unavailable) as e:
            ex.enqueue(_job(seq=1))
        assert e.value.retry_after_s is None              # do not retry here: restart
        assert ex.health().ready is False


def test_failed_reset_ends_failed(mode):
    plan = FaultPlan.of(FaultRule("infer", "ccu_exception", seq_id=SEQ),
                        FaultRule.always("reset", "code"))
    with make_executor(mode, faults=plan, recovery=RecoveryPolicy(grace_period_s=0.01)) as ex:
        outcome(ex, ex.enqueue(_job()))
        settle(ex)
        assert ex.lifecycle_state == "Failed"
        assert "reset" in ex.failure_reason and "failed" in ex.failure_reason


def test_health_reports_state_generation_and_heartbeats(mode):
    with make_executor(mode) as ex:
        h = ex.health()
        assert h.ready and h.state == "Ready" and h.generation == 1
        assert h.inflight == 0 and h.queue_depth == 0
        assert h.submitter_heartbeat <= ex.clock.now()


def test_wedged_device_never_looks_healthy():
    """A job on the device and no completion progress past the threshold: health() turns
    the executor into a drain (a device fault), it does not keep saying ready."""
    clock = SteppedRealClock()
    inner = make_sim("threaded", clock=clock)
    gated = GatedDriver(inner)
    ex = make_executor("threaded", driver=gated, execution_timeout_s=60,
                       recovery=RecoveryPolicy(progress_timeout_s=0.05, grace_period_s=0.01))
    try:
        gated.gate.clear()
        ex.enqueue(_job())
        assert gated.waiting.wait(5)
        clock.jump(1.0)                          # as if the wait had hung for a second
        h = ex.health()
        # the wedged generation is never reported ready: health() drained it. Its grace is
        # 0.01 s, so on a loaded machine the recovery thread may have brought generation 2
        # up before the snapshot is read: that one may say ready, generation 1 never
        assert not (h.ready and h.generation == 1), h
        assert h.generation > 1 or h.state != "Ready", h
    finally:
        gated.gate.set()
        ex.close()


# ---- model switch --------------------------------------------------------------------

def test_model_switch_to_a_good_artifact(mode):
    with make_executor(mode, recovery=RecoveryPolicy(grace_period_s=0.01)) as ex:
        new = renamed(TINY, "_v2")
        ex.driver.add_calbin(Calbin.from_manifest(new)) if hasattr(
            ex.driver, "add_calbin") else None
        ex.switch_model(new)
        assert ex.lifecycle_state == "Ready" and ex.generation == 2
        assert ex.epoch.manifest is new
        assert outcome(ex, ex.enqueue(_job())) is None


def test_model_switch_host_side_mismatch_keeps_old_serving(mode):
    with make_executor(mode) as ex:
        new = renamed(TINY, "_v2")
        broken = Calbin.from_manifest(new).replace_model(
            new.submodels[1].exact_name, name=new.submodels[1].exact_name + "x")
        with pytest.raises(ManifestError) as e:
            ex.switch_model(new, broken)
        assert "missing" in str(e.value) and "unexpected" in str(e.value)
        assert ex.lifecycle_state == "Ready" and ex.generation == 1   # untouched
        assert outcome(ex, ex.enqueue(_job())) is None


def test_model_switch_broken_artifact_rolls_back_and_names_problem(mode):
    # the device refuses the new calbin when configuring it (2nd configure call)
    plan = FaultPlan.of(FaultRule("configure", "code", nth=2,
                                  code=int(CalrtCode.INVALID_CALBIN)))
    with make_executor(mode, faults=plan, recovery=RecoveryPolicy(grace_period_s=0.01)) as ex:
        new = renamed(TINY, "_v2")
        with pytest.raises(ManifestError) as e:
            ex.switch_model(new)
        msg = str(e.value)
        assert "INVALID_CALBIN" in msg and "rolled back" in msg
        assert e.value.category is ErrorCategory.ARTIFACT
        assert ex.lifecycle_state == "Ready"
        assert ex.epoch.manifest is TINY                  # the last known-good model
        assert outcome(ex, ex.enqueue(_job())) is None    # ... keeps serving


def test_switch_needs_configuration_reset(mode):
    caps = Capabilities(resets=frozenset({ResetKind.CCU}))
    drv = make_sim(mode, capabilities=caps)
    with make_executor(mode, driver=drv) as ex:
        with pytest.raises(Exception, match="configuration or full reset"):
            ex.switch_model(renamed(TINY, "_v2"))
        assert ex.lifecycle_state == "Ready"


def test_unknown_kv_sequence_refused_until_reset_others_keep_working():
    """A failure after submit leaves that sequence Unknown; it is refused with a clear
    error until the caller resets it, and other sequences are unaffected. A short output
    is an output fault of the device (category unknown, like a NaN): the generation is
    drained and reset, and the refusal outlives the recovery."""
    plan = FaultPlan.of(FaultRule("infer", "short_output", seq_id=SEQ, n_bytes=64))
    with make_executor("step", faults=plan) as ex:
        err = outcome(ex, ex.enqueue(_job()))
        assert err.calrt_code == CalrtCode.SHAPE_MISMATCH
        assert err.category is ErrorCategory.UNKNOWN
        _recovered_and_serving(ex)
        again = outcome(ex, ex.enqueue(_job()))
        assert again is not None and "reset" in str(again)
        assert outcome(ex, ex.enqueue(_job(seq=SEQ + 1))) is None
        ex.reset_sequence(SEQ)
        assert outcome(ex, ex.enqueue(_job())) is None


def test_fi09_short_output_written_nowhere_past_target(mode):
    plan = FaultPlan.of(FaultRule("infer", "short_output", seq_id=SEQ, n_bytes=100))
    target = np.full(1500, 3.0, dtype=np.float32)
    with make_executor(mode, faults=plan) as ex:
        h = ex.enqueue(Request.prefill(SEQ, [1, 2, 3], target=target))
        err = outcome(ex, h)
        assert err.calrt_code == CalrtCode.SHAPE_MISMATCH
        assert np.all(target[1024:] == 3.0)


def test_a_short_output_that_covers_the_row_is_still_an_output_fault(mode):
    """A one-token prefill reads row 0 of the 16-row tile: an output of exactly one row
    covers it, and was accepted before issue 20 (the same fault failed a prompt whose
    last token fell in row 1). Any size but the tensor's is the device's output fault:
    quarantined, category unknown, the generation drained and reset."""
    vocab = TINY.submodel(TaskKind.PREFILL_IDS).vocab
    plan = FaultPlan.of(FaultRule("infer", "short_output", seq_id=SEQ, n_bytes=vocab * 2))
    with make_executor(mode, faults=plan) as ex:
        err = outcome(ex, ex.enqueue(_job(tokens=(7,))))
        assert err is not None and err.category is ErrorCategory.UNKNOWN
        assert err.calrt_code == CalrtCode.SHAPE_MISMATCH and err.stage == "output"
        assert f"short output: device reports {vocab * 2} bytes" in err.message
        _recovered_and_serving(ex)


def test_recovery_policy_is_frozen_data():
    p = RecoveryPolicy()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        p.grace_period_s = 3


def test_sequences_with_kv_are_refused_after_a_reset_until_reset(mode):
    """The device lost every KV word in the reset: continuing a sequence would silently
    read an empty cache, so the new generation refuses it with the reason."""
    with make_executor(mode, recovery=RecoveryPolicy(grace_period_s=0.01)) as ex:
        assert outcome(ex, ex.enqueue(_job(seq=3))) is None
        assert ex.recover("operator asked")
        settle(ex, lambda: ex.generation == 2)
        err = outcome(ex, ex.enqueue(Request.decode(3, 7, 3)))
        assert err is not None and "lost in the reset of generation 1" in str(err)
        assert err.http_status == 400
        ex.reset_sequence(3)
        assert outcome(ex, ex.enqueue(_job(seq=3))) is None


def test_close_during_recovery_stops_it_cleanly():
    """close() while the recovery thread is inside its warm-up: the recovery stops at its
    next step (no IllegalTransition in a thread, no Failed), the lifecycle ends Closed and
    no lease stays out."""
    import threading

    class WarmupGate(GatedDriver):
        def wait(self, out, timeout_s):
            if threading.current_thread().name == "calfsm-recovery":
                self.waiting.set()
                assert self.gate.wait(30)
            return self._inner.wait(out, timeout_s)

    gated = WarmupGate(make_sim("threaded"))
    ex = make_executor("threaded", driver=gated, recovery=RecoveryPolicy(grace_period_s=0.0))
    errors = []
    old_hook = threading.excepthook
    threading.excepthook = lambda args: errors.append(args.exc_value)
    try:
        gated.gate.clear()
        gated.waiting.clear()
        assert ex.recover("test")
        assert gated.waiting.wait(10)             # the recovery is inside its warm-up
        closer = threading.Thread(target=ex.close, kwargs={"timeout": 10})
        closer.start()
        gated.gate.set()
        closer.join(20)
        assert not closer.is_alive()
        assert not errors, errors
        assert ex.lifecycle_state == "Closed"
        assert ex.epoch.pool.stats().leased == 0
    finally:
        gated.gate.set()
        threading.excepthook = old_hook


def test_calfsm_run_exits_3_when_the_device_cannot_be_recovered(monkeypatch, capsys):
    """A supervisor restarts the process on exit status 3: the executor ended Failed."""
    from calfsm.tools import cli

    def no_reset_driver(name, manifest, *, faults, seed, latency):
        plan = FaultPlan.of(FaultRule("infer", "ccu_exception", seq_id=0))
        return make_sim("threaded", faults=plan, manifest=manifest,
                        capabilities=Capabilities())

    monkeypatch.setattr(cli, "build_driver", no_reset_driver)
    rc = cli.main(["run", "--manifest", "tiny", "--prompts", "2", "--sequences", "1",
                   "--tokens", "2", "--quiet"])
    out = capsys.readouterr().out
    assert rc == cli.EXIT_DEVICE_FAILED == 3
    assert "no reset" in out


def test_a_driver_that_raises_cannot_stop_the_pipeline():
    """Drivers must return codes, but one that raises (a bug, a binding error) must not
    kill the completion thread: the job fails with a classified error, the generation is
    recovered, later jobs succeed."""

    class Raising(GatedDriver):
        armed = False                     # armed after start-up (the warm-up calls it)

        def status(self, out):
            if self.armed:
                self.armed = False
                raise RuntimeError("binding bug")
            return self._inner.status(out)

    drv = Raising(make_sim("threaded"))
    with make_executor("threaded", driver=drv,
                       recovery=RecoveryPolicy(grace_period_s=0.01)) as ex:
        drv.armed = True
        err = ex.enqueue(_job()).exception(10)
        assert isinstance(err, Internal) and "binding bug" in str(err)
        assert err.category is ErrorCategory.UNKNOWN
        ex.wait_lifecycle("Ready", timeout=10)
        assert ex.enqueue(_job(seq=SEQ + 1)).result(10).token_count == 3
        assert ex.stats().inflight == 0


# ---- kv_release codes (from the issue #12 defects) --------------------------------

_LOST = int(CalrtCode.DEVICE_UNAVAILABLE)


@pytest.mark.parametrize("reset", [ResetKind.CONFIGURATION, ResetKind.CCU])
def test_defect_kv_release_refused_after_a_partial_reset_is_retried(mode, reset):
    plan = FaultPlan.of(FaultRule("kv_release", "code", seq_id=SEQ, code=_LOST))
    drv = make_sim(mode, faults=plan, capabilities=Capabilities(resets=frozenset({reset})))
    with make_executor(mode, driver=drv, recovery=RecoveryPolicy(grace_period_s=0.01)) as ex:
        assert outcome(ex, ex.enqueue(_prefill())) is None     # SEQ holds KV now
        assert ex.recover("operator asked")
        settle(ex, lambda: ex.stats().recoveries == 1)
        assert ex.lifecycle_state == "Ready", ex.failure_reason
        released = [c["rc"] for c in calls(drv, "kv_release") if c["seq"] == SEQ]
        assert released == [_LOST, 0]                 # refused, then released after a reset
        assert [c["kind"] for c in calls(drv, "reset")] == [reset.value] * 2


@pytest.mark.parametrize("reset", [ResetKind.CONFIGURATION, ResetKind.CCU])
def test_defect_kv_release_always_refused_after_a_partial_reset_ends_failed(mode, reset):
    plan = FaultPlan.of(FaultRule.always("kv_release", "code", seq_id=SEQ, code=_LOST))
    drv = make_sim(mode, faults=plan, capabilities=Capabilities(resets=frozenset({reset})))
    with make_executor(mode, driver=drv, recovery=RecoveryPolicy(grace_period_s=0.01)) as ex:
        assert outcome(ex, ex.enqueue(_prefill())) is None
        assert ex.recover("operator asked")
        settle(ex)
        assert ex.lifecycle_state == "Failed"          # before: Ready, as if released
        assert "DEVICE_UNAVAILABLE" in ex.failure_reason
        assert "kv_release" in ex.failure_reason
        assert ex.health().ready is False


def test_defect_warmup_kv_release_failure_fails_startup(mode):
    plan = FaultPlan.of(FaultRule.always("kv_release", "code", seq_id=WARMUP_SEQ,
                                         code=_LOST))
    with pytest.raises(CalfsmError) as e:
        make_executor(mode, faults=plan).close()
    assert "DEVICE_UNAVAILABLE" in str(e.value)
    assert e.value.category is ErrorCategory.DEVICE
