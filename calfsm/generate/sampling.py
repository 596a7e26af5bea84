"""Choosing the next token from a logits row: greedy, temperature, top-k, top-p, a seeded
draw, or the caller's own sampler.

Theory of operation
-------------------
:class:`SamplingParams` is a request's sampling policy, validated when it is built (a bad
value raises :class:`~calfsm.errors.InvalidArgument` naming the field, stage
``request``). A stream makes one :class:`Sampler` from it (``params.sampler_for(vocab)``),
which owns the stream's random generator: ``PCG64(seed)``, or fresh OS entropy once when
``seed`` is None. Every non-greedy draw consumes exactly one 64-bit output of it, so the
same seed and the same logits give the same tokens on every run and on every driver
(both drivers produce bit-identical logits).

Greedy (``temperature == 0``) is ``argmax`` with ties to the lowest index, as
``InferenceResult.greedy``; the row is only read. Otherwise the row is *consumed*: it is
overwritten in place with the tokens' weights, and no temporary of the vocabulary's size
is made. The draw is defined exactly, so that the native kernel
(``native/calfsm_sampling.c``) and the numpy fallback here give the same token, and leave
the same weights in the row, bit for bit:

1. ``m`` = the largest logit. Rows are finite (the pipeline checks); a ``-inf`` logit
   weighs 0 (a banned token), a NaN or ``+inf`` maximum raises Internal.
2. top-k: ``tk`` = the ``top_k``-th largest logit; logits below it weigh 0 (ties at the
   boundary are kept, so more than ``top_k`` tokens may remain).
3. weights: ``s = float32(((double)x - (double)m) * (1 / temperature))`` and ``w =
   exp(s)`` in float32, by a fixed sequence of IEEE operations (range reduction and
   Cephes' polynomial: :func:`_weights`); ``s < -28`` weighs 0. Each weight's *mass* is
   the integer ``trunc(w * 2**40)``; everything from here on is integer arithmetic, so no
   summation order can change a result.
4. top-p: ``need = ceil(total * P / 2**32)`` with ``P = round(top_p * 2**32)``; the
   nucleus is every token whose weight is at least the largest weight ``t`` such that the
   tokens weighing ``>= t`` reach ``need`` (ties at the boundary kept).
5. the draw: ``r = (u * S) >> 64`` for the 64-bit draw ``u`` and the nucleus mass ``S``;
   the token is the first index (in vocabulary order) at which the running mass of the
   nucleus exceeds ``r``.

So a token's probability is its mass over the nucleus mass, within ``2**-64``; ``exp`` is
within 8e-8 relative; masses resolve ``2**-40`` of the top token's weight (a token below
that is never drawn), and top-p is read to ``2**-32``. Thresholds are found by radix
selection over the bits (exact order statistics, so how the passes are grouped cannot
matter), which the numpy path does in fixed-size chunks and the kernel prunes by blocks.
Measured side by side in one run (``bench/bench_sampling.py``, 2-core VM, sampling alone
over a float32 copy of the row): at V=151936 greedy ~1.0x, temperature ~14x (~100 us),
top-k 50 ~5-9x, top-p 0.9 ~35-38x on the kernel, and 170-320x on numpy; at V=1024 the
fixed cost of a call dominates (2-4 us on the kernel).

A user ``sampler`` receives the first ``vocab`` values of the row (a view it may modify)
and must return a token id in ``[0, vocab)``; if it raises, or returns anything else,
:meth:`Sampler.sample` raises :class:`~calfsm.errors.Internal` of category PROGRAMMING at
stage ``sample`` (a :class:`~calfsm.errors.CalfsmError` it raises passes through, with
that stage filled in).

Logits processors (``SamplingParams.logits_processors``, :mod:`calfsm.generate.processors`) run
in order on the row before anything else, and fail the same way. After them the row may
hold ``-inf`` (banned tokens: greedy's argmax and a draw never choose one); a row with
every token banned is an InvalidArgument, and a NaN or ``+inf`` a processor left is an
Internal, rather than a token. Logprobs (:meth:`Sampler.sample_logprobs`) are those of
the row the sampler saw: after the processors, before temperature, top-k and top-p
(:mod:`calfsm.generate.logprobs`), computed before a draw consumes the row.
"""

from __future__ import annotations

import logging
import math
import reprlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from calfsm import _native
from calfsm.engine.tail import DRAW, GREEDY, TailRow, native_tail_available
from calfsm.engine.tail import EDRAW as TAIL_EDRAW
from calfsm.engine.tail import OK as TAIL_OK
from calfsm.engine.tail import UNUSABLE as TAIL_UNUSABLE
from calfsm.errors import (
    CalfsmError,
    ErrorCategory,
    Incompatible,
    Internal,
    InvalidArgument,
)
from calfsm.generate.constraint import (
    Constraint,
    RowConstraint,
    check_constraint,
    compile_constraint,
    dead_end,
)
from calfsm.generate.logprobs import MAX_LOGPROBS, RowLogprobs, unusable_row
from calfsm.generate.penalties import Penalties
from calfsm.generate.processors import BanTokens, LogitBias, token_id

__all__ = ["MAX_LOGPROBS", "MAX_VOCAB", "LogitsProcessor", "Sampler", "SamplingParams",
           "native_sampling_available"]

