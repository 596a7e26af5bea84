"""``LlamaBatch``, llama.cpp's ``llama_batch``, and its check against one sequence.

A batch holds ``n_tokens`` tokens (``token``) or embedding rows (``embd``), each with a
position (``pos``), the sequences it belongs to (``n_seq_id[i]`` ids in ``seq_id[i]``)
and a ``logits`` flag (output this token's logits). As in llama.cpp, ``pos=None`` means
"after what the sequence holds", ``seq_id=None`` sequence 0 and ``logits=None`` the last
token only.

:func:`plan_batch` checks a batch before anything runs — the calbin takes one sequence
per job (batch 1), so every token names exactly that one sequence; the flags are 0 or 1
and one per token; the positions go on from what the sequence already holds, one by one
— and cuts it into *ubatches*, one executor job each: a job gives the logits of its last
token only, so a ubatch ends at every flagged token and after ``n_ubatch`` tokens.
Token ids and embeddings are checked against the manifest by the caller, with the
executor's own :func:`~calfsm.request.check_request`, before the first job.
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from typing import Any

import attrs
import numpy as np

from calfsm.errors import InvalidArgument

__all__ = ["BatchPlan", "LlamaBatch", "Ubatch", "plan_batch"]

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
    """Tokens ``start:stop`` of the batch, one job; ``output``: its last token's logits
    are wanted."""

    start: int
    stop: int
    output: bool


@attrs.frozen
class BatchPlan:
    """A checked batch: its one sequence, first position, the batch indexes whose logits
    are wanted (in order) and the ubatches."""

    seq: int
    pos0: int
    n_tokens: int
    outputs: tuple[int, ...]
    ubatches: tuple[Ubatch, ...]
    tokens: np.ndarray | None = attrs.field(default=None, eq=False, repr=False)
    embd: np.ndarray | None = attrs.field(default=None, eq=False, repr=False)


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


def _one_sequence(batch: LlamaBatch, n: int, n_seq_max: int,
                  ctx: Mapping[str, Any]) -> int:
    """The one sequence every token of ``batch`` names."""
    if batch.seq_id is None:
        if batch.n_seq_id is not None and \
                (_ints(batch.n_seq_id, "n_seq_id", n, ctx) != 1).any():
            raise _bad("n_seq_id names several sequences per token but seq_id is not "
                       "given: the calbin takes one sequence per batch (batch 1)", ctx)
        seq = 0
    else:
        ids = batch.seq_id
        if not _is_seq(ids) or len(ids) != n:
            raise _bad(f"seq_id must hold one list of sequence ids per token ({n})", ctx)
        counts = (_ints(batch.n_seq_id, "n_seq_id", n, ctx) if batch.n_seq_id is not None
                  else None)
        seqs = set()
        for i, row in enumerate(ids):
            if not _is_seq(row):
                raise _bad(f"seq_id[{i}] must be a list of sequence ids, got "
                           f"{reprlib.repr(row)}", ctx)
            k = len(row) if counts is None else int(counts[i])
            if k != 1 or len(row) < 1:
                raise _bad(f"token {i} belongs to {k} sequences: the calbin takes one "
                           "sequence per batch (batch 1), so each token names exactly one",
                           ctx)
            seqs.update(_ints(list(row)[:1], f"seq_id[{i}]", 1, ctx).tolist())
        if len(seqs) != 1:
            raise _bad(f"the batch mixes sequences {sorted(seqs)}: the calbin takes one "
                       "sequence per batch (batch 1)", ctx)
        seq = seqs.pop()
    if not 0 <= seq < n_seq_max:
        raise _bad(f"seq_id {seq} outside this context's sequences 0..{n_seq_max - 1}", ctx)
    return seq


def plan_batch(batch: LlamaBatch, *, seq_ids: Seq[int], n_ubatch: int, n_outputs_max: int,
               next_pos: Callable[[int], int], context: Mapping[str, Any]) -> BatchPlan:
    """Check ``batch`` and cut it into ubatches. ``seq_ids[s]`` is the executor's id of
    llama sequence ``s`` (errors carry it); ``next_pos(s)`` the position the sequence
    goes on at (what it holds). Raises InvalidArgument (stage ``llama_batch``, with
    ``context``)."""
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
    seq = _one_sequence(batch, n, len(seq_ids), ctx)
    ctx["seq_id"] = seq_ids[seq]
    pos0 = next_pos(seq)
    if batch.pos is not None:
        pos = _ints(batch.pos, "pos", n, ctx)
        if pos[0] != pos0 or (n > 1 and not np.array_equal(np.diff(pos), np.ones(n - 1))):
            raise _bad(f"positions must go on from what sequence {seq} holds ({pos0} "
                       f"positions, last {pos0 - 1}) one by one: {pos0}..{pos0 + n - 1}, "
                       f"got {reprlib.repr(pos.tolist())}", ctx)
    if batch.logits is None:
        flags = np.zeros(n, np.int64)
        flags[-1] = 1
    else:
        flags = _ints(batch.logits, "logits", n, ctx, flags=True)
        if not np.isin(flags, (0, 1)).all():
            i = int(np.flatnonzero(~np.isin(flags, (0, 1)))[0])
            raise _bad(f"logits[{i}] must be 0 or 1, got {int(flags[i])}", ctx)
    outputs = tuple(int(i) for i in np.flatnonzero(flags))
    if len(outputs) > n_outputs_max:
        raise _bad(f"the batch asks for {len(outputs)} logits rows, this context holds "
                   f"{n_outputs_max} (n_outputs_max)", ctx)
    ubatches, start = [], 0
    for i in range(n):
        if flags[i] or i + 1 - start == n_ubatch or i == n - 1:
            ubatches.append(Ubatch(start, i + 1, bool(flags[i])))
            start = i + 1
    return BatchPlan(seq, pos0, n, outputs, tuple(ubatches), tokens, embd)
