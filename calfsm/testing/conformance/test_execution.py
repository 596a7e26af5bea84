"""Conformance: KV manager, device-side checks, queueing, timing, resets."""

from __future__ import annotations

import math

import numpy as np
import pytest

from calfsm.drivers.base import EngineSlot, OutputStatus, ResetKind
from calfsm.drivers.sim import LatencyModel
from calfsm.errors import CalrtCode as C
from calfsm.manifest import TaskKind
from calfsm.testing import refmodel_pure as pure
from calfsm.testing.conformance.util import (
    aborted,
    answer,
    pending,
    prepare,
    run,
    setup,
    small_calbin,
)

CB = small_calbin(vocab=64, max_seq=64)
OK, EXC = OutputStatus.DONE_OK, OutputStatus.DONE_CCU_EXCEPTION
SLOW = LatencyModel.fixed(decode_s=1.0, prefill_per_token_s=0.1)


# ---- KV manager ------------------------------------------------------------------------

def test_kv_capacity(make_driver) -> None:
    d = make_driver(kv_capacity=10)
    assert d.kv_can_allocate(10) and not d.kv_can_allocate(11)
    assert d.kv_apply(1, 6)
    assert d.kv_can_allocate(4) and not d.kv_can_allocate(5)
    assert not d.kv_apply(2, 5)              # beyond capacity: False, nothing changes
    assert d.kv_can_allocate(4)
    assert d.kv_apply(2, 4)
    assert not d.kv_can_allocate(1)
    assert d.kv_apply(1, 3)                  # not above the allocation: True, no change
    assert not d.kv_can_allocate(1)
    assert d.kv_release(1, 2) == 0           # frees 4
    assert d.kv_can_allocate(4) and not d.kv_can_allocate(5)
    assert d.kv_release(2) == 0
    assert d.kv_release(99) == 0             # unknown sequence
    assert d.kv_can_allocate(8)
    assert d.kv_apply(3, 8)


def test_kv_release_forgets_words(driver) -> None:
    d = driver
    d.configure(CB)
    dec = setup(d, CB, TaskKind.DECODE)
    for p, t in enumerate([1, 2, 3]):
        assert run(d, dec, 0, [t], p) == OK
    assert d.kv_release(0, 1) == 0           # keep position 0 only
    assert run(d, dec, 0, [9], 2) == OK      # reads kv[1]: forgotten -> 0
    assert dec.logits.reshape(-1).tolist() == pure.logits_bf16(pure.step(0, 9, 2), 64)


def test_position_beyond_kv_allocation_is_device_exception(driver) -> None:
    d = driver
    d.configure(CB)
    dec = setup(d, CB, TaskKind.DECODE)
    dec.logits[...] = 0x1234
    assert run(d, dec, 0, [1], 0, apply=False) == EXC       # nothing allocated
    assert (dec.logits == 0x1234).all()                     # nothing written
    assert d.output_bytes(dec.out, "logits") == (0, 0)
    assert d.kv_apply(0, 3)
    assert run(d, dec, 0, [1], 3, apply=False) == EXC        # position 3 >= allocation 3
    assert run(d, dec, 0, [1], 2, apply=False) == OK


def test_position_beyond_max_seq_is_device_exception(make_driver) -> None:
    d = make_driver()
    cb = small_calbin(vocab=64, max_seq=32)
    d.configure(cb)
    dec = setup(d, cb, TaskKind.DECODE)
    assert d.kv_apply(0, 40)
    assert run(d, dec, 0, [1], 31, apply=False) == OK
    assert run(d, dec, 0, [1], 32, apply=False) == EXC


@pytest.mark.parametrize(("cur", "total"), [(2, 3), (3, 4), (3, 2), (0, 3)])
def test_csr_disagreement_is_device_exception(driver, cur, total) -> None:
    d = driver
    d.configure(CB)
    pre = setup(d, CB, TaskKind.PREFILL_IDS)
    pre.logits[...] = 7
    assert run(d, pre, 0, [1, 2, 3], 0, cur=cur, total=total) == EXC
    assert (pre.logits == 7).all()


def test_position_slice_disagreement_is_device_exception(driver) -> None:
    d = driver
    d.configure(CB)
    pre = setup(d, CB, TaskKind.PREFILL_IDS)
    prepare(d, pre, 0, [1, 2, 3], 0)
    assert d.slice_tensor(pre.inp, "position_ids", 0, 8) == 0
    assert d.infer(pre.model, pre.inp, pre.out) == 0
    assert d.wait(pre.out, 1e6) == 0
    assert d.status(pre.out) == EXC


