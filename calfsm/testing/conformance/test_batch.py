"""Conformance: batch graphs (docs/driver-protocol.md, "Batches"): a model whose tensors are
``[B, ...]`` runs jobs of 1..B rows, each row with its own KV sequence, CSRs and outcome,
and each row computes exactly what it computes alone on a batch-1 model.

Every test runs on every registered driver that has the batch calls
(``Capabilities.batch_rows``); a driver without them skips the module's tests. The tests
that inject faults are named ``test_faults_*``, so the selection a vendor shim runs the
suite with (``-k "... and not test_faults ..."``, docs/vendor-shim.md) leaves them out
with the other fault modules (a shim has no fault plans)."""

from __future__ import annotations

import numpy as np
import pytest

from calfsm.drivers.base import Calbin, JobTag, OutputStatus, ResetKind
from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.drivers.sim import LatencyModel
from calfsm.errors import CalrtCode as C
from calfsm.manifest import TaskKind
from calfsm.testing import refmodel_pure as pure
from calfsm.testing.conformance.util import (
    Bufs,
    Row,
    aborted,
    answer,
    batch_calbin,
    pending,
    prepare_rows,
    row_of,
    run,
    run_rows,
    setup,
    small_calbin,
)

V = 64
S = 64          # max_seq: the tokens of one row of the prefill graph
T = 16          # tile_d0
B = 4
OK = OutputStatus.DONE_OK
CCU = OutputStatus.DONE_CCU_EXCEPTION
IDLE = OutputStatus.IDLE
PENDING = OutputStatus.PENDING
GARBAGE = 0xAAAA
#: a batch-1 calbin ("one_*") and its batch-B twin ("b_*") in one configuration: a row
#: of a batch job is compared with the same row run alone
BOTH = Calbin(small_calbin(vocab=V, max_seq=S, tile_d0=T, prefix="one").models
              + batch_calbin(B=B, vocab=V, max_seq=S, tile_d0=T, prefix="b").models)
BATCH = batch_calbin(B=B, vocab=V, max_seq=S, tile_d0=T, embed_rows=8, hidden=4)
SLOW = LatencyModel.fixed(decode_s=1.0, prefill_per_token_s=0.1)


def _dev(make_driver, calbin: Calbin = BATCH, *rules: FaultRule, **kw):
    d = make_driver(faults=FaultPlan.of(*rules), **kw) if rules else make_driver(**kw)
    if not d.capabilities().batch_rows:
        pytest.skip(f"{d.name} has no batch calls (Capabilities.batch_rows)")
    assert d.configure(calbin) == 0
    return d


def _bufs(d, calbin: Calbin, kind: TaskKind, prefix: str = "b") -> Bufs:
    name = next(m.name for m in calbin.models if m.kind is kind and m.name.startswith(prefix))
    return setup(d, calbin, kind, name=name)


