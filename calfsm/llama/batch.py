"""``LlamaBatch``, llama.cpp's ``llama_batch``, and its check against one sequence.

A batch holds ``n_tokens`` tokens (``token``) or embedding rows (``embd``), each with a
position (``pos``), the sequences it belongs to (``n_seq_id[i]`` ids in ``seq_id[i]``)
and a ``logits`` flag (output this token's logits). As in llama.cpp, ``pos=None`` means
"after what the sequence holds", ``seq_id=None`` sequence 0 and ``logits=None`` the last
token only.

:func:`plan_batch` checks a batch before anything runs — every token names exactly one
sequence (calfsm cannot share KV between sequences); on a batch-1 calbin every token
names the same one, on a batch calbin (``max_batch`` > 1) the batch may hold several;
the flags are 0 or 1 and one per token; each sequence's positions go on from what it
already holds, one by one, in batch order — and cuts each sequence's tokens into
*ubatches*, one executor job each: a job gives the logits of its last token only, so a
ubatch ends at every flagged token and after ``n_ubatch`` tokens. The caller runs the
k-th ubatch of every sequence together (one *round*), so the decodes of several
sequences share a device step. Token ids and embeddings are checked against the manifest
by the caller, with the executor's own :func:`~calfsm.request.check_request`, before the
first job.
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from typing import Any

import attrs
import numpy as np

from calfsm.errors import InvalidArgument

__all__ = ["BatchPlan", "LlamaBatch", "SeqPart", "Ubatch", "plan_batch"]

_STAGE = "llama_batch"
_LIST_FIELDS = ("token", "pos", "n_seq_id", "seq_id", "logits")
_TOKEN_NOT_A_SEQUENCE = "token must be a sequence of token ids, got {}"
_EMBD_NOT_2D = "embd must be a 2-D (n_tokens, hidden) numpy array"


@attrs.define(eq=False)
class LlamaBatch:
    """llama.cpp's ``llama_batch``: ``token`` or ``embd``, ``pos``, ``n_seq_id`` /
    ``seq_id`` and ``logits`` flags, one entry per token. Checked by ``decode``."""

    token: Any = None
    embd: np.ndarray | None = None
    pos: Any = None
    n_seq_id: Any = None
    seq_id: Any = None
    logits: Any = None

    @classmethod
    def get_one(cls, tokens: Seq[int]) -> LlamaBatch:
        """``llama_batch_get_one``: ``tokens`` on sequence 0 after what it holds, logits
        of the last token only."""
        if not _is_seq(tokens):
            raise _bad(f"get_one takes a sequence of token ids, got {reprlib.repr(tokens)}",
                       {})
        return cls(token=list(tokens))

    @property
    def n_tokens(self) -> int:
        """Tokens (or embedding rows) in the batch; a ``token`` that is no sequence or an
        ``embd`` that is no 2-D array is an InvalidArgument, as :func:`plan_batch` says."""
        if self.token is not None:
            if not _is_seq(self.token):
                raise _bad(_TOKEN_NOT_A_SEQUENCE.format(reprlib.repr(self.token)), {})
            return len(self.token)
        if self.embd is None:
            return 0
        if not _is_embd(self.embd):
            raise _bad(_EMBD_NOT_2D, {})
        return len(self.embd)

    def add(self, token: int, pos: int, seq_ids: Seq[int], logits: bool) -> None:
        """``common_batch_add``: append one token (checked first: a refused call changes
        nothing)."""
        if self.embd is not None:
            raise InvalidArgument("add() appends token ids; this batch holds embeddings",
                                  stage=_STAGE)
        if not _is_seq(seq_ids):
            raise _bad(f"add(): seq_ids must be a list of sequence ids, got "
                       f"{reprlib.repr(seq_ids)}", {})
        for name in _LIST_FIELDS:
            value = getattr(self, name)
            if value is not None and not isinstance(value, list):
                raise _bad(f"add() appends to list fields; {name} is a "
                           f"{type(value).__name__}", {})
        for name in _LIST_FIELDS:
            if getattr(self, name) is None:
                setattr(self, name, [])
        self.token.append(token)
        self.pos.append(pos)
        self.n_seq_id.append(len(seq_ids))
        self.seq_id.append(list(seq_ids))
        self.logits.append(logits)

    def clear(self) -> None:
        """``common_batch_clear``: no tokens (fields given as lists become empty)."""
        self.token = [] if self.embd is None else None
        self.embd = None
        self.pos = self.n_seq_id = self.seq_id = self.logits = None


@attrs.frozen
class Ubatch:
    """Tokens ``start:stop`` of one sequence's part of the batch (indexes into
    :attr:`SeqPart.index`), one job; ``output``: its last token's logits are wanted."""

    start: int
    stop: int
    output: bool


