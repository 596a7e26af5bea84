"""Helpers of the driver conformance suite: small calbins (also batch ones,
:func:`batch_calbin`) and a raw job runner that uses only the public Driver protocol (so
the suite runs unchanged on every driver; :func:`prepare_rows`/:func:`run_rows` for batch
jobs), and :func:`answer`, for checks whose right answer depends on whether a job already
ended.

A job submitted is pending until it ends. On a virtual clock it ends only when a call
moves device time (``wait``), so a test knows it is pending; a real device (or a fast
shim) may have finished it before ``infer`` returned. A check about a pending job — a
busy queue, a refused change, a reset that aborts it — is therefore made with
:func:`answer`: the same call, judged by what the protocol says for the state the job
was in, never only under the assumption that it is still running."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import numpy as np

from calfsm.drivers.base import Calbin, Driver, OutputStatus
from calfsm.manifest import DType, ModelInfo, TaskKind, TensorInfo, builtin_manifest

__all__ = ["OK", "Bufs", "Row", "aborted", "answer", "batch_calbin", "configure", "generate",
           "greedy", "last_row", "pending", "prepare", "prepare_rows", "qwen3_calbin", "row_of",
           "run", "run_rows", "setup", "small_calbin"]

OK = 0


def small_calbin(vocab: int = 1024, max_seq: int = 8192, tile_d0: int = 16,
                 prefix: str = "t") -> Calbin:
    """A prefill_ids + decode calbin with the given vocabulary and context."""
    def t(name: str, shape: tuple[int, ...], dt: DType) -> TensorInfo:
        return TensorInfo(name, shape, dt, int(np.prod(shape)) * dt.itemsize)
    prefill = ModelInfo(
        name=f"{prefix}_prefill_ids", kind=TaskKind.PREFILL_IDS,
        inputs=(t("input_ids", (1, max_seq), DType.S32),
                t("position_ids", (1, max_seq), DType.S32)),
        outputs=(t("logits", (1, tile_d0, vocab), DType.BF16),),
        csr_names=("cur_seq", "total_seq"), tile_d0=tile_d0)
    decode = ModelInfo(
        name=f"{prefix}_decode", kind=TaskKind.DECODE,
        inputs=(t("input_ids", (1, 1), DType.S32), t("position_ids", (1, 1), DType.S32)),
        outputs=(t("logits", (1, 1, vocab), DType.BF16),),
        csr_names=("cur_seq", "total_seq"))
    return Calbin((prefill, decode), sha256=f"{prefix}-{vocab}-{max_seq}")


def batch_calbin(B: int = 4, vocab: int = 1024, max_seq: int = 8192, tile_d0: int = 16,
                 prefix: str = "b", embed_rows: int = 0, hidden: int = 8) -> Calbin:
    """:func:`small_calbin` with batch ``B``: every tensor's first dimension is ``B``
    (token and position ``[B, max_seq]``, logits ``[B, tile_d0, vocab]``; decode ``[B, 1]``
    and ``[B, 1, vocab]``). With ``embed_rows`` > 0 also a prefill_embeds model of F32
    embeddings ``[B, embed_rows, hidden]`` (``docs/driver-protocol.md``, Batches)."""
    def t(name: str, shape: tuple[int, ...], dt: DType) -> TensorInfo:
        return TensorInfo(name, shape, dt, int(np.prod(shape)) * dt.itemsize)
    models = [
        ModelInfo(
            name=f"{prefix}_prefill_ids", kind=TaskKind.PREFILL_IDS,
            inputs=(t("input_ids", (B, max_seq), DType.S32),
                    t("position_ids", (B, max_seq), DType.S32)),
            outputs=(t("logits", (B, tile_d0, vocab), DType.BF16),),
            csr_names=("cur_seq", "total_seq"), tile_d0=tile_d0),
        ModelInfo(
            name=f"{prefix}_decode", kind=TaskKind.DECODE,
            inputs=(t("input_ids", (B, 1), DType.S32), t("position_ids", (B, 1), DType.S32)),
            outputs=(t("logits", (B, 1, vocab), DType.BF16),),
            csr_names=("cur_seq", "total_seq"))]
    if embed_rows:
        models.append(ModelInfo(
            name=f"{prefix}_prefill_embeds", kind=TaskKind.PREFILL_EMBEDS,
            inputs=(t("inputs_embeds", (B, embed_rows, hidden), DType.F32),
                    t("position_ids", (B, embed_rows), DType.S32)),
            outputs=(t("logits", (B, tile_d0, vocab), DType.BF16),),
            csr_names=("cur_seq", "total_seq"), tile_d0=tile_d0))
    return Calbin(tuple(models), sha256=f"{prefix}-b{B}-{vocab}-{max_seq}")


def pending(d: Driver, *bufs: Bufs) -> bool:
    """Whether the job last submitted on every one of ``bufs`` is still pending."""
    return all(d.status(b.out) == OutputStatus.PENDING for b in bufs)


def answer(d: Driver, call: Callable[[], int], *, refused: int, accepted: int,
           while_: Callable[[], bool], resubmits: bool = False) -> int:
    """``call()``'s code, checked: ``refused`` while ``while_()`` holds (a condition on
    jobs still pending, e.g. :func:`pending`), ``accepted`` once it no longer does.

    Such a condition only ever stops holding (jobs end; they never start again by
    themselves). On a virtual clock a job ends only when a call moves device time past
    its finish, and the tests call this where their jobs (which all take device time)
    cannot have ended yet: the condition must hold, and ``refused`` is the only right
    answer — exactly the check made before, assuming the job still runs. In real time a
    job may end at any moment, also while ``call`` runs: holding before and after means
    ``refused``, not holding before means ``accepted``, and ending in between allows
    either (``resubmits``: an accepted ``call`` submits a new job that the condition
    reads, so "after" says nothing)."""
    before = while_()
    assert before or not d.clock.virtual, "a job ended on a virtual clock too early"
    code = call()
    if not before:
        expected: tuple[int, ...] = (accepted,)
    elif d.clock.virtual or (not resubmits and while_()):
        expected = (refused,)
    else:
        expected = (refused, accepted)
    assert code in expected, (f"code {code}, expected one of {expected} (the condition "
                              f"held before the call: {before})")
    return code


def aborted(d: Driver, action: Callable[[], int | None], *bufs: Bufs) -> list[bool]:
    """Run ``action`` (a reset or close, which must succeed: 0 or None) and say for each
    of ``bufs`` whether its job was aborted by it.

    A job pending at a reset or close ends ``DONE_ABORTED``; one that had ended keeps
    ``DONE_OK``. On a virtual clock every job of ``bufs`` was pending (nothing ended
    without a wait), so each must be aborted; in real time a job pending just before may
    have ended first (``DONE_OK``), one that had ended before must keep ``DONE_OK``."""
    before = [pending(d, b) for b in bufs]
    assert all(before) or not d.clock.virtual, "a job ended on a virtual clock too early"
    assert action() in (0, None)
    out = []
    for b, was in zip(bufs, before, strict=True):
        status = d.status(b.out)
        allowed = ({OutputStatus.DONE_ABORTED} if d.clock.virtual else
                   {OutputStatus.DONE_ABORTED, OutputStatus.DONE_OK}) if was \
            else {OutputStatus.DONE_OK}
        assert status in allowed, f"{status!r} after the reset or close, expected {allowed}"
        out.append(status == OutputStatus.DONE_ABORTED)
    return out


def qwen3_calbin() -> Calbin:
    return Calbin.from_manifest(builtin_manifest("qwen3-b1"))


@attrs.define
class Bufs:
    """One model's handle, buffers and mapped host arrays."""

    model: object
    inp: object
    out: object
    tok: np.ndarray
    pos: np.ndarray
    logits: np.ndarray
    info: ModelInfo

    @property
    def vocab(self) -> int:
        return self.info.outputs[0].shape[-1]

    @property
    def rows(self) -> int:
        return self.info.tile_d0 or 1

    @property
    def batch(self) -> int:
        """B: the first dimension of the model's tensors."""
        return self.info.inputs[0].shape[0]


