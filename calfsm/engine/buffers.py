"""Buffer slots built once per generation, lent out as move-only leases.

Theory of operation
-------------------
A :class:`BufferSlot` is one set of device buffers (CalRT input + output buffer) for one
(generation, task kind, engine slot), together with the host arrays mapped into them:
the token (or embedding) tensor, the position tensor and the logits tensor. Every slot is
created when the model is configured (:meth:`BufferPool.build`): ``create_buffers``, host
arrays allocated once with the tensor's host dtype and exact byte size, ``map_buffer``
once per tensor, every CalRT code checked. Nothing is allocated on the hot path (S07).

The device reads and writes host arrays *when the job runs*, so a slot whose job may
still be on the device must never be reused, resized or freed (S06, invariant 4). The
pool therefore hands a slot out only through a :class:`BufferLease`:

- *move-only*: ``new = lease.move()`` transfers ownership; the old object is dead, and
  any use of a moved-from or returned lease raises :class:`~calfsm.errors.LeaseError`;
- it tracks what its holder did to the slot: slices applied through it, and whether
  the job is on the device (``mark_on_device()`` after ``infer`` succeeded,
  ``mark_off_device()`` after ``wait`` returned);
- :meth:`BufferPool.release` checks the slot is clean before it goes back to the free
  list. A slice left applied quarantines the slot (FI15; ``release`` returns False and
  logs). A lease still marked on-device is *refused*: the slot is quarantined, the lease
  is consumed and :class:`LeaseError` is raised (the spec's "assert and quarantine": a
  caller that knows the job may still run must call :meth:`BufferPool.quarantine`).

A quarantined slot is never lent again in its generation; its host arrays stay alive
(referenced by the slot) so a late DMA has somewhere harmless to land. After a device
reset the executor calls :meth:`BufferPool.retire`: every slot of the generation is
retired (leased ones become quarantined when returned), free slots' device buffers are
destroyed, and a new pool is built for the new generation. A lease of another generation
returned to a pool is refused with :class:`LeaseError` and its slot left alone.
The pool counts the usable (not quarantined) slots of each task kind; when a
quarantine takes a kind's last one its jobs could only wait, so the pool logs it and
calls ``on_exhausted(kind, reason)`` (outside its lock), whose owner drains and resets.

Invariant (checked by the stateful tests): ``free + leased + quarantined == total`` and
no slot is held by two leases. Retired slots count as quarantined.

Locking: one pool lock (``pool_mu`` in the spec), never held across a runtime call.
Lease operations that call the runtime (slice, CSR, KV sequence) take no pool lock: a
lease has one owner at a time, that is what move-only means.

Lending never waits: :meth:`BufferPool.acquire` lends a free slot now or raises
ResourceExhausted. Who waits for a slot, in what order and until when is the executor's
admission queue (:mod:`calfsm.engine.admission`); a slot coming back calls ``on_freed()`` (set
by the owner, no lock held) so that queue tries again.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from calfsm.drivers.base import SEQ_LIMIT as _SEQ_LIMIT
from calfsm.drivers.base import U32_MAX as _U32_MAX
from calfsm.drivers.base import Driver, EngineSlot
from calfsm.engine.sync import Sync
from calfsm.errors import (
    CalfsmError,
    InvalidArgument,
    LeaseError,
    ManifestError,
    ResourceExhausted,
    Unavailable,
    Unsupported,
    check,
    code_name,
    csr_refused,
    from_calrt,
)
from calfsm.manifest import SubmodelContract, TaskKind, TensorContract
from calfsm.request import check_embeds
from calfsm.util.lazy import bf16_dtype
from calfsm.util.lograte import RateLimitedLog

__all__ = [
    "BufferLease",
    "BufferPool",
    "BufferSlot",
    "PoolStats",
    "SlotState",
]

log = logging.getLogger(__name__)
#: the warnings a fault storm repeats, a burst per minute each (calfsm/util/lograte.py)
_limited = RateLimitedLog(log)


class SlotState(enum.StrEnum):
    FREE = "free"
    LEASED = "leased"
    QUARANTINED = "quarantined"
    RETIRED = "retired"  #: retired by a reset; counts as quarantined in the stats


@attrs.frozen
class PoolStats:
    """A snapshot of a pool; ``free + leased + quarantined == total`` always."""

    generation: int
    total: int
    free: int
    leased: int
    quarantined: int
    retired: bool = False


@attrs.define(eq=False, slots=True, repr=False)
class BufferSlot:
    """One set of device buffers and the host arrays mapped into them.

    ``tokens`` and ``positions`` are flat views of the input host arrays; ``logits`` is
    the whole physical output tensor as raw BF16 bits (``uint16``) and ``logits_bf16``
    a flat ``ml_dtypes.bfloat16`` view of it (made once: the per-token path reads it
    without building views). The arrays are allocated once and never resized, moved or
    freed while the slot exists.
    """

    index: int
    generation: int
    kind: TaskKind
    engine: EngineSlot
    model: Any
    inp: Any
    out: Any
    contract: SubmodelContract
    token_host: np.ndarray
    position_host: np.ndarray
    logits: np.ndarray
    tokens: np.ndarray
    positions: np.ndarray
    logits_bf16: np.ndarray
    state: SlotState = SlotState.FREE
    reason: str | None = None
    holder: _LeaseCore | None = None
    destroyed: bool = False
    #: rows its input buffer is set to carry (a batch graph; ``set_batch_rows``)
    batch_rows: int = 1
    #: the exact name of the shape bucket it is a slot of (None: its kind's widest
    #: graph, the one every job is prepared in): lent only by name, to the submitter
    graph: str | None = None

    def tensor(self, name: str) -> tuple[TensorContract, Any] | None:
        """The contract of a tensor of this slot by exact name, and the buffer it is in."""
        c = self.contract
        if name == c.token_or_embed.name:
            return c.token_or_embed, self.inp
        if name == c.position.name:
            return c.position, self.inp
        if name == c.logits.name:
            return c.logits, self.out
        return None

    def __repr__(self) -> str:
        return (f"<BufferSlot #{self.index} gen={self.generation} {self.kind.value} "
                f"{self.engine.name} {self.state.value}>")


class _LeaseCore:
    """What a lease knows, shared by the successive owners of one acquisition."""

    __slots__ = ("job_id", "on_device", "pool", "seq_id", "slices", "slot")

    def __init__(self, pool: BufferPool, slot: BufferSlot) -> None:
        self.pool = pool
        self.slot = slot
        self.slices: dict[str, tuple[int, int]] = {}
        self.on_device = False
        self.job_id: int | None = None
        self.seq_id: int | None = None


class BufferLease:
    """Move-only ownership of one :class:`BufferSlot` (see the module docstring).

    Every driver code met through a lease is checked with :func:`calfsm.errors.check`
    and raised with the lease's context (``bind(job_id=..., seq_id=...)``, generation).
    """

    __slots__ = ("_core", "_dead", "_last")

    def __init__(self, core: _LeaseCore) -> None:
        self._core: _LeaseCore | None = core
        self._dead = ""
        self._last: _LeaseCore | None = None  # kept for the context of misuse errors

    # ---- ownership --------------------------------------------------------------------
    def _live(self) -> _LeaseCore:
        """The lease's core, or LeaseError if it was released or handed on. Callers read
        ``self._core or self._live()``: a live lease costs no call on the token's way."""
        core = self._core
        if core is None:
            last = self._last
            ctx = ({} if last is None else
                   {"job_id": last.job_id, "seq_id": last.seq_id,
                    "generation": last.slot.generation})
            raise LeaseError(f"buffer lease used after it was {self._dead}", stage="lease",
                             **ctx)
        return core

    @property
    def valid(self) -> bool:
        """Whether this object still owns its slot (not moved, not returned)."""
        return self._core is not None

    def move(self) -> BufferLease:
        """Transfer ownership to a new lease object; this one becomes unusable."""
        core = self._core or self._live()
        self._consume("moved")
        return BufferLease(core)

    def _consume(self, why: str) -> None:
        self._last = self._core
        self._core = None
        self._dead = why

    # ---- what the holder sees -----------------------------------------------------------
    @property
    def slot(self) -> BufferSlot:
        return (self._core or self._live()).slot

    @property
    def generation(self) -> int:
        return (self._core or self._live()).slot.generation

    @property
    def kind(self) -> TaskKind:
        return (self._core or self._live()).slot.kind

    @property
    def engine(self) -> EngineSlot:
        return (self._core or self._live()).slot.engine

    @property
    def job_id(self) -> int | None:
        return (self._core or self._live()).job_id

    @property
    def seq_id(self) -> int | None:
        return (self._core or self._live()).seq_id

    @property
    def on_device(self) -> bool:
        return (self._core or self._live()).on_device

    @property
    def slices(self) -> Mapping[str, tuple[int, int]]:
        """Slices applied through this lease and not undone: name -> (offset, size)."""
        return dict((self._core or self._live()).slices)

    def bind(self, *, job_id: int | None = None, seq_id: int | None = None) -> BufferLease:
        """Set the job/sequence context every error raised through this lease carries."""
        core = self._core or self._live()
        if job_id is not None:
            core.job_id = job_id
        if seq_id is not None:
            core.seq_id = seq_id
        return self

    def _ctx(self, core: _LeaseCore) -> dict[str, Any]:
        return {"job_id": core.job_id, "seq_id": core.seq_id,
                "generation": core.slot.generation}

    def mark_on_device(self) -> None:
        """``infer`` succeeded: the device may read and write this slot until ``wait``."""
        (self._core or self._live()).on_device = True

    def mark_off_device(self) -> None:
        """``wait`` returned (or a verified reset aborted the job): the device is done."""
        (self._core or self._live()).on_device = False

    # ---- host data ----------------------------------------------------------------------
    def write_inputs(self, tokens: Any, positions: Any) -> int:
        """Copy ``tokens`` and ``positions`` into the host arrays; returns the token count.

        Checked locally (InvalidArgument, nothing written): at least one token, equal
        lengths, no more than the tensor holds, values representable in the host dtype
        and positions non-negative. For ``PREFILL_EMBEDS`` ``tokens`` is ``(n, hidden)``
        in the tensor's dtype (:func:`calfsm.request.check_embeds`), copied bit for bit.
        """
        core = self._core or self._live()
        slot = core.slot
        tok = tokens if type(tokens) is np.ndarray else np.asarray(tokens)
        pos = positions if type(positions) is np.ndarray else np.asarray(positions)
        embeds = slot.kind is TaskKind.PREFILL_EMBEDS
        if not embeds and _write_one(slot, tok, pos):
            return 1
        ctx = self._ctx(core)
        if embeds:
            check_embeds(tok, slot.contract, {"stage": "prepare", **ctx})
        elif tok.ndim != 1:
            raise InvalidArgument(f"tokens must be 1-D, got shape {tok.shape}",
                                  stage="prepare", **ctx)
        if pos.ndim != 1:
            raise InvalidArgument(f"positions must be 1-D, got shape {pos.shape}",
                                  stage="prepare", **ctx)
        n = tok.shape[0]
        capacity = slot.contract.max_tokens
        if n < 1:
            raise InvalidArgument("no tokens to write", stage="prepare", **ctx)
        if pos.shape[0] != n:
            raise InvalidArgument(f"{n} tokens but {pos.shape[0]} positions",
                                  stage="prepare", **ctx)
        if n > capacity:
            raise InvalidArgument(f"{n} tokens exceed the {slot.kind.value} tensor "
                                  f"capacity of {capacity}", stage="prepare", **ctx)
        tok_range = None if embeds else _check_values(tok, slot.tokens.dtype, "tokens", ctx)
        pos_range = _check_values(pos, slot.positions.dtype, "positions", ctx) \
            or _value_range(pos)
        if pos_range[0] < 0:
            raise InvalidArgument(f"negative position {int(pos_range[0])}",
                                  stage="prepare", **ctx)
        if n == 1 and tok.size == 1 and tok_range is not None:
            slot.tokens[0] = tok_range[0]       # a decode: two scalar stores, no copies
            slot.positions[0] = pos_range[0]
        else:
            flat = tok.reshape(-1)
            # embeddings keep their bits (BF16 is held as uint16): a view, never a cast
            slot.tokens[:tok.size] = flat.view(slot.tokens.dtype) if embeds else flat
            slot.positions[:n] = pos
        return n

    def write_token(self, token: int) -> None:
        """Put ``token`` in the slot's one-token input, whose position :meth:`load`
        wrote (a decode prepared ahead, its token now known: checked against the
        vocabulary by the caller, :func:`calfsm.request.check_token`)."""
        core = self._core or self._live()
        if core.slot.kind is not TaskKind.DECODE:
            raise InvalidArgument(f"write_token is for a decode slot, not "
                                  f"{core.slot.kind.value}", stage="prepare",
                                  **self._ctx(core))
        core.slot.tokens[0] = token

    # ---- device-side settings -------------------------------------------------------------
    def slice(self, tensor_name: str, offset_bytes: int, size_bytes: int) -> None:
        """Set the active region of a tensor of this slot.

        Bounds are checked locally *before* the driver is called (FI03): the tensor must
        be one of the slot's, ``offset >= 0``, ``size > 0``, ``offset + size <=
        byte_size``, both multiples of the dtype size; else InvalidArgument and the
        runtime is never called. The slice is tracked until :meth:`undo_slices`.
        """
        core = self._core or self._live()
        slot = core.slot
        ctx = self._ctx(core)
        found = slot.tensor(tensor_name)
        if found is None:
            raise InvalidArgument(f"{slot.kind.value} has no tensor {tensor_name!r}",
                                  stage="slice", **ctx)
        contract, buf = found
        for what, v in (("offset", offset_bytes), ("size", size_bytes)):
            if isinstance(v, bool) or not isinstance(v, int | np.integer):
                raise InvalidArgument(f"slice {what} of {tensor_name!r} must be an integer, "
                                      f"got {v!r}", stage="slice", **ctx)
        offset, size = int(offset_bytes), int(size_bytes)
        byte_size = contract.byte_size
        item = contract.dtype.itemsize
        if offset < 0 or size <= 0 or offset > byte_size or size > byte_size - offset:
            raise InvalidArgument(f"slice [{offset}, +{size}) of {tensor_name!r} outside its "
                                  f"{byte_size} bytes", stage="slice", **ctx)
        if offset % item or size % item:
            raise InvalidArgument(f"slice [{offset}, +{size}) of {tensor_name!r} not a "
                                  f"multiple of its {item}-byte {contract.dtype.value} "
                                  "elements", stage="slice", **ctx)
        check(core.pool.driver.slice_tensor(buf, tensor_name, offset, size), "slice", **ctx)
        core.slices[tensor_name] = (offset, size)

    def slice_inputs(self, n_tokens: int) -> None:
        """Slice the token and position tensors to their first ``n_tokens`` elements."""
        core = self._core or self._live()
        c = core.slot.contract
        per_token = c.token_or_embed.byte_size // c.max_tokens
        self.slice(c.token_or_embed.name, 0, n_tokens * per_token)
        self.slice(c.position.name, 0, n_tokens * c.position.dtype.itemsize)

    def load(self, seq_id: int, tokens: Any, positions: Any) -> int:
        """Program the slot for one job; returns the token count ``n``.

        Copies ``tokens`` and ``positions``, slices the sliceable input tensors to them,
        binds the KV sequence and sets both CSRs: ``cur_seq = n`` and ``total_seq`` =
        last position + 1 (what the device checks). Each step checks and raises as the
        method it calls does (nothing reaches the runtime after a local failure)."""
        n = self.write_inputs(tokens, positions)
        slot = (self._core or self._live()).slot
        c = slot.contract
        if c.token_or_embed.sliceable:
            per_token = c.token_or_embed.byte_size // c.max_tokens
            self.slice(c.token_or_embed.name, 0, n * per_token)
        if c.position.sliceable:
            self.slice(c.position.name, 0, n * c.position.dtype.itemsize)
        self.set_kv_seq(seq_id)
        self.set_csr(c.csr_cur_seq, n)
        self.set_csr(c.csr_total_seq, int(slot.positions.item(n - 1)) + 1)
        return n

    def load_row(self, row: int, src: BufferSlot, seq_id: int, n: int, *,
                 job_id: int | None = None) -> None:
        """Row ``row`` of this batch graph's slot: the first ``n`` tokens and positions of
        ``src`` (another job's slot, written and checked when that job was prepared), its
        KV sequence and both CSRs, as :meth:`load` sets row 0's. Row 0 is a job moved to
        this slot of another graph (a shape bucket) from the slot it was prepared in. An
        error names ``job_id`` (the row's own job) and ``seq_id``."""
        core = self._core or self._live()
        slot = core.slot
        c = slot.contract
        if not 0 <= row < c.max_batch or not 1 <= n <= c.max_tokens:
            raise InvalidArgument(f"row {row} of {n} tokens outside the {c.kind.value} "
                                  f"graph's {c.max_batch} rows of {c.max_tokens}",
                                  stage="prepare", **self._ctx(core))
        at = row * c.max_tokens
        slot.tokens[at:at + n] = src.tokens[:n]
        slot.positions[at:at + n] = src.positions[:n]
        driver, inp = core.pool.driver, slot.inp
        ctx = {**self._ctx(core), "seq_id": seq_id}    # the row's job, not the leader's
        if job_id is not None:
            ctx["job_id"] = job_id
        where = {"row": row} if row else {}     # row 0: the single-row calls
        check(driver.set_kv_seq(inp, int(seq_id), **where), "kv_seq", **ctx)
        for name, value in ((c.csr_cur_seq, int(n)),
                            (c.csr_total_seq, int(src.positions[n - 1]) + 1)):
            code = driver.set_csr(inp, name, value, **where)
            if code:
                raise csr_refused(code, name, declared=True, **ctx)

    def set_rows(self, rows: int) -> None:
        """How many rows the next job of this batch graph's slot carries (said only when
        it changes)."""
        core = self._core or self._live()
        slot = core.slot
        if slot.batch_rows != rows:
            check(core.pool.driver.set_batch_rows(slot.inp, int(rows)),  # type: ignore[attr-defined]
                  "batch_rows", **self._ctx(core))
            slot.batch_rows = int(rows)

    def undo_slices(self) -> None:
        """Restore every tensor sliced through this lease. Tries all of them; a slice whose
        undo failed stays tracked (the slot will be quarantined on return) and the first
        failure is raised."""
        core = self._core or self._live()
        if not core.slices:
            return
        ctx = self._ctx(core)
        first: CalfsmError | None = None
        for name in list(core.slices):
            found = core.slot.tensor(name)
            buf = found[1] if found else core.slot.inp
            try:
                check(core.pool.driver.undo_slice(buf, name), "undo_slice", **ctx)
            except CalfsmError as e:
                first = first or e
                continue
            del core.slices[name]
        if first is not None:
            raise first

    def set_csr(self, name: str, value: int) -> None:
        """Set a CSR of the input buffer (value checked to ``0..2**32-1`` locally)."""
        core = self._core or self._live()
        if isinstance(value, bool) or not isinstance(value, int | np.integer) \
                or not 0 <= value <= _U32_MAX:
            raise InvalidArgument(f"CSR {name!r} value {value!r} outside 0..2**32-1",
                                  stage="csr", **self._ctx(core))
        code = core.pool.driver.set_csr(core.slot.inp, name, int(value))
        if code:
            c = core.slot.contract
            raise csr_refused(code, name, declared=name in (c.csr_cur_seq, c.csr_total_seq),
                              **self._ctx(core))

    def set_kv_seq(self, seq_id: int) -> None:
        """Bind the input buffer to a KV sequence (``0 <= seq_id < 2**31`` locally)."""
        core = self._core or self._live()
        if isinstance(seq_id, bool) or not isinstance(seq_id, int | np.integer) \
                or not 0 <= seq_id < _SEQ_LIMIT:
            raise InvalidArgument(f"KV sequence id {seq_id!r} outside 0..2**31-1",
                                  stage="kv_seq", **self._ctx(core))
        code = core.pool.driver.set_kv_seq(core.slot.inp, int(seq_id))
        if code:
            raise from_calrt(code, "kv_seq", **self._ctx(core))

    def __repr__(self) -> str:
        core = self._core
        if core is None:
            return f"<BufferLease {self._dead}>"
        return f"<BufferLease of {core.slot!r} job={core.job_id} seq={core.seq_id}>"


