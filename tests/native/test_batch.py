"""The batch calls at the C boundary and in CalrtDriver (docs/driver-protocol.md, Batches):
the capability bit and its absence, the raw ABI's answers to bad arguments, the batch row
share pushed down with the latency model, traces that name the row, row statuses that
outlive a destroy or a close, a batch job in real time, and batch workloads bit for bit
(logits, row statuses, phases) against SimDriver."""

from __future__ import annotations

import json

import numpy as np
import pytest

from calfsm.drivers import calrt
from calfsm.drivers.base import Calbin, Capabilities, EngineSlot, OutputStatus, ResetKind
from calfsm.drivers.calrt import CalrtDriver, load_library
from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.drivers.sim import LatencyModel, SimDriver
from calfsm.errors import CalrtCode as C
from calfsm.manifest import TaskKind, builtin_manifest
from calfsm.testing import refmodel_pure as pure
from calfsm.testing.conformance.util import Row, batch_calbin, prepare_rows, row_of, run_rows, setup

V = 64
CB = batch_calbin(B=4, vocab=V, max_seq=64)
OK = OutputStatus.DONE_OK
IDLE = OutputStatus.IDLE


def _dec(d):
    assert d.configure(CB) == 0
    return setup(d, CB, TaskKind.DECODE)


def test_the_library_reports_the_batch_calls() -> None:
    with CalrtDriver.virtual() as d:
        assert d.capabilities().batch_rows
    assert calrt.ABI_VERSION == 2


def test_without_the_capability_the_batch_setters_are_unsupported() -> None:
    caps = Capabilities(resets=frozenset(ResetKind), batch_rows=False)
    with CalrtDriver.virtual(capabilities=caps) as d:
        assert not d.capabilities().batch_rows
        dec = _dec(d)
        assert d.set_batch_rows(dec.inp, 1) == C.UNSUPPORTED
        assert d.set_kv_seq(dec.inp, 1, row=1) == C.UNSUPPORTED
        assert d.set_csr(dec.inp, "cur_seq", 1, row=1) == C.UNSUPPORTED
        # the handle and direction checks come first; row 0 is the single-row calls
        assert d.set_batch_rows(dec.out, 1) == C.WRONG_DIRECTION
        assert d.set_kv_seq(dec.inp, 1, row=0) == 0
        assert d.set_csr(dec.inp, "cur_seq", 1) == 0
        assert d.set_csr(dec.inp, "total_seq", 1) == 0
        assert d.kv_apply(1, 1)
        dec.tok[...] = 3
        assert d.infer(dec.model, dec.inp, dec.out) == 0        # a one-row job runs
        assert d.wait(dec.out, 1e6) == 0
        assert [d.row_status(dec.out, r) for r in range(4)] == [OK, IDLE, IDLE, IDLE]
        assert row_of(dec, 0).tolist() == [pure.logits_bf16(pure.step(pure.H_INIT, 3, 0), V)]


@pytest.fixture
def raw():
    lib, _path, _emu = load_library(None)
    ffi = calrt._get_ffi()
    dev = ffi.new("calrt_device_t *")
    assert lib.calrt_device_open(ffi.NULL, dev) == 0
    yield lib, ffi, dev[0]
    lib.calrt_device_close(dev[0])