class Oracle:
    """The reference model per sequence (refmodel_pure), with each sequence's KV words."""

    def __init__(self) -> None:
        self.kv: dict[int, dict[int, int]] = {}

    def prefill(self, seq: int, tokens: list[int], start: int = 0) -> list[list[int]]:
        """The tile a prefill of ``tokens`` at ``start...`` writes (its last chunk)."""
        hs = pure.hashes(tokens, start, self.kv.setdefault(seq, {}))
        first = ((len(tokens) - 1) // T) * T
        rows = [pure.logits_bf16(h, V) for h in hs[first:]]
        return rows + [[0] * V] * (T - len(rows))

    def decode(self, seq: int, token: int, pos: int) -> list[list[int]]:
        return [pure.logits_bf16(pure.hashes([token], pos, self.kv.setdefault(seq, {}))[0],
                                 V)]


def _zero(b: Bufs, r: int) -> bool:
    return bool((row_of(b, r) == 0).all())


# ---- rows compute what they compute alone -------------------------------------------------

def test_every_row_equals_the_same_row_run_alone_bit_for_bit(make_driver) -> None:
    d = _dev(make_driver, BOTH)
    one_pre, one_dec = (setup(d, BOTH, k, name=f"one_{k.value}")
                        for k in (TaskKind.PREFILL_IDS, TaskKind.DECODE))
    pre, dec = _bufs(d, BOTH, TaskKind.PREFILL_IDS), _bufs(d, BOTH, TaskKind.DECODE)
    oracle = Oracle()
    twin = 100              # sequence s runs in the batch, s + twin alone on batch 1
    history = [4, 5, 6, 7, 8]
    for s in (12, 12 + twin):
        assert run(d, one_pre, s, history) == OK
    oracle.prefill(12, history)

    def alone(b: Bufs, seq: int, tokens: list[int], start: int) -> np.ndarray:
        assert run(d, b, seq + twin, tokens, start) == OK
        return b.logits.reshape(-1, V).copy()

    # one prefill job of mixed lengths and start positions (one row continues a sequence),
    # the last row padding
    rows = [Row(10, [1, 2, 3]), Row(11, [(3 * i + 1) % V for i in range(20)]),
            Row(12, [9, 10, 11, 12], 5)]
    pre.logits[...] = GARBAGE
    assert run_rows(d, pre, rows) == OK
    for r, row in enumerate(rows):
        assert d.row_status(pre.out, r) == OK
        want = alone(one_pre, row.seq, list(row.tokens), row.start)
        assert np.array_equal(row_of(pre, r), want), f"row {r}"
        assert row_of(pre, r).tolist() == oracle.prefill(row.seq, list(row.tokens), row.start)
    assert _zero(pre, 3) and d.row_status(pre.out, 3) == IDLE

    # decode steps of several rows: the KV each row wrote is its own sequence's, and a
    # row's place in the batch does not matter
    pos = {10: 3, 11: 20, 12: 9, 13: 0}
    last = {10: 7, 11: 8, 12: 9, 13: 10}
    for step, order in enumerate(([10, 11, 12, 13], [13, 12, 11, 10], [12, 10])):
        rows = [Row(s, [last[s]], pos[s]) for s in order]
        dec.logits[...] = GARBAGE
        assert run_rows(d, dec, rows) == OK
        for r, s in enumerate(order):
            assert d.row_status(dec.out, r) == OK
            want = alone(one_dec, s, [last[s]], pos[s])
            assert np.array_equal(row_of(dec, r), want), f"step {step} row {r} (seq {s})"
            assert row_of(dec, r).tolist() == oracle.decode(s, last[s], pos[s])
            last[s] = pure.greedy(row_of(dec, r)[0].tolist())
            pos[s] += 1
        for r in range(len(order), B):
            assert _zero(dec, r) and d.row_status(dec.out, r) == IDLE


def test_embedding_rows_read_their_own_prefix(make_driver) -> None:
    d = _dev(make_driver)
    emb = _bufs(d, BATCH, TaskKind.PREFILL_EMBEDS)
    rng = np.random.default_rng(5)
    rows = [Row(1, rng.standard_normal((3, 4)).astype(np.float32)),
            Row(2, rng.standard_normal((8, 4)).astype(np.float32), 4),
            Row(3, rng.standard_normal((1, 4)).astype(np.float32))]
    emb.tok[...] = 7.5          # what a row does not read
    assert run_rows(d, emb, rows) == OK
    for r, row in enumerate(rows):
        words = [pure.embed_word(e.tobytes()) for e in row.tokens]
        hs = pure.hashes(words, row.start)      # a fresh sequence: earlier words read 0
        assert d.row_status(emb.out, r) == OK
        n = len(words)
        tile = row_of(emb, r)
        assert tile[(n - 1) % T].tolist() == pure.logits_bf16(hs[-1], V)
        assert (tile[n:] == 0).all()
    assert _zero(emb, 3)


def test_padding_rows_read_nothing_and_touch_no_kv(make_driver) -> None:
    d = _dev(make_driver)
    dec = _bufs(d, BATCH, TaskKind.DECODE)
    assert run_rows(d, dec, [Row(5, [3], 0)]) == OK          # seq 5: kv[0] = h(3)
    # row 1 is a complete row of sequence 5 at position 1, rows 2 and 3 nonsense (shared
    # sequences, CSRs that fail every check, positions past any allocation): as padding
    # nothing of them is read, checked or written
    prepare_rows(d, dec, [Row(6, [1], 0), Row(5, [2], 1), Row(6, [3], 40, cur=9),
                          Row(6, [4], 50, total=3)], count=1)
    pos = dec.pos.reshape(B)
    pos[2:] = 1000
    dec.logits[...] = GARBAGE
    assert d.infer(dec.model, dec.inp, dec.out) == 0
    assert d.wait(dec.out, 1e6) == 0
    assert d.status(dec.out) == OK
    assert [d.row_status(dec.out, r) for r in range(B + 2)] == [OK] + [IDLE] * (B + 1)
    assert row_of(dec, 0).tolist() == Oracle().decode(6, 1, 0)
    assert all(_zero(dec, r) for r in range(1, B))
    # sequence 5 has no word at position 1 (the padding row on it wrote none)
    assert run_rows(d, dec, [Row(5, [4], 2)]) == OK
    assert row_of(dec, 0).tolist() == [pure.logits_bf16(pure.step(0, 4, 2), V)]


def test_a_new_buffer_carries_one_row(make_driver) -> None:
    d = _dev(make_driver)
    dec = _bufs(d, BATCH, TaskKind.DECODE)
    dec.tok[...] = 1
    assert d.set_csr(dec.inp, "cur_seq", 1) == 0
    assert d.set_csr(dec.inp, "total_seq", 1) == 0
    assert d.set_kv_seq(dec.inp, 1) == 0                    # row 0: the single-row calls
    assert d.kv_apply(1, 1)
    dec.logits[...] = GARBAGE
    assert d.infer(dec.model, dec.inp, dec.out) == 0
    assert d.wait(dec.out, 1e6) == 0
    assert d.status(dec.out) == OK
    assert row_of(dec, 0).tolist() == Oracle().decode(1, 1, 0)
    assert all(_zero(dec, r) for r in range(1, B))
    assert [d.row_status(dec.out, r) for r in range(B)] == [OK, IDLE, IDLE, IDLE]


# ---- row status ---------------------------------------------------------------------------

def test_row_status_in_every_state(make_driver) -> None:
    d = _dev(make_driver, latency=SLOW)
    dec = _bufs(d, BATCH, TaskKind.DECODE)
    assert [d.row_status(dec.out, r) for r in range(B + 1)] == [IDLE] * (B + 1)
    prepare_rows(d, dec, [Row(1, [1], 0), Row(2, [2], 0), Row(3, [3], 0)])
    assert d.infer(dec.model, dec.inp, dec.out) == 0
    if d.clock.virtual:                     # (a real device may have ended it already)
        assert [d.row_status(dec.out, r) for r in range(B + 1)] == [PENDING] * 3 + [IDLE] * 2
    assert d.wait(dec.out, 1e6) == 0
    assert [d.row_status(dec.out, r) for r in range(B + 1)] == [OK] * 3 + [IDLE] * 2
    # a row failing its checks: DONE_CCU_EXCEPTION for it alone, the job DONE_OK
    assert run_rows(d, dec, [Row(1, [1], 1), Row(2, [2], 1, total=5)]) == OK
    assert [d.row_status(dec.out, r) for r in range(B)] == [OK, CCU, IDLE, IDLE]
    # a job aborted by a reset: every row of it DONE_ABORTED
    prepare_rows(d, dec, [Row(1, [1], 2), Row(2, [2], 1)])
    assert d.infer(dec.model, dec.inp, dec.out) == 0
    if aborted(d, lambda: d.reset(ResetKind.CCU), dec) == [True]:
        assert [d.row_status(dec.out, r) for r in range(B)] == \
            [OutputStatus.DONE_ABORTED] * 2 + [IDLE] * 2
    # mapping the output consumes the result: every row IDLE again
    assert d.map_buffer(dec.out, "logits", dec.logits) == 0
    assert [d.row_status(dec.out, r) for r in range(B)] == [IDLE] * B


def test_row_status_of_a_batch_one_model_is_the_jobs(make_driver) -> None:
    d = _dev(make_driver, BOTH)
    one = setup(d, BOTH, TaskKind.DECODE, name="one_decode")
    assert d.row_status(one.out, 0) == IDLE
    assert d.set_batch_rows(one.inp, 1) == 0                  # 1 <= rows <= B = 1
    assert d.set_batch_rows(one.inp, 2) == C.INVALID_VALUE
    assert run(d, one, 0, [1], 0) == OK
    assert (d.row_status(one.out, 0), d.row_status(one.out, 1)) == (OK, IDLE)
    assert run(d, one, 0, [1], 1, total=7) == CCU             # a failed check fails the job
    assert (d.row_status(one.out, 0), d.row_status(one.out, 1)) == (CCU, IDLE)


# ---- argument checks and refusals -----------------------------------------------------------

def test_batch_call_arguments(make_driver) -> None:
    d = _dev(make_driver)
    dec = _bufs(d, BATCH, TaskKind.DECODE)
    for bad in (0, B + 1, -1, 1.0, True, "2", None):
        assert d.set_batch_rows(dec.inp, bad) == C.INVALID_VALUE, bad
    assert d.set_batch_rows(dec.out, 2) == C.WRONG_DIRECTION
    for rows in range(1, B + 1):
        assert d.set_batch_rows(dec.inp, rows) == 0
    for bad in (B, B + 7, -1, 2**40, 1.0, True, None):
        assert d.set_kv_seq(dec.inp, 1, row=bad) == C.INVALID_VALUE, bad
        assert d.set_csr(dec.inp, "cur_seq", 1, row=bad) == C.INVALID_VALUE, bad
    # the single-row call's checks come first, the row check after them
    assert d.set_csr(dec.inp, "bogus", 1, row=B) == C.NOT_FOUND
    assert d.set_csr(dec.out, "cur_seq", 1, row=B) == C.WRONG_DIRECTION
    assert d.set_kv_seq(dec.out, 1, row=B) == C.WRONG_DIRECTION
    assert d.set_csr(dec.inp, "cur_seq", -1, row=1) == C.INVALID_VALUE
    assert d.set_kv_seq(dec.inp, -1, row=1) == C.INVALID_VALUE
    for r in range(B):
        assert d.set_kv_seq(dec.inp, 10 + r, row=r) == 0
        assert d.set_csr(dec.inp, "cur_seq", 1, row=r) == 0
        assert d.set_csr(dec.inp, "total_seq", 1, row=np.int64(r)) == 0


def test_a_batch_one_model_has_row_zero_only(make_driver) -> None:
    d = _dev(make_driver, BOTH)
    one = setup(d, BOTH, TaskKind.DECODE, name="one_decode")
    assert d.set_kv_seq(one.inp, 1, row=0) == 0
    assert d.set_csr(one.inp, "cur_seq", 1, row=0) == 0
    assert d.set_kv_seq(one.inp, 1, row=1) == C.INVALID_VALUE
    assert d.set_csr(one.inp, "cur_seq", 1, row=1) == C.INVALID_VALUE


def test_a_pending_buffer_refuses_the_batch_calls_after_their_own_checks(make_driver) -> None:
    d = _dev(make_driver, latency=SLOW)
    dec = _bufs(d, BATCH, TaskKind.DECODE)
    prepare_rows(d, dec, [Row(1, [1], 0), Row(2, [1], 0)])
    assert d.infer(dec.model, dec.inp, dec.out) == 0
    still = lambda: pending(d, dec)  # noqa: E731
    answer(d, lambda: d.set_batch_rows(dec.inp, 1), refused=C.DEVICE_BUSY, accepted=0,
           while_=still)
    answer(d, lambda: d.set_kv_seq(dec.inp, 3, row=1), refused=C.DEVICE_BUSY, accepted=0,
           while_=still)
    answer(d, lambda: d.set_csr(dec.inp, "cur_seq", 1, row=2), refused=C.DEVICE_BUSY,
           accepted=0, while_=still)
    # an argument the call refuses anyway is refused as such, pending or not
    assert d.set_batch_rows(dec.inp, B + 1) == C.INVALID_VALUE
    assert d.set_kv_seq(dec.inp, 3, row=B) == C.INVALID_VALUE
    assert d.set_csr(dec.inp, "cur_seq", 1, row=B) == C.INVALID_VALUE


def test_infer_refuses_an_incomplete_or_shared_or_sliced_batch(make_driver) -> None:
    d = _dev(make_driver)
    pre = _bufs(d, BATCH, TaskKind.PREFILL_IDS)

    def refused(code: int) -> None:
        assert d.infer(pre.model, pre.inp, pre.out) == code
        assert d.status(pre.out) == IDLE                         # nothing queued

    prepare_rows(d, pre, [Row(1, [1, 2]), Row(2, [3])])
    assert d.set_batch_rows(pre.inp, 3) == 0                    # row 2 has nothing set
    refused(C.MISSING_CONFIG)
    assert d.set_kv_seq(pre.inp, 3, row=2) == 0
    refused(C.MISSING_CONFIG)
    assert d.set_csr(pre.inp, "cur_seq", 1, row=2) == 0
    refused(C.MISSING_CONFIG)                                   # total_seq still missing
    assert d.set_csr(pre.inp, "total_seq", 1, row=2) == 0
    assert d.set_kv_seq(pre.inp, 1, row=2) == 0                 # row 0's sequence
    refused(C.INVALID_VALUE)
    assert d.set_kv_seq(pre.inp, 3, row=2) == 0
    assert d.kv_apply(3, 1)
    assert d.slice_tensor(pre.inp, "input_ids", 0, 8) == 0      # any tensor may be sliced
    refused(C.INVALID_VALUE)                                    # a batch job may not read one
    assert d.undo_slice(pre.inp, "input_ids") == 0
    assert d.slice_tensor(pre.inp, "position_ids", 4, 8) == 0
    refused(C.INVALID_VALUE)
    assert d.undo_slice(pre.inp, "position_ids") == 0
    # padding rows need nothing, and two of them may share anything
    assert d.set_kv_seq(pre.inp, 1, row=3) == 0
    # an output slice does not limit what the device writes
    assert d.slice_tensor(pre.out, "logits", 0, 2 * V) == 0
    pre.logits[...] = GARBAGE
    assert d.infer(pre.model, pre.inp, pre.out) == 0
    assert d.wait(pre.out, 1e6) == 0
    assert [d.row_status(pre.out, r) for r in range(B)] == [OK, OK, OK, IDLE]
    assert _zero(pre, 3)
    assert d.output_bytes(pre.out, "logits") == (0, B * T * V * 2)


def _with_batch(i: int, tensor: int, batch: int) -> Calbin:
    m = BATCH.models[i]
    ts = [*m.inputs, *m.outputs]
    t = ts[tensor]
    per = t.byte_size // t.shape[0]
    ts[tensor] = type(t)(t.name, (batch, *t.shape[1:]), t.dtype, per * batch)
    return BATCH.replace_model(m.name, inputs=tuple(ts[:len(m.inputs)]),
                               outputs=tuple(ts[len(m.inputs):]))


@pytest.mark.parametrize(("model", "tensor", "batch"), [
    (0, 0, 2), (0, 1, 1), (0, 2, 8), (1, 2, 1), (1, 0, 3), (2, 1, 5)],
    ids=["prefill-tokens", "prefill-positions", "prefill-logits", "decode-logits",
         "decode-tokens", "embeds-positions"])
def test_configure_refuses_tensors_that_disagree_on_the_batch(make_driver, model, tensor,
                                                              batch) -> None:
    d = make_driver()
    if not d.capabilities().batch_rows:
        pytest.skip(f"{d.name} has no batch calls (Capabilities.batch_rows)")
    assert d.configure(_with_batch(model, tensor, batch)) == C.INVALID_CALBIN
    assert d.get_all_models() == (C.MISSING_CONFIG, None)
    assert d.configure(BATCH) == 0


def test_configure_refuses_any_tensor_of_a_batch_model_that_is_not_b_rows(make_driver) -> None:
    d = make_driver()
    if not d.capabilities().batch_rows:
        pytest.skip(f"{d.name} has no batch calls (Capabilities.batch_rows)")
    m = BATCH.models[0]
    tok = m.inputs[0]
    for extra in (type(tok)("attention_mask", (2, S), tok.dtype, 2 * S * 4),   # another B
                  type(tok)("attention_mask", (B,), tok.dtype, B * 4)):        # no rows
        bad = BATCH.replace_model(m.name, inputs=(*m.inputs, extra))
        assert d.configure(bad) == C.INVALID_CALBIN, extra
    ok = type(tok)("attention_mask", (B, 3), tok.dtype, B * 3 * 4)
    assert d.configure(BATCH.replace_model(m.name, inputs=(*m.inputs, ok))) == 0


def test_configure_refuses_a_batch_prefill_output_that_is_not_b_tiles(make_driver) -> None:
    d = make_driver()
    if not d.capabilities().batch_rows:
        pytest.skip(f"{d.name} has no batch calls (Capabilities.batch_rows)")
    m = BATCH.models[0]
    assert d.configure(BATCH.replace_model(m.name, tile_d0=T * 2)) == C.INVALID_CALBIN
    assert d.configure(BATCH) == 0


# ---- rows that fail alone ---------------------------------------------------------------------

def test_a_row_failing_its_checks_fails_alone(make_driver) -> None:
    d = _dev(make_driver)
    pre = _bufs(d, BATCH, TaskKind.PREFILL_IDS)
    oracle = Oracle()
    assert run_rows(d, pre, [Row(s, [s, s + 1]) for s in (1, 2, 3, 4)]) == OK
    for s in (1, 2, 3, 4):
        oracle.prefill(s, [s, s + 1])
    rows = [Row(1, [5, 6, 7], 2),
            Row(2, [5, 6, 7], 2, total=9),          # total_seq is not last position + 1
            Row(3, [5, 6, 7], 2, cur=0),            # no tokens
            Row(4, [5, 6, 7], 2, cur=S + 1)]        # more tokens than a row holds
    pre.logits[...] = GARBAGE
    assert run_rows(d, pre, rows) == OK
    assert [d.row_status(pre.out, r) for r in range(B)] == [OK, CCU, CCU, CCU]
    assert row_of(pre, 0).tolist() == oracle.prefill(1, [5, 6, 7], 2)
    assert all(_zero(pre, r) for r in (1, 2, 3))                    # zeros, not untouched
    assert d.output_bytes(pre.out, "logits") == (0, B * T * V * 2)
    # the failed rows wrote no KV: positions 2.. of their sequences still read 0
    dec = _bufs(d, BATCH, TaskKind.DECODE)
    assert run_rows(d, dec, [Row(s, [9], 3) for s in (1, 2, 3, 4)]) == OK
    assert row_of(dec, 0).tolist() == oracle.decode(1, 9, 3)
    for r, s in enumerate((2, 3, 4), start=1):
        assert row_of(dec, r).tolist() == [pure.logits_bf16(pure.step(0, 9, 3), V)], s


def test_each_row_is_checked_against_its_own_kv_and_the_per_row_context(make_driver) -> None:
    d = _dev(make_driver)
    dec = _bufs(d, BATCH, TaskKind.DECODE)
    assert d.kv_apply(2, S + 1)           # allocated past max_seq: max_seq still bounds it
    assert d.kv_apply(1, 1) and d.kv_apply(3, S)            # sequence 4: nothing allocated
    assert run_rows(d, dec, [Row(1, [1], 0), Row(2, [1], S), Row(3, [1], S - 1),
                             Row(4, [1], 5)], apply=False) == OK
    # max_seq is the tokens of one row of the prefill graph (S), not of the whole tensor
    assert [d.row_status(dec.out, r) for r in range(B)] == [OK, CCU, OK, CCU]
    assert row_of(dec, 2).tolist() == [pure.logits_bf16(pure.step(0, 1, S - 1), V)]


def test_a_decode_row_of_two_tokens_fails_alone(make_driver) -> None:
    d = _dev(make_driver)
    dec = _bufs(d, BATCH, TaskKind.DECODE)
    assert run_rows(d, dec, [Row(1, [1], 0), Row(2, [1], 0, cur=2, total=2)]) == OK
    assert [d.row_status(dec.out, r) for r in range(2)] == [OK, CCU]


# ---- faults (test_faults_*: the emulator's and the simulated device's) -----------------------

def _three(d) -> tuple[Bufs, Oracle, list[Row]]:
    """A decode job of three rows on sequences 10, 11, 12 after a prefill of each."""
    pre, dec = _bufs(d, BATCH, TaskKind.PREFILL_IDS), _bufs(d, BATCH, TaskKind.DECODE)
    oracle = Oracle()
    assert run_rows(d, pre, [Row(s, [s, 1]) for s in (10, 11, 12)]) == OK
    for s in (10, 11, 12):
        oracle.prefill(s, [s, 1])
    return dec, oracle, [Row(s, [s % 7], 2) for s in (10, 11, 12)]


@pytest.mark.parametrize(("seq", "row"), [(11, 1), (12, 2), (None, 0)])
def test_faults_row_ccu_exception_fails_the_named_row_alone(make_driver, seq, row) -> None:
    d = _dev(make_driver, BATCH, FaultRule("infer", "row_ccu_exception", nth=2, seq_id=seq))
    dec, oracle, rows = _three(d)         # the prefill is the rule's first match
    dec.logits[...] = GARBAGE
    assert run_rows(d, dec, rows) == OK
    want = [OK, OK, OK, IDLE]
    want[row] = CCU
    assert [d.row_status(dec.out, r) for r in range(B)] == want
    assert _zero(dec, row) and _zero(dec, 3)
    assert d.output_bytes(dec.out, "logits") == (0, B * V * 2)
    for r, x in enumerate(rows):
        if r != row:
            assert row_of(dec, r).tolist() == oracle.decode(x.seq, x.tokens[0], 2)
    # the failed row wrote no KV: the same step again computes what it would have
    assert run_rows(d, dec, rows[row:row + 1]) == OK
    assert row_of(dec, 0).tolist() == oracle.decode(rows[row].seq, rows[row].tokens[0], 2)


@pytest.mark.parametrize("effect", ["row_ccu_exception", "nan", "inf"])
def test_faults_a_row_effect_on_a_sequence_of_no_row_hits_no_row(make_driver, effect) -> None:
    d = _dev(make_driver, BATCH, FaultRule("infer", effect, seq_id=99))
    dec = _bufs(d, BATCH, TaskKind.DECODE)
    prepare_rows(d, dec, [Row(10, [1], 0), Row(11, [2], 0)])
    assert d.infer(dec.model, dec.inp, dec.out, tag=JobTag(1, 99)) == 0   # the tag matched
    assert d.wait(dec.out, 1e6) == 0
    assert [d.row_status(dec.out, r) for r in range(B)] == [OK, OK, IDLE, IDLE]
    oracle = Oracle()
    assert row_of(dec, 0).tolist() == oracle.decode(10, 1, 0)
    assert row_of(dec, 1).tolist() == oracle.decode(11, 2, 0)


def test_faults_row_ccu_exception_on_a_batch_one_model_is_the_jobs(make_driver) -> None:
    d = _dev(make_driver, BOTH, FaultRule("infer", "row_ccu_exception"))
    one = setup(d, BOTH, TaskKind.DECODE, name="one_decode")
    one.logits[...] = GARBAGE
    assert run(d, one, 0, [1], 0) == CCU
    assert (one.logits == GARBAGE).all()
    assert d.output_bytes(one.out, "logits") == (0, 0)
    assert d.row_status(one.out, 0) == CCU
    assert run(d, one, 0, [1], 0) == OK


@pytest.mark.parametrize(("effect", "bits"), [("nan", 0x7FC0), ("inf", 0x7F80)])
@pytest.mark.parametrize(("seq", "row"), [(11, 1), (None, 0)])
def test_faults_nan_and_inf_go_into_the_matched_row(make_driver, effect, bits, seq, row) -> None:
    d = _dev(make_driver, BATCH, FaultRule("infer", effect, nth=2, seq_id=seq, index=V + 3))
    dec, oracle, rows = _three(d)
    assert run_rows(d, dec, rows) == OK
    assert [d.row_status(dec.out, r) for r in range(B)] == [OK, OK, OK, IDLE]
    for r, x in enumerate(rows):
        want = oracle.decode(x.seq, x.tokens[0], 2)
        if r == row:
            want[0][3] = bits               # index mod V
        assert row_of(dec, r).tolist() == want, r


def test_faults_nan_lands_in_the_tile_row_of_the_rows_last_token(make_driver) -> None:
    d = _dev(make_driver, BATCH, FaultRule("infer", "nan", seq_id=2))
    pre = _bufs(d, BATCH, TaskKind.PREFILL_IDS)
    assert run_rows(d, pre, [Row(1, list(range(5))), Row(2, list(range(19)))]) == OK
    assert int(row_of(pre, 1)[2, 0]) == 0x7FC0              # (19 - 1) % 16
    assert int(row_of(pre, 0)[4, 0]) != 0x7FC0


def test_faults_the_infer_seq_id_filter_matches_any_row(make_driver) -> None:
    d = _dev(make_driver, BATCH, FaultRule.always("infer", "code", seq_id=12, code=77))
    dec = _bufs(d, BATCH, TaskKind.DECODE)
    prepare_rows(d, dec, [Row(10, [1], 0), Row(11, [1], 0), Row(12, [1], 0)])
    assert d.infer(dec.model, dec.inp, dec.out) == 77               # row 2's sequence
    assert d.infer(dec.model, dec.inp, dec.out, tag=JobTag(1, 99)) == 77
    assert d.status(dec.out) == IDLE
    assert d.set_batch_rows(dec.inp, 2) == 0                        # row 2 is padding now
    assert d.infer(dec.model, dec.inp, dec.out) == 0
    assert d.wait(dec.out, 1e6) == 0
    assert [d.row_status(dec.out, r) for r in range(B)] == [OK, OK, IDLE, IDLE]


def test_faults_the_infer_seq_id_filter_matches_a_one_row_batch_jobs_row(make_driver) -> None:
    d = _dev(make_driver, BATCH, FaultRule.always("infer", "code", seq_id=10, code=77))
    dec = _bufs(d, BATCH, TaskKind.DECODE)
    prepare_rows(d, dec, [Row(10, [1], 0)])
    assert d.infer(dec.model, dec.inp, dec.out, tag=JobTag(1, 99)) == 77    # row 0's KV seq
    prepare_rows(d, dec, [Row(11, [1], 0)])
    assert d.infer(dec.model, dec.inp, dec.out, tag=JobTag(1, 10)) == 77    # the tag's
    assert d.infer(dec.model, dec.inp, dec.out, tag=JobTag(1, 99)) == 0


def test_faults_job_effects_hit_the_whole_batch(make_driver) -> None:
    d = _dev(make_driver, BATCH, FaultRule("infer", "ccu_exception", seq_id=11, nth=2),
             FaultRule("infer", "short_output", nth=3, n_bytes=V * 2 + 6))
    dec, oracle, rows = _three(d)
    dec.logits[...] = GARBAGE
    assert run_rows(d, dec, rows) == CCU
    assert [d.row_status(dec.out, r) for r in range(B)] == [CCU] * 3 + [IDLE]
    assert (dec.logits == GARBAGE).all()
    assert d.output_bytes(dec.out, "logits") == (0, 0)
    assert run_rows(d, dec, rows) == OK                             # short: the whole output's
    assert d.output_bytes(dec.out, "logits") == (0, V * 2 + 6)
    flat = dec.logits.reshape(-1)
    assert flat[:V].tolist() == oracle.decode(10, rows[0].tokens[0], 2)[0]
    assert flat[V:V + 3].tolist() == oracle.decode(11, rows[1].tokens[0], 2)[0][:3]
    assert (flat[V + 3:] == GARBAGE).all()


def test_faults_a_stale_batch_job_writes_its_rows_but_no_kv(make_driver) -> None:
    d = _dev(make_driver, BATCH, FaultRule("infer", "stale"), latency=SLOW)
    dec = _bufs(d, BATCH, TaskKind.DECODE)
    prepare_rows(d, dec, [Row(1, [5], 0), Row(2, [6], 0)])
    dec.logits[...] = GARBAGE
    assert d.infer(dec.model, dec.inp, dec.out) == 0
    assert d.reset(ResetKind.CCU) == 0
    assert d.wait(dec.out, 1e6) == 0                        # it still finishes
    assert [d.row_status(dec.out, r) for r in range(B)] == [OK, OK, IDLE, IDLE]
    oracle = Oracle()
    assert row_of(dec, 0).tolist() == oracle.decode(1, 5, 0)
    assert row_of(dec, 1).tolist() == oracle.decode(2, 6, 0)
    assert _zero(dec, 2) and _zero(dec, 3)
    other = _bufs(d, BATCH, TaskKind.DECODE)
    assert run_rows(d, other, [Row(2, [7], 1), Row(1, [7], 1)]) == OK
    for r in range(2):                                      # position 0 was never written
        assert row_of(other, r).tolist() == [pure.logits_bf16(pure.step(0, 7, 1), V)]


def test_faults_set_batch_rows_fault_point(make_driver) -> None:
    d = _dev(make_driver, BATCH, FaultRule("set_batch_rows", "code"),
             FaultRule("set_batch_rows", "code", seq_id=5, code=1234))
    dec = _bufs(d, BATCH, TaskKind.DECODE)
    assert d.set_batch_rows(dec.inp, 0) == C.INVALID_VALUE      # fails alone: not counted
    assert d.set_batch_rows(dec.inp, 3) == C.INVALID_VALUE      # injected (default code)
    assert d.set_batch_rows(dec.inp, 3) == 0
    assert d.set_kv_seq(dec.inp, 5, row=1) == 0                 # row 0 has no sequence yet
    assert d.set_batch_rows(dec.inp, 2) == 0
    assert d.set_kv_seq(dec.inp, 5, row=0) == 0
    assert d.set_kv_seq(dec.inp, 6, row=1) == 0
    assert d.set_batch_rows(dec.inp, 1) == 1234                 # row 0 on sequence 5
    # the refused call changed nothing: the job carries 2 rows
    for r in range(2):
        assert d.set_csr(dec.inp, "cur_seq", 1, row=r) == 0
        assert d.set_csr(dec.inp, "total_seq", 1, row=r) == 0
    assert d.kv_apply(5, 1) and d.kv_apply(6, 1)
    assert d.infer(dec.model, dec.inp, dec.out) == 0
    assert d.wait(dec.out, 1e6) == 0
    assert [d.row_status(dec.out, r) for r in range(B)] == [OK, OK, IDLE, IDLE]


def test_faults_a_refused_set_batch_rows_changes_nothing(make_driver) -> None:
    d = _dev(make_driver, BATCH, FaultRule("set_batch_rows", "code", nth=2))
    dec = _bufs(d, BATCH, TaskKind.DECODE)
    prepare_rows(d, dec, [Row(1, [1], 0), Row(2, [2], 0), Row(3, [3], 0)])   # 1st: rows 3
    assert d.set_batch_rows(dec.inp, 1) == C.INVALID_VALUE                     # 2nd: refused
    assert d.infer(dec.model, dec.inp, dec.out) == 0
    assert d.wait(dec.out, 1e6) == 0
    assert [d.row_status(dec.out, r) for r in range(B)] == [OK, OK, OK, IDLE]


def test_faults_row_calls_reach_the_single_row_fault_points(make_driver) -> None:
    d = _dev(make_driver, BATCH, FaultRule("set_kv_seq", "code", seq_id=7, code=1234),
             FaultRule.always("set_csr", "code", seq_id=3, name="total_seq", code=4321))
    dec = _bufs(d, BATCH, TaskKind.DECODE)
    assert d.set_kv_seq(dec.inp, 7, row=2) == 1234              # the seq argument
    assert d.set_kv_seq(dec.inp, 7, row=2) == 0
    assert d.set_kv_seq(dec.inp, 3, row=1) == 0
    assert d.set_csr(dec.inp, "total_seq", 1, row=1) == 0       # row 0 has no sequence
    assert d.set_kv_seq(dec.inp, 3, row=0) == 0
    assert d.set_csr(dec.inp, "total_seq", 1, row=1) == 4321    # row 0's sequence
    assert d.set_csr(dec.inp, "total_seq", 1, row=0) == 4321
    assert d.set_csr(dec.inp, "cur_seq", 1, row=1) == 0


# ---- timing -----------------------------------------------------------------------------------

def _finish_after_submit(d, b: Bufs, rows: list[Row], expected: float) -> None:
    prepare_rows(d, b, rows)
    t0 = d.clock.now()
    assert d.infer(b.model, b.inp, b.out) == 0
    assert d.wait(b.out, expected - 1e-6) == C.TIMEOUT
    assert d.wait(b.out, 1e6) == 0
    assert d.clock.now() - t0 == pytest.approx(expected, abs=2e-9)


def test_a_decode_step_of_rows_costs_a_share_per_row(make_driver) -> None:
    d = _dev(make_driver, latency=LatencyModel.fixed(decode_s=0.01, batch_row_share=0.05))
    if not d.clock.virtual:
        pytest.skip("device time is measured, not modelled, on a real device")
    dec = _bufs(d, BATCH, TaskKind.DECODE)
    _finish_after_submit(d, dec, [Row(s, [1], 0) for s in range(4)], 0.0115)
    _finish_after_submit(d, dec, [Row(s, [1], 1) for s in range(2)], 0.0105)
    _finish_after_submit(d, dec, [Row(0, [1], 2)], 0.01)


def test_a_static_graph_prices_a_decode_step_by_its_whole_batch(make_driver) -> None:
    # shape_cost="graph": a static calbin computes all B rows whatever is in them, so a
    # step of one row costs what a step of B rows costs (docs/driver-protocol.md, Timing)
    lat = LatencyModel.fixed(decode_s=0.01, batch_row_share=0.05, shape_cost="graph")
    d = _dev(make_driver, latency=lat)
    if not d.clock.virtual:
        pytest.skip("device time is measured, not modelled, on a real device")
    dec = _bufs(d, BATCH, TaskKind.DECODE)
    _finish_after_submit(d, dec, [Row(0, [1], 0)], 0.0115)
    _finish_after_submit(d, dec, [Row(s, [1], 1) for s in range(4)], 0.0115)


def test_a_decode_row_pays_its_context_or_the_graphs_window(make_driver) -> None:
    # context_token_s: rows pay their own total_seq; a static graph pays its whole
    # context window (the configuration's max_seq, S) for every one of its B rows
    per = 1e-5
    rows = [Row(0, [1], 9), Row(1, [1], 3)]        # total_seq 10 and 4
    for cost, expected in (("rows", 0.01 + per * 14), ("graph", 0.01 + per * B * S)):
        d = _dev(make_driver, latency=LatencyModel.fixed(decode_s=0.01, context_token_s=per,
                                                         shape_cost=cost))
        if not d.clock.virtual:
            pytest.skip("device time is measured, not modelled, on a real device")
        dec = _bufs(d, BATCH, TaskKind.DECODE)
        _finish_after_submit(d, dec, rows, expected)
        d.close()


def test_a_static_graph_prefill_pads_every_row_to_the_longest(make_driver) -> None:
    lat = LatencyModel.fixed(decode_s=0.01, prefill_per_token_s=1e-3, shape_cost="graph")
    d = _dev(make_driver, latency=lat)
    if not d.clock.virtual:
        pytest.skip("device time is measured, not modelled, on a real device")
    pre = _bufs(d, BATCH, TaskKind.PREFILL_IDS)
    _finish_after_submit(d, pre, [Row(1, list(range(3))), Row(2, list(range(20)))],
                         B * 20 * 1e-3)


def test_a_batch_prefill_costs_the_tokens_of_its_rows(make_driver) -> None:
    lat = LatencyModel.fixed(decode_s=0.01, prefill_per_token_s=1e-3, h2d_s_per_byte=1e-6,
                             d2h_s_per_byte=1e-7, batch_row_share=0.5)
    d = _dev(make_driver, latency=lat)
    if not d.clock.virtual:
        pytest.skip("device time is measured, not modelled, on a real device")
    pre = _bufs(d, BATCH, TaskKind.PREFILL_IDS)
    # H2D: each row's cur_seq tokens and positions (4 + 4 bytes each), not the tensors;
    # compute: the tokens of all rows; D2H: the whole logits tensor
    n = [3, 20, 5]
    expected = sum(n) * 8 * 1e-6 + sum(n) * 1e-3 + B * T * V * 2 * 1e-7
    _finish_after_submit(d, pre, [Row(s, list(range(k))) for s, k in zip((1, 2, 3), n,
                                                                          strict=True)],
                         expected)
