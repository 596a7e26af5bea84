"""One admission queue (issue 21, item 4): a threaded ``enqueue`` that must wait for KV or a
buffer slot waits in the executor's one FIFO admission queue, not inside the KV books or
the pool (which grant now or refuse, and never sleep). It is admitted first come first
served, as soon as what it needs comes back (a finished job, a sequence reset), gives up
at its admission deadline (also on a virtual clock nobody advances), and close() returns
it. FI04's bounded wait without busy CPU is
tests/api/test_executor.py::test_fi04_kv_never_allocatable_waits_until_deadline_without_cpu
(the CPU it burns) and test_a_blocked_enqueue_sleeps_until_it_is_woken here (that it
does not poll, however politely).

Threaded mode on real time with zero device latency; a job is held on the device with
:class:`GatedDriver`, never with a sleep.
"""

from __future__ import annotations

import sys
import threading
import time

import pytest

from calfsm.clock import VirtualClock
from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.engine.job import JobHandle
from calfsm.errors import CalfsmError, DeadlineExceeded
from calfsm.executor import DeviceExecutor, ExecutorConfig
from calfsm.generate.sampling import SamplingParams
from calfsm.request import Request
from tests.helpers.executor import (
    TINY,
    GatedDriver,
    always,
    drive,
    eventually,
    hold_on_device,
    make_executor,
    make_sim,
    prefill,
    reference_stream,
)
from tests.helpers.streams import direct_runner

pytestmark = pytest.mark.timeout(120)


class Caller(threading.Thread):
    """A thread blocked in ``ex.enqueue(request)``; ``handle`` once it returns."""

    def __init__(self, ex: DeviceExecutor, request: Request) -> None:
        super().__init__(daemon=True)
        self.ex, self.request = ex, request
        self.handle: JobHandle | None = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.handle = self.ex.enqueue(self.request)
        except BaseException as e:          # reported by the test
            self.error = e

    def returned(self, timeout: float = 10) -> JobHandle:
        self.join(timeout)
        assert not self.is_alive(), "the blocked enqueue never returned"
        assert self.error is None, self.error
        assert self.handle is not None
        return self.handle


class CountingCaller(Caller):
    """A :class:`Caller` that counts the Python events its own thread runs inside
    ``enqueue`` (``sys.setprofile``: every call and return, of Python and of C
    functions, a lock's acquire or a sleep included). A thread blocked in one wait runs
    nothing until it is woken; a thread that polls runs its loop at every tick."""

    def __init__(self, ex: DeviceExecutor, request: Request) -> None:
        self.events = 0
        super().__init__(ex, request)

    def run(self) -> None:
        def count(frame: object, event: str, arg: object) -> None:
            self.events += 1
        sys.setprofile(count)
        try:
            super().run()
        finally:
            sys.setprofile(None)


def _queue_callers(ex: DeviceExecutor, requests: list[Request]) -> list[Caller]:
    """Start one blocked caller per request, each in the queue before the next starts,
    so the queue's order is the list's."""
    callers = []
    for i, request in enumerate(requests, 1):
        callers.append(Caller(ex, request))
        assert eventually(lambda i=i: ex.stats().admitting == i), ex.stats()
    return callers


def test_blocked_enqueues_are_admitted_first_come_first_served():
    """One prefill slot, held on the device: three callers block in turn; once the slot
    comes back each is admitted, and runs, in the order it came."""
    gated = GatedDriver(make_sim("threaded"))
    with make_executor("threaded", driver=gated, slots_per_engine=1,
                       admission_timeout_s=60) as ex:
        held = hold_on_device(ex, gated, prefill(0, range(1, 5)))
        callers = _queue_callers(ex, [prefill(s, range(1, 5)) for s in (3, 1, 2)])
        assert all(c.is_alive() for c in callers)       # nobody passed the held slot
        gated.gate.set()
        held.result(10)
        handles = [c.returned() for c in callers]
        for h in handles:
            h.result(10)
        admitted = [h.context.timings.admitted for h in handles]
        assert admitted == sorted(admitted) and len(set(admitted)) == 3, admitted
        assert ex.stats().admitting == 0


def test_a_blocked_enqueue_goes_on_when_a_sequence_reset_frees_the_kv():
    """The device has KV for 16 positions: sequence 0 holds 12, so a prefill of 8 on
    sequence 1 must wait. Resetting sequence 0 (no job ends: only the KV books change)
    lets it through at once, long before its 60 s admission deadline."""
    sim = make_sim("threaded", kv_capacity=16)
    with make_executor("threaded", driver=sim, admission_timeout_s=60) as ex:
        ex.enqueue(prefill(0, range(1, 13))).result(10)
        caller = Caller(ex, prefill(1, range(1, 9)))
        assert eventually(lambda: ex.stats().admitting == 1), ex.stats()
        t0 = time.monotonic()
        ex.reset_sequence(0)
        caller.returned().result(10)
        assert time.monotonic() - t0 < 5