def test_the_raw_abi_refuses_bad_arguments(raw) -> None:
    lib, ffi, d = raw
    st = ffi.new("int32_t *")
    for h in (0, 1, 2**64 - 1):
        assert lib.calrt_get_row_status(d, h, 0, st) == C.INVALID_STATE
        assert lib.calrt_set_batch_rows(d, h, 1) == C.INVALID_STATE
        assert lib.calrt_set_kv_seq_row(d, h, 1, 0) == C.INVALID_STATE
        assert lib.calrt_set_csr_row(d, h, b"cur_seq", 1, 0) == C.INVALID_STATE
    assert lib.calrt_get_row_status(d, 0, 0, ffi.NULL) == C.INVALID_VALUE
    assert lib.calrt_set_csr_row(d, 0, ffi.NULL, 1, 0) == C.INVALID_VALUE
    for share in (1.0, -0.1, float("nan"), float("inf")):
        assert lib.calrt_emu_set_batch_row_share(d, share) == C.INVALID_VALUE
    assert lib.calrt_emu_set_batch_row_share(d, 0.999) == 0
    text = calrt.calbin_text(CB)
    assert lib.calrt_configure(d, text, len(text)) == 0
    m = ffi.new("calrt_model_t *")
    assert lib.calrt_model_lookup(d, b"b_decode", m) == 0
    bi, bo = ffi.new("calrt_buf_t *"), ffi.new("calrt_buf_t *")
    assert lib.calrt_create_buffers(d, m[0], -1, bi, bo) == 0
    assert lib.calrt_get_row_status(d, bi[0], 0, st) == C.INVALID_STATE      # an input
    assert lib.calrt_get_row_status(d, bo[0], 2**32 - 1, st) == 0 and st[0] == IDLE
    assert lib.calrt_set_batch_rows(d, bi[0], 0) == C.INVALID_VALUE
    assert lib.calrt_set_batch_rows(d, bi[0], 5) == C.INVALID_VALUE
    assert lib.calrt_set_batch_rows(d, bi[0], 2**32 - 1) == C.INVALID_VALUE
    assert lib.calrt_set_batch_rows(d, bo[0], 1) == C.WRONG_DIRECTION
    assert lib.calrt_set_kv_seq_row(d, bi[0], 4, 1) == C.INVALID_VALUE
    assert lib.calrt_set_kv_seq_row(d, bi[0], 4, -1) == C.INVALID_VALUE
    assert lib.calrt_set_kv_seq_row(d, bo[0], 1, 1) == C.WRONG_DIRECTION
    assert lib.calrt_set_csr_row(d, bi[0], b"nope", 9, 1) == C.NOT_FOUND
    assert lib.calrt_set_csr_row(d, bi[0], b"cur_seq", 9, 2**32) == C.INVALID_VALUE
    assert lib.calrt_set_csr_row(d, bi[0], b"cur_seq", 3, 2**32 - 1) == 0
    # stale after a configuration reset: the row status stays readable, the rest refused
    assert lib.calrt_reset_configuration(d) == 0
    assert lib.calrt_get_row_status(d, bo[0], 0, st) == 0 and st[0] == IDLE
    assert lib.calrt_set_batch_rows(d, bi[0], 1) == C.INVALID_STATE


def test_a_batch_fault_rule_reaches_the_library() -> None:
    plan = FaultPlan.of(FaultRule("set_batch_rows", "code", code=55),
                        FaultRule("infer", "row_ccu_exception", seq_id=2))
    with CalrtDriver.virtual(faults=plan) as d:
        dec = _dec(d)
        assert d.set_batch_rows(dec.inp, 2) == 55
        assert run_rows(d, dec, [Row(1, [1], 0), Row(2, [1], 0)]) == OK
        assert [d.row_status(dec.out, r) for r in range(2)] == \
            [OK, OutputStatus.DONE_CCU_EXCEPTION]


def test_the_trace_names_rows_other_than_zero() -> None:
    with CalrtDriver.virtual(trace=True) as d:
        dec = _dec(d)
        assert d.set_kv_seq(dec.inp, 7, row=2) == 0
        assert d.set_kv_seq(dec.inp, 8) == 0
        assert d.set_csr(dec.inp, "cur_seq", 1, row=3) == 0
        assert d.set_batch_rows(dec.inp, 3) == 0
        calls = [(rec["call"], rec["args"][1:]) for rec in map(json.loads, d.trace_lines())]
    assert ("calrt_set_kv_seq_row", [2, 7]) in calls
    assert ("calrt_set_kv_seq", [8]) in calls
    assert ("calrt_set_csr_row", ["cur_seq", 3, 1]) in calls
    assert ("calrt_set_batch_rows", [3]) in calls


def test_row_statuses_outlive_a_destroy_and_a_close() -> None:
    d = CalrtDriver.virtual(latency=LatencyModel.fixed(decode_s=1.0))
    dec = _dec(d)
    assert run_rows(d, dec, [Row(1, [1], 0), Row(2, [1], 0, total=9)]) == OK
    want = [OK, OutputStatus.DONE_CCU_EXCEPTION, IDLE, IDLE]
    assert d.destroy_buffers(dec.inp, dec.out) == 0
    assert [d.row_status(dec.out, r) for r in range(5)] == [*want, IDLE]
    other = setup(d, CB, TaskKind.DECODE)
    prepare_rows(d, other, [Row(3, [1], 0), Row(4, [1], 0), Row(5, [1], 0)])
    assert d.infer(other.model, other.inp, other.out) == 0
    d.close()                                   # aborts the pending job
    assert d.status(other.out) == OutputStatus.DONE_ABORTED
    assert [d.row_status(other.out, r) for r in range(4)] == \
        [OutputStatus.DONE_ABORTED] * 3 + [IDLE]
    assert [d.row_status(dec.out, r) for r in range(4)] == want
    assert d.row_status(other.out, -1) == d.row_status(other.out, 1.5) == IDLE
    with pytest.raises(Exception, match="not an output buffer"):
        d.row_status(other.inp, 0)


