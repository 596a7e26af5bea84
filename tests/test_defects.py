"""Issue #12, item 4: one named test per executor v2 defect, each failing on the code
before the restructure (a93951f). Both modes where the defect is not about threads;
threaded timing is held with GatedDriver and events, never with sleeps."""

from __future__ import annotations

import contextlib
import gc
import logging
import queue
import sys
import threading
import weakref
from collections import Counter
from typing import Any

import attrs
import pytest

from calfsm.clock import SteppedRealClock
from calfsm.drivers.base import Capabilities, ResetKind
from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.drivers.sim import LatencyModel
from calfsm.epoch import WARMUP_SEQ
from calfsm.errors import (
    CalfsmError,
    CalrtCode,
    Cancelled,
    ErrorCategory,
    ExecutorBroken,
    ExecutorClosed,
    Unavailable,
)
from calfsm.job import JobHandle, Request
from calfsm.pipeline import Pipeline
from calfsm.recovery import RecoveryPolicy
from calfsm.scheduler import StepScheduler
from tests.executor_helpers import (
    GatedDriver,
    calls,
    eventually,
    finish,
    hold_on_device,
    make_executor,
    make_sim,
)

SEQ = 5



@pytest.fixture
def thread_errors(monkeypatch):
    """Exceptions that escaped any thread during the test (``threading.excepthook``)."""
    errors: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    return errors


def _prefill(seq=SEQ, tokens=(1, 2, 3)):
    return Request.prefill(seq, list(tokens))


def outcome(ex, handle, timeout=20.0):
    """The job's error, or None if it succeeded (step mode: drive it there first)."""
    if not ex.config.threaded:
        StepScheduler(ex, seed=2).run_until(handle.done)
    return handle.exception(timeout)


def settle(ex, predicate=None, timeout=20.0):
    """Until Ready or Failed, idle, and ``predicate()`` holds."""
    if not ex.config.threaded:
        StepScheduler(ex, seed=1).run_until(
            lambda: ex.lifecycle_state in ("Ready", "Failed") and ex.idle()
            and (predicate is None or predicate()))
        return
    ex.wait_lifecycle("Ready", "Failed", timeout=timeout)
    if predicate is not None:
        assert ex.wait_until(predicate, timeout)


class _Call(threading.Thread):
    """Run ``fn(*args, **kw)`` on a thread of its own; ``value`` or ``error`` after."""

    def __init__(self, fn, *args, **kw) -> None:
        super().__init__(name=f"test-{fn.__name__}", daemon=True)
        self._fn, self._args, self._kw = fn, args, kw
        self.value: Any = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.value = self._fn(*self._args, **self._kw)
        except BaseException as e:      # reported to the test
            self.error = e


def _on_closing(ex) -> threading.Event:
    """An event set as soon as ``close()`` has begun (the lifecycle's change listener)."""
    began = threading.Event()
    ex.lifecycle.on_change(lambda: began.set() if ex.lifecycle.closing else None)
    return began


# ---- 1. --max-inflight 2 --sequences 4 ------------------------------------------------

def _four_sequences(ex, seqs, decodes):
    """A prefill and ``decodes`` greedy decodes on each of ``seqs``, interleaved: threaded,
    one caller thread per sequence; step mode, one round of jobs at a time. The errors."""
    if ex.config.threaded:
        def chat(seq):
            r = ex.enqueue(_prefill(seq, (1 + seq, 2, 3))).result(30)
            for pos in range(3, 3 + decodes):
                r = ex.enqueue(Request.decode(seq, r.greedy(), pos)).result(30)
            return r
        callers = [_Call(chat, s) for s in seqs]
        for c in callers:
            c.join(60)
        return [c.error for c in callers if c.error is not None or c.is_alive()]
    handles = [ex.enqueue(_prefill(s, (1 + s, 2, 3))) for s in seqs]
    errors = []
    for pos in range(3, 4 + decodes):
        StepScheduler(ex, seed=pos).run_until(
            lambda hs=handles: all(h.done() for h in hs))
        errors += [h.exception(0) for h in handles if h.exception(0) is not None]
        if errors or pos == 3 + decodes:
            break
        handles = [ex.enqueue(Request.decode(h.seq_id, h.result(0).greedy(), pos))
                   for h in handles]
    return errors