def test_a_blocked_enqueue_gives_up_at_its_admission_deadline():
    gated = GatedDriver(make_sim("threaded"))
    with make_executor("threaded", driver=gated, slots_per_engine=1,
                       admission_timeout_s=0.2) as ex:
        held = hold_on_device(ex, gated, prefill(0, range(1, 5)))
        handle = Caller(ex, prefill(1, range(1, 5))).returned()
        err = handle.exception(5)
        assert isinstance(err, DeadlineExceeded) and err.stage == "admission", err
        assert (err.seq_id, err.http_status) == (1, 504)
        gated.gate.set()
        held.result(10)


def _events_of_a_blocked_enqueue(admission_s: float) -> int:
    """What a caller's thread runs in an ``enqueue`` that waits ``admission_s`` for KV
    that never comes (FI04) and then gives up."""
    with make_executor("threaded", faults=always("kv_can_allocate", "refuse"),
                       admission_timeout_s=admission_s) as ex:
        caller = CountingCaller(ex, prefill(1, range(1, 5)))
        err = caller.returned(30).exception(5)
        assert isinstance(err, DeadlineExceeded) and err.stage == "admission", err
        return caller.events


def test_a_blocked_enqueue_sleeps_until_it_is_woken():
    """FI04 without busy CPU, counted rather than timed: a caller blocked in ``enqueue``
    waits on its job and is woken once, when the job leaves the admission queue. What
    its thread runs is then the same for a 0.1 s wait as for a 1.1 s one; a poll (a
    loop of short sleeps or timed waits, which a CPU-time bound lets through) runs its
    loop at every tick, tens of events each. Counting Python events is exact under any
    load (a thread that waits runs none, however long the machine keeps it off a
    core); the margin covers one-off work such as a first isinstance filling an ABC
    cache."""
    short = _events_of_a_blocked_enqueue(0.1)
    long = _events_of_a_blocked_enqueue(1.1)
    assert long - short < 40, (
        f"a caller blocked 1 s longer ran {long - short} more Python events "
        f"({short} in 0.1 s, {long} in 1.1 s): it polls instead of waiting")


def test_close_returns_every_blocked_enqueue():
    """close() ends the queue: each blocked caller returns with its job failed (a
    shutdown error), none is left blocked."""
    gated = GatedDriver(make_sim("threaded"))
    ex = make_executor("threaded", driver=gated, slots_per_engine=1,
                       admission_timeout_s=60, shutdown_timeout_s=2)
    hold_on_device(ex, gated, prefill(0, range(1, 5)))
    callers = _queue_callers(ex, [prefill(s, range(1, 5)) for s in (1, 2)])
    closer = threading.Thread(target=ex.close, daemon=True)
    closer.start()
    for c in callers:
        err = c.returned().exception(10)
        assert isinstance(err, CalfsmError), err
    gated.gate.set()
    closer.join(20)
    assert not closer.is_alive()


def test_a_blocked_enqueue_on_a_virtual_clock_nobody_advances_gives_up_in_real_time():
    """A threaded executor on a virtual clock that nothing drives: a job that cannot be
    admitted (the device never has KV room) keeps its 0.3 s admission budget in real
    seconds, as many as the virtual ones left, instead of blocking its caller forever."""
    drv = make_sim("threaded", clock=VirtualClock(), faults=always("kv_can_allocate",
                                                                   "refuse"))
    ex = DeviceExecutor(drv, TINY, ExecutorConfig(threaded=True, admission_timeout_s=0.3,
                                                  warmup=False))
    try:
        t0 = time.monotonic()
        handle = Caller(ex, prefill(1, range(1, 5))).returned()
        waited = time.monotonic() - t0
        err = handle.exception(5)
        assert isinstance(err, DeadlineExceeded), err
        assert 0.25 <= waited < 5, waited
    finally:
        ex.close()


@pytest.mark.parametrize("mode", ["step", "threaded"])
def test_a_device_refusal_with_nothing_left_to_free_is_asked_again(mode):
    """The device refuses a lone stream's KV grow twice (``kv_apply`` says no, the books
    had room): no reservation is open elsewhere, so no ``on_freed`` will ever come. The
    admission step asks the device again after its back-off, and the stream ends with
    the tokens it gives without the refusals (it waited for ever: step mode stuck,
    threaded mode asleep; found under load among 16 batched streams, every other step
    parked behind the refused head)."""
    prompt, params = [3, 1, 4], SamplingParams(max_tokens=6)
    want = reference_stream(direct_runner(), prompt, params)
    with make_executor(mode, faults=FaultPlan.of(FaultRule(
            "kv_apply", "refuse", seq_id=0, nth=3, every=1, count=2))) as ex:
        with ex.open_sequence() as seq:
            assert seq.seq_id == 0
            stream = seq.generate(prompt, params)
            drive(ex, stream.done)
            r = stream.result(0)
        assert ex.driver.faults_fired() == (2,)
        assert r.error is None and list(r.tokens) == want