def test_a_batch_job_in_real_time() -> None:
    with CalrtDriver(latency=LatencyModel.fixed(decode_s=0.02, batch_row_share=0.5)) as d:
        dec = _dec(d)
        assert run_rows(d, dec, [Row(s, [s], 0) for s in range(4)]) == OK
        for r in range(4):
            assert d.row_status(dec.out, r) == OK
            assert row_of(dec, r).tolist() == [pure.logits_bf16(pure.step(pure.H_INIT, r, 0),
                                                                V)]


def _batch_workload(d, cb: Calbin, seed: int) -> tuple[list[np.ndarray], list[list[int]]]:
    """Prefill and decode batch jobs of random rows on the tiny-b8 graphs, a row that
    fails now and then, a CCU reset in the middle: every output array and row status."""
    rng = np.random.default_rng(seed)
    assert d.configure(cb) == 0
    pre = setup(d, cb, TaskKind.PREFILL_IDS)
    dec = setup(d, cb, TaskKind.DECODE)
    emb = setup(d, cb, TaskKind.PREFILL_EMBEDS)
    outs, statuses = [], []
    lengths: dict[int, int] = {}

    def record(b) -> None:
        outs.append(b.logits.copy())
        statuses.append([int(d.row_status(b.out, r)) for r in range(9)])

    for job in range(12):
        b = (pre, dec, emb)[job % 3]
        rows = int(rng.integers(1, 9))
        seqs = [int(s) for s in rng.choice(40, size=rows, replace=False)]
        spec = []
        for s in seqs:
            start = lengths.get(s, 0)
            n = 1 if b is dec else int(rng.integers(1, 40 if b is pre else 20))
            if b is emb:
                tokens = rng.standard_normal((n, 64)).astype(np.float32)
            else:
                tokens = [int(t) for t in rng.integers(0, 1024, size=n)]
            bad = rng.random() < 0.15
            spec.append(Row(s, tokens, start, total=start + n + 3 if bad else None))
            if not bad:
                lengths[s] = start + n
        b.logits[...] = 0x5555
        if job == 7:        # a job a reset aborts: every row DONE_ABORTED, nothing written
            prepare_rows(d, b, spec)
            assert d.infer(b.model, b.inp, b.out) == 0
            assert d.reset(ResetKind.CCU) == 0
            for s in seqs:
                lengths.pop(s, None)
            record(b)
            continue
        assert run_rows(d, b, spec) == OK
        record(b)
    # ping/pong: a batch prefill on PING while a batch decode runs on PONG
    assert d.enable_parallel_mode(True) == 0
    ping = setup(d, cb, TaskKind.PREFILL_IDS, engine=EngineSlot.PING)
    pong = setup(d, cb, TaskKind.DECODE, engine=EngineSlot.PONG)
    for k in range(3):
        prepare_rows(d, ping, [Row(100 + 8 * k + r, list(range(1, 3 + r + k)))
                               for r in range(1 + k)])
        prepare_rows(d, pong, [Row(200 + 8 * k + r, [r + 1], 0) for r in range(8 - k)])
        for b in (ping, pong):
            assert d.infer(b.model, b.inp, b.out) == 0
        for b in (ping, pong):
            assert d.wait(b.out, 1e6) == 0
            record(b)
    return outs, statuses


def test_batch_workloads_bit_identical_to_sim() -> None:
    cb = Calbin.from_manifest(builtin_manifest("tiny-b8"))
    lat = LatencyModel.fixed(decode_s=0.01, prefill_per_token_s=1e-4, h2d_s_per_byte=1e-9,
                             d2h_s_per_byte=1e-9, jitter=0.2, batch_row_share=0.1)
    with SimDriver(latency=lat, seed=3) as sim, \
            CalrtDriver.virtual(latency=lat, seed=3) as emu:
        a = _batch_workload(sim, cb, 11)
        b = _batch_workload(emu, cb, 11)
        ta, tb = sim.timeline(), emu.timeline()
    for k, (x, y) in enumerate(zip(a[0], b[0], strict=True)):
        assert np.array_equal(x, y), f"job {k}: logits differ"
    assert a[1] == b[1]
    assert any(OutputStatus.DONE_CCU_EXCEPTION in s for s in a[1])   # a row failed alone
    key = [(s.job, s.engine, s.phase, s.status) for s in ta]
    assert key == [(s.job, s.engine, s.phase, s.status) for s in tb]
    assert any(s.engine == EngineSlot.PONG for s in ta)
    assert [t for s in tb for t in (s.start, s.end)] == \
        pytest.approx([t for s in ta for t in (s.start, s.end)], abs=1e-6)