def test_defect_max_inflight_2_runs_one_and_says_why(mode, caplog):
    """Two jobs in flight once landed on one engine by job-id parity: DEVICE_BUSY, then a
    recovery with no fault. Job 1 is held on the device, job 2 is refused at enqueue (its
    id is spent), job 3 (job 1's parity) waits behind job 1; then four sequences run."""
    caplog.set_level(logging.WARNING, logger="calfsm")
    clock = SteppedRealClock()      # threaded: job 1 keeps the device busy until a jump
    gated = GatedDriver(make_sim(mode) if mode == "step" else make_sim(
        mode, clock=clock, latency=LatencyModel.fixed(decode_s=0.0,
                                                      prefill_per_token_s=1e-3)))
    with make_executor(mode, driver=gated, max_inflight=2) as ex:
        try:
            first = hold_on_device(ex, gated, _prefill(seq=0, tokens=[1] * 2000))
            refused = ex.enqueue(_prefill(seq=9, tokens=(1_000_000,)))  # not in the vocab
            behind = ex.enqueue(_prefill(seq=1))
            if mode == "step":
                ex.steps.submit()       # a second submit while job 1 is on the device
            else:                       # the submitter's chance to send job 3 beside
                eventually(behind.done, 0.05)   # job 1: it must stay queued, however long
            assert not behind.done(), behind.exception(0)
            clock.jump(5.0)             # job 1's 2 s of device time are over
        finally:
            gated.gate.set()
        assert outcome(ex, refused).category is ErrorCategory.REQUEST
        assert outcome(ex, first) is None and outcome(ex, behind) is None
        assert _four_sequences(ex, (10, 11, 12, 13), decodes=6) == []
        st = ex.stats()
        assert st.succeeded == 2 + 4 * 7 and st.failed == 1 and st.quarantined == 0, st
        assert st.recoveries == 0 and ex.generation == 1   # no fault, no recovery
        health = ex.health()
        assert health.ready and health.max_inflight == 1
        assert any("max_inflight=2" in n and "parallel_two_in_flight" in n
                   and "claimed" in n for n in health.notes), health.notes
        ex.health()
    said = [r for r in caplog.records if "max_inflight=2" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, said


# ---- 2. parallel mode after a full reset ----------------------------------------------

def test_defect_max_inflight_2_keeps_serving_after_a_full_reset(mode):
    with make_executor(mode, max_inflight=2,
                       recovery=RecoveryPolicy(grace_period_s=0.01)) as ex:
        assert outcome(ex, ex.enqueue(_prefill(seq=1))) is None
        assert ex.recover("operator asked")
        settle(ex, lambda: ex.generation == 2)
        assert ex.lifecycle_state == "Ready" and ex.health().ready
        for seq in (2, 3, 4, 5):                  # before: each failed UNSUPPORTED
            assert outcome(ex, ex.enqueue(_prefill(seq=seq))) is None, seq
        assert ex.stats().recoveries == 1 and ex.generation == 2
        assert ex.health().ready and ex.health().max_inflight == 1


# ---- 3. close() during a recovery -----------------------------------------------------

class _ResetGate(GatedDriver):
    """Once armed, ``reset`` blocks until the test releases it."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.armed = False
        self.resetting = threading.Event()
        self.release = threading.Event()

    def reset(self, kind: Any) -> int:
        if self.armed:
            self.resetting.set()
            if not self.release.wait(30):
                raise AssertionError("test never released the reset")
        return self._inner.reset(kind)


def test_defect_close_while_the_device_resets_ends_closed(thread_errors):
    drv = _ResetGate(make_sim("threaded"))
    ex = make_executor("threaded", driver=drv, recovery=RecoveryPolicy(grace_period_s=0.0))
    closing = _on_closing(ex)
    drv.armed = True
    try:
        assert ex.recover("operator asked")
        assert drv.resetting.wait(10)             # the recovery thread is inside reset
        closer = _Call(ex.close, timeout=10)
        assert closing.wait(10)                   # close() began while resetting
    finally:
        drv.release.set()
    closer.join(20)
    assert not closer.is_alive() and closer.error is None, closer.error
    assert ex.lifecycle_state == "Closed"          # not Draining, not Failed
    assert ex.generation == 1 and not thread_errors, thread_errors


def test_defect_close_right_after_recover_never_joins_an_unstarted_thread(
        monkeypatch, thread_errors):
    ex = make_executor("threaded", recovery=RecoveryPolicy(grace_period_s=0.0))
    closing = _on_closing(ex)
    starting = threading.Event()
    real_start = threading.Thread.start

    def start(self):            # hold the recovery thread until close() has begun
        if self.name == "calfsm-recovery":
            starting.set()
            closing.wait(10)
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    recoverer = _Call(ex.recover, "operator asked")
    assert starting.wait(10)
    ex.close(timeout=10)       # before: RuntimeError: cannot join thread before it is started
    recoverer.join(10)
    assert recoverer.error is None and recoverer.value is True
    assert ex.lifecycle_state == "Closed"
    assert ex.generation == 1 and not thread_errors, thread_errors


# ---- 4. a dead worker -----------------------------------------------------------------

def _kill_submitter_when_armed(monkeypatch) -> threading.Event:
    """Make the submitter's loop raise outside its per-step guard once armed and a job is
    queued (so the crash always meets a queued job). Patched on the public class: there
    is one executor in the test."""
    armed = threading.Event()
    real = Pipeline.take_expired

    def take_expired(self):
        if armed.is_set() and self.has_queued() \
                and threading.current_thread().name == "calfsm-submitter":
            raise RuntimeError("injected: the submitter loop crashed")
        return real(self)

    monkeypatch.setattr(Pipeline, "take_expired", take_expired)
    return armed


def test_defect_a_dead_submitter_fails_pending_jobs_and_says_so(monkeypatch):
    gated = GatedDriver(make_sim("threaded"))
    ex = make_executor("threaded", driver=gated)
    armed = _kill_submitter_when_armed(monkeypatch)
    try:
        on_device = hold_on_device(ex, gated, _prefill(seq=1))
        assert gated.waiting.wait(5)
        armed.set()
        queued = ex.enqueue(_prefill(seq=2))      # wakes the submitter, which dies
        for h in (queued, on_device):
            err = h.exception(10)                 # before: waited forever
            assert isinstance(err, ExecutorBroken), err
            assert "submitter" in str(err) and "injected" in str(err)
        health = ex.health()
        assert health.broken is not None and "submitter" in health.broken
        assert health.ready is False
        with pytest.raises(ExecutorBroken):
            ex.enqueue(_prefill(seq=3))
    finally:
        gated.gate.set()
    closer = _Call(ex.close, timeout=5)
    closer.join(20)
    assert not closer.is_alive() and closer.error is None, closer.error


@pytest.mark.parametrize("slots", [
    pytest.param(2, id="slot-freed-by-the-break"),
    pytest.param(1, id="no-slot"),
])
def test_defect_a_dead_submitter_fails_jobs_still_in_admission(monkeypatch, slots):
    """A caller is blocked waiting for a prefill slot when the submitter dies. With two
    slots the break fails the queued job, whose slot the blocked caller then gets; with
    one, the only slot stays quarantined on the device. Either way it must end, promptly,
    with ExecutorBroken."""
    gated = GatedDriver(make_sim("threaded"))
    ex = make_executor("threaded", driver=gated, slots_per_engine=slots,
                       admission_timeout_s=60)
    armed = _kill_submitter_when_armed(monkeypatch)
    try:
        first = ex.enqueue(_prefill(seq=0)).result(10)         # KV for a decode below
        gated.waiting.clear()                 # set by that job's wait
        hold_on_device(ex, gated, _prefill(seq=1))
        assert gated.waiting.wait(5)          # the completion thread waits for seq 1
        if slots == 2:
            ex.enqueue(_prefill(seq=2))       # queued: both prefill slots are out now
        blocked = _Call(ex.enqueue, _prefill(seq=3))          # waits for a prefill slot
        assert eventually(lambda: ex.epoch.pool.stats().waiting == 1)
        armed.set()
        with contextlib.suppress(ExecutorBroken):   # a decode slot is free: queued,
            ex.enqueue(Request.decode(0, first.greedy(), 3))   # it wakes the submitter
        assert eventually(lambda: ex.health().broken is not None)
        blocked.join(2)
        assert not blocked.is_alive(), "a job in admission still waits after the break"
        assert eventually(blocked.value.done, 2), "a job admitted after the break waits"
        err = blocked.value.exception(0)
        assert isinstance(err, ExecutorBroken), err
    finally:
        gated.gate.set()
        ex.close(timeout=5)


# ---- 5. counters under concurrency ----------------------------------------------------

def test_defect_counters_add_up_under_concurrent_enqueue_and_cancel(thread_errors):
    """Four threads enqueue, two others cancel every other job, while a job holds the
    device (so every cancel lands before submit); then everything runs, some jobs
    meeting DEVICE_BUSY. Every counter matches the outcomes the callers saw."""
    producers, per_producer = 4, 16
    busy = FaultPlan.of(FaultRule("infer", "code", nth=4, every=5, count=4,
                                  code=int(CalrtCode.DEVICE_BUSY)))
    gated = GatedDriver(make_sim("threaded", faults=busy))
    ex = make_executor("threaded", driver=gated, token_budget=100_000,
                       slots_per_engine=producers * per_producer + 2)
    handles: queue.Queue[JobHandle] = queue.Queue()
    mine: list[JobHandle] = []
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)                 # many more thread switches, so races show
    try:
        mine.append(hold_on_device(ex, gated, _prefill(seq=0)))

        def produce(p):
            for i in range(per_producer):
                handles.put(ex.enqueue(_prefill(seq=1 + p * per_producer + i)))

        def cancel():
            while (h := handles.get()) is not None:
                mine.append(h)
                if h.job_id % 2:
                    assert h.cancel()

        cancellers = [_Call(cancel) for _ in range(2)]
        for p in [_Call(produce, p) for p in range(producers)]:
            p.join(30)
            assert p.error is None, p.error
        for _ in cancellers:
            handles.put(None)
        for c in cancellers:
            c.join(30)
            assert c.error is None, c.error
    finally:
        sys.setswitchinterval(switch)
        gated.gate.set()
    try:
        errors = [h.exception(30) for h in mine]
        assert ex.wait_until(ex.idle, 10)
        st = ex.stats()
    finally:
        ex.close()
    failures = [e for e in errors if e is not None]
    assert len(mine) == 1 + producers * per_producer == st.accepted
    assert st.accepted == st.succeeded + st.failed + st.cancelled + st.quarantined, st
    assert st.succeeded == errors.count(None)
    assert st.cancelled == sum(isinstance(e, Cancelled) for e in failures) \
        == producers * per_producer // 2
    assert st.failed + st.quarantined == sum(not isinstance(e, Cancelled) for e in failures)
    assert any(e.calrt_code == CalrtCode.DEVICE_BUSY for e in failures)
    assert st.errors_by_category == Counter(e.category.value for e in failures), st
    assert sum(st.errors_by_category.values()) == st.failed + st.cancelled + st.quarantined
    assert st.leased == 0 and not thread_errors, thread_errors


def test_defect_a_cancel_after_submit_counts_its_error_category(mode):
    gated = GatedDriver(make_sim(mode))
    with make_executor(mode, driver=gated) as ex:
        h = hold_on_device(ex, gated, _prefill())
        assert h.cancel()
        gated.gate.set()
        assert isinstance(outcome(ex, h), Cancelled)
        st = ex.stats()
        assert st.cancelled == 1
        assert st.errors_by_category == {"request": 1}, st


# ---- 6. kv_release codes --------------------------------------------------------------

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


# ---- 7. a closed executor -------------------------------------------------------------

def test_defect_a_closed_executor_raises_executor_closed_not_a_device_error(mode):
    ex = make_executor(mode)
    ex.close()
    for call in (ex.enqueue, ex.decode_sync):
        with pytest.raises(ExecutorClosed) as e:
            call(_prefill())
        assert isinstance(e.value, Unavailable)          # old callers still catch it
        assert e.value.category is ErrorCategory.PROGRAMMING
    # a device that failed is a device error, not a closed executor
    plan = FaultPlan.of(FaultRule("infer", "ccu_exception", seq_id=SEQ))
    drv = make_sim(mode, faults=plan, capabilities=Capabilities())
    with make_executor(mode, driver=drv,
                       recovery=RecoveryPolicy(grace_period_s=0.01)) as failed:
        outcome(failed, failed.enqueue(_prefill()))
        settle(failed)
        assert failed.lifecycle_state == "Failed"
        with pytest.raises(Unavailable) as e:
            failed.enqueue(_prefill(seq=1))
        assert not isinstance(e.value, ExecutorClosed)
        assert e.value.category is ErrorCategory.DEVICE


# ---- 8. no per-job reference cycle ----------------------------------------------------

def _handles_alive() -> int:
    """JobHandles the interpreter holds, counted without collecting anything."""
    return sum(type(o) is JobHandle for o in gc.get_objects())


def test_defect_no_job_needs_the_cycle_collector(mode):
    with make_executor(mode) as ex:
        tok = finish(ex, ex.enqueue(_prefill())).greedy()
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            handles_before = _handles_alive()
            contexts = []
            for pos in range(3, 203):
                h = ex.enqueue(Request.decode(SEQ, tok, pos))
                contexts.append(weakref.ref(h.context))
                tok = finish(ex, h).greedy()
            del h
            # one more job: every worker's locals move past the 200 watched ones
            finish(ex, ex.enqueue(_prefill(seq=SEQ + 1)))
            alive = sum(ref() is not None for ref in contexts)
            assert alive == 0, f"{alive} of 200 JobContexts need the cycle collector"
            assert _handles_alive() == handles_before
        finally:
            if was_enabled:
                gc.enable()


# ---- 9. completion order (spec 6.5) ---------------------------------------------------

def test_defect_completion_resolves_before_it_returns_the_lease(mode):
    gated = GatedDriver(make_sim(mode))
    with make_executor(mode, driver=gated) as ex:
        seen: dict[str, Any] = {}

        def observe(handle):
            epoch = ex.epoch
            seen["leased"] = epoch.pool.stats().leased
            seen["kv_len"] = epoch.kv.sequence_length(SEQ)
            seen["kv_state"] = handle.context.kv.state
            seen["undone"] = len(calls(gated, "undo_slice")) - undone_before

        undone_before = len(calls(gated, "undo_slice"))
        h = hold_on_device(ex, gated, _prefill())
        h.add_done_callback(observe)
        gated.gate.set()
        result = finish(ex, h)
        assert result.token_count == 3
        assert seen["kv_len"] == 3 and seen["kv_state"] == "Committed"   # KV committed,
        assert seen["undone"] == 2                     # the slices undone,
        assert seen["leased"] == 1                     # the lease still out at resolve
        assert eventually(lambda: ex.epoch.pool.stats().leased == 0)   # then returned


# ---- 10. timings (S11) ----------------------------------------------------------------

def test_defect_each_result_keeps_its_own_timings(mode):
    with make_executor(mode) as ex:
        a = finish(ex, ex.enqueue(_prefill(seq=1)))
        kept = attrs.asdict(a.timings)
        b = finish(ex, ex.enqueue(_prefill(seq=2)))
        tok = b.greedy()
        for pos in range(3, 8):
            tok = finish(ex, ex.enqueue(Request.decode(2, tok, pos))).greedy()
        assert a.timings is not b.timings
        assert attrs.asdict(a.timings) == kept            # later jobs changed nothing
        assert a.timings.completed >= a.timings.submitted >= a.timings.accepted
        assert b.timings.accepted >= a.timings.completed


def test_defect_a_cancel_during_the_admission_of_a_parked_job_fails_it_once(caplog):
    """Found by the soak (240 in 860,000 jobs): a cancel landing while the admission step
    admitted a parked job failed it under the step's hands, and the step then fired
    ``admit`` on a Failed job (IllegalTransition, a programming error in the counters).
    The cancel is made to land there by the buffer lease itself."""
    ex = make_executor("step", slots_per_engine=1)
    with ex:
        first = ex.enqueue_nowait(Request.prefill(0, [1, 2]))
        parked = ex.enqueue_nowait(Request.prefill(1, [3, 4]))    # waits for the slot
        kv, pool = ex.epoch.kv, ex.epoch.pool
        acquire = pool.acquire

        def cancel_mid_admission(*a, **kw):
            got = acquire(*a, **kw)
            if first.done():                # the parked job's turn: it gets the slot
                parked.cancel()
            return got

        pool.acquire = cancel_mid_admission
        try:
            StepScheduler(ex).run_until(lambda: first.done() and parked.done())
        finally:
            del pool.acquire
        assert first.exception(0) is None
        err = parked.exception(0)
        assert isinstance(err, Cancelled), err
        st = ex.stats()
        assert st.cancelled == 1 and st.errors_by_category.get("programming", 0) == 0, st
        assert st.leased == 0 and kv.stats().open == 0
        s = kv.stats()
        assert s.reserved == s.committed + s.rolled_back + s.unknown + s.open, s
    assert not [r for r in caplog.records if "IllegalTransition" in r.getMessage()
                or "unexpected" in r.getMessage()]


def test_defect_wait_until_idle_wakes_when_the_last_stream_ends():
    """Found by the soak: ``wait_until(executor.idle, t)`` could sleep until its timeout
    after the last job ended, because a one-shot stream's deferred release (and a job
    failed before submit) left the books without telling the waiters."""
    import time

    from calfsm.sampling import SamplingParams

    with make_executor("threaded") as ex:
        slowest = 0.0
        for i in range(60):
            s = ex.generate([1, 2, i % 50], SamplingParams(max_tokens=2 + i % 5))
            if i % 3 == 0:
                s.cancel()
            s.result(10)
            t0 = time.monotonic()
            assert ex.wait_until(ex.idle, 3.0)
            slowest = max(slowest, time.monotonic() - t0)
        assert slowest < 1.0, f"wait_until(idle) slept {slowest:.3f} s after the work ended"


def test_defect_close_racing_a_job_being_started_waits_for_that_job(caplog):
    """Found while breaking reference cycles: ``Sequence.close()`` landing between a
    job's start (the sequence Busy) and its handle being recorded waited for the job
    before it, released the KV under the new one and gave the id back while it ran."""
    with make_executor("threaded") as ex:
        seq = ex.open_sequence()
        assert finish(ex, seq.prefill([1, 2, 3])).greedy() is not None
        real = ex.enqueue_nowait
        closer = threading.Thread(target=seq.close, name="test-closer")
        seen: dict[str, bool] = {}

        def enqueue_while_closing(request, **kw):
            closer.start()
            closer.join(0.2)                 # close() must wait for this job's handle
            seen["waited"] = closer.is_alive()
            return real(request, **kw)

        ex.enqueue_nowait = enqueue_while_closing
        try:
            handle = seq.decode(7)
        finally:
            del ex.enqueue_nowait
        closer.join(10)
        assert seen["waited"], "close() went on before the job being started was known"
        assert not closer.is_alive()
        assert handle.exception(5) is None
        assert seq.state == "Released"
        assert ex.wait_until(ex.idle, 5) and ex.epoch.kv.stats().open == 0
    assert not [r for r in caplog.records if "releasing the KV" in r.getMessage()]

