"""DeviceExecutor: the pipeline, cancel, deadlines and shutdown — each FI row in both the
deterministic step mode and the threaded mode."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import numpy as np
import pytest

from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.errors import (
    CalfsmError,
    CalrtCode,
    Cancelled,
    DeadlineExceeded,
    ErrorCategory,
    InvalidArgument,
    Unavailable,
)
from calfsm.executor import DeviceExecutor, ExecutorConfig
from calfsm.job import Request
from calfsm.machines.job import JobState
from calfsm.manifest import TaskKind
from calfsm.scheduler import StepScheduler
from tests.executor_helpers import (
    TINY,
    GatedDriver,
    calls,
    finish,
    hold_on_device,
    make_executor,
    make_sim,
)

SEQ = 7


def _prefill(tokens=(1, 2, 3), seq=SEQ, **kw):
    return Request.prefill(seq, list(tokens), **kw)


def _assert_clean(ex: DeviceExecutor) -> None:
    """Nothing leaked: no lease out, no reservation open, no job in flight."""
    pool = ex.epoch.pool.stats()
    assert pool.leased == 0, pool
    kv = ex.epoch.kv.stats()
    assert kv.open == 0, kv
    st = ex.stats()
    assert st.inflight == 0 and st.queued == 0, st



def test_prefill_then_decode_matches_reference(mode):
    from calfsm import refmodel
    with make_executor(mode) as ex:
        r = finish(ex, ex.enqueue(_prefill([1, 2, 3])))
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
    plan = FaultPlan.of(FaultRule.always("set_csr", "code", seq_id=SEQ,
                                         code=int(CalrtCode.NOT_FOUND)))
    with make_executor(mode, faults=plan) as ex:
        infers = len(calls(ex.driver, "infer"))
        h = ex.enqueue(_prefill())
        err = finish(ex, h)
        assert err.calrt_code == CalrtCode.NOT_FOUND and err.stage == "csr"
        assert h.state == JobState.FAILED
        assert len(calls(ex.driver, "infer")) == infers       # nothing submitted
        _assert_clean(ex)
        assert ex.lifecycle_state == "Ready"                  # a request error only


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
