"""DeviceExecutor: the pipeline, cancel, deadlines and shutdown — each FI row in both the
deterministic step mode and the threaded mode."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import queue
import sys
import threading
import time
import weakref
from collections import Counter
from typing import Any

import attrs
import numpy as np
import pytest

from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.engine.job import JobHandle, Request
from calfsm.engine.submission import Submission
from calfsm.errors import (
    CalfsmError,
    CalrtCode,
    Cancelled,
    DeadlineExceeded,
    ErrorCategory,
    ExecutorBroken,
    InvalidArgument,
    Unavailable,
)
from calfsm.executor import DeviceExecutor, ExecutorConfig
from calfsm.machines.job import JobState
from calfsm.manifest import TaskKind
from calfsm.runtime.stepper import StepScheduler
from tests.helpers.executor import (
    TINY,
    Call,
    GatedDriver,
    calls,
    eventually,
    finish,
    hold_on_device,
    make_executor,
    make_sim,
    outcome,
    prefill,
    settle,
)

SEQ = 7


_prefill = functools.partial(prefill, seq=SEQ)


def _assert_clean(ex: DeviceExecutor) -> None:
    """Nothing leaked: no lease out, no reservation open, no job in flight."""
    pool = ex.epoch.pool.stats()
    assert pool.leased == 0, pool
    kv = ex.epoch.kv.stats()
    assert kv.open == 0, kv
    st = ex.stats()
    assert st.inflight == 0 and st.queued == 0, st



def test_prefill_then_decode_matches_reference(mode):
    from calfsm.drivers import refmodel
    with make_executor(mode) as ex:
        r = finish(ex, ex.enqueue(_prefill(tokens=[1, 2, 3])))
        hashes = refmodel.chain([1, 2, 3])
        want = refmodel.logits_bf16(hashes[-1], TINY.submodel(TaskKind.DECODE).vocab)
        np.testing.assert_array_equal(
            r.logits, (want.astype(np.uint32) << 16).view(np.float32))
        assert r.token_count == 3 and r.generation == ex.generation
        tok = r.greedy()
        r2 = finish(ex, ex.enqueue(Request.decode(SEQ, tok, 3)))
        h = refmodel.step(hashes[-1], tok, 3)
        assert r2.greedy() == refmodel.greedy(refmodel.logits_bf16(h, r2.logits.shape[0]))
        t = r2.timings
        assert t.accepted <= t.admitted <= t.queued <= t.submitted <= t.completed
        _assert_clean(ex)


def test_target_array_receives_logits_without_copy(mode):
    target = np.full(2048, -7.0, dtype=np.float32)
    with make_executor(mode) as ex:
        r = finish(ex, ex.enqueue(_prefill(target=target)))
        assert np.shares_memory(r.logits, target)
        assert np.all(target[1024:] == -7.0)       # nothing written past the vocabulary


@pytest.mark.parametrize("bad, match", [
    (dict(tokens=[], positions=[]), "token_count"),
    (dict(tokens=[1, 2], positions=[0]), "positions"),
    (dict(tokens=[1], positions=[5], past_len=5), None),   # valid shape, hole in KV below
    (dict(tokens=[5000], positions=[0]), "token ids"),
    (dict(tokens=[1, 2], positions=[0, 2]), "positions must run"),
])
def test_bad_requests_fail_before_the_device(mode, bad, match):
    with make_executor(mode) as ex:
        before = len(calls(ex.driver, "infer"))
        h = ex.enqueue(Request(SEQ, TaskKind.PREFILL_IDS, **bad))
        err = finish(ex, h)
        assert isinstance(err, InvalidArgument | CalfsmError)
        if match:
            assert match in str(err)
        assert err.job_id == h.job_id and err.seq_id == SEQ
        assert len(calls(ex.driver, "infer")) == before
        _assert_clean(ex)


def test_max_seq_bound_rejects_40960_plus_decode(mode):
    with make_executor(mode, manifest=TINY) as ex:
        max_seq = TINY.submodel(TaskKind.DECODE).max_seq
        err = finish(ex, ex.enqueue(Request.decode(SEQ, 1, max_seq)))
        assert isinstance(err, InvalidArgument)
        assert "max_seq" in str(err)


def test_fi02_unknown_csr_name_fails_prepare_nothing_submitted(mode):
    """The device answers NOT_FOUND for a CSR its own model list declared (a manifest
    naming a CSR the device does not offer fails at resolve, see test_manifest.py): prepare fails
    and nothing is submitted, and the device, which contradicts itself, is drained and
    reset (issue 34: a device error, never a request error or a 500)."""
    plan = FaultPlan.of(FaultRule.always("set_csr", "code", seq_id=SEQ,
                                         code=int(CalrtCode.NOT_FOUND)))
    with make_executor(mode, faults=plan) as ex:
        h = ex.enqueue(_prefill())
        err = finish(ex, h)
        assert err.calrt_code == CalrtCode.NOT_FOUND and err.stage == "csr"
        assert h.state == JobState.FAILED
        assert err.category is ErrorCategory.DEVICE and err.http_status == 503
        assert not any(c["tag"][1] == SEQ for c in calls(ex.driver, "infer"))  # none
        settle(ex, lambda: ex.generation == 2)
        assert ex.lifecycle_state == "Ready"      # the warm-up's writes are not refused
        _assert_clean(ex)


def test_fi04_kv_never_allocatable_waits_until_deadline_without_cpu(mode):
    plan = FaultPlan.of(FaultRule.always("kv_can_allocate", "refuse"))
    with make_executor(mode, faults=plan, admission_timeout_s=0.5) as ex:
        # fill nothing: can_allocate(1) is always false, so admission must wait
        if mode == "step":
            h = ex.enqueue(_prefill())
            sched = StepScheduler(ex)
            t0 = ex.clock.now()
            sched.run_until(h.done)
            err = h.exception()
            assert isinstance(err, DeadlineExceeded)
            assert ex.clock.now() - t0 == pytest.approx(0.5, abs=1e-6)
        else:
            box = {}

            def caller():
                c0 = time.thread_time()
                box["handle"] = ex.enqueue(_prefill())
                box["cpu"] = time.thread_time() - c0

            t = threading.Thread(target=caller)
            t.start()
            t.join(10)
            err = box["handle"].exception(5)
            assert isinstance(err, DeadlineExceeded)
            assert box["cpu"] < 0.02, f"admission wait burned {box['cpu'] * 1e3:.1f} ms CPU"
        assert len(calls(ex.driver, "infer")) == 2            # only the warm-up's
        _assert_clean(ex)


def test_fi05_submit_busy_rolls_back_and_never_waits(mode):
    plan = FaultPlan.of(FaultRule("infer", "code", seq_id=SEQ,
                                  code=int(CalrtCode.DEVICE_BUSY)))
    with make_executor(mode, faults=plan) as ex:
        waits = len(calls(ex.driver, "wait"))
        h = ex.enqueue(_prefill())
        err = finish(ex, h)
        assert err.calrt_code == CalrtCode.DEVICE_BUSY
        assert err.category is ErrorCategory.TRANSIENT
        assert len(calls(ex.driver, "wait")) == waits         # no Wait for it
        assert ex.epoch.kv.stats().rolled_back == 1
        _assert_clean(ex)
        assert ex.lifecycle_state == "Ready"                  # within the error budget
        assert finish(ex, ex.enqueue(_prefill())).token_count == 3   # sequence still usable


def test_fi11_cancel_before_submit_no_device_call(mode):
    inner = make_sim(mode)
    gated = GatedDriver(inner)
    ex = make_executor(mode, driver=gated)
    try:
        first = hold_on_device(ex, gated, _prefill(seq=1))
        infers = len(calls(ex.driver, "infer"))
        second = ex.enqueue(_prefill(seq=2))
        assert second.state == JobState.QUEUED
        assert second.cancel()
        err = second.exception(5)
        assert isinstance(err, Cancelled)
        assert second.state == JobState.FAILED
        gated.gate.set()
        assert finish(ex, first).token_count == 3
        assert len(calls(ex.driver, "infer")) == infers       # the cancelled one never ran
        _assert_clean(ex)
    finally:
        gated.gate.set()
        ex.close()


def test_fi12_cancel_after_submit_still_waits_drops_result(mode):
    inner = make_sim(mode)
    gated = GatedDriver(inner)
    ex = make_executor(mode, driver=gated)
    try:
        h = hold_on_device(ex, gated, _prefill())
        waits = len(calls(ex.driver, "wait"))
        assert h.cancel()
        assert not h.done()                 # the device owns it: still waited for
        gated.gate.set()
        err = finish(ex, h)
        assert isinstance(err, Cancelled)
        assert len(calls(ex.driver, "wait")) == waits + 1
        _assert_clean(ex)
        # the device did run it: the KV advanced, so the next job may continue from it
        assert ex.epoch.kv.sequence_length(SEQ) == 3
    finally:
        gated.gate.set()
        ex.close()


def test_fi13_shutdown_cancels_queued_drains_submitted(mode):
    inner = make_sim(mode)
    gated = GatedDriver(inner)
    ex = make_executor(mode, driver=gated)
    submitted = hold_on_device(ex, gated, _prefill(seq=1))
    queued = ex.enqueue(_prefill(seq=2))
    assert queued.state == JobState.QUEUED
    closer = threading.Thread(target=ex.close)
    closer.start()
    assert isinstance(queued.exception(5), Cancelled)
    gated.gate.set()
    closer.join(10)
    assert not closer.is_alive()
    assert submitted.result(5).token_count == 3             # drained, not dropped
    assert ex.epoch.pool.stats().leased == 0
    assert not [t for t in threading.enumerate() if t.name.startswith("calfsm-")
                and t.is_alive()]
    with pytest.raises(Unavailable):
        ex.enqueue(_prefill())


def test_shutdown_is_bounded_when_the_device_never_finishes():
    inner = make_sim("threaded")
    gated = GatedDriver(inner)
    ex = make_executor("threaded", driver=gated)
    h = hold_on_device(ex, gated, _prefill())
    t0 = time.monotonic()
    with pytest.raises(Unavailable, match="did not drain"):
        ex.close(timeout=0.2)
    assert time.monotonic() - t0 < 5
    gated.gate.set()
    h.exception(5)


def test_queue_deadline_fails_job_before_submit(mode):
    inner = make_sim(mode)
    gated = GatedDriver(inner)
    ex = make_executor(mode, driver=gated, queue_timeout_s=0.05)
    try:
        first = hold_on_device(ex, gated, _prefill(seq=1))
        second = ex.enqueue(_prefill(seq=2))
        if mode == "step":
            ex.clock.advance(0.1)
            StepScheduler(ex).run_until(second.done)
        err = second.exception(5)
        assert isinstance(err, DeadlineExceeded) and err.stage == "queue"
        gated.gate.set()
        finish(ex, first)
        _assert_clean(ex)
    finally:
        gated.gate.set()
        ex.close()


def test_await_handle_from_asyncio():
    with make_executor("threaded") as ex:
        async def main():
            ticks = 0

            async def ticker():
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0)

            t = asyncio.create_task(ticker())
            r = await ex.enqueue(_prefill())
            t.cancel()
            return r, ticks

        r, ticks = asyncio.run(main())
        assert r.token_count == 3
        assert ticks >= 1                  # the loop kept running while we awaited


def test_decode_sync_compat_entry(mode):
    with make_executor(mode) as ex:
        r = ex.decode_sync(_prefill())
        assert r.token_count == 3


def test_each_failure_logged_once_with_context(mode, caplog):
    plan = FaultPlan.of(FaultRule("infer", "code", seq_id=SEQ,
                                  code=int(CalrtCode.DEVICE_BUSY)))
    with make_executor(mode, faults=plan) as ex, caplog.at_level(logging.WARNING,
                                                                  "calfsm.executor"):
        h = ex.enqueue(_prefill())
        finish(ex, h)
    recs = [r for r in caplog.records if getattr(r, "job_id", None) == h.job_id]
    assert len(recs) == 1
    rec = recs[0]
    assert (rec.seq_id, rec.calrt_code, rec.stage) == (SEQ, int(CalrtCode.DEVICE_BUSY),
                                                       "submit")
    assert rec.generation == 1


def test_config_rejects_nonsense():
    with pytest.raises(InvalidArgument):
        ExecutorConfig(max_inflight=0)
    with pytest.raises(InvalidArgument):
        ExecutorConfig(execution_timeout_s=0)


# ---- a dead worker (from the issue #12 defects) -----------------------------------

def _kill_submitter_when_armed(monkeypatch) -> threading.Event:
    """Make the submitter's loop raise outside its per-step guard once armed and a job is
    queued (so the crash always meets a queued job). Patched on the public class: there
    is one executor in the test."""
    armed = threading.Event()
    real = Submission.fail_expired

    def fail_expired(self):
        if armed.is_set() and self.has_queued() \
                and threading.current_thread().name == "calfsm-submitter":
            raise RuntimeError("injected: the submitter loop crashed")
        return real(self)

    monkeypatch.setattr(Submission, "fail_expired", fail_expired)
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
    closer = Call(ex.close, timeout=5)
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
        blocked = Call(ex.enqueue, _prefill(seq=3))          # waits for a prefill slot
        assert eventually(lambda: ex.stats().admitting == 1)
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


# ---- counters under concurrency (from the issue #12 defects) ----------------------

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

        cancellers = [Call(cancel) for _ in range(2)]
        for p in [Call(produce, p) for p in range(producers)]:
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


# ---- no per-job reference cycle (from the issue #12 defects) ----------------------

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


# ---- completion order, spec 6.5 (from the issue #12 defects) ----------------------

def test_defect_completion_resolves_before_it_returns_the_lease(mode):
    gated = GatedDriver(make_sim(mode))
    with make_executor(mode, driver=gated) as ex:
        seen: dict[str, Any] = {}
        # result() returns once the handle resolves, while its done-callbacks may still
        # run on the completion thread: wait for this one to have looked
        observed = threading.Event()

        def observe(handle):
            epoch = ex.epoch
            seen["leased"] = epoch.pool.stats().leased
            seen["kv_len"] = epoch.kv.sequence_length(SEQ)
            seen["kv_state"] = handle.context.kv.state
            seen["undone"] = len(calls(gated, "undo_slice")) - undone_before
            observed.set()

        undone_before = len(calls(gated, "undo_slice"))
        h = hold_on_device(ex, gated, _prefill())
        h.add_done_callback(observe)
        gated.gate.set()
        result = finish(ex, h)
        assert result.token_count == 3
        assert observed.wait(10)
        assert seen["kv_len"] == 3 and seen["kv_state"] == "Committed"   # KV committed,
        assert seen["undone"] == 2                     # the slices undone,
        assert seen["leased"] == 1                     # the lease still out at resolve
        assert eventually(lambda: ex.epoch.pool.stats().leased == 0)   # then returned


# ---- timings (S11) and admission (from the issue #12 defects) ---------------------

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
