"""Graceful shutdown of the executor (issue 20, item 4).

``close()`` / ``aclose()`` stop taking new work at once (``ExecutorClosed``, a 503 with
Retry-After), let running streams finish for ``grace_s``, then cut the rest (each ends
``error`` with a retryable ``ExecutorClosed``) and return as soon as that is done — not
after ``shutdown_timeout_s``. Jobs on the device when ``close()`` begins are drained,
whichever comes first: ``close()`` or the completion side picking the job up, forced
both ways here with a gated ``wait``; one in flight and two on Ping/Pong.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from typing import Any

import pytest

from calfsm.drivers.base import Capabilities
from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.engine.recovery import RecoveryPolicy
from calfsm.errors import Cancelled, ErrorCategory, ExecutorClosed, Unavailable
from calfsm.generate.sampling import SamplingParams
from calfsm.generate.streams import FinishReason
from calfsm.machines.job import JobState
from calfsm.request import Request
from calfsm.serve.realtime import realtime_sim
from tests.helpers.executor import (
    TINY,
    Call,
    GatedDriver,
    eventually,
    make_executor,
    make_sim,
    outcome,
    prefill,
    settle,
    two_in_flight,
)

pytestmark = pytest.mark.timeout(120)

LONG = SamplingParams(max_tokens=5000)
#: the tests' shutdown timeout: a close that waits for it instead of returning when done
#: is what they catch, so their bounds sit far below it and far above a busy machine's
#: scheduling delays
TIMEOUT = 60.0
PROMPT_BOUND = TIMEOUT / 4
SEQ = 5


_prefill = functools.partial(prefill, seq=SEQ)


def _on_closing(ex) -> threading.Event:
    """An event set as soon as ``close()`` has begun (the lifecycle's change listener)."""
    began = threading.Event()
    ex.lifecycle.on_change(lambda: began.set() if ex.lifecycle.closing else None)
    return began


def _realtime(decode_ms: float = 2.0):
    return realtime_sim(TINY, decode_ms=decode_ms, prefill_token_us=10)


def test_close_with_a_running_stream_returns_at_once_and_cuts_it_retryably():
    ex = make_executor("threaded", driver=_realtime(), shutdown_timeout_s=TIMEOUT)
    stream = ex.generate([1, 2, 3], LONG)
    next(iter(stream))                                # it is running
    t0 = time.monotonic()
    ex.close()
    took = time.monotonic() - t0
    assert took < PROMPT_BOUND, took
    r = stream.result(0)
    assert r.finish_reason is FinishReason.ERROR and isinstance(r.error, ExecutorClosed)
    assert r.error.retryable and r.error.http_status == 503
    assert r.error.retry_after_s is not None


def test_aclose_with_live_streams_returns_when_they_are_cut():
    async def main() -> float:
        ex = await asyncio.to_thread(make_executor, "threaded", driver=_realtime(),
                                     shutdown_timeout_s=TIMEOUT)
        streams = [ex.generate([i, 1], LONG) for i in range(4)]
        async for _ in streams[0]:
            break
        t0 = time.monotonic()
        await ex.aclose()
        took = time.monotonic() - t0
        assert all(s.done() for s in streams)
        return took

    assert asyncio.run(main()) < PROMPT_BOUND


def test_a_grace_lets_running_streams_finish_and_refuses_new_work():
    """close(grace_s=10): a running 40-token stream (2 ms a step) ends ``length`` with
    all its tokens; a new stream asked for meanwhile is refused with a retryable
    ExecutorClosed; close returns right after the stream ended, long before the grace."""
    ex = make_executor("threaded", driver=_realtime(), shutdown_timeout_s=TIMEOUT)
    stream = ex.generate([1, 2, 3], SamplingParams(max_tokens=40))
    next(iter(stream))
    closer = threading.Thread(target=ex.close, kwargs={"grace_s": TIMEOUT})
    t0 = time.monotonic()
    closer.start()
    assert eventually(lambda: ex.lifecycle.stopping, PROMPT_BOUND)
    with pytest.raises(ExecutorClosed) as info:
        ex.generate([4, 5, 6], SamplingParams(max_tokens=4))
    assert info.value.retryable and info.value.retry_after_s is not None
    assert not ex.health().ready and ex.health().ready_reason == "shutting down"
    closer.join(TIMEOUT)
    took = time.monotonic() - t0
    assert not closer.is_alive()
    r = stream.result(0)
    assert r.finish_reason is FinishReason.LENGTH and len(r.tokens) == 40, r
    assert took < PROMPT_BOUND, took


def test_a_grace_cuts_what_is_still_running_when_it_ends():
    ex = make_executor("threaded", driver=_realtime(), shutdown_timeout_s=TIMEOUT)
    stream = ex.generate([1, 2, 3], LONG)
    next(iter(stream))
    t0 = time.monotonic()
    ex.close(grace_s=0.3)
    took = time.monotonic() - t0
    assert 0.3 <= took < PROMPT_BOUND, took
    r = stream.result(0)
    assert r.finish_reason is FinishReason.ERROR and isinstance(r.error, ExecutorClosed)
    assert len(r.tokens) > 1


def test_a_grace_in_step_mode_drives_the_streams_to_their_end():
    with make_executor("step") as ex:
        stream = ex.generate([1, 2, 3], SamplingParams(max_tokens=10))
        ex.close(grace_s=5.0)
        r = stream.result(0)
        assert r.finish_reason is FinishReason.LENGTH and len(r.tokens) == 10


def test_a_job_cancelled_by_shutdown_carries_a_retry_after():
    inner = make_sim("threaded")
    gated = GatedDriver(inner)
    ex = make_executor("threaded", driver=gated, max_inflight=1, slots_per_engine=2)
    gated.gate.clear()
    on_device = ex.enqueue_nowait(Request.prefill(1, [1, 2, 3]))
    assert gated.submitted.wait(5)
    queued = ex.enqueue_nowait(Request.prefill(2, [1, 2, 3]))
    closer = threading.Thread(target=ex.close)
    closer.start()
    err = queued.exception(5)
    assert isinstance(err, Cancelled) and err.retry_after_s is not None and err.retryable
    gated.gate.set()
    closer.join(10)
    assert not closer.is_alive() and on_device.exception(0) is None


# ---- jobs on the device, close() and the completion's pickup in both orders --------

def _hold(ex, gated, n: int) -> list:
    gated.gate.clear()
    handles = [ex.enqueue_nowait(Request.prefill(10 + i, [1, 2, 3])) for i in range(n)]
    deadline = time.monotonic() + 10
    while sum(h.state == JobState.SUBMITTED for h in handles) < n:
        assert time.monotonic() < deadline, [h.state for h in handles]
        gated.submitted.wait(0.01)
        gated.submitted.clear()
    assert gated.waiting.wait(5)          # the completion side is inside wait()
    return handles


@pytest.mark.parametrize("inflight", [1, 2], ids=["one", "pingpong"])
@pytest.mark.parametrize("order", ["close_first", "pickup_first"])
def test_close_drains_the_jobs_on_the_device_in_either_order(tmp_path, inflight, order):
    """``close_first``: close() begins (and has stopped admission) while the completion
    side is still held inside wait(); ``pickup_first``: the jobs come back and are
    resolved before close() begins. Either way every job on the device gets its result,
    close returns promptly, and nothing is left leased."""
    inner = make_sim("threaded")
    gated = GatedDriver(inner)
    extra = two_in_flight(tmp_path, inner) if inflight == 2 else {}
    ex = make_executor("threaded", driver=gated, shutdown_timeout_s=TIMEOUT, **extra)
    assert ex.health().max_inflight == inflight
    handles = _hold(ex, gated, inflight)
    if order == "close_first":
        closer = threading.Thread(target=ex.close)
        closer.start()
        deadline = time.monotonic() + 5
        while not ex.lifecycle.closing:
            assert time.monotonic() < deadline
            closer.join(0.001)
        assert all(not h.done() for h in handles)       # still on the device
        gated.gate.set()
        closer.join(10)
        assert not closer.is_alive()
    else:
        gated.gate.set()
        for h in handles:
            h.exception(5)
        t0 = time.monotonic()
        ex.close()
        assert time.monotonic() - t0 < PROMPT_BOUND
    assert [h.exception(0) for h in handles] == [None] * inflight
    assert [h.result(0).token_count for h in handles] == [3] * inflight
    assert ex.epoch.pool.stats().leased == 0
    assert not [t for t in threading.enumerate() if t.name.startswith("calfsm-")
                and t.is_alive()]


# ---- close() during a recovery (from the issue #12 defects) -----------------------

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
        closer = Call(ex.close, timeout=10)
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
    recoverer = Call(ex.recover, "operator asked")
    assert starting.wait(10)
    ex.close(timeout=10)       # before: RuntimeError: cannot join thread before it is started
    recoverer.join(10)
    assert recoverer.error is None and recoverer.value is True
    assert ex.lifecycle_state == "Closed"
    assert ex.generation == 1 and not thread_errors, thread_errors


# ---- a closed executor (from the issue #12 defects) -------------------------------

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
