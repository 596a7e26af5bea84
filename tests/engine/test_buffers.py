"""BufferPool / BufferLease: build once, move-only leases, clean-return checks, quarantine,
generation retirement."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from calfsm.drivers.base import EngineSlot
from calfsm.engine.buffers import BufferLease, BufferPool, PoolStats, SlotState
from calfsm.errors import (
    CalfsmError,
    CalrtCode,
    Internal,
    InvalidArgument,
    LeaseError,
    ResourceExhausted,
    Unavailable,
    Unsupported,
)
from calfsm.manifest import TaskKind
from calfsm.runtime.sync import THREADS
from tests.helpers.buffers import DECODE, MODELS, PREFILL, TINY, FakeDriver, make_pool


def assert_invariant(pool: BufferPool) -> PoolStats:
    s = pool.stats()
    assert s.free + s.leased + s.quarantined == s.total
    return s


# ---- build ---------------------------------------------------------------------------

def test_build_creates_and_maps_every_slot_once_with_exact_host_arrays():
    drv, pool = make_pool(engines=(EngineSlot.PING, EngineSlot.PONG), slots_per_engine=2)
    assert pool.stats() == PoolStats(0, total=8, free=8, leased=0, quarantined=0)
    assert drv.names().count("create_buffers") == 8
    assert drv.names().count("map_buffer") == 24
    for slot in pool.slots:
        c = slot.contract
        assert slot.token_host.nbytes == c.token_or_embed.byte_size
        assert slot.position_host.nbytes == c.position.byte_size
        assert slot.logits.nbytes == c.logits.byte_size and slot.logits.dtype == np.uint16
        assert slot.tokens.base is slot.token_host and slot.tokens.ndim == 1
        assert drv.maps[(slot.inp[1], c.token_or_embed.name)] is slot.token_host
        assert drv.maps[(slot.out[1], c.logits.name)] is slot.logits
    # Leasing and returning calls no runtime function: nothing allocated on the hot path.
    before = len(drv.calls)
    for _ in range(3):
        assert pool.release(pool.acquire(TaskKind.DECODE, EngineSlot.PONG))
    assert len(drv.calls) == before


def test_build_failure_checks_the_code_and_destroys_what_it_created():
    drv = FakeDriver()
    drv.fail["map_buffer"] = CalrtCode.SHAPE_MISMATCH
    with pytest.raises(Internal) as info:
        BufferPool.build(drv, 3, MODELS, sync=THREADS)
    assert info.value.calrt_code == CalrtCode.SHAPE_MISMATCH
    assert info.value.stage == "map" and info.value.generation == 3
    assert drv.destroyed == {1}
    drv = FakeDriver()
    drv.fail["create_buffers"] = CalrtCode.UNSUPPORTED
    with pytest.raises(Unsupported):
        BufferPool.build(drv, 0, MODELS, engines=(EngineSlot.PING,), sync=THREADS)


# ---- acquire / release ------------------------------------------------------------------

def test_acquire_until_exhausted_then_release_makes_it_available_again():
    _, pool = make_pool(slots_per_engine=2)
    a = pool.acquire(TaskKind.DECODE)
    b = pool.acquire(TaskKind.DECODE)
    assert a.slot is not b.slot
    with pytest.raises(ResourceExhausted) as info:
        pool.acquire(TaskKind.DECODE)
    assert info.value.http_status == 429
    assert pool.acquire(TaskKind.PREFILL_IDS).kind is TaskKind.PREFILL_IDS
    assert pool.release(a) is True
    assert pool.acquire(TaskKind.DECODE).slot.kind is TaskKind.DECODE
    assert assert_invariant(pool).leased == 3


def test_unknown_kind_or_engine_is_unsupported():
    _, pool = make_pool()
    with pytest.raises(Unsupported):
        pool.acquire(TaskKind.VISION)
    with pytest.raises(Unsupported):
        pool.acquire(TaskKind.DECODE, EngineSlot.PING)


def test_lease_used_after_move_raises_and_the_new_owner_works():
    drv, pool = make_pool()
    old = pool.acquire(TaskKind.DECODE).bind(job_id=7, seq_id=1)
    slot = old.slot
    new = old.move()
    assert not old.valid and new.valid and new.slot is slot and new.job_id == 7
    n_calls = len(drv.calls)
    for use in (lambda: old.slot, lambda: old.slice("input_ids", 0, 4),
                lambda: old.set_csr("cur_seq", 1), lambda: old.write_inputs([1], [0]),
                lambda: old.move(), lambda: pool.release(old)):
        with pytest.raises(LeaseError, match="moved") as info:
            use()
        assert (info.value.job_id, info.value.seq_id, info.value.generation) == (7, 1, 0)
    assert len(drv.calls) == n_calls
    assert pool.release(new)


def test_double_return_raises_lease_error():
    _, pool = make_pool()
    lease = pool.acquire(TaskKind.DECODE)
    assert pool.release(lease)
    with pytest.raises(LeaseError, match="returned") as info:
        pool.release(lease)
    assert isinstance(info.value, CalfsmError) and info.value.stage == "lease"
    assert assert_invariant(pool).free == 2


def test_lease_of_another_generation_is_refused_and_its_slot_left_alone():
    _, old_pool = make_pool(generation=1)
    _, new_pool = make_pool(generation=2)
    lease = old_pool.acquire(TaskKind.DECODE)
    with pytest.raises(LeaseError, match="generation 1") as info:
        new_pool.release(lease)
    assert info.value.generation == 1
    assert lease.valid and lease.slot.state is SlotState.LEASED
    assert new_pool.stats().free == 2 and old_pool.stats().leased == 1
    assert old_pool.release(lease)


def test_return_while_on_device_is_refused_and_quarantines():
    _, pool = make_pool(slots_per_engine=2)
    lease = pool.acquire(TaskKind.DECODE).bind(job_id=5)
    slot = lease.slot
    lease.mark_on_device()
    with pytest.raises(LeaseError, match="on the device") as info:
        pool.release(lease)
    assert info.value.job_id == 5
    assert slot.state is SlotState.QUARANTINED and not lease.valid
    assert assert_invariant(pool).quarantined == 1
    # after wait returned, a return is normal
    lease = pool.acquire(TaskKind.DECODE)
    lease.mark_on_device()
    lease.mark_off_device()
    assert pool.release(lease)


def test_fi15_slot_returned_with_slice_not_undone_is_quarantined_never_leased_again():
    _, pool = make_pool(slots_per_engine=2)
    lease = pool.acquire(TaskKind.PREFILL_IDS)
    dirty = lease.slot
    lease.slice("input_ids", 0, 16)
    assert pool.release(lease) is False
    assert dirty.state is SlotState.QUARANTINED and "input_ids" in dirty.reason
    assert assert_invariant(pool).quarantined == 1
    seen = set()
    for _ in range(20):
        lease = pool.acquire(TaskKind.PREFILL_IDS)
        seen.add(id(lease.slot))
        assert lease.slot is not dirty
        pool.release(lease)
    assert len(seen) == 1
    last = pool.acquire(TaskKind.PREFILL_IDS)
    with pytest.raises(ResourceExhausted):  # the quarantined one is not lent
        pool.acquire(TaskKind.PREFILL_IDS)
    assert last.slot is not dirty
    # undone slices make a clean return
    drv2, pool2 = make_pool()
    lease = pool2.acquire(TaskKind.PREFILL_IDS)
    lease.slice_inputs(3)
    assert set(lease.slices) == {"input_ids", "position_ids"}
    lease.undo_slices()
    assert drv2.names()[-2:] == ["undo_slice", "undo_slice"]
    assert pool2.release(lease) is True


def test_failed_undo_keeps_the_slice_tracked_so_the_return_quarantines():
    drv, pool = make_pool()
    lease = pool.acquire(TaskKind.PREFILL_IDS).bind(job_id=2, seq_id=8)
    lease.slice("input_ids", 0, 8)
    drv.fail["undo_slice"] = CalrtCode.DEVICE_UNAVAILABLE
    with pytest.raises(Unavailable) as info:
        lease.undo_slices()
    assert (info.value.job_id, info.value.seq_id, info.value.stage) == (2, 8, "undo_slice")
    assert pool.release(lease) is False


# ---- slice / csr / kv seq / inputs: checked before the runtime ------------------------

@pytest.mark.parametrize(("offset", "size", "match"), [
    (0, PREFILL.token_or_embed.byte_size + 1, "outside"),
    (4, PREFILL.token_or_embed.byte_size, "outside"),
    (-4, 8, "outside"), (0, 0, "outside"), (0, -4, "outside"),
    (2, 4, "multiple"), (0, 6, "multiple"), (0, 4.0, "integer"), (True, 4, "integer")])
def test_bad_slice_is_rejected_locally_with_context(offset, size, match):
    drv, pool = make_pool()
    lease = pool.acquire(TaskKind.PREFILL_IDS).bind(job_id=11, seq_id=3)
    with pytest.raises(InvalidArgument, match=match) as info:
        lease.slice("input_ids", offset, size)
    err = info.value
    assert (err.job_id, err.seq_id, err.generation, err.stage) == (11, 3, 0, "slice")
    assert "slice_tensor" not in drv.names()
    assert not lease.slices


def test_slice_of_unknown_tensor_and_driver_error_are_raised_with_context():
    drv, pool = make_pool()
    lease = pool.acquire(TaskKind.PREFILL_IDS).bind(job_id=1)
    with pytest.raises(InvalidArgument, match="no tensor"):
        lease.slice("inputs_ids", 0, 4)
    assert "slice_tensor" not in drv.names()
    drv.fail["slice_tensor"] = CalrtCode.OUT_OF_RANGE
    with pytest.raises(InvalidArgument) as info:
        lease.slice("logits", 0, 2)
    assert info.value.calrt_code == CalrtCode.OUT_OF_RANGE and info.value.job_id == 1
    assert not lease.slices  # not applied
    assert drv.calls[-1][1][0] == lease.slot.out  # output tensor sliced on the out buffer


def test_set_csr_and_kv_seq_check_values_locally_and_codes_from_the_driver():
    drv, pool = make_pool()
    lease = pool.acquire(TaskKind.DECODE).bind(job_id=4, seq_id=9)
    for bad in (-1, 2**32, 1.5, True):
        with pytest.raises(InvalidArgument):
            lease.set_csr("cur_seq", bad)
    for bad in (-1, 2**31):
        with pytest.raises(InvalidArgument):
            lease.set_kv_seq(bad)
    assert not {"set_csr", "set_kv_seq"} & set(drv.names())
    lease.set_csr("cur_seq", 2**32 - 1)
    lease.set_kv_seq(2**31 - 1)
    drv.fail["set_csr"] = CalrtCode.NOT_FOUND
    with pytest.raises(Internal) as info:
        lease.set_csr("cur_seqq", 1)
    assert (info.value.calrt_code, info.value.stage, info.value.job_id) == (3, "csr", 4)


def test_write_inputs_copies_and_checks_lengths():
    _, pool = make_pool()
    lease = pool.acquire(TaskKind.PREFILL_IDS)
    assert lease.write_inputs([5, 6, 7], [0, 1, 2]) == 3
    assert lease.slot.tokens[:3].tolist() == [5, 6, 7]
    assert lease.slot.positions[:3].tolist() == [0, 1, 2]
    for toks, pos, match in (([], [], "no tokens"), ([1, 2], [0], "positions"),
                             ([1] * 8193, list(range(8193)), "capacity"),
                             ([2**31], [0], "fit"), ([1], [-1], "negative"),
                             ([1.5], [0], "integers"), ([[1]], [0], "1-D")):
        with pytest.raises(InvalidArgument, match=match):
            lease.write_inputs(toks, pos)
    assert lease.slot.tokens[:3].tolist() == [5, 6, 7]
    dec = pool.acquire(TaskKind.DECODE)
    with pytest.raises(InvalidArgument, match="capacity of 1"):
        dec.write_inputs([1, 2], [0, 1])


# ---- a slot coming back ---------------------------------------------------------------

def test_a_slot_back_in_the_free_list_calls_on_freed_and_a_quarantined_one_does_not():
    """``acquire`` never waits: who waits is the executor's admission queue, which
    ``on_freed`` tells when a slot is free again (no lock held: the hook may read the
    pool). A slot that does not come back free calls nothing."""
    _, pool = make_pool(slots_per_engine=2)
    seen: list[int] = []
    pool.on_freed = lambda: seen.append(pool.stats().free)
    a, b = pool.acquire(TaskKind.DECODE), pool.acquire(TaskKind.DECODE)
    with pytest.raises(ResourceExhausted):
        pool.acquire(TaskKind.DECODE)
    assert seen == []
    free_before = pool.stats().free
    pool.release(a)
    assert seen == [free_before + 1]
    pool.quarantine(b, "wait timed out")
    assert seen == [free_before + 1]
    assert_invariant(pool)


# ---- retire ----------------------------------------------------------------------------

def test_retire_destroys_free_slots_and_quarantines_leased_ones_on_return():
    drv, pool = make_pool(slots_per_engine=2)
    lease = pool.acquire(TaskKind.DECODE)
    pool.retire()
    s = assert_invariant(pool)
    assert (s.free, s.leased, s.quarantined, s.retired) == (0, 1, 3, True)
    assert drv.names().count("destroy_buffers") == 3
    assert not lease.slot.destroyed
    with pytest.raises(Unavailable):
        pool.acquire(TaskKind.PREFILL_IDS)
    assert pool.release(lease) is False
    assert lease.valid is False
    s = assert_invariant(pool)
    assert (s.free, s.leased, s.quarantined) == (0, 0, 4)
    pool.retire()
    assert drv.names().count("destroy_buffers") == 3



def test_a_failed_destroy_on_retire_is_logged_classified_and_the_retirement_finishes(
        caplog):
    drv, pool = make_pool()
    drv.fail["destroy_buffers"] = int(CalrtCode.DEVICE_UNAVAILABLE)
    with caplog.at_level("WARNING", logger="calfsm.engine.buffers"):
        pool.retire()
    assert drv.names().count("destroy_buffers") == 2       # both tried, none raised
    records = [r for r in caplog.records if getattr(r, "stage", None) == "destroy_buffers"]
    assert len(records) == 2
    r = records[0]
    assert (r.calrt_code, r.error, r.generation) == (
        int(CalrtCode.DEVICE_UNAVAILABLE), "Unavailable", 0)
    assert "DEVICE_UNAVAILABLE" in r.getMessage() and r.category == "device"
    assert assert_invariant(pool).quarantined == 2

# ---- stateful: any sequence keeps the books straight -----------------------------------

class PoolMachine(RuleBasedStateMachine):
    """Acquire, move, bind, slice, undo, mark on/off device, return, quarantine and
    retire/rebuild generations: free + leased + quarantined == total in every pool, and no
    slot ever has two live holders."""

    leases = Bundle("leases")

    def __init__(self) -> None:
        super().__init__()
        self.driver = FakeDriver()
        self.generation = 0
        self.pool = BufferPool.build(self.driver, 0, MODELS, slots_per_engine=2, sync=THREADS)
        self.pools = [self.pool]
        self.live: dict[int, BufferLease] = {}  # id(slot) -> the one live lease
        self.dead: list[BufferLease] = []

    def _pool_of(self, lease: BufferLease) -> BufferPool:
        return next(p for p in self.pools if p.generation == lease.generation)

    @rule(target=leases, kind=st.sampled_from([TaskKind.PREFILL_IDS, TaskKind.DECODE]))
    def acquire(self, kind):
        try:
            lease = self.pool.acquire(kind)
        except ResourceExhausted:
            assert self.pool.stats().free == 0 or all(
                s.state is not SlotState.FREE for s in self.pool.slots if s.kind is kind)
            return None
        assert id(lease.slot) not in self.live, "slot given to two holders"
        assert lease.slot.generation == self.generation
        self.live[id(lease.slot)] = lease
        return lease

    @rule(target=leases, lease=consumes(leases))
    def move(self, lease):
        if lease is None:
            return None
        new = lease.move()
        self.live[id(new.slot)] = new
        self.dead.append(lease)
        return new

    @rule(lease=leases, job=st.integers(0, 99))
    def bind_and_slice(self, lease, job):
        if lease is None:
            return
        lease.bind(job_id=job, seq_id=job % 3)
        lease.slice(lease.slot.contract.token_or_embed.name, 0, 4)

    @rule(lease=leases)
    def undo(self, lease):
        if lease is not None:
            lease.undo_slices()

    @rule(lease=leases, on=st.booleans())
    def device(self, lease, on):
        if lease is None:
            return
        if on:
            lease.mark_on_device()
        else:
            lease.mark_off_device()

    @rule(lease=consumes(leases))
    def release(self, lease):
        if lease is None:
            return
        slot = lease.slot
        pool = self._pool_of(lease)
        dirty = bool(lease.slices) or lease.on_device or pool.retired
        if self.pool is not pool:
            with pytest.raises(LeaseError):
                self.pool.release(lease)
            assert lease.valid
        if lease.on_device:
            with pytest.raises(LeaseError):
                pool.release(lease)
        else:
            assert pool.release(lease) is (not dirty)
        assert slot.state is (SlotState.FREE if not dirty else
                              (SlotState.RETIRED if pool.retired else SlotState.QUARANTINED))
        del self.live[id(slot)]
        self.dead.append(lease)

    @rule(lease=consumes(leases))
    def quarantine(self, lease):
        if lease is None:
            return
        slot = lease.slot
        self._pool_of(lease).quarantine(lease, "test")
        assert slot.state in (SlotState.QUARANTINED, SlotState.RETIRED)
        del self.live[id(slot)]
        self.dead.append(lease)

    @precondition(lambda self: len(self.pools) < 4)
    @rule()
    def retire_and_rebuild(self):
        self.pool.retire()
        self.generation += 1
        self.pool = BufferPool.build(self.driver, self.generation, MODELS,
                                     slots_per_engine=2, sync=THREADS)
        self.pools.append(self.pool)

    @rule()
    def dead_leases_stay_dead(self):
        for lease in self.dead[-3:]:
            with pytest.raises(LeaseError):
                lease.slot  # noqa: B018

    @invariant()
    def books_balance(self):
        for pool in self.pools:
            s = pool.stats()
            assert s.free + s.leased + s.quarantined == s.total
            states = [sl.state for sl in pool.slots]
            assert s.free == states.count(SlotState.FREE)
            assert s.leased == states.count(SlotState.LEASED)
            live = [lz for lz in self.live.values() if lz.generation == pool.generation]
            assert s.leased == len(live)
            for sl in pool.slots:
                assert (sl.state is SlotState.LEASED) == (sl.holder is not None)
        assert all(lease.valid for lease in self.live.values())
        assert len({id(lease.slot) for lease in self.live.values()}) == len(self.live)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


# ---- against the simulated device ----------------------------------------------------

def sim_pool(**kw):
    from calfsm.drivers.sim import SimDriver

    driver = SimDriver(TINY, trace=True, **kw)     # trace_calls reads the whole trace
    assert driver.configure(driver.calbin) == 0
    models = {}
    for kind in (TaskKind.PREFILL_IDS, TaskKind.DECODE):
        contract = TINY.submodel(kind)
        code, handle = driver.model(contract.exact_name)
        assert code == 0
        models[kind] = (handle, contract)
    return driver, BufferPool.build(driver, 0, models, sync=THREADS)


def trace_calls(driver) -> list[str]:
    import json

    return [json.loads(line)["call"] for line in driver.trace_lines()]


@pytest.mark.parametrize("tensor", ["input_ids", "position_ids", "logits"])
def test_fi03_slice_of_bytesize_plus_one_is_rejected_locally_runtime_not_called(tensor):
    driver, pool = sim_pool()
    lease = pool.acquire(TaskKind.PREFILL_IDS).bind(job_id=31, seq_id=2)
    byte_size = lease.slot.tensor(tensor)[0].byte_size
    with pytest.raises(InvalidArgument) as info:
        lease.slice(tensor, 0, byte_size + 1)
    err = info.value
    assert (err.job_id, err.seq_id, err.generation, err.stage) == (31, 2, 0, "slice")
    assert err.http_status == 400 and str(byte_size) in err.message
    assert "slice_tensor" not in trace_calls(driver)
    assert not lease.slices
    # the largest legal slice does reach the device, and a clean return follows the undo
    lease.slice(tensor, 0, byte_size)
    assert trace_calls(driver).count("slice_tensor") == 1
    lease.undo_slices()
    assert pool.release(lease) is True


def test_fi15_on_the_simulated_device_dirty_slot_never_comes_back():
    driver, pool = sim_pool()
    lease = pool.acquire(TaskKind.PREFILL_IDS)
    dirty = lease.slot
    lease.slice_inputs(4)
    assert pool.release(lease) is False
    assert dirty.state is SlotState.QUARANTINED
    with pytest.raises(ResourceExhausted):  # the only prefill slot is out of service
        pool.acquire(TaskKind.PREFILL_IDS)
    assert assert_invariant(pool) == PoolStats(0, total=2, free=1, leased=0, quarantined=1)
    assert "destroy_buffers" not in trace_calls(driver)  # its host arrays stay alive


def test_load_programs_the_slot_for_one_job() -> None:
    """load(): inputs copied, only sliceable tensors sliced, KV sequence bound, and the
    CSRs the device checks: cur_seq = n, total_seq = last position + 1."""
    driver, pool = make_pool()
    lease = pool.acquire(TaskKind.PREFILL_IDS)
    driver.calls.clear()
    assert lease.load(4, [7, 8, 9], [5, 6, 7]) == 3
    assert list(lease.slot.tokens[:3]) == [7, 8, 9]
    got = [(name, args[1:]) for name, args in driver.calls]
    item = PREFILL.position.dtype.itemsize
    assert got == [
        ("slice_tensor", (PREFILL.token_or_embed.name, 0, 3 * item)),
        ("slice_tensor", (PREFILL.position.name, 0, 3 * item)),
        ("set_kv_seq", (4,)),
        ("set_csr", (PREFILL.csr_cur_seq, 3)),
        ("set_csr", (PREFILL.csr_total_seq, 8)),
    ]
    lease.undo_slices()
    pool.release(lease)
    decode = pool.acquire(TaskKind.DECODE)
    driver.calls.clear()
    decode.load(4, [1], [8])
    assert ("slice_tensor" in driver.names()) == DECODE.token_or_embed.sliceable
    pool.release(decode)