@attrs.frozen
class SeqPart:
    """One sequence's tokens in a batch: the llama sequence, the position its first
    token goes to, the batch indexes of its tokens (in batch order) and its ubatches."""

    seq: int
    pos0: int
    index: tuple[int, ...]
    ubatches: tuple[Ubatch, ...]

    def batch_index(self, ub: Ubatch) -> int:
        """The batch index of ``ub``'s last token."""
        return self.index[ub.stop - 1]


@attrs.frozen
class BatchPlan:
    """A checked batch: each sequence's part (in order of first appearance), the batch
    indexes whose logits are wanted (in batch order) and the tokens or embeddings."""

    n_tokens: int
    outputs: tuple[int, ...]
    parts: tuple[SeqPart, ...]
    tokens: np.ndarray | None = attrs.field(default=None, eq=False, repr=False)
    embd: np.ndarray | None = attrs.field(default=None, eq=False, repr=False)

    @property
    def seq(self) -> int:
        """The first part's sequence (the only one on a batch-1 calbin)."""
        return self.parts[0].seq

    @property
    def pos0(self) -> int:
        """The first part's first position."""
        return self.parts[0].pos0

    def rounds(self) -> list[list[tuple[SeqPart, Ubatch]]]:
        """Round ``k``: the ``k``-th ubatch of every part that has one — jobs of
        different sequences that may run (and share device steps) together."""
        depth = max(len(p.ubatches) for p in self.parts)
        return [[(p, p.ubatches[k]) for p in self.parts if k < len(p.ubatches)]
                for k in range(depth)]


def _bad(message: str, ctx: Mapping[str, Any]) -> InvalidArgument:
    return InvalidArgument(message, stage=_STAGE, **ctx)


def _is_seq(value: Any) -> bool:
    """A list-like of entries: a sequence (not text) or a 1-D or 2-D numpy array."""
    if isinstance(value, np.ndarray):
        return value.ndim in (1, 2)
    return isinstance(value, Seq) and not isinstance(value, str | bytes)


def _is_embd(value: Any) -> bool:
    return isinstance(value, np.ndarray) and value.ndim == 2


def _ints(values: Any, field: str, n: int, ctx: Mapping[str, Any], *,
          flags: bool = False) -> np.ndarray:
    """``values`` as ``int64[n]``; bools only where ``flags`` (a logits flag)."""
    if isinstance(values, np.ndarray):
        kinds = "iub" if flags else "iu"
        if values.ndim != 1 or values.dtype.kind not in kinds:
            raise _bad(f"{field} must be a 1-D array of integers, got {values.dtype} "
                       f"{values.shape}", ctx)
        items = values.tolist()
    elif isinstance(values, Seq) and not isinstance(values, str | bytes):
        items = list(values)
    else:
        raise _bad(f"{field} must be a sequence of integers, got {reprlib.repr(values)}",
                   ctx)
    if len(items) != n:
        raise _bad(f"{field} has {len(items)} entries, the batch has {n} tokens", ctx)
    for i, v in enumerate(items):
        ok = isinstance(v, int | np.integer) and (flags or not isinstance(v, bool | np.bool_))
        if not (ok or (flags and isinstance(v, np.bool_))):
            raise _bad(f"{field}[{i}] must be an integer, got {reprlib.repr(v)}", ctx)
        if not -2**63 <= int(v) < 2**63:
            raise _bad(f"{field}[{i}] = {v} does not fit int64", ctx)
    return np.array([int(v) for v in items], dtype=np.int64)


def _token_sequences(batch: LlamaBatch, n: int, n_seq_max: int, multi: bool,
                     ctx: Mapping[str, Any]) -> np.ndarray:
    """The one sequence each token of ``batch`` names (``int64[n]``); unless ``multi``
    (a batch calbin), all the same one."""
    one = ("the calbin takes one sequence per job (batch 1)" if not multi
           else "calfsm cannot share one token's KV between sequences")
    if batch.seq_id is None:
        if batch.n_seq_id is not None and \
                (_ints(batch.n_seq_id, "n_seq_id", n, ctx) != 1).any():
            raise _bad(f"n_seq_id names several sequences per token but seq_id is not "
                       f"given: {one}", ctx)
        seqs = np.zeros(n, np.int64)
    else:
        ids = batch.seq_id
        if not _is_seq(ids) or len(ids) != n:
            raise _bad(f"seq_id must hold one list of sequence ids per token ({n})", ctx)
        counts = (_ints(batch.n_seq_id, "n_seq_id", n, ctx) if batch.n_seq_id is not None
                  else None)
        seqs = np.empty(n, np.int64)
        for i, row in enumerate(ids):
            if not _is_seq(row):
                raise _bad(f"seq_id[{i}] must be a list of sequence ids, got "
                           f"{reprlib.repr(row)}", ctx)
            k = len(row) if counts is None else int(counts[i])
            if k != 1 or len(row) < 1:
                raise _bad(f"token {i} belongs to {k} sequences: {one}, so each token "
                           "names exactly one", ctx)
            seqs[i] = _ints(list(row)[:1], f"seq_id[{i}]", 1, ctx)[0]
        distinct = sorted(set(seqs.tolist()))
        if len(distinct) != 1 and not multi:
            raise _bad(f"the batch mixes sequences {distinct}: the calbin takes one "
                       "sequence per job (batch 1); a batch calbin (max_batch > 1) takes "
                       "several", ctx)
    bad = seqs[(seqs < 0) | (seqs >= n_seq_max)]
    if bad.size:
        raise _bad(f"seq_id {int(bad[0])} outside this context's sequences "
                   f"0..{n_seq_max - 1}", ctx)
    return seqs


