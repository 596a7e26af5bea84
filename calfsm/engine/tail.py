"""The native tail: the part of a step's completion the next step waits for, for every row
of a job in one call without the GIL.

Theory of operation
-------------------
After a job's one ``wait`` and its job-level checks, each row still needs its BF16 logits
converted into its float32 target and checked finite (:mod:`calfsm.engine.logits`), and
a stream's row its token (:mod:`calfsm.generate.sampling`): the penalties, then the
argmax or the seeded draw. Row by row in Python that is one core holding the GIL while
the device waits (issue 36: at V = 151,936 and 64 rows, a third of the step). Here every
row of the job is one ``calfsm_tail`` call (``native/calfsm_tail.c``; cffi releases the
GIL around it), whose rows are shared among a few native threads (:func:`set_threads`).

A row is a :class:`TailRow`: a C struct a stream keeps for its life (its sampling
parameters, its generator, set once) whose penalties the stream sets before each step
(:meth:`TailRow.penalties`), and whose source and target the completion binds per step.
A row nobody samples (a prefill, a request, a stream with a user sampler, logits
processors or logprobs) is converted and checked only (``mode`` CONVERT); its stream
then chooses its token in Python, as before.

The call never judges: a row that is not plainly right (a non-finite value, a maximum
that is not finite after the penalties) is reported with nothing drawn, and the caller's
checked path raises the precise error (the engine's :func:`~calfsm.engine.readback.convert_row`,
the sampler's :meth:`~calfsm.generate.sampling.Sampler.tail_token`). The token is bit for
bit the numpy path's (tests/engine/test_tail.py), so the reproducibility contract holds
whichever path ran.

``allowed`` (:meth:`TailRow.allow`) is the hook for constrained decoding: a per-row mask of
the tokens that may come next, applied after the penalties and before the token is chosen.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from calfsm import _native
from calfsm.manifest import TaskKind

__all__ = ["CONVERT", "DRAW", "EDRAW", "GREEDY", "NONFINITE", "OK", "SKIPPED", "UNUSABLE",
           "TailRow", "native_tail_available", "output_pointer", "run_tail", "set_threads",
           "tail_rows", "threads", "use_native_tail"]

log = logging.getLogger("calfsm.tail")

#: ``CALFSM_TAIL_VERSION`` of native/calfsm_tail.h that this module speaks
TAIL_VERSION = 1
CONVERT, GREEDY, DRAW = 0, 1, 2
OK, NONFINITE, UNUSABLE, EDRAW, SKIPPED = 0, 1, 2, 3, 4

#: native/calfsm_tail.h's declarations (that header is not installed with the package, so
#: they are written again here; tests/engine/test_tail_header.py keeps them the same)
_CDEF = """
typedef struct calfsm_tail_row {
    const uint16_t *src;
    float *dst;
    uint64_t vocab;
    int32_t mode;
    int32_t status;
    double inv_temp;
    uint64_t top_k;
    uint64_t top_p_q32;
    void *bitgen;
    float repetition;
    float frequency;
    float presence;
    int32_t penalized;
    const int64_t *seen;
    uint64_t n_seen;
    const int64_t *out_ids;
    const float *out_counts;
    uint64_t n_out;
    const int64_t *banned;
    uint64_t n_banned;
    const uint8_t *allowed;
    int64_t token;
    int64_t bad;
} calfsm_tail_row;
uint32_t calfsm_tail_version(void);
int32_t calfsm_tail(calfsm_tail_row *const *rows, uint32_t n, uint32_t threads);
"""

_F32 = np.dtype(np.float32)
_I64 = np.dtype(np.int64)
#: rows x vocabulary below which one thread does all (a thread costs ~20-50 us to start)
_SPLIT_VALUES = 1 << 18


class _Lib:
    __slots__ = ("ffi", "from_buffer", "lib", "null", "tail")

    def __init__(self) -> None:
        ffi, lib = _native.load_library(_CDEF, "native tail", "calfsm_tail_version",
                                        TAIL_VERSION)
        self.ffi = ffi
        self.lib = lib
        self.tail = lib.calfsm_tail
        self.from_buffer = ffi.from_buffer
        self.null = ffi.NULL


_AUTO: Any = object()
_state: dict[str, Any] = {}
#: id(contract) -> (contract, vocab, rows per tile, is a decode): read once, as
#: calfsm/engine/logits.py's plans (a contract's properties cost more than a small row)
_shapes: dict[int, tuple[Any, int, int, bool]] = {}


def _lib() -> _Lib | None:
    """The tail's library, loaded at the first call (None: not available)."""
    lib = _state.get("lib", _AUTO)
    if lib is _AUTO:
        try:
            lib = _Lib()
        except _native.BuildError as e:
            log.info("the native tail is not available: rows are done one by one (%s)", e)
            lib = None
        lib = _state.setdefault("lib", lib)
    return lib