_INT_RANGE: dict[np.dtype, tuple[int, int]] = {}


def _int_range(dtype: np.dtype) -> tuple[int, int]:
    r = _INT_RANGE.get(dtype)
    if r is None:
        info = np.iinfo(dtype)
        r = _INT_RANGE[dtype] = (int(info.min), int(info.max))
    return r


def _write_one(slot: BufferSlot, tok: np.ndarray, pos: np.ndarray) -> bool:
    """A decode's one token and position, written with scalar reads and stores when they
    pass every check :meth:`BufferLease.write_inputs` makes (1-D, one of each, integers
    that fit the host dtypes, position non-negative, room for a token): True when
    written. False, nothing written: not that plain case, or a check failed, and the
    general path checks again and raises (issue 35 item 4: one call, not eight)."""
    if tok.shape != (1,) or pos.shape != (1,) or tok.dtype.kind not in "iu" \
            or pos.dtype.kind not in "iu" or slot.contract.max_tokens < 1:
        return False
    t_range = _INT_RANGE.get(slot.tokens.dtype)     # (filled by the general path)
    p_range = _INT_RANGE.get(slot.positions.dtype)
    if t_range is None or p_range is None:
        return False
    t, p = tok.item(), pos.item()
    if not (t_range[0] <= t <= t_range[1] and p >= 0 and p_range[0] <= p <= p_range[1]):
        return False
    slot.tokens[0] = t
    slot.positions[0] = p
    return True