def _ubatches(flags: np.ndarray, n_ubatch: int) -> tuple[Ubatch, ...]:
    """Cut a sequence's tokens (their logits ``flags``) at every flagged token and after
    ``n_ubatch`` tokens."""
    out, start, n = [], 0, len(flags)
    for i in range(n):
        if flags[i] or i + 1 - start == n_ubatch or i == n - 1:
            out.append(Ubatch(start, i + 1, bool(flags[i])))
            start = i + 1
    return tuple(out)


def plan_batch(batch: LlamaBatch, *, seq_ids: Seq[int], n_ubatch: int, n_outputs_max: int,
               next_pos: Callable[[int], int], context: Mapping[str, Any],
               multi: bool = False) -> BatchPlan:
    """Check ``batch`` and cut each sequence's tokens into ubatches. ``seq_ids[s]`` is
    the executor's id of llama sequence ``s`` (errors carry it); ``next_pos(s)`` the
    position the sequence goes on at (what it holds); ``multi``: the batch may hold
    several sequences (a batch calbin). Raises InvalidArgument (stage ``llama_batch``,
    with ``context``)."""
    ctx = dict(context)
    if not isinstance(batch, LlamaBatch):
        raise _bad(f"decode takes a LlamaBatch, got {type(batch).__name__}", ctx)
    if batch.embd is not None and not _is_embd(batch.embd):
        raise _bad(_EMBD_NOT_2D, ctx)
    if batch.token is not None and not _is_seq(batch.token):
        raise _bad(_TOKEN_NOT_A_SEQUENCE.format(reprlib.repr(batch.token)), ctx)
    has_tok = batch.token is not None and len(batch.token) > 0
    has_embd = batch.embd is not None and len(batch.embd) > 0
    if has_tok and has_embd:
        raise _bad("a batch holds token ids or embeddings, not both", ctx)
    tokens = embd = None
    if has_embd:
        embd = batch.embd
        n = len(embd)
    else:
        n = batch.n_tokens
        if n == 0:
            raise _bad("the batch has no tokens (n_tokens == 0)", ctx)
        tokens = _ints(batch.token, "token", n, ctx)
    seqs = _token_sequences(batch, n, len(seq_ids), multi, ctx)
    pos = _ints(batch.pos, "pos", n, ctx) if batch.pos is not None else None
    if batch.logits is None:
        flags = np.zeros(n, np.int64)
        flags[-1] = 1
    else:
        flags = _ints(batch.logits, "logits", n, ctx, flags=True)
        if not np.isin(flags, (0, 1)).all():
            i = int(np.flatnonzero(~np.isin(flags, (0, 1)))[0])
            raise _bad(f"logits[{i}] must be 0 or 1, got {int(flags[i])}", ctx)
    parts = []
    for seq in dict.fromkeys(seqs.tolist()):           # order of first appearance
        index = np.flatnonzero(seqs == seq)
        pctx = {**ctx, "seq_id": seq_ids[seq]}
        pos0 = next_pos(seq)
        if pos is not None:
            p = pos[index]
            k = len(p)
            if p[0] != pos0 or (k > 1 and not np.array_equal(np.diff(p), np.ones(k - 1))):
                raise _bad(f"positions must go on from what sequence {seq} holds ({pos0} "
                           f"positions, last {pos0 - 1}) one by one: {pos0}..{pos0 + k - 1}, "
                           f"got {reprlib.repr(p.tolist())}", pctx)
        parts.append(SeqPart(seq, pos0, tuple(int(i) for i in index),
                             _ubatches(flags[index], n_ubatch)))
    if len(parts) == 1:
        ctx["seq_id"] = seq_ids[parts[0].seq]
    outputs = tuple(int(i) for i in np.flatnonzero(flags))
    if len(outputs) > n_outputs_max:
        raise _bad(f"the batch asks for {len(outputs)} logits rows, this context holds "
                   f"{n_outputs_max} (n_outputs_max)", ctx)
    return BatchPlan(n, outputs, tuple(parts), tokens, embd)