def use_native_tail(enable: bool | None = None) -> bool:
    """Choose whether completions use the native tail: True (BuildError if the library
    lacks it), False (every row one by one, as before: the reference), None (the
    default: when available). Returns whether it is now used. Samplers decide once,
    at their first step."""
    _state.pop("lib", None)
    if enable is False:
        _state["lib"] = None
    elif enable:
        _state["lib"] = _Lib()
    return _lib() is not None


def native_tail_available() -> bool:
    """Whether the bundled library has the native tail (loading it now if not yet)."""
    return _lib() is not None


def _default_threads() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(4, cores))


def threads() -> int:
    """The native threads a call may use (the caller's included)."""
    n = _state.get("threads")
    return n if n is not None else _state.setdefault("threads", _default_threads())


def set_threads(n: int | None) -> int:
    """Use at most ``n`` native threads per call (None: the default, the cores this
    process may use, at most 4). Returns the number now in use."""
    if n is None:
        _state.pop("threads", None)
    else:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"threads must be an integer >= 1, got {n!r}")
        _state["threads"] = n
    return threads()


class TailRow:
    """One row of the native tail (see the module): a C struct and the arrays it points
    into, kept alive here. Not shared between threads; one per stream (or per
    completion, for rows converted only)."""

    __slots__ = ("_allowed", "_bitgen", "_lib", "_pen", "c", "target", "vocab")

    def __init__(self, vocab: int, mode: int = CONVERT, *, inv_temp: float = 0.0,
                 top_k: int = 0, top_p_q32: int = 0,
                 bitgen: np.random.BitGenerator | None = None) -> None:
        lib = _lib()
        if lib is None:
            raise _native.BuildError("the native tail is not available")
        self._lib = lib
        c = lib.ffi.new("calfsm_tail_row *")
        c.vocab = vocab
        c.mode = mode
        c.inv_temp = inv_temp
        c.top_k = top_k
        c.top_p_q32 = top_p_q32
        c.repetition = 1.0
        c.status = SKIPPED
        c.token = -1
        c.bad = -1
        self._bitgen = bitgen           # kept alive: the struct points at its state
        if bitgen is not None:
            c.bitgen = lib.ffi.cast("void *", bitgen.ctypes.bit_generator.value)
        self.c = c
        self.vocab = vocab
        self._pen: tuple[Any, ...] = ()
        self._allowed: Any = None
        #: the float32 row of the last bind (what the row's logits are, after the call)
        self.target: np.ndarray | None = None

    @property
    def mode(self) -> int:
        return int(self.c.mode)

    @property
    def status(self) -> int:
        return int(self.c.status)

    @property
    def token(self) -> int:
        return int(self.c.token)

    @property
    def bad(self) -> int:
        return int(self.c.bad)

    def penalties(self, repetition: float, frequency: float, presence: float,
                  seen: np.ndarray | None, out_ids: np.ndarray | None,
                  out_counts: np.ndarray | None, banned: np.ndarray | None) -> None:
        """The penalties of the next call (float32 factors as the numpy path has them;
        int64 id arrays and float32 counts, contiguous; None: none). The arrays must
        not change until the call returns."""
        c, fb = self.c, self._lib.from_buffer
        c.penalized = 1
        c.repetition = repetition
        c.frequency = frequency
        c.presence = presence
        keep = []
        for ptr, n, a, t in (("seen", "n_seen", seen, "int64_t[]"),
                             ("out_ids", "n_out", out_ids, "int64_t[]"),
                             ("out_counts", None, out_counts, "float[]"),
                             ("banned", "n_banned", banned, "int64_t[]")):
            if a is None or not a.shape[0]:
                setattr(c, ptr, self._lib.null)
                if n:
                    setattr(c, n, 0)
                continue
            v = fb(t, a)
            keep.append(v)
            setattr(c, ptr, v)
            if n:
                setattr(c, n, a.shape[0])
        self._pen = tuple(keep)

    def no_penalties(self) -> None:
        self.c.penalized = 0
        self._pen = ()

    def allow(self, allowed: np.ndarray | None) -> None:
        """Constrained decoding's hook: ``allowed`` (``vocab`` bytes, 0: the token may not
        come next) for the next call, applied after the penalties; None: every token."""
        if allowed is None:
            self.c.allowed = self._lib.null
            self._allowed = None
            return
        v = self._lib.from_buffer("uint8_t[]", allowed)
        self.c.allowed = v
        self._allowed = v

    def bind(self, src: Any, target: np.ndarray | None) -> None:
        """Convert from ``src`` (a cffi ``uint16_t *`` into the output) into ``target``
        (float32, writeable, contiguous, at least ``vocab``: ValueError otherwise), or,
        None, into the library's scratch: then only the token is had (a row that only
        converts is then skipped)."""
        self.c.dst = self._lib.null if target is None \
            else self._lib.from_buffer("float[]", target, True)
        self.c.src = src
        self.target = target
        self.c.status = SKIPPED