def test_exception_writes_no_kv(driver) -> None:
    d = driver
    d.configure(CB)
    dec = setup(d, CB, TaskKind.DECODE)
    assert run(d, dec, 0, [1], 0) == OK
    assert run(d, dec, 0, [2], 1, total=5) == EXC           # would write kv[1]
    assert run(d, dec, 0, [3], 2) == OK                     # reads kv[1]: still 0
    assert dec.logits.reshape(-1).tolist() == pure.logits_bf16(pure.step(0, 3, 2), 64)


# ---- queue, timing ---------------------------------------------------------------------

def test_serial_queue_holds_one_job(make_driver) -> None:
    d = make_driver(latency=SLOW)
    d.configure(CB)
    a = setup(d, CB, TaskKind.DECODE)
    b = setup(d, CB, TaskKind.DECODE)
    prepare(d, a, 0, [1], 0)
    prepare(d, b, 1, [1], 0)
    assert d.infer(a.model, a.inp, a.out) == 0
    a_runs = lambda: pending(d, a)     # noqa: E731
    # out pending: refused (once a's job ended, the same buffer takes the next)
    answer(d, lambda: d.infer(a.model, a.inp, a.out), refused=C.DEVICE_BUSY, accepted=0,
           while_=a_runs, resubmits=True)
    queued = answer(d, lambda: d.infer(b.model, b.inp, b.out), refused=C.DEVICE_BUSY,
                    accepted=0, while_=a_runs)                  # queue full
    if queued == C.DEVICE_BUSY:
        assert d.status(b.out) == OutputStatus.IDLE             # refused, not queued
        assert d.wait(a.out, 1e6) == 0
        assert d.infer(b.model, b.inp, b.out) == 0
    assert d.wait(a.out, 1e6) == 0 and d.wait(b.out, 1e6) == 0
    assert d.status(a.out) == d.status(b.out) == OK


def test_pending_buffer_cannot_be_changed(make_driver) -> None:
    d = make_driver(latency=SLOW)
    d.configure(CB)
    a = setup(d, CB, TaskKind.DECODE)
    prepare(d, a, 0, [1], 0)
    assert d.infer(a.model, a.inp, a.out) == 0
    a_runs = lambda: pending(d, a)     # noqa: E731
    for change in (lambda: d.set_csr(a.inp, "cur_seq", 1), lambda: d.set_kv_seq(a.inp, 3),
                   lambda: d.map_buffer(a.inp, "input_ids", a.tok),
                   lambda: d.enable_parallel_mode(True)):
        answer(d, change, refused=C.DEVICE_BUSY, accepted=0, while_=a_runs)
    # mapping the output of an ended job consumes its result (status IDLE)
    mapped = answer(d, lambda: d.map_buffer(a.out, "logits", a.logits),
                    refused=C.DEVICE_BUSY, accepted=0, while_=a_runs)
    if mapped == C.DEVICE_BUSY:
        assert d.wait(a.out, 1e6) == 0 and d.status(a.out) == OK
    else:
        assert d.status(a.out) == OutputStatus.IDLE


def test_wait_timeout_keeps_job_pending(make_driver) -> None:
    d = make_driver(latency=SLOW)
    d.configure(CB)
    a = setup(d, CB, TaskKind.DECODE)
    prepare(d, a, 0, [1], 0)
    assert d.infer(a.model, a.inp, a.out) == 0
    a_runs = lambda: pending(d, a)     # noqa: E731
    answer(d, lambda: d.wait(a.out, 0.0), refused=C.TIMEOUT, accepted=0, while_=a_runs)
    answer(d, lambda: d.status(a.out), refused=OutputStatus.PENDING, accepted=OK,
           while_=a_runs)
    got: list[tuple] = []
    code = answer(d, lambda: got.append(d.output_bytes(a.out, "logits")) or got[-1][0],
                  refused=C.INVALID_STATE, accepted=0, while_=a_runs)
    assert got[-1] == ((0, 128) if code == 0 else (C.INVALID_STATE, None))
    assert d.wait(a.out, 1e6) == 0
    assert d.status(a.out) == OK
    assert d.output_bytes(a.out, "logits") == (0, 128)


def test_virtual_time_wait_advances_to_finish(make_driver) -> None:
    lat = LatencyModel(h2d_s_per_byte=1e-3, decode_s=0.5, d2h_s_per_byte=1e-4)
    d = make_driver(latency=lat)
    if not d.clock.virtual:
        pytest.skip("virtual-time driver only")
    d.configure(CB)
    a = setup(d, CB, TaskKind.DECODE)
    prepare(d, a, 0, [1], 0)
    t0 = d.clock.now()
    assert d.infer(a.model, a.inp, a.out) == 0
    assert d.wait(a.out, 0.25) == C.TIMEOUT
    assert d.clock.now() == pytest.approx(t0 + 0.25)
    assert d.wait(a.out, 10.0) == 0
    # H2D 8 bytes, compute 0.5 s, D2H 128 bytes
    assert d.clock.now() == pytest.approx(t0 + 8e-3 + 0.5 + 128e-4)