def configure(d: Driver, calbin: Calbin) -> dict[str, ModelInfo]:
    assert d.configure(calbin) == OK
    code, models = d.get_all_models()
    assert code == OK
    return {m.name: m for m in models}


def setup(d: Driver, calbin: Calbin, kind: TaskKind, *, engine=None,
          name: str | None = None) -> Bufs:
    """Buffers for the calbin's (first) model of ``kind`` — or the one called ``name`` —
    with every tensor mapped."""
    info = next(m for m in calbin.models if m.kind is kind and name in (None, m.name))
    code, h = d.model(info.name)
    assert code == OK
    code, bufs = d.create_buffers(h) if engine is None else d.create_buffers(h, engine)
    assert code == OK
    inp, out = bufs
    tok_i, pos_i = info.inputs[0], info.inputs[1]
    out_i = info.outputs[0]
    tok = np.zeros(tok_i.shape, tok_i.dtype.host_dtype)
    pos = np.zeros(pos_i.shape, pos_i.dtype.host_dtype)
    logits = np.zeros(out_i.shape, out_i.dtype.host_dtype)
    assert d.map_buffer(inp, tok_i.name, tok) == OK
    assert d.map_buffer(inp, pos_i.name, pos) == OK
    assert d.map_buffer(out, out_i.name, logits) == OK
    return Bufs(h, inp, out, tok, pos, logits, info)