def _value_range(a: np.ndarray) -> tuple[Any, Any]:
    """(min, max) of a non-empty array; one element (a decode) is read as a scalar, with
    no reductions."""
    if a.size == 1:
        v = a.item()
        return v, v
    return a.min(), a.max()


def _check_values(a: np.ndarray, dtype: np.dtype, what: str,
                  ctx: dict[str, Any]) -> tuple[int, int] | None:
    """Check ``a`` holds integers that fit the integer host ``dtype``; returns their
    (min, max). None, with nothing checked: ``a`` empty or ``dtype`` not an integer."""
    if a.size == 0 or dtype.kind not in "iu":
        return None
    if a.dtype.kind not in "iu":
        raise InvalidArgument(f"{what} must be integers, got {a.dtype}", stage="prepare",
                              **ctx)
    lo, hi = _value_range(a)
    lo, hi = int(lo), int(hi)
    low, high = _int_range(dtype)
    if lo < low or hi > high:
        raise InvalidArgument(f"{what} values [{lo}, {hi}] do not fit {dtype}",
                              stage="prepare", **ctx)
    return lo, hi


class BufferPool:
    """Every buffer slot of one generation, and the free/leased/quarantined bookkeeping.

    Build with :meth:`build`. ``acquire`` never blocks (ResourceExhausted when nothing is
    free).
    """

    def __init__(self, driver: Driver, generation: int, slots: Iterable[BufferSlot], *,
                 sync: Sync) -> None:
        self.driver = driver
        self.generation = generation
        self._slots: tuple[BufferSlot, ...] = tuple(slots)
        self._lock = sync.lock()
        self._free: dict[tuple[TaskKind, EngineSlot, str | None], deque[BufferSlot]] = {}
        self._kinds: dict[tuple[TaskKind, str | None], list[EngineSlot]] = {}
        for s in self._slots:
            self._free.setdefault((s.kind, s.engine, s.graph), deque()).append(s)
            engines = self._kinds.setdefault((s.kind, s.graph), [])
            if s.engine not in engines:
                engines.append(s.engine)
        self._n_free = len(self._slots)
        self._n_leased = 0
        self._n_quarantined = 0
        self._retired = False
        #: slots per kind not quarantined: once a kind has none, only a new generation
        #: serves it again, and ``on_exhausted(kind, reason)`` is told (no lock held)
        self._usable: dict[TaskKind, int] = {}
        for s in self._slots:
            if s.graph is None:     # a shape bucket's slots are a choice, not a need
                self._usable[s.kind] = self._usable.get(s.kind, 0) + 1
        self.on_exhausted: Callable[[TaskKind, str], None] | None = None
        #: called (no lock held) when a slot came back free: the owner's admission
        #: queue may try again
        self.on_freed: Callable[[], None] | None = None

    # ---- construction ---------------------------------------------------------------------
    @classmethod
    def build(cls, driver: Driver, generation: int,
              models: Mapping[TaskKind, tuple[Any, SubmodelContract]], *,
              sync: Sync,
              engines: Sequence[EngineSlot] = (EngineSlot.AUTO,),
              slots_per_engine: int = 1,
              extra: Mapping[TaskKind, int] | None = None,
              buckets: Mapping[str, tuple[Any, SubmodelContract]] | None = None,
              bucket_slots: int = 1) -> BufferPool:
        """Create every slot now: per (task kind, engine) ``slots_per_engine`` buffer sets
        (and ``extra[kind]`` more), and per shape bucket (``buckets``: by exact name) and
        engine ``bucket_slots`` more, lent only by name; host arrays allocated and mapped
        once. Any failure destroys what was created and raises the classified error
        (stage ``buffers`` or ``map``)."""
        if slots_per_engine < 1:
            raise InvalidArgument(f"slots_per_engine must be >= 1, got {slots_per_engine}",
                                  stage="buffers", generation=generation)
        if not engines:
            raise InvalidArgument("no engine slots given", stage="buffers",
                                  generation=generation)
        slots: list[BufferSlot] = []
        try:
            for kind, (model, contract) in models.items():
                for engine in engines:
                    for _ in range(slots_per_engine + (extra or {}).get(kind, 0)):
                        slots.append(_make_slot(driver, generation, len(slots), kind,
                                                EngineSlot(engine), model, contract))
            for name, (model, contract) in (buckets or {}).items():
                for engine in engines:
                    for _ in range(bucket_slots):
                        slots.append(_make_slot(driver, generation, len(slots),
                                                contract.kind, EngineSlot(engine), model,
                                                contract, graph=name))
        except BaseException:
            for s in slots:
                _destroy(driver, s)
            raise
        return cls(driver, generation, slots, sync=sync)

    # ---- lending --------------------------------------------------------------------------
    def _take(self, kind: TaskKind, engine: EngineSlot, graph: str | None = None
              ) -> BufferSlot | None:
        """Pop a free slot (lock held). Raises for a kind/engine the pool never had."""
        engines = self._kinds.get((kind, graph))
        if engines is None:
            of = f" of graph {graph!r}" if graph is not None else ""
            raise Unsupported(f"pool of generation {self.generation} has no "
                              f"{kind.value} slots{of}", stage="lease",
                              generation=self.generation)
        if engine is EngineSlot.AUTO:     # the engine with the most free slots (ping/pong
            best = None                   # stays even); ties go to the first
            for e in engines:
                q = self._free[(kind, e, graph)]
                if q and (best is None or len(q) > len(best)):
                    best = q
            return best.popleft() if best is not None else None
        q = self._free.get((kind, engine, graph))
        if q is None:
            raise Unsupported(f"pool of generation {self.generation} has no {kind.value} "
                              f"slots on engine {engine.name}", stage="lease",
                              generation=self.generation)
        return q.popleft() if q else None

    def _lend(self, slot: BufferSlot) -> BufferLease:
        core = _LeaseCore(self, slot)
        slot.state = SlotState.LEASED
        slot.holder = core
        self._n_free -= 1
        self._n_leased += 1
        return BufferLease(core)

    def _refuse_retired(self) -> None:
        raise Unavailable(f"buffer pool of generation {self.generation} is retired",
                          stage="lease", generation=self.generation)

    def acquire(self, kind: TaskKind, engine: EngineSlot = EngineSlot.AUTO,
                graph: str | None = None) -> BufferLease:
        """Lease a free slot now (of the shape bucket named ``graph``; None: the kind's
        widest graph), or raise ResourceExhausted (Unavailable once retired)."""
        with self._lock:
            if self._retired:
                self._refuse_retired()
            slot = self._take(kind, engine, graph)
            if slot is None:
                raise ResourceExhausted(f"no free {kind.value} buffer slot "
                                        f"(engine {engine.name})", stage="lease",
                                        generation=self.generation)
            return self._lend(slot)

    # ---- returning ------------------------------------------------------------------------
    def _own(self, lease: BufferLease) -> _LeaseCore:
        core = lease._live()
        slot = core.slot
        if core.pool is not self or slot.generation != self.generation:
            raise LeaseError(f"lease of generation {slot.generation} returned to the pool "
                             f"of generation {self.generation}", stage="lease",
                             job_id=core.job_id, seq_id=core.seq_id,
                             generation=slot.generation)
        if slot.holder is not core:  # cannot happen through the public API
            raise LeaseError(f"{slot!r} is not held by this lease", stage="lease",
                             job_id=core.job_id, seq_id=core.seq_id,
                             generation=slot.generation)
        return core

    def _quarantine_locked(self, slot: BufferSlot, reason: str) -> str | None:
        """Returns why the slot's kind has no usable slot left, if this took the last."""
        slot.holder = None
        slot.reason = reason
        slot.state = SlotState.RETIRED if self._retired else SlotState.QUARANTINED
        self._n_leased -= 1
        self._n_quarantined += 1
        if self._retired or slot.graph is not None:
            return None
        self._usable[slot.kind] -= 1
        if self._usable[slot.kind]:
            return None
        return (f"every {slot.kind.value} buffer slot of generation {self.generation} is "
                f"quarantined (the last: {reason})")

    def _report_exhausted(self, kind: TaskKind, why: str | None) -> None:
        if why is not None:
            log.error("%s", why, extra={"generation": self.generation, "stage": "lease"})
            hook = self.on_exhausted
            if hook is not None:
                try:                # a cleanup path called us: the hook must not break it
                    hook(kind, why)
                except Exception:
                    log.exception("the exhaustion hook of generation %s failed",
                                  self.generation)

    def usable(self, kind: TaskKind) -> int:
        """Slots of ``kind`` not quarantined (free or leased); 0 once retired."""
        with self._lock:
            return 0 if self._retired else self._usable.get(kind, 0)

    def release(self, lease: BufferLease) -> bool:
        """Return a lease's slot; True if it went back to the free list.

        - lease moved-from, already returned, or of another pool/generation: LeaseError
          (a foreign lease is left untouched, still valid for its own pool);
        - lease still marked on-device: refused, the slot is quarantined, the lease
          consumed, and LeaseError raised;
        - a slice still applied through the lease (FI15): the slot is quarantined, the
          fact logged, False returned;
        - pool retired: the slot is quarantined (retired), False returned.
        """
        freed = False
        with self._lock:
            core = self._own(lease)
            slot = core.slot
            lease._consume("returned")
            if core.on_device:
                why = self._quarantine_locked(slot, "returned while the job may be on "
                                              "the device")
                on_device = True
            else:
                on_device = False
                if core.slices:
                    reason = f"returned with slices applied: {sorted(core.slices)}"
                    why = self._quarantine_locked(slot, reason)
                elif self._retired:
                    why = self._quarantine_locked(slot, "generation retired")
                else:
                    slot.holder = None
                    slot.state = SlotState.FREE
                    self._free[(slot.kind, slot.engine, slot.graph)].append(slot)
                    self._n_leased -= 1
                    self._n_free += 1
                    freed = True
        if freed:
            hook = self.on_freed
            if hook is not None:
                hook()
            return True
        if on_device:
            err = LeaseError(f"{slot!r} returned while its job may still be on the device; "
                             "slot quarantined", stage="lease", job_id=core.job_id,
                             seq_id=core.seq_id, generation=slot.generation)
            log.error("%s", str(err), extra=err.context())
            self._report_exhausted(slot.kind, why)
            raise err
        # the log gets text, not the slot: a handler that keeps records (pytest's does)
        # would keep a retired generation's slot and its host arrays alive
        _limited.warning("quarantine", "buffer slot quarantined on return: %s (%s)",
                         slot.reason, str(slot), extra={
                             "job_id": core.job_id, "seq_id": core.seq_id,
                             "generation": slot.generation, "stage": "lease"})
        self._report_exhausted(slot.kind, why)
        return False

    def quarantine(self, lease: BufferLease, reason: str) -> None:
        """Take a lease's slot out of service for this generation (e.g. after a Wait
        timeout, when the device may still write it). The lease is consumed; the host
        arrays stay alive with the slot."""
        with self._lock:
            core = self._own(lease)
            lease._consume("quarantined")
            why = self._quarantine_locked(core.slot, reason)
        _limited.warning("quarantine", "buffer slot quarantined: %s (%s)", reason,
                         str(core.slot), extra={
                             "job_id": core.job_id, "seq_id": core.seq_id,
                             "generation": core.slot.generation, "stage": "lease"})
        self._report_exhausted(core.slot.kind, why)

    def retire(self) -> None:
        """After a reset: no slot of this generation is lent again. Free slots are retired
        and their device buffers destroyed (codes logged, not raised: after a
        configuration reset the handles are stale); leased ones become quarantined when
        returned. Calling it twice is harmless."""
        with self._lock:
            self._retired = True
            self.on_exhausted = None    # a retired pool serves nobody: nothing to report
            freed: list[BufferSlot] = []
            for q in self._free.values():
                while q:
                    slot = q.popleft()
                    slot.state = SlotState.RETIRED
                    slot.reason = "generation retired"
                    freed.append(slot)
            self._n_free -= len(freed)
            self._n_quarantined += len(freed)
        for slot in freed:
            _destroy(self.driver, slot)

    # ---- introspection --------------------------------------------------------------------
    @property
    def retired(self) -> bool:
        return self._retired

    @property
    def slots(self) -> tuple[BufferSlot, ...]:
        return self._slots

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(self.generation, len(self._slots), self._n_free,
                             self._n_leased, self._n_quarantined, self._retired)

    def __repr__(self) -> str:
        s = self.stats()
        return (f"<BufferPool gen={s.generation} total={s.total} free={s.free} "
                f"leased={s.leased} quarantined={s.quarantined}"
                f"{' retired' if s.retired else ''}>")