def test_parallel_mode_two_in_flight_and_overlap(make_driver) -> None:
    lat = LatencyModel(h2d_s_per_byte=0.1 / 8, decode_s=1.0, d2h_s_per_byte=0.1 / 128)
    d = make_driver(latency=lat)
    if not d.capabilities().parallel_mode:
        pytest.skip("no parallel mode")
    d.configure(CB)
    assert d.enable_parallel_mode(True) == 0
    bufs = [setup(d, CB, TaskKind.DECODE) for _ in range(3)]
    for i, b in enumerate(bufs):
        prepare(d, b, i, [i], 0)
    t0 = d.clock.now()
    assert d.infer(bufs[0].model, bufs[0].inp, bufs[0].out) == 0
    assert d.infer(bufs[1].model, bufs[1].inp, bufs[1].out) == 0
    third = answer(d, lambda: d.infer(bufs[2].model, bufs[2].inp, bufs[2].out),
                   refused=C.DEVICE_BUSY, accepted=0,
                   while_=lambda: pending(d, bufs[0], bufs[1]))   # two in flight at most
    assert d.wait(bufs[1].out, 1e6) == 0
    assert d.status(bufs[0].out) == OK          # execution in submission order
    if d.clock.virtual:
        # job 2's H2D overlapped job 1's compute: 0.1 + 1 + 1 + 0.1, not 2 * 1.2
        assert d.clock.now() - t0 == pytest.approx(2.2)
    ran = (0, 1) if third == C.DEVICE_BUSY else (0, 1, 2)
    if third == 0:
        assert d.wait(bufs[2].out, 1e6) == 0
    for i in ran:
        assert bufs[i].logits.reshape(-1).tolist() == pure.logits_bf16(
            pure.step(pure.H_INIT, i, 0), 64)


def test_infer_fixed_engines(make_driver) -> None:
    d = make_driver(latency=SLOW)
    caps = d.capabilities()
    if not (caps.parallel_mode and caps.fixed_engine_slots):
        pytest.skip("no ping/pong")
    d.configure(CB)
    ping = setup(d, CB, TaskKind.DECODE, engine=EngineSlot.PING)
    pong = setup(d, CB, TaskKind.DECODE, engine=EngineSlot.PONG)
    prepare(d, ping, 0, [1], 0)
    prepare(d, pong, 1, [2], 0)
    assert d.infer_fixed(ping.model, ping.inp, ping.out, EngineSlot.PING) == C.UNSUPPORTED
    assert d.enable_parallel_mode(True) == 0
    assert d.infer_fixed(ping.model, ping.inp, ping.out, EngineSlot.PONG) == C.INVALID_VALUE
    assert d.infer_fixed(ping.model, ping.inp, ping.out, EngineSlot.PING) == 0
    assert d.infer_fixed(pong.model, pong.inp, pong.out, EngineSlot.PONG) == 0
    assert d.wait(ping.out, 1e6) == 0 and d.wait(pong.out, 1e6) == 0
    assert d.status(ping.out) == OK and d.status(pong.out) == OK


def test_infer_fixed_same_engine_busy(make_driver) -> None:
    d = make_driver(latency=SLOW)
    d.configure(CB)
    if d.enable_parallel_mode(True) != 0:
        pytest.skip("no parallel mode")
    a = setup(d, CB, TaskKind.DECODE)
    b = setup(d, CB, TaskKind.DECODE)
    prepare(d, a, 0, [1], 0)
    prepare(d, b, 1, [1], 0)
    assert d.infer_fixed(a.model, a.inp, a.out, EngineSlot.PING) == 0
    if answer(d, lambda: d.infer_fixed(b.model, b.inp, b.out, EngineSlot.PING),
              refused=C.DEVICE_BUSY, accepted=0, while_=lambda: pending(d, a)) == 0:
        assert d.wait(b.out, 1e6) == 0          # PING was free again: b ran there
    assert d.infer_fixed(b.model, b.inp, b.out, EngineSlot.PONG) == 0
    assert d.wait(b.out, 1e6) == 0 and d.wait(a.out, 1e6) == 0
    assert d.status(a.out) == d.status(b.out) == OK