def prepare(d: Driver, b: Bufs, seq: int, tokens: Sequence[int], start: int, *,
            apply: bool = True, cur: int | None = None, total: int | None = None) -> None:
    """Write ``tokens`` at positions ``start...`` into ``b``, slice, set CSRs/seq, apply KV."""
    n = len(tokens)
    tf, pf = b.tok.reshape(-1), b.pos.reshape(-1)
    tf[:n] = tokens
    pf[:n] = np.arange(start, start + n)
    if b.info.kind is not TaskKind.DECODE:
        assert d.slice_tensor(b.inp, b.info.inputs[0].name, 0, 4 * n) == OK
        assert d.slice_tensor(b.inp, b.info.inputs[1].name, 0, 4 * n) == OK
    assert d.set_csr(b.inp, b.info.csr_names[0], n if cur is None else cur) == OK
    assert d.set_csr(b.inp, b.info.csr_names[1], start + n if total is None else total) == OK
    assert d.set_kv_seq(b.inp, seq) == OK
    if apply:
        assert d.kv_apply(seq, start + n)


def run(d: Driver, b: Bufs, seq: int, tokens: Sequence[int], start: int = 0,
        **kw) -> OutputStatus:
    """Prepare, infer, wait; returns the status (the caller checks it)."""
    prepare(d, b, seq, tokens, start, **kw)
    assert d.infer(b.model, b.inp, b.out) == OK
    assert d.wait(b.out, 1e6) == OK
    return d.status(b.out)


@attrs.frozen
class Row:
    """One row of a batch job: its KV sequence, its tokens (ids, or for prefill_embeds
    embedding rows) and the position of the first; ``cur``/``total`` override its CSRs."""

    seq: int
    tokens: Sequence
    start: int = 0
    cur: int | None = None
    total: int | None = None


def prepare_rows(d: Driver, b: Bufs, rows: Sequence[Row], *, apply: bool = True,
                 count: int | None = None) -> None:
    """Write each row's tokens and positions at ``[r, :n]`` of a batch model's inputs, set
    its CSRs and KV sequence (``row=r``), the job's rows (``count``, else ``len(rows)``)
    and apply each row's KV. Nothing is sliced (a batch job reads each row's prefix)."""
    tok = b.tok.reshape(b.batch, -1) if b.info.kind is not TaskKind.PREFILL_EMBEDS \
        else b.tok.reshape(b.batch, -1, b.tok.shape[-1])
    pos = b.pos.reshape(b.batch, -1)
    for r, row in enumerate(rows):
        n = len(row.tokens)
        tok[r, :n] = row.tokens
        pos[r, :n] = np.arange(row.start, row.start + n)
        cur = n if row.cur is None else row.cur
        total = row.start + n if row.total is None else row.total
        assert d.set_csr(b.inp, b.info.csr_names[0], cur, row=r) == OK
        assert d.set_csr(b.inp, b.info.csr_names[1], total, row=r) == OK
        assert d.set_kv_seq(b.inp, row.seq, row=r) == OK
        if apply:
            assert d.kv_apply(row.seq, row.start + n)
    assert d.set_batch_rows(b.inp, len(rows) if count is None else count) == OK


def run_rows(d: Driver, b: Bufs, rows: Sequence[Row], **kw) -> OutputStatus:
    """Prepare a batch job, infer, wait; returns the job's status."""
    prepare_rows(d, b, rows, **kw)
    assert d.infer(b.model, b.inp, b.out) == OK
    assert d.wait(b.out, 1e6) == OK
    return d.status(b.out)


def row_of(b: Bufs, r: int) -> np.ndarray:
    """Row ``r``'s logits of a batch model's output: ``[tile_d0, V]`` (prefill) or
    ``[1, V]`` (decode)."""
    return b.logits.reshape(b.batch, -1, b.vocab)[r]


def last_row(b: Bufs, n: int) -> np.ndarray:
    """The BF16 row of the last of ``n`` tokens."""
    return b.logits.reshape(b.rows, b.vocab)[(n - 1) % b.rows]


def greedy(row: np.ndarray) -> int:
    return int((row.astype(np.uint32) << 16).view(np.float32).argmax())


def generate(d: Driver, pre: Bufs, dec: Bufs, seq: int, prompt: Sequence[int],
             n_tokens: int) -> list[int]:
    assert run(d, pre, seq, prompt) == OutputStatus.DONE_OK
    tok = greedy(last_row(pre, len(prompt)))
    out = [tok]
    pos = len(prompt)
    while len(out) < n_tokens:
        assert run(d, dec, seq, [tok], pos) == OutputStatus.DONE_OK
        tok = greedy(dec.logits.reshape(-1))
        out.append(tok)
        pos += 1
    return out