def _host_array(t: TensorContract, generation: int, where: str) -> np.ndarray:
    host = np.zeros(t.shape, dtype=t.dtype.host_dtype)
    if host.nbytes != t.byte_size:
        raise ManifestError(f"{where}: shape {list(t.shape)} of {t.dtype.value} is "
                            f"{host.nbytes} bytes, byte_size says {t.byte_size}",
                            stage="buffers", generation=generation)
    return host


def _make_slot(driver: Driver, generation: int, index: int, kind: TaskKind,
               engine: EngineSlot, model: Any, contract: SubmodelContract, *,
               graph: str | None = None) -> BufferSlot:
    ctx = {"generation": generation}
    token = _host_array(contract.token_or_embed, generation, f"{kind.value}.token_or_embed")
    position = _host_array(contract.position, generation, f"{kind.value}.position")
    logits = _host_array(contract.logits, generation, f"{kind.value}.logits")
    if logits.dtype != np.uint16:
        raise ManifestError(f"{kind.value}.logits: dtype {contract.logits.dtype.value}, "
                            "calfsm reads BF16 logits", stage="buffers", **ctx)
    code, bufs = driver.create_buffers(model, engine)
    check(code, "buffers", **ctx)
    assert bufs is not None
    inp, out = bufs
    slot = BufferSlot(index=index, generation=generation, kind=kind, engine=engine,
                      model=model, inp=inp, out=out, contract=contract, token_host=token,
                      position_host=position, logits=logits, tokens=token.reshape(-1),
                      positions=position.reshape(-1),
                      logits_bf16=logits.reshape(-1).view(bf16_dtype()), graph=graph)
    try:
        check(driver.map_buffer(inp, contract.token_or_embed.name, token), "map", **ctx)
        check(driver.map_buffer(inp, contract.position.name, position), "map", **ctx)
        check(driver.map_buffer(out, contract.logits.name, logits), "map", **ctx)
        if contract.batched:    # one row per job, said once (the device's default too)
            check(driver.set_batch_rows(inp, 1), "batch_rows", **ctx)  # type: ignore[attr-defined]
    except BaseException:
        _destroy(driver, slot)
        raise
    return slot


def _destroy(driver: Driver, slot: BufferSlot) -> None:
    """Best-effort cleanup: a failed ``destroy_buffers`` is classified and logged, not
    raised. Its callers are already failing (a build that raised) or retiring a
    generation after a reset, whose handles the device may have dropped; raising would
    hide the first error or stop the retirement halfway. The slot is never lent again."""
    if slot.destroyed:
        return
    code = driver.destroy_buffers(slot.inp, slot.out)
    slot.destroyed = True
    if code != 0:
        err = from_calrt(code, "destroy_buffers",
                         f"destroy_buffers of {slot!r} returned {code_name(code)}",
                         generation=slot.generation)
        log.warning("%s", str(err), extra=err.context())