#: ``fn(tokens, row) -> None``: changes the float32 row in place (:mod:`calfsm.generate.processors`)
LogitsProcessor = Callable[[Sequence[int], np.ndarray], None]

#: bounds of ``SamplingParams.stop_sequences`` (each is matched after every token)
MAX_STOP_SEQUENCES = 16
MAX_STOP_LENGTH = 64
#: bounds of ``SamplingParams.stop``: strings, and characters in each (the text a stream
#: scans after every token is bounded by the longest)
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256

log = logging.getLogger("calfsm.sampling")

#: bounds of ``presence_penalty`` and ``frequency_penalty`` (OpenAI's and vLLM's)
MAX_PENALTY = 2.0

#: the largest vocabulary a draw accepts (masses of this many tokens sum below 2**64)
MAX_VOCAB = 1 << 23
_STAGE = "sample"
_set = object.__setattr__

_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)
_U32 = np.dtype(np.uint32)
_U64 = np.dtype(np.uint64)

# ---- validation -------------------------------------------------------------------------


def _bad(message: str, field: str) -> InvalidArgument:
    return InvalidArgument(message, stage="request", field=field)


def _int(value: Any, field: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise _bad(f"{field} must be an integer, got {reprlib.repr(value)}", field)
    value = int(value)
    if value < low:
        raise _bad(f"{field} must be >= {low}, got {value}", field)
    return value


def _number(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise _bad(f"{field} must be a number, got {reprlib.repr(value)}", field)
    try:
        value = float(value)
    except OverflowError:           # an int beyond the floats
        value = math.inf
    if not math.isfinite(value):
        raise _bad(f"{field} must be finite, got {value}", field)
    return value


def _token_ids(values: Any, field: str) -> tuple[int, ...]:
    if isinstance(values, str | bytes) or not isinstance(values, Sequence | np.ndarray):
        raise _bad(f"{field} must be a sequence of token ids, got {reprlib.repr(values)}",
                   field)
    return tuple(token_id(v, f"{field}[{i}]", field=field) for i, v in enumerate(values))


def _stop_strings(values: Any) -> tuple[str, ...]:
    """``stop``: a string (one stop string) or a sequence of non-empty strings."""
    if isinstance(values, str):
        values = (values,)
    if isinstance(values, bytes) or not isinstance(values, Sequence):
        raise _bad(f"stop must be a string or a sequence of strings, got "
                   f"{reprlib.repr(values)}", "stop")
    if len(values) > MAX_STOP_STRINGS:
        raise _bad(f"stop: at most {MAX_STOP_STRINGS} strings, got {len(values)}", "stop")
    for i, s in enumerate(values):
        if not isinstance(s, str):
            raise _bad(f"stop[{i}] must be a string, got {reprlib.repr(s)}", "stop")
        if not 1 <= len(s) <= MAX_STOP_CHARS:
            raise _bad(f"stop[{i}] must hold 1 to {MAX_STOP_CHARS} characters, got "
                       f"{len(s)}", "stop")
    return tuple(values)


@attrs.frozen
class SamplingParams:
    """How a stream chooses its tokens.

    ``temperature`` 0 is greedy (then ``top_k``, ``top_p`` and ``seed`` do not apply);
    ``top_k`` 0 and ``top_p`` 1 are off; ``seed`` None draws fresh entropy once per
    stream. Generation ends at a token of ``stop_token_ids`` (:meth:`is_stop`), when
    the tokens end with one of ``stop_sequences`` (token-id sequences; a stream holds
    back the tokens that may begin one and never delivers a completed one), when its
    text holds one of the ``stop`` strings (a stream on an executor with a tokenizer
    only; :mod:`calfsm.generate.stopstrings`), or after ``max_tokens`` tokens (the stream bounds
    it by ``max_seq`` too). A ``sampler`` (``fn(row) -> token``) replaces the built-in
    one (then leave temperature, top_k, top_p and seed at their defaults).
    ``logits_processors`` (``fn(tokens, row) -> None``, :mod:`calfsm.generate.processors`) change
    the row in place, in order, before the token is chosen. ``logprobs`` ``k`` (0..20)
    makes every token event carry its log-probability and the ``k`` most likely tokens
    with theirs. ``repetition_penalty`` (> 0, 1 off), ``frequency_penalty`` and
    ``presence_penalty`` (in [-2, 2], 0 off) are vLLM's (:mod:`calfsm.generate.penalties`);
    ``min_tokens`` tokens are generated before a stop token, a stop sequence, a stop
    string or the end-of-sequence token can end the stream; ``ignore_eos``: the
    end-of-sequence token (the tokenizer's ``eos_token_id``) does not end it.
    ``constraint`` (:mod:`calfsm.generate.constraint`: a JSON schema, any JSON object, a
    regex, a choice of strings or a Lark grammar) masks every row to the tokens its
    grammar allows next, after the processors and penalties; the grammar's end ends the
    stream ``stop`` (even before ``min_tokens``, even with ``ignore_eos``). Every
    field is checked here; a bad value raises InvalidArgument.
    ``docs/sampling.md`` has the whole story.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    max_tokens: int = 16
    sampler: Callable[[np.ndarray], int] | None = None
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    logits_processors: tuple[LogitsProcessor, ...] = ()
    logprobs: int | None = None
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    constraint: Constraint | None = None
    _stops: frozenset[int] = attrs.field(init=False, repr=False, eq=False)
    _multi: tuple[tuple[int, ...], ...] = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        t = _number(self.temperature, "temperature")
        if t < 0:
            raise _bad(f"temperature must be >= 0 (0 is greedy), got {t}", "temperature")
        _set(self, "temperature", t)
        _set(self, "top_k", _int(self.top_k, "top_k", 0))
        p = _number(self.top_p, "top_p")
        if not 0.0 < p <= 1.0:
            raise _bad(f"top_p must be in (0, 1], got {p}", "top_p")
        _set(self, "top_p", p)
        if self.seed is not None:
            _set(self, "seed", _int(self.seed, "seed", 0))
        stops = _token_ids(self.stop_token_ids, "stop_token_ids")
        _set(self, "stop_token_ids", stops)
        seqs = self.stop_sequences
        if isinstance(seqs, str | bytes) or not isinstance(seqs, Sequence | np.ndarray):
            raise _bad(f"stop_sequences must be a sequence of token-id sequences, got "
                       f"{reprlib.repr(seqs)}", "stop_sequences")
        if len(seqs) > MAX_STOP_SEQUENCES:
            raise _bad(f"stop_sequences: at most {MAX_STOP_SEQUENCES}, got {len(seqs)}",
                       "stop_sequences")
        checked = []
        for i, seq in enumerate(seqs):
            ids = _token_ids(seq, f"stop_sequences[{i}]")
            if not 1 <= len(ids) <= MAX_STOP_LENGTH:
                raise _bad(f"stop_sequences[{i}] must hold 1 to {MAX_STOP_LENGTH} token "
                           f"ids, got {len(ids)}", "stop_sequences")
            checked.append(ids)
        # a one-token sequence is a stop token; the longer ones need the tail matcher
        stops = (*stops, *(ids[0] for ids in checked if len(ids) == 1))
        _set(self, "stop_sequences", tuple(checked))
        _set(self, "_stops", frozenset(stops))
        _set(self, "_multi", tuple(ids for ids in checked if len(ids) > 1))
        _set(self, "stop", _stop_strings(self.stop))
        _set(self, "max_tokens", _int(self.max_tokens, "max_tokens", 1))
        for field in ("presence_penalty", "frequency_penalty"):
            v = _number(getattr(self, field), field)
            if not -MAX_PENALTY <= v <= MAX_PENALTY:
                raise _bad(f"{field} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {v}",
                           field)
            _set(self, field, v)
        r = _number(self.repetition_penalty, "repetition_penalty")
        if not r > 0:
            raise _bad(f"repetition_penalty must be > 0 (1 is off), got {r}",
                       "repetition_penalty")
        _set(self, "repetition_penalty", r)
        m = _int(self.min_tokens, "min_tokens", 0)
        if m > self.max_tokens:
            raise _bad(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {m}",
                       "min_tokens")
        _set(self, "min_tokens", m)
        if not isinstance(self.ignore_eos, bool | np.bool_):
            raise _bad(f"ignore_eos must be a boolean, got {reprlib.repr(self.ignore_eos)}",
                       "ignore_eos")
        _set(self, "ignore_eos", bool(self.ignore_eos))
        check_constraint(self.constraint)
        procs = self.logits_processors
        if isinstance(procs, str | bytes) or not isinstance(procs, Sequence):
            raise _bad(f"logits_processors must be a sequence of callables, got "
                       f"{reprlib.repr(procs)}", "logits_processors")
        for i, fn in enumerate(procs):
            if not callable(fn):
                raise _bad(f"logits_processors[{i}] must be callable(tokens, row) -> None, "
                           f"got {reprlib.repr(fn)}", "logits_processors")
        _set(self, "logits_processors", tuple(procs))
        if self.logprobs is not None:
            k = _int(self.logprobs, "logprobs", 0)
            if k > MAX_LOGPROBS:
                raise _bad(f"logprobs must be <= {MAX_LOGPROBS}, got {k}", "logprobs")
            _set(self, "logprobs", k)
        if self.sampler is not None:
            if not callable(self.sampler):
                raise _bad(f"sampler must be callable(logits) -> int, got "
                           f"{reprlib.repr(self.sampler)}", "sampler")
            set_ = [f for f, default in (("temperature", 0.0), ("top_k", 0), ("top_p", 1.0),
                                         ("seed", None)) if getattr(self, f) != default]
            if set_:
                raise _bad(f"a sampler replaces the built-in sampling: leave "
                           f"{', '.join(set_)} at the default", "sampler")

    @property
    def greedy(self) -> bool:
        """Whether the built-in greedy choice (argmax) is used."""
        return self.temperature == 0.0 and self.sampler is None

    def is_stop(self, token: int) -> bool:
        """Whether ``token`` is one of the stop tokens (or a one-token stop sequence)."""
        return token in self._stops

    @property
    def holds_back(self) -> bool:
        """Whether a stream must hold tokens back: a stop sequence of two or more."""
        return bool(self._multi)

    def stop_match(self, tokens: Sequence[int]) -> int:
        """The length of a stop sequence (of two or more tokens) that ``tokens`` end
        with, else 0."""
        for seq in self._multi:
            n = len(seq)
            if len(tokens) >= n and tuple(tokens[-n:]) == seq:
                return n
        return 0

    def stop_prefix(self, tokens: Sequence[int]) -> int:
        """How many of the last ``tokens`` may begin a stop sequence (the longest tail
        that is a proper prefix of one): the tokens a stream holds back for now."""
        longest = max((len(s) for s in self._multi), default=1)
        for k in range(min(len(tokens), longest - 1), 0, -1):
            tail = tuple(tokens[-k:])
            if any(len(s) > k and s[:k] == tail for s in self._multi):
                return k
        return 0

    @property
    def penalized(self) -> bool:
        """Whether a penalty or ``min_tokens`` changes the row (they read the tokens)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0 or self.min_tokens > 0)

    def sampler_for(self, vocab: int, *, native: bool | None = None, prompt_len: int = 0,
                    eos_token_id: int | None = None, tokenizer: Any = None) -> Sampler:
        """A new :class:`Sampler` (one per stream) for a vocabulary of ``vocab``;
        ``prompt_len``: the history's first tokens that are the prompt (the penalties'
        output begins after them); ``eos_token_id``: the model's end-of-sequence token
        (None: it has none); ``tokenizer``: the executor's (a constraint needs it)."""
        return Sampler(self, vocab, native=native, prompt_len=prompt_len,
                       eos_token_id=eos_token_id, tokenizer=tokenizer)


# ---- the native kernel ------------------------------------------------------------------

#: ``CALFSM_SAMPLING_VERSION`` of native/calfsm_sampling.h that this module speaks
KERNEL_VERSION = 1
_CDEF = """
uint32_t calfsm_sampling_version(void);
int32_t calfsm_kernels_level(void);
int64_t calfsm_sample(float *row, uint64_t n, double inv_temp, uint64_t top_k,
                      uint64_t top_p_q32, uint64_t u);
int64_t calfsm_sample_at(float *row, uint64_t n, double inv_temp, uint64_t top_k,
                         uint64_t top_p_q32, uint64_t u, int32_t level);
"""
_EINVAL, _ENOMASS = -1, -2


class _Kernel:
    """The kernel's cffi functions, bound once."""

    __slots__ = ("f32_array", "from_buffer", "lib", "sample")

    def __init__(self) -> None:
        ffi, lib = _native.load_library(_CDEF, "sampling kernel", "calfsm_sampling_version",
                                        KERNEL_VERSION)
        self.lib = lib
        self.from_buffer = ffi.from_buffer
        self.f32_array = ffi.typeof("float[]")
        self.sample = lib.calfsm_sample


_AUTO: Any = object()
_lock = threading.Lock()
_kernel: Any = _AUTO   # a _Kernel, None (unavailable), or _AUTO (not tried yet)


def _default_kernel() -> _Kernel | None:
    global _kernel
    with _lock:
        if _kernel is _AUTO:
            try:
                _kernel = _Kernel()
            except _native.BuildError as e:
                log.info("sampling uses numpy: the native kernel is not available (%s)", e)
                _kernel = None
        return _kernel


def native_sampling_available() -> bool:
    """Whether the bundled library has the sampling kernel (loading it now if not yet)."""
    return _default_kernel() is not None


# ---- the sampler ------------------------------------------------------------------------

class Sampler:
    """One stream's token chooser: :meth:`sample` on each logits row in turn.

    Owns the stream's random generator, so it is not shared between streams or threads.
    ``native`` chooses the draw's path: the kernel (True; Incompatible if the bundled
    library lacks it), numpy (False), or the kernel when available (None). Both give the
    same tokens.
    """

    __slots__ = ("_bitgen", "_con", "_con_start", "_ends", "_inv_t", "_kernel", "_mode",
                 "_p_q", "_pen", "_procs", "_scratch", "_tail", "_top_k", "_user", "params",
                 "plain", "tail_capable", "vocab")

    def __init__(self, params: SamplingParams, vocab: int, *,
                 native: bool | None = None, prompt_len: int = 0,
                 eos_token_id: int | None = None, tokenizer: Any = None) -> None:
        if not isinstance(params, SamplingParams):
            raise InvalidArgument(f"params must be SamplingParams, got "
                                  f"{reprlib.repr(params)}", stage=_STAGE)
        if isinstance(vocab, bool) or not isinstance(vocab, int | np.integer) \
                or not 1 <= vocab <= MAX_VOCAB:
            raise InvalidArgument(f"vocab must be an integer in [1, {MAX_VOCAB}], got "
                                  f"{reprlib.repr(vocab)}", stage=_STAGE)
        vocab = int(vocab)
        for i, t in enumerate(params.stop_token_ids):
            if t >= vocab:
                raise InvalidArgument(f"stop_token_ids[{i}] = {t} is outside the "
                                      f"vocabulary of {vocab}", stage="request")
        for i, seq in enumerate(params.stop_sequences):
            if max(seq) >= vocab:
                raise InvalidArgument(f"stop_sequences[{i}] holds {max(seq)}, outside the "
                                      f"vocabulary of {vocab}", stage="request")
        for i, fn in enumerate(params.logits_processors):
            ids = fn.token_ids if isinstance(fn, LogitBias | BanTokens) else ()
            if ids and max(ids) >= vocab:       # built directly, they need not be sorted
                raise InvalidArgument(f"logits_processors[{i}] ({type(fn).__name__}) names "
                                      f"token {max(ids)}, outside the vocabulary of {vocab}",
                                      stage="request")
        if eos_token_id is not None:
            eos_token_id = token_id(eos_token_id, "eos_token_id")
            if eos_token_id >= vocab:
                raise InvalidArgument(f"eos_token_id {eos_token_id} is outside the "
                                      f"vocabulary of {vocab}", stage="config")
        if isinstance(prompt_len, bool) or not isinstance(prompt_len, int) or prompt_len < 0:
            raise InvalidArgument(f"prompt_len must be an integer >= 0, got "
                                  f"{reprlib.repr(prompt_len)}", stage=_STAGE)
        self.params = params
        self.vocab = vocab
        self._procs = params.logits_processors
        eos = () if eos_token_id is None else (eos_token_id,)
        #: the tokens that end the stream (once ``min_tokens`` are made)
        self._ends = params._stops | frozenset(() if params.ignore_eos else eos)
        self._pen = Penalties(
            repetition=params.repetition_penalty, frequency=params.frequency_penalty,
            presence=params.presence_penalty, min_tokens=params.min_tokens,
            stop_ids=(*params._stops, *eos), prompt_len=prompt_len) \
            if params.penalized else None
        #: the stream's matcher (None: no constraint); it reads the tokens after the prompt
        self._con: RowConstraint | None = None if params.constraint is None else \
            compile_constraint(params.constraint, tokenizer, vocab).start()
        self._con_start = prompt_len
        #: no processors, no penalties, no constraint and no logprobs: ``sample(row)`` is
        #: all a stream needs
        self.plain = not self._procs and self._pen is None and params.logprobs is None \
            and self._con is None
        self._scratch: np.ndarray | None = None
        self._tail: Any = _AUTO
        self._user = params.sampler
        self._bitgen = None
        self._kernel = None
        self._inv_t = self._p_q = self._top_k = 0
        if self._user is not None:
            self._mode = "user"
        elif params.greedy:
            self._mode = "greedy"
        else:
            self._mode = "draw"
            inv_t = 1.0 / params.temperature
            self._inv_t = inv_t if inv_t <= 1e300 else 1e300
            self._top_k = params.top_k if params.top_k < vocab else 0
            self._p_q = max(1, min(1 << 32, round(params.top_p * 2.0**32)))
            self._bitgen = np.random.PCG64(params.seed)
            if native is None:
                self._kernel = _default_kernel()
            elif native:
                try:
                    self._kernel = _default_kernel() or _Kernel()
                except _native.BuildError as e:
                    raise Incompatible(f"the native sampling kernel is not available: {e}",
                                       stage=_STAGE) from None
        #: whether the native tail (calfsm/engine/tail.py) can choose this sampler's
        #: tokens: greedy or a built-in draw on the kernel, no logits processors, no
        #: logprobs (those rows are converted natively and sampled here)
        self.tail_capable = (self._mode == "greedy" or (self._mode == "draw"
                                                        and self._kernel is not None)) \
            and not self._procs and params.logprobs is None and native is not False \
            and self._con is None       # a constraint's mask: TailRow.allow, not yet wired

    # ---- the native tail: the token chosen in the completion's one native call -----
    def tail_row(self, tokens: Sequence[int] = ()) -> TailRow | None:
        """This sampler's row of the native tail, set for the token after ``tokens``
        (the penalties counted, as :meth:`sample` would), or None: the token is chosen
        by :meth:`sample` (not :attr:`tail_capable`, or no native tail). After the call,
        :meth:`tail_token` reads the token."""
        row = self._tail
        if row is _AUTO:
            row = self._tail = self._make_tail_row()
        if row is None:
            return None
        pen = self._pen
        if pen is not None:
            row.penalties(*pen.native_args(tokens))
        return row

    def _make_tail_row(self) -> TailRow | None:
        if not self.tail_capable or not native_tail_available():
            return None
        if self._mode == "greedy":
            return TailRow(self.vocab, GREEDY)
        return TailRow(self.vocab, DRAW, inv_temp=self._inv_t, top_k=self._top_k,
                       top_p_q32=self._p_q, bitgen=self._bitgen)

    def tail_token(self, row: TailRow) -> int | None:
        """The token the native tail chose with ``row`` (this sampler's), raising what
        :meth:`sample` raises for the same row; None when the tail did not run it (then
        nothing was drawn: :meth:`sample` chooses)."""
        c = row.c
        status = c.status
        if status == TAIL_OK:
            return int(c.token)
        if status == TAIL_UNUSABLE:     # ``bad``: the row's maximum, as float32 bits
            raise unusable_row(float(np.uint32(int(c.bad)).view(_F32)))
        if status == TAIL_EDRAW:
            raise _draw_error(int(c.token))
        return None

    @property
    def uses_native_kernel(self) -> bool:
        """Whether draws run on the native kernel (False for greedy and user samplers)."""
        return self._kernel is not None

    @property
    def uses_tokens(self) -> bool:
        """Whether :meth:`sample` reads ``tokens`` (there are logits processors,
        penalties, ``min_tokens`` or a constraint)."""
        return bool(self._procs) or self._pen is not None or self._con is not None

    @property
    def constrained(self) -> bool:
        """Whether a constraint masks the rows (:meth:`prepare` is worth calling)."""
        return self._con is not None

    def ends(self, token: int, made: int) -> bool:
        """Whether ``token``, after ``made`` generated tokens, ends the stream: a stop
        token (or one-token stop sequence), or the end-of-sequence token unless
        ``ignore_eos``; none does before ``min_tokens`` tokens were made. The end of a
        constraint's grammar always does."""
        return (token in self._ends and made >= self.params.min_tokens) or (
            self._con is not None and token == self._con.eos)

    def prepare(self, tokens: Sequence[int]) -> None:
        """Make the constraint's mask for the token after ``tokens`` (the prompt, then
        what was generated), off the token path: while the device runs the step whose
        row it masks. No-op without a constraint."""
        if self._con is not None:
            self._con.prepare(tokens, self._con_start)

    def sample(self, row: np.ndarray, tokens: Sequence[int] = ()) -> int:
        """The next token from ``row``: a float32 1-D array of at least ``vocab`` values,
        of which the first ``vocab`` count. The logits processors (if any) change it in
        place first, given ``tokens`` (the stream's tokens so far). A draw consumes the
        row (it holds the weights afterwards); greedy only reads it.

        Raises InvalidArgument (stage ``sample``) for a row of the wrong kind or one
        whose every token the processors banned; Internal for a processor or a user
        sampler that fails, or a row whose maximum is NaN or ``+inf``."""
        x = self._row(row)
        con = self._con
        if con is not None:
            plan = con.plan(tokens, self._con_start)
            if plan.kind == "end":
                return con.eos
            self._process(x, tokens)
            con.apply(x, plan)
            try:
                tok = self._choose_processed(x)
            except InvalidArgument as e:
                raise self._dead(e) from None
            if self._mode == "user":
                self._check_allowed(tok, plan)
            return tok
        if self._procs or self._pen is not None:
            self._process(x, tokens)
            return self._choose_processed(x)
        return self._choose(x)

    def _dead(self, e: InvalidArgument) -> InvalidArgument:
        """A constrained row with no token left: the dead end (else ``e`` itself)."""
        if e.field is None and e.stage == _STAGE:
            return dead_end("the logits processors or penalties banned every token the "
                            "grammar allows")
        return e

    def _check_allowed(self, tok: int, plan: Any) -> None:
        """A user sampler's token, against the constraint's plan."""
        kind, ids = plan.kind, plan.ids
        if kind == "keep":
            ok = bool((ids == tok).any())
        elif kind == "ban":
            ok = not (ids == tok).any()
        else:
            ok = bool(plan.row[tok] == 0)
        if not ok:
            raise dead_end(f"the sampler chose token {tok}, which the grammar does not "
                           f"allow")

    def sample_logprobs(self, row: np.ndarray, tokens: Sequence[int] = ()
                        ) -> tuple[int, float, tuple[tuple[int, float], ...]]:
        """As :meth:`sample`, and the log-probabilities of the row the sampler saw
        (after the processors, before temperature, top-k and top-p): ``(token, its
        logprob, the params' logprobs most likely tokens with theirs)``
        (:class:`~calfsm.generate.logprobs.RowLogprobs`). A draw or a user sampler changes the
        row, so the row is copied first into a buffer the sampler keeps (one row)."""
        x = self._row(row)
        con, plan = self._con, None
        if con is not None:
            plan = con.plan(tokens, self._con_start)
            if plan.kind == "end":
                return con.eos, 0.0, ()
        if self._procs or self._pen is not None:
            self._process(x, tokens)
        if plan is not None:
            con.apply(x, plan)
        try:
            lp = RowLogprobs(x)
        except InvalidArgument as e:
            raise (self._dead(e) if con is not None else e) from None
        top = lp.top(x, self.params.logprobs or 0)
        if self._mode == "greedy":
            return lp.argmax, lp.of(lp.max_logit), top
        kept = self._scratch
        if kept is None:
            kept = self._scratch = np.empty(self.vocab, _F32)
        np.copyto(kept, x)
        tok = self._choose(x)
        if plan is not None and self._mode == "user":
            self._check_allowed(tok, plan)
        return tok, lp.of(kept[tok]), top

    def _row(self, row: np.ndarray) -> np.ndarray:
        """The first ``vocab`` values of ``row``, checked."""
        vocab = self.vocab
        if not (isinstance(row, np.ndarray) and row.dtype == _F32 and row.ndim == 1
                and row.shape[0] >= vocab):
            what = (f"{row.dtype} {row.shape}" if isinstance(row, np.ndarray)
                    else reprlib.repr(row))
            raise InvalidArgument(f"logits row must be a 1-D float32 numpy array of at "
                                  f"least {vocab} values, got {what}", stage=_STAGE)
        return row if row.shape[0] == vocab else row[:vocab]

    def _process(self, x: np.ndarray, tokens: Sequence[int]) -> None:
        """Run the logits processors on ``x`` in order, then the penalties and the
        ``min_tokens`` mask (as vLLM: logit_bias before the penalties)."""
        if not (x.flags.writeable and x.flags.c_contiguous):
            raise InvalidArgument("logits processors change the row in place: it must be "
                                  "writeable and contiguous", stage=_STAGE)
        for i, fn in enumerate(self._procs):
            try:
                fn(tokens, x)
            except CalfsmError as e:
                raise e.with_context(stage=_STAGE) from None
            except Exception as e:
                raise Internal(f"logits processor {i} ({reprlib.repr(fn)}) raised "
                               f"{type(e).__name__}: {e}",
                               category=ErrorCategory.PROGRAMMING, stage=_STAGE) from e
        if self._pen is not None:
            self._pen.apply(x, tokens)

    def _choose_processed(self, x: np.ndarray) -> int:
        """:meth:`_choose` on a row the processors changed: it may hold ``-inf`` (banned
        tokens; all of them is an error, not a token) or a processor's NaN/``+inf``."""
        mode = self._mode
        if mode == "greedy":
            tok = int(x.argmax())       # a NaN or +inf is the argmax; -inf only if all are
            v = float(x[tok])
            if not math.isfinite(v):
                raise unusable_row(v)
            return tok
        if mode == "draw":
            m = float(x.max())
            if not math.isfinite(m):
                raise unusable_row(m)
        return self._choose(x)

    def _choose(self, x: np.ndarray) -> int:
        mode = self._mode
        if mode == "greedy":
            return int(x.argmax())
        if mode == "user":
            return self._call_user(x)
        if not (x.flags.writeable and x.flags.c_contiguous):
            raise InvalidArgument("a sampled logits row is consumed in place: it must be "
                                  "writeable and contiguous", stage=_STAGE)
        u = self._bitgen.random_raw()
        k = self._kernel
        if k is not None:
            tok = k.sample(k.from_buffer(k.f32_array, x, True), self.vocab, self._inv_t,
                           self._top_k, self._p_q, u)
        else:
            tok = _draw_numpy(x, self._inv_t, self._top_k, self._p_q, u)
        if tok < 0:
            raise _draw_error(tok)
        return tok

    def _call_user(self, x: np.ndarray) -> int:
        try:
            tok = self._user(x)
        except CalfsmError as e:
            raise e.with_context(stage=_STAGE) from None
        except Exception as e:
            raise Internal(f"the user sampler raised {type(e).__name__}: {e}",
                           category=ErrorCategory.PROGRAMMING, stage=_STAGE) from e
        if isinstance(tok, bool) or not isinstance(tok, int | np.integer) \
                or not 0 <= tok < self.vocab:
            raise Internal(f"the user sampler returned {reprlib.repr(tok)}, not a token id "
                           f"in [0, {self.vocab})", category=ErrorCategory.PROGRAMMING,
                           stage=_STAGE)
        return int(tok)


def _draw_error(code: int) -> Internal:
    if code == _ENOMASS:
        return Internal("no token has a positive probability: the logits row's maximum is "
                        "NaN or +inf (rows must be finite)", stage=_STAGE)
    return Internal(f"the sampling kernel refused its arguments (code {code})",
                    category=ErrorCategory.PROGRAMMING, stage=_STAGE)


# ---- the numpy path: the arithmetic of the kernel, in chunks ----------------------------

_CHUNK = 4096
_S_MIN = -28.0
_Q = 2.0**40
_P_ONE = 1 << 32


def _f32(hex_literal: str) -> np.float32:
    return np.float32(float.fromhex(hex_literal))


# the float32 constants of native/calfsm_sampling.c, bit for bit
_LOG2E = _f32("0x1.715476p+0")
_MAGIC = _f32("0x1.8p23")
_MAGIC_BITS = np.uint32(_MAGIC.view(np.uint32))
_LN2_HI = _f32("0x1.63p-1")
_LN2_LO = _f32("-0x1.bd0106p-13")
_POLY = tuple(_f32(h) for h in ("0x1.a0d2cep-13", "0x1.6e879cp-10", "0x1.11121p-7",
                                "0x1.555382p-5", "0x1.555554p-3", "0x1.0p-1"))
_ONE = np.float32(1.0)
_BIAS = np.uint32(127)
_U31, _LOW31, _TOP = np.uint32(31), np.uint32(0x7FFFFFFF), np.uint32(0x80000000)


def _keys(bits: np.ndarray) -> np.ndarray:
    """Order keys of float bits: unsigned order of the keys is the order of the floats."""
    return bits ^ ((bits >> _U31) * _LOW31 | _TOP)


def _key_float(key: int) -> float:
    b = key ^ 0x80000000 if key & 0x80000000 else ~key & 0xFFFFFFFF
    return float(np.uint32(b).view(np.float32))


def _weights(x: np.ndarray, m: float, inv_t: float, tk: int) -> np.ndarray:
    """The weights of one chunk, written into it (the kernel's ``weights``, op by op)."""
    d = x.astype(_F64)
    d -= m
    d *= inv_t
    keep = d >= _S_MIN
    if tk:
        keep &= _keys(x.view(_U32)) >= tk
    np.fmax(d, _S_MIN, out=d)
    s = d.astype(_F32)
    kb = s * _LOG2E
    kb += _MAGIC
    kf = kb - _MAGIC
    k = kb.view(_U32) - _MAGIC_BITS
    r = s - kf * _LN2_HI
    r -= kf * _LN2_LO
    z = r * r
    y = r * _POLY[0]
    for c in _POLY[1:-1]:
        y += c
        y *= r
    y += _POLY[-1]
    y *= z
    y += r
    y += _ONE
    k += _BIAS
    k <<= np.uint32(23)
    y *= k.view(_F32)
    y *= keep
    x[...] = y
    return x


def _masses(w: np.ndarray) -> np.ndarray:
    """``trunc(w * 2**40)`` of non-negative weights, as uint64."""
    return (w.astype(_F64) * _Q).astype(_U64)


def _walk(hist: np.ndarray, need: int) -> tuple[int, int, int]:
    """From the top bucket down, the one where the running total reaches ``need``:
    (bucket, what is still needed inside it, the total above it)."""
    rev = np.cumsum(hist[::-1])
    j = int(np.searchsorted(rev, np.uint64(need) if rev.dtype == _U64 else need))
    if j >= hist.shape[0]:
        raise Internal(f"radix select: {need} needed, {int(rev[-1])} in all", stage=_STAGE)
    b = hist.shape[0] - 1 - j
    above = int(rev[j]) - int(hist[b])
    return b, need - above, above


def _chunks(n: int) -> range:
    return range(0, n, _CHUNK)


def _topk_key(x: np.ndarray, k: int) -> int:
    """The k-th largest order key of ``x`` (1 <= k < len(x))."""
    n = x.shape[0]
    bits = x.view(_U32)
    h1 = np.zeros(2048, np.int64)
    for lo in _chunks(n):
        h1 += np.bincount(_keys(bits[lo:lo + _CHUNK]) >> 21, minlength=2048)
    b1, k, _ = _walk(h1, k)
    h2 = np.zeros(2048, np.int64)
    for lo in _chunks(n):
        key = _keys(bits[lo:lo + _CHUNK])
        h2 += np.bincount((key[key >> 21 == b1] >> 10) & 0x7FF, minlength=2048)
    b2, k, _ = _walk(h2, k)
    pre = b1 << 11 | b2
    h3 = np.zeros(1024, np.int64)
    for lo in _chunks(n):
        key = _keys(bits[lo:lo + _CHUNK])
        h3 += np.bincount(key[key >> 10 == pre] & 0x3FF, minlength=1024)
    b3, _, _ = _walk(h3, k)
    return pre << 10 | b3


def _topp_key(x: np.ndarray, need: int, mass_a: np.ndarray) -> tuple[int, int]:
    """(t, mass): the largest weight bits t whose tokens weighing >= t reach ``need``,
    and their mass; ``mass_a`` holds the masses by the top 11 bits."""
    n = x.shape[0]
    bits = x.view(_U32)
    ba, need, above = _walk(mass_a, need)
    h2 = np.zeros(2048, _U64)
    for lo in _chunks(n):
        b = bits[lo:lo + _CHUNK]
        b = b[b >> 21 == ba]
        np.add.at(h2, (b >> 10) & 0x7FF, _masses(b.view(_F32)))
    b2, need, a2 = _walk(h2, need)
    pre = ba << 11 | b2
    h3 = np.zeros(1024, _U64)
    for lo in _chunks(n):
        b = bits[lo:lo + _CHUNK]
        b = b[b >> 10 == pre]
        np.add.at(h3, b & 0x3FF, _masses(b.view(_F32)))
    b3, _, a3 = _walk(h3, need)
    return pre << 10 | b3, above + a2 + a3 + int(h3[b3])


def _draw_numpy(x: np.ndarray, inv_t: float, top_k: int, p_q: int, u: int) -> int:
    """The kernel's ``calfsm_sample`` on numpy: the same token, the same weights left in
    ``x``, with temporaries of a fixed chunk size (returns the kernel's error codes)."""
    with np.errstate(invalid="ignore", over="ignore"):   # a non-finite row: ENOMASS
        return _draw_chunks(x, inv_t, top_k, p_q, u)


def _draw_chunks(x: np.ndarray, inv_t: float, top_k: int, p_q: int, u: int) -> int:
    n = x.shape[0]
    bits = x.view(_U32)
    tk = _topk_key(x, top_k) if top_k and top_k < n else 0
    mx = max(int(_keys(bits[lo:lo + _CHUNK]).max()) for lo in _chunks(n))
    m = _key_float(mx)
    nucleus = p_q < _P_ONE
    mass_a = np.zeros(2048, _U64)
    total = 0
    for lo in _chunks(n):
        w = _weights(x[lo:lo + _CHUNK], m, inv_t, tk)
        q = _masses(w)
        total += int(q.sum(dtype=_U64))
        if nucleus:
            np.add.at(mass_a, w.view(_U32) >> 21, q)
    if total == 0:
        return _ENOMASS
    tp, mass = 0, total
    if nucleus:
        need = (total * p_q + _P_ONE - 1) >> 32
        tp, mass = _topp_key(x, need, mass_a)
    r = (u * mass) >> 64
    cum = 0
    for lo in _chunks(n):
        w = x[lo:lo + _CHUNK]
        q = _masses(w)
        if tp:
            q[w.view(_U32) < tp] = 0
        cs = np.cumsum(q)
        if cum + int(cs[-1]) > r:
            return lo + int(np.searchsorted(cs, np.uint64(r - cum), side="right"))
        cum += int(cs[-1])
    return _ENOMASS