# ---- resets ----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", list(ResetKind))
def test_reset_aborts_pending(make_driver, kind) -> None:
    d = make_driver(latency=SLOW, kv_capacity=100)
    if not d.capabilities().can_reset(kind):
        pytest.skip(f"no {kind} reset")
    d.configure(CB)
    dec = setup(d, CB, TaskKind.DECODE)
    assert run(d, dec, 0, [1], 0) == OK
    dec.logits[...] = 3
    prepare(d, dec, 0, [2], 1)
    assert d.infer(dec.model, dec.inp, dec.out) == 0
    (was_aborted,) = aborted(d, lambda: d.reset(kind), dec)
    if was_aborted:
        assert (dec.logits == 3).all()                      # unwritten
    else:                                                   # it had ended: written
        assert dec.logits.reshape(-1).tolist() == pure.logits_bf16(pure.hashes([1, 2])[-1], 64)
    if kind is ResetKind.CCU:
        assert d.wait(dec.out, 0.0) == 0                   # ended: wait reports it
        assert d.output_bytes(dec.out, "logits") == (0, 0 if was_aborted else 128)
        assert run(d, dec, 0, [2], 1) == OK                # configuration and KV stay
        h = pure.hashes([1, 2])[-1]
        assert dec.logits.reshape(-1).tolist() == pure.logits_bf16(h, 64)
        return
    assert d.configure(CB) == 0
    fresh = setup(d, CB, TaskKind.DECODE)
    if kind is ResetKind.CONFIGURATION:
        assert run(d, fresh, 0, [2], 1, apply=False) == OK  # KV stays (allocation too)
        h = pure.hashes([1, 2])[-1]
    else:
        assert d.kv_can_allocate(100)                        # every allocation freed
        assert run(d, fresh, 0, [2], 1, apply=False) == EXC  # KV allocation cleared
        assert run(d, fresh, 0, [2], 1) == OK                # words cleared: kv[0] = 0
        h = pure.step(0, 2, 1)
    assert fresh.logits.reshape(-1).tolist() == pure.logits_bf16(h, 64)


def test_full_reset_turns_parallel_mode_off(make_driver) -> None:
    d = make_driver(latency=SLOW)
    if d.enable_parallel_mode(True) != 0 or not d.capabilities().can_reset(ResetKind.FULL):
        pytest.skip("needs parallel mode and a full reset")
    assert d.reset(ResetKind.FULL) == 0
    d.configure(CB)
    a = setup(d, CB, TaskKind.DECODE)
    b = setup(d, CB, TaskKind.DECODE)
    prepare(d, a, 0, [1], 0)
    prepare(d, b, 1, [1], 0)
    assert d.infer(a.model, a.inp, a.out) == 0
    if answer(d, lambda: d.infer(b.model, b.inp, b.out), refused=C.DEVICE_BUSY,
              accepted=0, while_=lambda: pending(d, a)) == 0:   # serial again: one in all
        assert d.wait(b.out, 1e6) == 0
    assert d.infer_fixed(b.model, b.inp, b.out, EngineSlot.PONG) == C.UNSUPPORTED
    assert d.wait(a.out, 1e6) == 0


def test_wait_infinite_timeout_on_finite_job(driver) -> None:
    driver.configure(CB)
    dec = setup(driver, CB, TaskKind.DECODE)
    prepare(driver, dec, 0, [1], 0)
    assert driver.infer(dec.model, dec.inp, dec.out) == 0
    assert driver.wait(dec.out, math.inf) == 0
    assert driver.status(dec.out) == OK


@pytest.mark.parametrize("timeout", [math.nan, True, "1", None, [1.0]])
def test_wait_refuses_a_timeout_that_is_no_number(driver, timeout) -> None:
    """INVALID_VALUE, checked right after the buffer (before whether the job ended), on
    every driver; the job is not touched."""
    driver.configure(CB)
    dec = setup(driver, CB, TaskKind.DECODE)
    prepare(driver, dec, 0, [1], 0)
    assert driver.infer(dec.model, dec.inp, dec.out) == 0
    assert driver.wait(dec.out, timeout) == C.INVALID_VALUE
    assert driver.wait(dec.out, math.inf) == 0
    assert driver.wait(dec.out, timeout) == C.INVALID_VALUE      # finished: still refused
    assert driver.status(dec.out) == OK


def test_positions_are_read_from_host_not_counted(driver) -> None:
    d = driver
    d.configure(CB)
    dec = setup(d, CB, TaskKind.DECODE)
    assert run(d, dec, 0, [1], 0) == OK
    assert run(d, dec, 0, [2], 1) == OK
    # repeat position 1 with another token: overwrites kv[1] from kv[0]
    assert run(d, dec, 0, [5], 1) == OK
    assert dec.logits.reshape(-1).tolist() == pure.logits_bf16(pure.hashes([1, 5])[-1], 64)
    assert np.asarray(dec.pos).reshape(-1)[0] == 1
