"""Conformance: every effect of a FaultPlan, and the counting rules (faults.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from calfsm.drivers.base import MAX_WAIT_S, JobTag, OutputStatus, ResetKind
from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.drivers.sim import LatencyModel
from calfsm.errors import CalrtCode as C
from calfsm.manifest import TaskKind
from calfsm.testing import refmodel_pure as pure
from calfsm.testing.conformance.util import prepare, run, setup, small_calbin

V = 64
CB = small_calbin(vocab=V, max_seq=64)
OK = OutputStatus.DONE_OK
SLOW = LatencyModel.fixed(decode_s=1.0, prefill_per_token_s=0.1)


def _dev(make_driver, *rules: FaultRule, **kw):
    d = make_driver(faults=FaultPlan.of(*rules), **kw)
    d.configure(CB)
    return d, setup(d, CB, TaskKind.DECODE)


def _expected(tokens: list[int]) -> list[int]:
    return pure.logits_bf16(pure.hashes(tokens)[-1], V)


def test_set_csr_code_by_name(make_driver) -> None:
    d, dec = _dev(make_driver, FaultRule("set_csr", "code", name="total_seq"))
    assert d.set_csr(dec.inp, "cur_seq", 1) == 0
    assert d.set_csr(dec.inp, "total_seq", 1) == C.NOT_FOUND
    assert d.set_csr(dec.inp, "total_seq", 1) == 0            # fires once
    assert d.set_csr(dec.inp, "bogus", 1) == C.NOT_FOUND      # honest failure, not counted


def test_buffer_point_matches_the_buffer_kv_seq(make_driver) -> None:
    d, dec = _dev(make_driver, FaultRule.always("set_csr", "code", seq_id=4))
    assert d.set_csr(dec.inp, "cur_seq", 1) == 0              # no KV sequence yet
    assert d.set_kv_seq(dec.inp, 3) == 0
    assert d.set_csr(dec.inp, "cur_seq", 1) == 0
    assert d.set_kv_seq(dec.inp, 4) == 0
    assert d.set_csr(dec.inp, "cur_seq", 1) == C.NOT_FOUND
    assert d.set_csr(dec.inp, "total_seq", 1) == C.NOT_FOUND


@pytest.mark.parametrize("code", [C.DEVICE_BUSY, C.DEVICE_UNAVAILABLE, C.DEVICE_CRASHED, 99])
def test_submit_code_on_nth_infer(make_driver, code) -> None:
    d, dec = _dev(make_driver, FaultRule("infer", "code", nth=2, code=int(code)))
    assert run(d, dec, 0, [1], 0) == OK
    prepare(d, dec, 0, [2], 1)
    dec.logits[...] = 9
    assert d.infer(dec.model, dec.inp, dec.out) == code
    assert d.status(dec.out) == OK                            # the old status, nothing queued
    assert (dec.logits == 9).all()
    assert d.infer(dec.model, dec.inp, dec.out) == 0
    assert d.wait(dec.out, 1e6) == 0
    assert dec.logits.reshape(-1).tolist() == _expected([1, 2])


def test_infer_rule_matches_job_tag(make_driver) -> None:
    d, dec = _dev(make_driver, FaultRule("infer", "code", seq_id=7, job_id=3, code=17))
    prepare(d, dec, 0, [1], 0)
    assert d.infer(dec.model, dec.inp, dec.out, tag=JobTag(3, 6)) == 0
    assert d.wait(dec.out, 1e6) == 0
    assert d.infer(dec.model, dec.inp, dec.out, tag=JobTag(4, 7)) == 0
    assert d.wait(dec.out, 1e6) == 0
    assert d.infer(dec.model, dec.inp, dec.out, tag=JobTag(3, 7)) == C.DEVICE_BUSY


def test_seq_rule_falls_back_to_buffer_kv_seq(make_driver) -> None:
    d, dec = _dev(make_driver, FaultRule("infer", "ccu_exception", seq_id=5))
    assert run(d, dec, 4, [1], 0) == OK
    assert run(d, dec, 5, [1], 0) == OutputStatus.DONE_CCU_EXCEPTION


def test_wait_code(make_driver) -> None:
    d, dec = _dev(make_driver, FaultRule("wait", "code"), latency=SLOW)
    prepare(d, dec, 0, [1], 0)
    assert d.infer(dec.model, dec.inp, dec.out) == 0
    assert d.wait(dec.out, 1e6) == C.TIMEOUT                  # injected
    assert d.status(dec.out) == OutputStatus.PENDING          # job still pending
    assert d.wait(dec.out, 1e6) == 0
    assert d.status(dec.out) == OK


def test_wait_other_code(make_driver) -> None:
    d, dec = _dev(make_driver, FaultRule("wait", "code", code=C.DEVICE_CRASHED), latency=SLOW)
    prepare(d, dec, 0, [1], 0)
    assert d.infer(dec.model, dec.inp, dec.out) == 0
    assert d.wait(dec.out, 1e6) == C.DEVICE_CRASHED


def test_ccu_exception_although_wait_succeeds(make_driver) -> None:
    d, dec = _dev(make_driver, FaultRule("infer", "ccu_exception"))
    dec.logits[...] = 5
    assert run(d, dec, 0, [1], 0) == OutputStatus.DONE_CCU_EXCEPTION
    assert (dec.logits == 5).all()
    assert d.output_bytes(dec.out, "logits") == (0, 0)
    assert run(d, dec, 0, [1], 0) == OK


@pytest.mark.parametrize("n_bytes", [None, 0, 2, 100])
def test_short_output(make_driver, n_bytes) -> None:
    d, dec = _dev(make_driver, FaultRule("infer", "short_output", n_bytes=n_bytes))
    dec.logits[...] = 0xEEEE
    assert run(d, dec, 0, [1], 0) == OK
    expect = V * 2 // 2 if n_bytes is None else n_bytes
    code, got = d.output_bytes(dec.out, "logits")
    assert (code, got) == (0, expect)
    assert got < V * 2
    flat = dec.logits.reshape(-1)
    want = _expected([1])
    k = expect // 2
    assert flat[:k].tolist() == want[:k]
    assert (flat[k:] == 0xEEEE).all()                         # only that many bytes written


@pytest.mark.parametrize(("effect", "bits"), [("nan", 0x7FC0), ("inf", 0x7F80)])
def test_nan_inf_in_logits(make_driver, effect, bits) -> None:
    d, dec = _dev(make_driver, FaultRule("infer", effect, index=5))
    assert run(d, dec, 0, [1], 0) == OK
    flat = dec.logits.reshape(-1)
    assert int(flat[5]) == bits
    want = _expected([1])
    want[5] = bits
    assert flat.tolist() == want
    assert not np.isfinite((flat.astype(np.uint32) << 16).view(np.float32)).all()


def test_nan_lands_in_the_prefill_row_the_host_reads(make_driver) -> None:
    d = make_driver(faults=FaultPlan.of(FaultRule("infer", "nan")))
    d.configure(CB)
    pre = setup(d, CB, TaskKind.PREFILL_IDS)
    assert run(d, pre, 0, list(range(19)), 0) == OK
    assert int(pre.logits.reshape(16, V)[2, 0]) == 0x7FC0


def test_kv_can_allocate_refused(make_driver) -> None:
    d = make_driver(faults=FaultPlan.of(FaultRule("kv_can_allocate", "refuse", nth=2)))
    assert d.kv_can_allocate(1)
    assert not d.kv_can_allocate(1)
    assert d.kv_can_allocate(1)


def test_kv_can_allocate_always_false(make_driver) -> None:
    d = make_driver(faults=FaultPlan.of(FaultRule.always("kv_can_allocate", "refuse")))
    assert not any(d.kv_can_allocate(1) for _ in range(50))
    assert d.kv_apply(0, 1)                                   # Apply itself is honest


def test_kv_apply_refused_changes_nothing(make_driver) -> None:
    d = make_driver(kv_capacity=10,
                    faults=FaultPlan.of(FaultRule("kv_apply", "refuse", seq_id=1, every=2)))
    assert not d.kv_apply(1, 4)                               # 1st match: fires
    assert d.kv_can_allocate(10)
    assert d.kv_apply(2, 4)                                   # other sequence
    assert d.kv_apply(1, 4)                                   # 2nd match
    assert not d.kv_apply(1, 5)                               # 3rd match: fires again
    assert d.kv_can_allocate(2) and not d.kv_can_allocate(3)


def test_hung_job_until_reset(make_driver) -> None:
    d, dec = _dev(make_driver, FaultRule("infer", "hang"))
    prepare(d, dec, 0, [1], 0)
    dec.logits[...] = 4
    assert d.infer(dec.model, dec.inp, dec.out) == 0
    assert d.wait(dec.out, 5.0) == C.TIMEOUT
    assert d.wait(dec.out, 50.0) == C.TIMEOUT
    assert d.status(dec.out) == OutputStatus.PENDING
    assert d.reset(ResetKind.CCU) == 0
    assert d.status(dec.out) == OutputStatus.DONE_ABORTED
    assert (dec.logits == 4).all()
    assert run(d, dec, 0, [1], 0) == OK                       # the device works again


@pytest.mark.parametrize("huge", [1e300, 2**70])
def test_a_hung_job_never_ends_by_waiting_however_long(make_driver, huge) -> None:
    """An infinite timeout returned 0 (the hang "finished" at the end of time, the clock
    went to infinity) on both shipped drivers; 1e300 raised OverflowError on one."""
    d, dec = _dev(make_driver, FaultRule("infer", "hang"))
    prepare(d, dec, 0, [1], 0)
    assert d.infer(dec.model, dec.inp, dec.out) == 0
    t0 = d.clock.now()
    assert d.wait(dec.out, math.inf) == C.TIMEOUT             # at once: time stays
    assert d.clock.now() == t0 and d.status(dec.out) == OutputStatus.PENDING
    assert d.wait(dec.out, huge) == C.TIMEOUT                 # clamped, not refused
    assert d.status(dec.out) == OutputStatus.PENDING
    if d.clock.virtual:                                       # moved by the clamp
        assert d.clock.now() == pytest.approx(t0 + MAX_WAIT_S)
    assert d.reset(ResetKind.CCU) == 0
    assert d.status(dec.out) == OutputStatus.DONE_ABORTED


def test_stale_completion_after_configuration_reset(make_driver) -> None:
    d, dec = _dev(make_driver, FaultRule("infer", "stale", nth=2), latency=SLOW)
    assert run(d, dec, 0, [1], 0) == OK                       # kv[0] = h(1)
    prepare(d, dec, 0, [2], 1)
    dec.logits[...] = 4
    assert d.infer(dec.model, dec.inp, dec.out) == 0
    assert d.reset(ResetKind.CONFIGURATION) == 0
    assert (dec.logits == 4).all()                            # not yet
    # new configuration; a new job on sequence 0 position 1 runs after the stale one
    assert d.configure(CB) == 0
    fresh = setup(d, CB, TaskKind.DECODE)
    assert run(d, fresh, 0, [3], 1) == OK
    # the stale job finished meanwhile and wrote its old output array...
    assert dec.logits.reshape(-1).tolist() == _expected([1, 2])
    assert fresh.logits.reshape(-1).tolist() == _expected([1, 3])
    # ...but no KV: position 1 of sequence 0 holds the new job's word
    assert run(d, fresh, 0, [4], 2) == OK
    assert fresh.logits.reshape(-1).tolist() == _expected([1, 3, 4])


def test_stale_completion_after_ccu_reset_writes_no_kv(make_driver) -> None:
    d, dec = _dev(make_driver, FaultRule("infer", "stale"), latency=SLOW)
    prepare(d, dec, 0, [1], 0)
    assert d.infer(dec.model, dec.inp, dec.out) == 0
    assert d.reset(ResetKind.CCU) == 0
    assert d.wait(dec.out, 1e6) == 0                          # it still finishes
    assert d.status(dec.out) == OK
    assert dec.logits.reshape(-1).tolist() == _expected([1])
    other = setup(d, CB, TaskKind.DECODE)
    assert run(d, other, 0, [2], 1) == OK                     # kv[0] was never written
    assert other.logits.reshape(-1).tolist() == pure.logits_bf16(pure.step(0, 2, 1), V)


@pytest.mark.parametrize("code", [C.SOFT_RESET_FAILED, C.HARD_RESET_FAILED])
def test_reset_fails(make_driver, code) -> None:
    d, dec = _dev(make_driver, FaultRule("reset", "code", code=int(code)), latency=SLOW)
    prepare(d, dec, 0, [1], 0)
    assert d.infer(dec.model, dec.inp, dec.out) == 0
    assert d.reset(ResetKind.CCU) == code
    assert d.status(dec.out) == OutputStatus.PENDING          # changed nothing
    assert d.reset(ResetKind.CCU) == 0
    assert d.status(dec.out) == OutputStatus.DONE_ABORTED


@pytest.mark.parametrize(("point", "nth", "call"), [
    ("map_buffer", 4, lambda d, b: d.map_buffer(b.inp, "input_ids", b.tok)),  # after setup's 3
    ("slice_tensor", 1, lambda d, b: d.slice_tensor(b.inp, "input_ids", 0, 4)),
    ("set_kv_seq", 1, lambda d, b: d.set_kv_seq(b.inp, 1)),
    ("create_buffers", 2, lambda d, b: d.create_buffers(b.model)[0]),
    ("enable_parallel_mode", 1, lambda d, b: d.enable_parallel_mode(True)),
])
def test_code_at_other_points(make_driver, point, nth, call) -> None:
    d, dec = _dev(make_driver, FaultRule(point, "code", nth=nth, code=15))
    if point == "enable_parallel_mode" and not d.capabilities().parallel_mode:
        pytest.skip("no parallel mode")
    assert call(d, dec) == 15
    assert call(d, dec) == 0


def test_configure_code(make_driver) -> None:
    d = make_driver(faults=FaultPlan.of(FaultRule("configure", "code", code=18)))
    assert d.configure(CB) == 18
    assert d.get_all_models() == (C.MISSING_CONFIG, None)
    assert d.configure(CB) == 0


def test_every_and_count(make_driver) -> None:
    d, dec = _dev(make_driver, FaultRule("infer", "code", nth=2, every=3, count=2))
    prepare(d, dec, 0, [1], 0)
    results = []
    for _ in range(12):
        rc = d.infer(dec.model, dec.inp, dec.out)
        results.append(rc)
        if rc == 0:
            assert d.wait(dec.out, 1e6) == 0
    fired = [i + 1 for i, rc in enumerate(results) if rc]
    assert fired == [2, 5]                                    # ordinals 2, 5 (8 capped)


def test_first_firing_rule_wins(make_driver) -> None:
    d, dec = _dev(make_driver, FaultRule("infer", "code", code=17),
                  FaultRule("infer", "code", code=18),
                  FaultRule("infer", "code", nth=2, code=19))
    prepare(d, dec, 0, [1], 0)
    assert d.infer(dec.model, dec.inp, dec.out) == 17
    assert d.infer(dec.model, dec.inp, dec.out) == 19         # rule 2 missed its ordinal
    assert d.infer(dec.model, dec.inp, dec.out) == 0
