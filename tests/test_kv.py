"""KvCoordinator: validation before the runtime, bounded FIFO admission on a condition
variable, and the reserve -> submit -> commit / rollback / Unknown transactions."""

from __future__ import annotations

import json
import threading
import time

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    rule,
)

from calfsm.clock import RealClock, VirtualClock
from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.drivers.sim import SimDriver
from calfsm.errors import (
    CalfsmError,
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    IllegalTransition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from calfsm.kv import KvCoordinator, KvReservation, KvState, SeqState
from calfsm.manifest import builtin_manifest
from tests.waiters import (
    check_wake_all_and_stop_reach_everyone,
    join_all,
    queue_in_order,
    served_after_a_cancelled_head,
)

TINY = builtin_manifest("tiny")
FAR = 1e12  # a deadline that never passes (virtual clocks start at 0)


def sim(**kw) -> SimDriver:
    kw.setdefault("kv_capacity", 1 << 20)
    kw.setdefault("trace", True)        # kv_calls reads the whole trace
    return SimDriver(TINY, **kw)


def kv_calls(driver: SimDriver) -> list[dict]:
    return [d for d in map(json.loads, driver.trace_lines()) if d["call"].startswith("kv_")]


def coordinator(driver=None, *, max_seq=8192, token_budget=1 << 16, clock=None, **kw):
    driver = driver or sim()
    return driver, KvCoordinator(driver, max_seq=max_seq, token_budget=token_budget,
                                 clock=clock or VirtualClock(), **kw)


def held_waiter(kv: KvCoordinator, *args, **kw):
    """Start ``kv.reserve(*args)`` in a thread; returns (thread, outcome list, waiting
    Event). The Event is set from the ``cancelled`` hook, which the coordinator calls under
    its lock right before it decides to wait: once it is set, any later commit, rollback,
    cancel or shutdown is seen by the waiter (no lost wake-up), without sleeping."""
    outcome: list = []
    waiting = threading.Event()
    cancel = kw.pop("cancel_flag", None)

    def cancelled() -> bool:
        waiting.set()
        return bool(cancel and cancel.is_set())

    def run() -> None:
        try:
            outcome.append(kv.reserve(*args, cancelled=cancelled, **kw))
        except CalfsmError as e:
            outcome.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert waiting.wait(10)
    return t, outcome, waiting


def finish(t: threading.Thread, outcome: list):
    t.join(10)
    assert not t.is_alive(), "waiter did not wake up"
    return outcome[0]


# ---- validation: every bad input is a clear error before the runtime -----------------

@pytest.mark.parametrize(("seq", "past", "count", "err", "match"), [
    (1, 0, 0, InvalidArgument, "token_count"),
    (1, 0, -3, InvalidArgument, "token_count"),
    (1, -1, 4, InvalidArgument, "past_len"),
    (1, 0, 1.0, InvalidArgument, "integer"),
    (1, True, 1, InvalidArgument, "integer"),
    (-1, 0, 1, InvalidArgument, "seq_id"),
    (2**31, 0, 1, InvalidArgument, "seq_id"),
    (1, 40960, 1, InvalidArgument, "max_seq 40960"),       # 40960 + decode
    (1, 0, 40961, InvalidArgument, "max_seq"),
    (1, 2**32, 1, InvalidArgument, "uint32"),
    (1, 2**32 - 1, 1, InvalidArgument, "uint32"),
    (1, 0, 2**32, InvalidArgument, "uint32"),
    (1, 0, 40000, ResourceExhausted, "whole token budget"),
])
def test_bad_requests_raise_with_context_before_any_runtime_call(seq, past, count, err,
                                                                 match):
    driver, kv = coordinator(max_seq=40960, token_budget=32768)
    for call in (lambda: kv.reserve(seq, past, count, FAR, job_id=77),
                 lambda: kv.try_reserve(seq, past, count, job_id=77)):
        with pytest.raises(err, match=match) as info:
            call()
        e = info.value
        assert (e.job_id, e.stage, e.generation) == (77, "admission", 0)
        if isinstance(seq, int) and 0 <= seq < 2**31:
            assert e.seq_id == seq
    assert kv_calls(driver) == []
    assert kv.stats().waiting == 0 and kv.stats().sequences == 0


def test_the_last_position_of_max_seq_is_admitted():
    _, kv = coordinator(max_seq=40960, token_budget=40960)
    r = kv.try_reserve(1, 0, 40959)
    kv.mark_submitted(r)
    kv.commit(r)
    last = kv.try_reserve(1, 40959, 1)
    assert last.target_len == 40960
    with pytest.raises(InvalidArgument, match="40961 exceeds max_seq"):
        kv.reserve(1, 40960, 1, FAR)


def test_deadline_already_past_is_refused_before_the_runtime():
    clock = VirtualClock(100.0)
    driver, kv = coordinator(clock=clock)
    for deadline in (100.0, 99.0):
        with pytest.raises(DeadlineExceeded) as info:
            kv.reserve(3, 0, 4, deadline, job_id=1)
        assert (info.value.seq_id, info.value.stage, info.value.http_status) == (
            3, "admission", 504)
    assert kv_calls(driver) == []


def test_hole_open_reservation_and_unknown_sequence_are_refused():
    driver, kv = coordinator()
    with pytest.raises(InvalidArgument, match="hole"):
        kv.try_reserve(5, 1, 1, job_id=2)
    r = kv.try_reserve(5, 0, 4, job_id=2)
    with pytest.raises(FailedPrecondition, match="open KV reservation"):
        kv.try_reserve(5, 4, 1, job_id=3)
    with pytest.raises(FailedPrecondition, match="open KV reservation"):
        kv.reserve(5, 4, 1, FAR, job_id=3)
    kv.mark_unknown(r, "wait timed out")
    n = len(kv_calls(driver))
    with pytest.raises(FailedPrecondition, match="reset the sequence") as info:
        kv.reserve(5, 0, 1, FAR, job_id=4)
    assert (info.value.seq_id, info.value.job_id) == (5, 4)
    assert len(kv_calls(driver)) == n
    assert kv.sequence_state(5) is SeqState.UNKNOWN


# ---- transactions ---------------------------------------------------------------------

def test_reserve_submit_commit_grows_the_sequence():
    driver, kv = coordinator(token_budget=100)
    r = kv.reserve(1, 0, 17, FAR, job_id=10)
    assert (r.seq_id, r.job_id, r.old_len, r.target_len, r.tokens, r.generation) == (
        1, 10, 0, 17, 17, 0)
    assert r.state == KvState.RESERVED
    assert driver.kv_allocated(1) == 17 and kv.stats().budget_used == 17
    assert kv.sequence_state(1) is SeqState.OPEN
    kv.mark_submitted(r)
    kv.commit(r)
    assert r.state == KvState.COMMITTED
    assert kv.sequence_length(1) == 17 and kv.sequence_state(1) is SeqState.READY
    d = kv.try_reserve(1, 17, 1)
    kv.mark_submitted(d)
    kv.commit(d)
    assert kv.sequence_length(1) == 18 == driver.kv_allocated(1)
    s = kv.stats()
    assert (s.reserved, s.committed, s.open, s.budget_used) == (2, 2, 0, 0)
    calls = [c["call"] for c in kv_calls(driver)]
    assert calls == ["kv_can_allocate", "kv_apply"] * 2


def test_rollback_only_from_reserved_and_gives_back_the_growth():
    driver, kv = coordinator()
    base = kv.try_reserve(2, 0, 8)
    kv.mark_submitted(base)
    kv.commit(base)
    r = kv.try_reserve(2, 8, 4, job_id=5)
    assert driver.kv_allocated(2) == 12
    kv.rollback(r)
    assert r.state == KvState.ROLLED_BACK
    assert driver.kv_allocated(2) == 8 == kv.sequence_length(2)
    assert kv_calls(driver)[-1] == {**kv_calls(driver)[-1], "call": "kv_release",
                                    "seq": 2, "keep": 8}
    r = kv.try_reserve(2, 8, 1, job_id=6)
    kv.mark_submitted(r)
    with pytest.raises(IllegalTransition) as info:
        kv.rollback(r)  # the device may have run it: never a claimed rollback
    assert (info.value.state, info.value.trigger, info.value.job_id) == (
        "Submitted", "rollback", 6)
    assert r.state == KvState.SUBMITTED and kv.stats().open == 1
    kv.mark_unknown(r, "completion failed")
    with pytest.raises(IllegalTransition):
        kv.commit(r)
    with pytest.raises(IllegalTransition):
        kv.mark_unknown(r, "again")


def test_unknown_sequence_is_refused_until_reset_then_starts_empty():
    driver, kv = coordinator()
    r = kv.try_reserve(4, 0, 10)
    kv.mark_submitted(r)
    kv.mark_unknown(r, "DONE_CCU_EXCEPTION")
    assert r.reason == "DONE_CCU_EXCEPTION"
    s = kv.stats()
    assert (s.unknown, s.open, s.budget_used, s.unknown_sequences) == (1, 0, 0, 1)
    assert kv.try_reserve(5, 0, 1) is not None  # other sequences are fine
    kv.reset_sequence(4)
    assert driver.kv_allocated(4) == 0
    assert kv.sequence_state(4) is SeqState.READY and kv.sequence_length(4) == 0
    assert kv.try_reserve(4, 0, 3).target_len == 3


def test_reset_sequence_refused_while_a_reservation_is_open():
    _, kv = coordinator()
    r = kv.try_reserve(4, 0, 10)
    with pytest.raises(FailedPrecondition):
        kv.reset_sequence(4)
    kv.rollback(r)
    kv.reset_sequence(4)



def test_a_failed_reset_is_classified_and_leaves_the_sequence_unknown_until_retried():
    driver, kv = coordinator(sim(faults=FaultPlan.of(FaultRule("kv_release", "code",
                                                               seq_id=4))))
    r = kv.try_reserve(4, 0, 10)
    kv.mark_submitted(r)
    kv.commit(r)
    with pytest.raises(CalfsmError) as info:
        kv.reset_sequence(4)
    e = info.value
    assert (e.calrt_code, e.stage, e.seq_id, e.generation) == (15, "kv_reset", 4, 0)
    assert kv.sequence_state(4) is SeqState.UNKNOWN
    with pytest.raises(FailedPrecondition, match="reset the sequence"):
        kv.try_reserve(4, 0, 1)
    kv.reset_sequence(4)                 # the fault fired once: the retry releases
    assert driver.kv_allocated(4) == 0 and kv.sequence_state(4) is SeqState.READY

def test_rewind_commit_trims_and_rollback_keeps_the_committed_kv():
    driver, kv = coordinator()
    r = kv.try_reserve(6, 0, 20)
    kv.mark_submitted(r)
    kv.commit(r)
    again = kv.try_reserve(6, 0, 5)  # a new prompt on the same sequence id
    assert (again.old_len, again.prev_len, again.growth) == (0, 20, 0)
    kv.rollback(again)
    assert kv.sequence_length(6) == 20 == driver.kv_allocated(6)
    again = kv.try_reserve(6, 0, 5)
    kv.mark_submitted(again)
    kv.commit(again)
    assert kv.sequence_length(6) == 5 == driver.kv_allocated(6)


def test_reservation_of_another_generation_or_coordinator_is_refused():
    driver = sim()
    _, old = coordinator(driver, generation=1)
    _, new = coordinator(driver, generation=2)
    r = old.try_reserve(1, 0, 4, job_id=9)
    for op in (new.mark_submitted, new.commit, new.rollback,
               lambda x: new.mark_unknown(x, "stale")):
        with pytest.raises(FailedPrecondition, match="generation 1") as info:
            op(r)
        assert (info.value.generation, info.value.job_id) == (1, 9)
    assert r.state == KvState.RESERVED and new.stats().open == 0
    forged = KvReservation(seq_id=1, job_id=None, old_len=0, target_len=4, tokens=4,
                           generation=1)
    with pytest.raises(FailedPrecondition):
        old.commit(forged)
    old.rollback(r)


# ---- admission: waiting on the condition ----------------------------------------------

def test_fi04_can_allocate_always_false_waits_to_the_deadline_without_busy_cpu():
    driver = sim(faults=FaultPlan.of(FaultRule.always("kv_can_allocate", "refuse")),
                 clock=RealClock())
    clock = RealClock()
    kv = KvCoordinator(driver, max_seq=8192, token_budget=4096, clock=clock)
    result: dict = {}

    def waiter() -> None:
        cpu0, t0 = time.thread_time(), clock.now()
        deadline = t0 + 1.0
        try:
            kv.reserve(7, 0, 16, deadline, job_id=70)
        except CalfsmError as e:
            result["error"] = e
        result["cpu"] = time.thread_time() - cpu0
        result["late"] = clock.now() - deadline

    t = threading.Thread(target=waiter)
    t.start()
    t.join(30)
    assert not t.is_alive()
    err = result["error"]
    assert isinstance(err, DeadlineExceeded)
    assert (err.seq_id, err.job_id, err.stage) == (7, 70, "admission")
    assert 0 <= result["late"] < 0.5
    assert result["cpu"] < 0.020, f"waiting thread used {result['cpu'] * 1e3:.1f} ms CPU"
    calls = [c["call"] for c in kv_calls(driver)]
    assert calls.count("kv_can_allocate") <= 2 and "kv_apply" not in calls
    assert kv.stats().waiting == 0 and kv.stats().open == 0


def test_waiter_is_admitted_when_a_commit_frees_device_capacity():
    driver, kv = coordinator(sim(kv_capacity=10))
    a = kv.try_reserve(1, 0, 8)
    assert kv.try_reserve(2, 0, 8) is None  # the device has no room
    t, outcome, _ = held_waiter(kv, 2, 0, 8, FAR, job_id=2)
    kv.mark_submitted(a)
    kv.commit(a)  # committed KV stays allocated: still no room
    kv.reset_sequence(1)  # frees 8 positions -> notifies
    r = finish(t, outcome)
    assert isinstance(r, KvReservation) and r.target_len == 8
    assert driver.kv_allocated(2) == 8


def test_waiter_is_admitted_when_the_token_budget_frees():
    driver, kv = coordinator(token_budget=10)
    a = kv.try_reserve(1, 0, 8)
    assert kv.try_reserve(2, 0, 4) is None  # budget short, device never asked
    n = len(kv_calls(driver))
    t, outcome, _ = held_waiter(kv, 2, 0, 4, FAR)
    assert len(kv_calls(driver)) == n
    kv.rollback(a)
    assert isinstance(finish(t, outcome), KvReservation)
    assert kv.stats().budget_used == 4


def test_admission_is_first_come_first_served():
    _, kv = coordinator(token_budget=10)
    a = kv.try_reserve(1, 0, 10)
    t1, out1, _ = held_waiter(kv, 2, 0, 6, FAR)
    t2, out2, _ = held_waiter(kv, 3, 0, 2, FAR)  # would fit before t1, but t1 came first
    assert kv.try_reserve(4, 0, 1) is None       # queue not empty: no overtaking
    assert kv.stats().waiting == 2
    kv.rollback(a)
    r1 = finish(t1, out1)
    r2 = finish(t2, out2)
    assert (r1.seq_id, r2.seq_id) == (2, 3)
    assert kv.stats().budget_used == 8




def queue_waiters(kv: KvCoordinator, n: int, *, deadline: float = FAR, **kw):
    """``n`` threads queued in order, each reserving one token of sequence ``100 + i``."""
    return queue_in_order(
        n, lambda i, cancelled: kv.reserve(100 + i, 0, 1, deadline, cancelled=cancelled),
        **kw)

def test_each_end_wakes_only_the_head_not_the_herd():
    """50 waiters behind a budget of one token: each commit wakes the next waiter alone,
    so the wake-ups stay within a few per grant (notify_all made ~n per grant)."""
    n = 50
    _, kv = coordinator(token_budget=1)
    blocker = kv.try_reserve(1, 0, 1)

    def commit(r: KvReservation) -> None:
        kv.mark_submitted(r)
        kv.commit(r)

    threads, outcomes = queue_waiters(kv, n, then=commit)
    assert kv.stats().waiting == n and kv.stats().wakeups == 0
    kv.rollback(blocker)
    join_all(threads)
    assert [r.seq_id for _, r in outcomes] == list(range(100, 100 + n))  # FIFO kept
    s = kv.stats()
    grants = s.reserved - 1
    assert (grants, s.waiting, s.open) == (n, 0, 0)
    assert s.wakeups <= 3 * grants + n, f"{s.wakeups} wake-ups for {grants} grants"
    assert s.wakeups == n  # in this chain: one each, nobody woken to find no room


def test_a_cancelled_head_passes_the_head_role_on():
    _, kv = coordinator(token_budget=1)
    blocker = kv.try_reserve(1, 0, 1)
    r = served_after_a_cancelled_head(lambda n, **kw: queue_waiters(kv, n, **kw),
                                      lambda: kv.rollback(blocker))
    assert isinstance(r, KvReservation) and r.seq_id == 101


def test_a_head_past_its_deadline_passes_the_head_role_on():
    """The head waits for more than the budget has free; the waiter behind it would fit
    but may not overtake. When the head's deadline passes it leaves, and the next one is
    admitted without any other event."""
    clock = VirtualClock(0.0)
    _, kv = coordinator(token_budget=10, clock=clock)
    kv.try_reserve(1, 0, 6)
    head, head_out, _ = held_waiter(kv, 2, 0, 6, 0.05)   # ~50 ms real on a virtual clock
    threads, outcomes = queue_waiters(kv, 1)
    assert isinstance(finish(head, head_out), DeadlineExceeded)
    join_all(threads)
    assert isinstance(outcomes[0][1], KvReservation) and outcomes[0][1].seq_id == 100


def test_shutdown_and_wake_all_reach_the_waiters_behind_the_head():
    _, kv = coordinator(token_budget=1)
    kv.try_reserve(1, 0, 1)
    check_wake_all_and_stop_reach_everyone(
        lambda n, **kw: queue_waiters(kv, n, **kw), kv.wake_all, kv.shutdown,
        lambda: kv.stats().waiting, Unavailable)


def test_cancel_and_wake_all_stop_a_waiter():
    _, kv = coordinator(token_budget=4)
    kv.try_reserve(1, 0, 4)
    flag = threading.Event()
    t, outcome, _ = held_waiter(kv, 2, 0, 4, FAR, job_id=8, cancel_flag=flag)
    flag.set()
    kv.wake_all()
    err = finish(t, outcome)
    assert isinstance(err, Cancelled) and (err.job_id, err.seq_id) == (8, 2)
    assert kv.stats().waiting == 0
    assert kv.sequence_state(2) is SeqState.READY


def test_shutdown_wakes_waiters_with_unavailable_and_refuses_new_reserves():
    _, kv = coordinator(token_budget=4)
    r = kv.try_reserve(1, 0, 4)
    t, outcome, _ = held_waiter(kv, 2, 0, 4, FAR)
    kv.shutdown()
    assert isinstance(finish(t, outcome), Unavailable)
    with pytest.raises(Unavailable):
        kv.reserve(3, 0, 1, FAR)
    with pytest.raises(Unavailable):
        kv.try_reserve(3, 0, 1)
    kv.mark_submitted(r)  # drain: open reservations still end normally
    kv.commit(r)
    assert kv.stats().open == 0 and kv.stats().shutdown


def test_virtual_clock_wait_ends_when_the_clock_is_advanced_and_waiters_woken():
    clock = VirtualClock(0.0)
    _, kv = coordinator(sim(faults=FaultPlan.of(FaultRule.always("kv_can_allocate",
                                                                 "refuse"))), clock=clock)
    t, outcome, _ = held_waiter(kv, 1, 0, 1, 3600.0)  # an hour of virtual time
    clock.advance(3601.0)
    kv.wake_all()
    assert isinstance(finish(t, outcome), DeadlineExceeded)


def test_virtual_clock_wait_is_bounded_by_the_virtual_time_left():
    clock = VirtualClock(0.0)
    _, kv = coordinator(sim(faults=FaultPlan.of(FaultRule.always("kv_can_allocate",
                                                                 "refuse"))), clock=clock)
    start = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        kv.reserve(1, 0, 1, 0.05)  # nobody advances the clock: 50 ms real, then give up
    assert time.monotonic() - start < 5


# ---- concurrency: many threads, capacity conserved -------------------------------------

def test_concurrent_reserve_commit_rollback_conserve_capacity():
    driver = sim(kv_capacity=64, clock=RealClock())
    kv = KvCoordinator(driver, max_seq=8192, token_budget=24, clock=RealClock())
    n_threads, rounds = 6, 25
    start = threading.Barrier(n_threads)
    errors: list[BaseException] = []

    def worker(seq: int) -> None:
        try:
            start.wait()
            length = 0
            for i in range(rounds):
                n = 1 + (seq + i) % 4
                r = kv.reserve(seq, length, n, time.monotonic() + 30, job_id=seq * 100 + i)
                if i % 3 == 2:
                    kv.rollback(r)
                else:
                    kv.mark_submitted(r)
                    kv.commit(r)
                    length += n
                if length > 6:
                    kv.reset_sequence(seq)
                    length = 0
            assert kv.sequence_length(seq) == length == driver.kv_allocated(seq)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    s = kv.stats()
    assert (s.open, s.waiting, s.budget_used) == (0, 0, 0)
    assert s.reserved == n_threads * rounds == s.committed + s.rolled_back
    assert sum(driver.kv_allocated(q) for q in range(n_threads)) == sum(
        kv.sequence_length(q) for q in range(n_threads))


class KvMachine(RuleBasedStateMachine):
    """try_reserve / mark_submitted / commit / rollback / mark_unknown / reset_sequence in
    any order against a small device and budget: the coordinator's books, the device's
    allocations and the token budget always agree."""

    open = Bundle("open")
    SEQS = 4

    def __init__(self) -> None:
        super().__init__()
        self.driver = sim(kv_capacity=40, trace=False)
        self.kv = KvCoordinator(self.driver, max_seq=64, token_budget=16,
                                clock=VirtualClock())
        self.live: set[int] = set()

    @rule(target=open, seq=st.integers(0, SEQS - 1), count=st.integers(1, 12),
          rewind=st.booleans())
    def reserve(self, seq, count, rewind):
        state = self.kv.sequence_state(seq)
        past = 0 if rewind else self.kv.sequence_length(seq)
        if state is not SeqState.READY or past + count > 64:
            with pytest.raises((FailedPrecondition, InvalidArgument)):
                self.kv.try_reserve(seq, past, count)
            return None
        before = self.driver.kv_allocated(seq)
        r = self.kv.try_reserve(seq, past, count)
        if r is None:  # would wait: budget or device short, nothing changed
            assert self.driver.kv_allocated(seq) == before
            return None
        self.live.add(id(r))
        return r

    @rule(r=open)
    def submit(self, r):
        if r is not None and r.state == KvState.RESERVED:
            self.kv.mark_submitted(r)

    @rule(r=consumes(open), how=st.sampled_from(["commit", "rollback", "unknown"]))
    def end(self, r, how):
        if r is None:
            return
        legal = {"commit": r.state == KvState.SUBMITTED,
                 "rollback": r.state == KvState.RESERVED, "unknown": True}[how]
        op = {"commit": self.kv.commit, "rollback": self.kv.rollback,
              "unknown": lambda x: self.kv.mark_unknown(x, "test")}[how]
        if not legal:
            state = r.state
            with pytest.raises(IllegalTransition):
                op(r)
            assert r.state == state
            if r.state == KvState.RESERVED:
                self.kv.rollback(r)
            else:
                self.kv.mark_unknown(r, "test")
        else:
            op(r)
        self.live.discard(id(r))

    @rule(seq=st.integers(0, SEQS - 1))
    def reset(self, seq):
        if self.kv.open_reservation(seq) is not None:
            with pytest.raises(FailedPrecondition):
                self.kv.reset_sequence(seq)
        else:
            self.kv.reset_sequence(seq)
            assert self.driver.kv_allocated(seq) == 0

    @invariant()
    def capacity_conserved(self):
        s = self.kv.stats()
        opened = [self.kv.open_reservation(q) for q in range(self.SEQS)]
        opened = [r for r in opened if r is not None]
        assert s.open == len(opened) == len(self.live)
        assert s.reserved == s.committed + s.rolled_back + s.unknown + s.open
        assert s.budget_used == sum(r.tokens for r in opened) <= s.token_budget
        if not opened:
            assert s.budget_used == 0
        for q in range(self.SEQS):
            r = self.kv.open_reservation(q)
            committed = self.kv.sequence_length(q)
            dev = self.driver.kv_allocated(q)
            if self.kv.sequence_state(q) is SeqState.UNKNOWN:
                continue
            expected = committed + (r.growth if r is not None else 0)
            assert dev == expected == self.kv.allocation(q), (q, dev, expected)


TestKvMachine = KvMachine.TestCase
TestKvMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
