"""KvCoordinator: validation before the runtime, reservations granted now or refused (the
books never wait: who waits is the executor's admission queue,
tests/engine/test_admission_queue.py),
``on_freed`` after whatever gives capacity back, and the reserve -> submit -> commit /
rollback / Unknown transactions."""

from __future__ import annotations

import json
import threading

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

from calfsm.clock import RealClock
from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.drivers.sim import SimDriver
from calfsm.engine.kv import KvCoordinator, KvReservation, KvState, SeqState
from calfsm.errors import (
    CalfsmError,
    FailedPrecondition,
    IllegalTransition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from calfsm.manifest import builtin_manifest
from calfsm.runtime.sync import THREADS

TINY = builtin_manifest("tiny")
def sim(**kw) -> SimDriver:
    kw.setdefault("kv_capacity", 1 << 20)
    kw.setdefault("trace", True)        # kv_calls reads the whole trace
    return SimDriver(TINY, **kw)


def kv_calls(driver: SimDriver) -> list[dict]:
    return [d for d in map(json.loads, driver.trace_lines()) if d["call"].startswith("kv_")]


def coordinator(driver=None, *, max_seq=8192, token_budget=1 << 16, **kw):
    driver = driver or sim()
    return driver, KvCoordinator(driver, max_seq=max_seq, token_budget=token_budget,
                                 sync=THREADS, **kw)


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
    with pytest.raises(err, match=match) as info:
        kv.try_reserve(seq, past, count, job_id=77)
    e = info.value
    assert (e.job_id, e.stage, e.generation) == (77, "admission", 0)
    if isinstance(seq, int) and 0 <= seq < 2**31:
        assert e.seq_id == seq
    assert kv_calls(driver) == []
    assert kv.stats().sequences == 0


def test_the_last_position_of_max_seq_is_admitted():
    _, kv = coordinator(max_seq=40960, token_budget=40960)
    r = kv.try_reserve(1, 0, 40959)
    kv.mark_submitted(r)
    kv.commit(r)
    last = kv.try_reserve(1, 40959, 1)
    assert last.target_len == 40960
    with pytest.raises(InvalidArgument, match="40961 exceeds max_seq"):
        kv.try_reserve(1, 40960, 1)


def test_hole_open_reservation_and_unknown_sequence_are_refused():
    driver, kv = coordinator()
    with pytest.raises(InvalidArgument, match="hole"):
        kv.try_reserve(5, 1, 1, job_id=2)
    r = kv.try_reserve(5, 0, 4, job_id=2)
    with pytest.raises(FailedPrecondition, match="open KV reservation"):
        kv.try_reserve(5, 4, 1, job_id=3)
    with pytest.raises(FailedPrecondition, match="open KV reservation"):
        kv.try_reserve(5, 4, 1, job_id=3)
    kv.mark_unknown(r, "wait timed out")
    n = len(kv_calls(driver))
    with pytest.raises(FailedPrecondition, match="reset the sequence") as info:
        kv.try_reserve(5, 0, 1, job_id=4)
    assert (info.value.seq_id, info.value.job_id) == (5, 4)
    assert len(kv_calls(driver)) == n
    assert kv.sequence_state(5) is SeqState.UNKNOWN


# ---- transactions ---------------------------------------------------------------------

def test_reserve_submit_commit_grows_the_sequence():
    driver, kv = coordinator(token_budget=100)
    r = kv.try_reserve(1, 0, 17, job_id=10)
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


# ---- admission: granted now or refused, and told when to try again ------------------

class Freed:
    """An ``on_freed`` hook that counts its calls and can be waited for."""

    def __init__(self) -> None:
        self.calls = 0
        self.event = threading.Event()

    def __call__(self) -> None:
        self.calls += 1
        self.event.set()


def test_fi04_can_allocate_always_false_is_refused_at_once_holding_nothing():
    """The books' half of FI04: a device that never has room is a None at once, after
    one ``kv_can_allocate`` and no ``kv_apply``, with nothing left open or budgeted (the
    bounded wait without busy CPU is the admission queue's:
    tests/api/test_executor.py::test_fi04_kv_never_allocatable_waits_until_deadline_without_cpu)."""
    driver, kv = coordinator(sim(faults=FaultPlan.of(FaultRule.always("kv_can_allocate",
                                                                      "refuse"))))
    assert kv.try_reserve(7, 0, 16, job_id=70) is None
    calls = [c["call"] for c in kv_calls(driver)]
    assert calls == ["kv_can_allocate"]
    s = kv.stats()
    assert (s.open, s.budget_used, s.sequences, s.reserved) == (0, 0, 0, 0)


def test_a_short_budget_is_refused_without_asking_the_device():
    driver, kv = coordinator(token_budget=10)
    a = kv.try_reserve(1, 0, 8)
    n = len(kv_calls(driver))
    assert kv.try_reserve(2, 0, 4) is None
    assert len(kv_calls(driver)) == n
    kv.rollback(a)
    assert kv.try_reserve(2, 0, 4) is not None


def test_on_freed_follows_every_end_reset_and_truncate():
    """Each thing that gives capacity back calls ``on_freed`` once, with the lock free
    (the hook reads the books); a grant and a refusal call nothing."""
    _, kv = coordinator(sim(kv_capacity=64), token_budget=32)
    seen = []
    kv.on_freed = lambda: seen.append(kv.stats().budget_used)
    r = kv.try_reserve(1, 0, 8)
    assert kv.try_reserve(2, 0, 30) is None and seen == []
    kv.mark_submitted(r)
    kv.commit(r)                                   # 1: the end of a reservation
    r = kv.try_reserve(2, 0, 4)
    kv.rollback(r)                                 # 2
    r = kv.try_reserve(3, 0, 4)
    kv.mark_unknown(r, "wait timed out")           # 3
    kv.reset_sequence(3)                           # 4
    kv.truncate_sequence(1, 2)                     # 5
    assert seen == [0] * 5


def test_an_admission_turned_away_while_another_asks_the_device_is_told_when_it_ends():
    """Only one admission talks to the device at a time: a second one meanwhile is a
    None, and ``on_freed`` tells it to try again the moment the first one's call ends,
    granted or not."""
    asking, go = threading.Event(), threading.Event()
    driver = sim()
    real_apply = driver.kv_apply

    def slow_apply(seq_id: int, target: int) -> bool:
        asking.set()
        assert go.wait(10)
        return real_apply(seq_id, target)

    driver.kv_apply = slow_apply
    _, kv = coordinator(driver)
    freed = Freed()
    kv.on_freed = freed
    box: list = []
    t = threading.Thread(target=lambda: box.append(kv.try_reserve(1, 0, 4)))
    t.start()
    assert asking.wait(10)
    assert kv.try_reserve(2, 0, 4) is None           # turned away, not waiting
    assert freed.calls == 0
    go.set()
    t.join(10)
    assert isinstance(box[0], KvReservation) and freed.calls == 1
    driver.kv_apply = real_apply
    assert kv.try_reserve(2, 0, 4) is not None


def test_shutdown_refuses_new_reserves_and_open_ones_still_end():
    _, kv = coordinator()
    r = kv.try_reserve(1, 0, 4)
    kv.shutdown()
    with pytest.raises(Unavailable):
        kv.try_reserve(3, 0, 1)
    kv.rollback(r)
    assert kv.stats().open == 0 and kv.stats().shutdown


# ---- chained reservations: the next step reserved while the one before it runs -----

def test_a_chained_reservation_follows_the_running_one_and_commits_after_it():
    driver, kv = coordinator()
    r1 = kv.try_reserve(1, 0, 4, job_id=1)
    kv.mark_submitted(r1)
    with pytest.raises(FailedPrecondition, match="open KV reservation"):
        kv.try_reserve(1, 4, 1, job_id=2)                   # not asked to chain
    with pytest.raises(FailedPrecondition, match="open KV reservation"):
        kv.try_reserve(1, 3, 1, job_id=2, chain=True)       # not where it ends
    r2 = kv.try_reserve(1, 4, 1, job_id=2, chain=True)
    assert (r2.old_len, r2.target_len, r2.prev_len) == (4, 5, 4)
    assert kv.chained_reservation(1) is r2 and kv.open_reservation(1) is r1
    assert driver.kv_allocated(1) == 5 and kv.stats().open == 2
    with pytest.raises(FailedPrecondition, match="open KV reservation"):
        kv.try_reserve(1, 5, 1, job_id=3, chain=True)       # one chained at a time
    with pytest.raises(FailedPrecondition, match="after the one before it"):
        kv.commit(r2)
    assert r2.state == KvState.RESERVED
    kv.mark_submitted(r2)                                   # it may run before r1 commits
    kv.commit(r1)
    assert kv.open_reservation(1) is r2 and kv.chained_reservation(1) is None
    assert kv.sequence_length(1) == 4 and driver.kv_allocated(1) == 5
    kv.commit(r2)
    assert kv.sequence_length(1) == 5 and kv.stats().budget_used == 0


@pytest.mark.parametrize("how", ["rollback", "unknown"])
def test_a_chained_reservation_ends_with_the_one_before_it(how):
    driver, kv = coordinator()
    r1 = kv.try_reserve(1, 0, 4)
    r2 = kv.try_reserve(1, 4, 1, chain=True)
    if how == "rollback":
        kv.rollback(r1)
        assert (r1.state, r2.state) == (KvState.ROLLED_BACK, KvState.ROLLED_BACK)
        assert driver.kv_allocated(1) == 0 and kv.sequence_state(1) is SeqState.READY
    else:
        kv.mark_unknown(r1, "wait timed out")
        assert (r1.state, r2.state) == (KvState.UNKNOWN, KvState.UNKNOWN)
        assert kv.sequence_state(1) is SeqState.UNKNOWN
    s = kv.stats()
    assert (s.open, s.budget_used) == (0, 0)
    with pytest.raises(IllegalTransition):
        kv.rollback(r2)                 # its owner's give-back finds it ended: refused


def test_a_chained_reservation_rolled_back_alone_gives_back_to_where_its_predecessor_ends():
    driver, kv = coordinator()
    r1 = kv.try_reserve(1, 0, 4)
    kv.mark_submitted(r1)
    r2 = kv.try_reserve(1, 4, 2, chain=True)
    assert driver.kv_allocated(1) == 6
    kv.rollback(r2)
    assert driver.kv_allocated(1) == 4 and kv.chained_reservation(1) is None
    kv.commit(r1)
    assert kv.sequence_length(1) == 4 and kv.stats().open == 0


# ---- concurrency: many threads, capacity conserved -------------------------------------

def test_concurrent_reserve_commit_rollback_conserve_capacity():
    """Six threads reserve, commit, roll back and reset on a device and budget too small
    for all of them; a refused one sleeps until ``on_freed`` (no polling)."""
    driver = sim(kv_capacity=64, clock=RealClock())
    kv = KvCoordinator(driver, max_seq=8192, token_budget=24, sync=THREADS)
    changed = threading.Condition()
    version = [0]

    def freed() -> None:
        with changed:
            version[0] += 1
            changed.notify_all()

    kv.on_freed = freed
    n_threads, rounds = 6, 25
    start = threading.Barrier(n_threads)
    errors: list[BaseException] = []

    def reserve(seq: int, past: int, n: int, job_id: int) -> KvReservation:
        while True:
            with changed:
                seen = version[0]
            r = kv.try_reserve(seq, past, n, job_id=job_id)
            if r is not None:
                return r
            with changed:
                assert changed.wait_for(lambda s=seen: version[0] != s, 30), "never freed"

    def worker(seq: int) -> None:
        try:
            start.wait()
            length = 0
            for i in range(rounds):
                n = 1 + (seq + i) % 4
                r = reserve(seq, length, n, seq * 100 + i)
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
    assert (s.open, s.budget_used) == (0, 0)
    assert s.reserved == n_threads * rounds == s.committed + s.rolled_back
    assert sum(driver.kv_allocated(q) for q in range(n_threads)) == sum(
        kv.sequence_length(q) for q in range(n_threads))


class KvMachine(RuleBasedStateMachine):
    """try_reserve (chained after a running one too) / mark_submitted / commit / rollback
    / mark_unknown / reset_sequence in any order against a small device and budget: the
    coordinator's books, the device's allocations and the token budget always agree."""

    open = Bundle("open")
    SEQS = 4
    LIVE = (KvState.RESERVED, KvState.SUBMITTED)

    def __init__(self) -> None:
        super().__init__()
        self.driver = sim(kv_capacity=40, trace=False)
        self.kv = KvCoordinator(self.driver, max_seq=64, token_budget=16, sync=THREADS)
        self.granted: list[KvReservation] = []

    def _granted(self, r: KvReservation | None, seq: int, before: int):
        if r is None:  # would wait: budget or device short, nothing changed
            assert self.driver.kv_allocated(seq) == before
            return None
        self.granted.append(r)
        return r

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
        return self._granted(self.kv.try_reserve(seq, past, count), seq, before)

    @rule(target=open, r=open, count=st.integers(1, 4))
    def chain(self, r, count):
        """The next step reserved while ``r`` runs: legal only after the open one, once."""
        if r is None or r.target_len + count > 64:
            return None
        seq = r.seq_id
        legal = (r.state in self.LIVE and self.kv.open_reservation(seq) is r
                 and self.kv.chained_reservation(seq) is None
                 and self.kv.sequence_state(seq) is not SeqState.UNKNOWN)
        if not legal:
            if self.kv.sequence_state(seq) is SeqState.READY \
                    and self.kv.sequence_length(seq) >= r.target_len:
                return None         # an ordinary reservation there: not this rule's
            with pytest.raises((FailedPrecondition, InvalidArgument)):
                self.kv.try_reserve(seq, r.target_len, count, chain=True)
            return None
        before = self.driver.kv_allocated(seq)
        return self._granted(self.kv.try_reserve(seq, r.target_len, count, chain=True),
                             seq, before)

    @rule(r=open)
    def submit(self, r):
        if r is not None and r.state == KvState.RESERVED:
            self.kv.mark_submitted(r)

    @rule(r=consumes(open), how=st.sampled_from(["commit", "rollback", "unknown"]))
    def end(self, r, how):
        if r is None:
            return
        op = {"commit": self.kv.commit, "rollback": self.kv.rollback,
              "unknown": lambda x: self.kv.mark_unknown(x, "test")}[how]
        if r.state not in self.LIVE:        # ended with the one it was chained after
            with pytest.raises((IllegalTransition, FailedPrecondition)):
                op(r)
            return
        chained = self.kv.chained_reservation(r.seq_id) is r
        if how == "commit" and chained:
            with pytest.raises(FailedPrecondition, match="after the one before it"):
                op(r)
            self.kv.mark_unknown(r, "test")
            return
        legal = {"commit": r.state == KvState.SUBMITTED,
                 "rollback": r.state == KvState.RESERVED, "unknown": True}[how]
        after = None if chained else self.kv.chained_reservation(r.seq_id)
        if how == "rollback" and legal and after is not None \
                and after.state != KvState.RESERVED:
            legal = False               # a submitted step cannot be rolled back under
        if not legal:
            state = r.state
            with pytest.raises(IllegalTransition):
                op(r)
            assert r.state == state
            self.kv.mark_unknown(r, "test")
        else:
            op(r)
        if after is not None and how != "commit":
            assert after.state not in self.LIVE     # it ended with the one before it

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
        live = [r for r in self.granted if r.state in self.LIVE]
        held = [r for q in range(self.SEQS)
                for r in (self.kv.open_reservation(q), self.kv.chained_reservation(q))
                if r is not None]
        assert s.open == len(held) == len(live)
        assert {id(r) for r in held} == {id(r) for r in live}
        assert s.reserved == s.committed + s.rolled_back + s.unknown + s.open
        assert s.budget_used == sum(r.tokens for r in live) <= s.token_budget
        for q in range(self.SEQS):
            r = self.kv.open_reservation(q)
            nxt = self.kv.chained_reservation(q)
            assert nxt is None or (r is not None and nxt.old_len == r.target_len)
            committed = self.kv.sequence_length(q)
            dev = self.driver.kv_allocated(q)
            if self.kv.sequence_state(q) is SeqState.UNKNOWN:
                continue
            expected = committed + (r.growth if r is not None else 0)
            if nxt is not None:
                expected = max(expected, nxt.target_len)
            assert dev == expected == self.kv.allocation(q), (q, dev, expected)


TestKvMachine = KvMachine.TestCase
TestKvMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