def output_pointer(out_u16: np.ndarray) -> Any:
    """A cffi ``uint16_t *`` to an output array (valid while the array lives)."""
    lib = _lib()
    assert lib is not None
    return lib.from_buffer("uint16_t[]", out_u16)


def run_tail(rows: Sequence[TailRow], n_threads: int | None = None) -> int:
    """Every row of ``rows`` in one native call, on up to ``n_threads`` threads (default
    :func:`threads`; one when the rows are small). Returns how many did not end OK."""
    n = len(rows)
    if not n:
        return 0
    lib = rows[0]._lib
    ptrs = lib.ffi.new("calfsm_tail_row *[]", n)   # per call: calls may overlap
    for i, r in enumerate(rows):
        ptrs[i] = r.c
    t = n_threads or _state.get("threads") or threads()
    if n * rows[0].vocab < _SPLIT_VALUES:
        t = 1
    failed = int(lib.tail(ptrs, n, t))
    for r in rows:                      # the arrays were the call's
        r._pen = ()
    return failed


def tail_rows(out: np.ndarray, reading: tuple[int, int, int, int | None], contract: Any,
              rows: Sequence[tuple[int, Any]]) -> list[np.ndarray | None]:
    """The native tail of the rows of one finished job whose ending was judged good (the
    job's status, its output size, each row's own status): ``rows`` holds ``(offset,
    job)``, the row's first value in the output array ``out`` (BF16 bits) and the row's
    job. Each row is converted into its job's target (allocated when None) and checked;
    a job whose ``tail`` gives a :class:`TailRow` has its token chosen instead, that row
    left in ``job.tailed`` for its continuation, and its target is not written (the
    float32 row is worked on in the library's scratch, in cache: the continuation, the
    only reader of a stream step's logits, takes the token). Returns each row's float32 logits, or
    None for a row to take the checked way (:func:`~calfsm.engine.readback.convert_row`,
    which raises the precise error): a non-finite value, anything not plainly right,
    or no native tail at all. Nothing was drawn for such a row."""
    lib = _state.get("lib", _AUTO)     # _lib(), inline: this runs once per token
    if lib is _AUTO:
        lib = _lib()
    n = len(rows)
    if lib is None or not n:
        return [None] * n
    shape = _shapes.get(id(contract))
    if shape is None or shape[0] is not contract:
        if len(_shapes) >= 64:
            _shapes.clear()
        shape = _shapes[id(contract)] = (contract, contract.vocab, contract.rows,
                                         contract.kind is TaskKind.DECODE)
    _, vocab, tile, decode = shape
    if out.dtype != np.uint16:
        out = out.view(np.uint16)
    try:
        src = lib.from_buffer("uint16_t[]", out)
    except ValueError:                  # not contiguous: the checked way says why
        return [None] * n
    size = min(reading[2] // 2, out.size)
    done: list[np.ndarray | None] = [None] * n
    ran: list[TailRow] = []
    cs: list[Any] = []
    where: list[int] = []
    for i, (offset, job) in enumerate(rows):
        job.tailed = None
        count = job.token_count
        if type(count) is not int or count < 1 or (decode and count != 1):
            continue
        base = offset + (count - 1) % tile * vocab
        if base < 0 or base + vocab > size:
            continue
        target = job.request.target
        if target is None:
            target = np.empty(vocab, _F32)
        elif not (target.dtype == _F32 and target.size >= vocab and target.flags.writeable
                  and target.flags.c_contiguous):
            continue
        row = None
        ask = job.tail
        if ask is not None and job.continuation is not None and not job.cancel_requested:
            try:
                row = ask(job)
            except Exception:           # a bug of the continuation's owner: it samples
                log.exception("the tail of job %s raised", job.job_id)
                row = None
        if row is None or row.vocab != vocab:
            row = TailRow(vocab)
        c = row.c                       # row.bind(), inline
        if c.mode != CONVERT:           # only the token is wanted: the library's scratch
            c.dst = lib.null
        else:
            try:
                c.dst = lib.from_buffer("float[]", target, True)
            except ValueError:
                continue
        c.src = src + base
        c.status = SKIPPED
        row.target = target
        ran.append(row)
        cs.append(c)
        where.append(i)
    if ran:                             # run_tail(), inline
        m = len(ran)
        ptrs = lib.ffi.new("calfsm_tail_row *[]", cs)
        t = _state.get("threads") or threads()
        lib.tail(ptrs, m, 1 if m * vocab < _SPLIT_VALUES else t)
        for r in ran:
            r._pen = ()
    for i, row in zip(where, ran, strict=True):
        status = row.c.status
        if status in (NONFINITE, SKIPPED):
            continue                    # nothing drawn: the checked way decides
        target = row.target
        assert target is not None
        done[i] = target if target.shape[0] == vocab and target.ndim == 1 \
            else target.reshape(-1)[:vocab]
        if row.c.mode != CONVERT:
            rows[i][1].tailed = row
    return done
