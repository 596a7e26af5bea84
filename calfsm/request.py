"""The request of one inference job, checked where it is made.

Theory of operation
-------------------
A :class:`Request` is validated when it is constructed: each field is kept in one type
(Python ints, ``int64`` arrays, the embeddings array as given) and any value that is not
exactly representable in it raises :class:`~calfsm.errors.InvalidArgument` naming the
field (stage ``request``). Nothing is coerced: a float, bool, string or complex token is
refused, never truncated; Python ints and numpy integers of any dtype are accepted when
they fit ``int64``.

What a request can only be judged against — the sub-model contract and the executor's
sequence-id range — is :func:`check_request`: the one validation the pipeline runs
before it takes any resource. The construction checks types and shapes; ``check_request``
checks values against limits; no fact is checked twice.

``Request.decode`` is on every token's critical path: it builds its two one-element
arrays itself so that construction takes the fast paths (about 2 µs in all).
"""

from __future__ import annotations

import functools
import math
import reprlib
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from calfsm.drivers.base import EngineSlot
from calfsm.errors import InvalidArgument
from calfsm.manifest import DType, SubmodelContract, TaskKind
from calfsm.util.lazy import bf16_dtype

__all__ = ["EMBED_DTYPES", "MAX_REQUEST_ID", "PRIORITY_MAX", "PRIORITY_MIN", "Request",
           "check_embeds", "check_request", "check_request_id", "check_token"]

#: the longest request id (``X-Request-Id`` values are usually a UUID, 36 characters)
MAX_REQUEST_ID = 128

_I64 = np.dtype(np.int64)
_I64_MIN, _I64_MAX = -2**63, 2**63 - 1

#: the range of :attr:`Request.priority` (a signed 16-bit integer): wide enough for any
#: ranking a caller keeps, and small enough that a priority times the executor's aging
#: step stays an exact, finite number of seconds
PRIORITY_MIN, PRIORITY_MAX = -2**15, 2**15 - 1


@functools.cache
def _embed_dtypes() -> Mapping[DType, np.dtype]:
    """:data:`EMBED_DTYPES`, the numpy dtype an embeddings array must have for each
    manifest dtype it may name; made at the first call (BF16 imports ml_dtypes)."""
    return {
        DType.F32: np.dtype(np.float32),
        DType.F16: np.dtype(np.float16),
        DType.BF16: bf16_dtype(),
    }


@functools.cache
def _embed_names() -> Mapping[np.dtype, str]:
    return {v: k.value for k, v in _embed_dtypes().items()}


if TYPE_CHECKING:
    #: the numpy dtype an embeddings array must have for each manifest dtype it may name
    EMBED_DTYPES: Mapping[DType, np.dtype]


def __getattr__(name: str) -> Any:
    # EMBED_DTYPES is made on first access, so importing this module does not import
    # ml_dtypes (~0.6 s)
    if name == "EMBED_DTYPES":
        return _embed_dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_set = object.__setattr__          # a frozen instance's fields, set once in post-init


def _bad(message: str, **ctx: Any) -> InvalidArgument:
    return InvalidArgument(message, stage="request", **ctx)


def _integer(value: Any, field: str) -> int:
    """``value`` as a Python int: an int (not a bool) or a numpy integer."""
    if type(value) is int:
        return value
    if isinstance(value, np.integer) or (isinstance(value, int) and not isinstance(value, bool)):
        return int(value)
    raise _bad(f"{field} must be an integer, got {reprlib.repr(value)}")


def _one(value: Any, field: str) -> np.ndarray:
    """A one-element ``int64`` array of the integer ``value`` (a decode's token and
    position)."""
    if type(value) is not int:
        value = _integer(value, field)
    try:
        return np.array((value,), _I64)
    except OverflowError:
        raise _bad(f"{field} {value} does not fit int64") from None


def _is_int_type(t: type) -> bool:
    return (issubclass(t, int) and not issubclass(t, bool)) or issubclass(t, np.integer)


def _int_array(values: Any, field: str) -> np.ndarray:
    """``values`` as a 1-D ``int64`` array, or InvalidArgument naming ``field``."""
    if isinstance(values, np.ndarray):
        a = values
        if type(a) is np.ndarray and a.dtype == _I64 and a.ndim == 1:
            return a                    # already what we keep (a decode builds this)
        if a.ndim != 1:
            raise _bad(f"{field} must be 1-D, got shape {a.shape}")
        kind = a.dtype.kind
        if kind == "u" and a.dtype.itemsize == 8 and a.size and int(a.max()) > _I64_MAX:
            raise _bad(f"{field} value {int(a.max())} does not fit int64")
        if kind not in "iu":
            raise _bad(f"{field} must be integers, got an array of {a.dtype}")
        return np.asarray(a, dtype=_I64)   # a plain array, also of a subclass
    if not isinstance(values, Sequence) or isinstance(values, str | bytes):
        raise _bad(f"{field} must be a sequence of integers, got {reprlib.repr(values)}")
    wrong = [t for t in set(map(type, values)) if not _is_int_type(t)]
    if wrong:
        i, v = next((i, v) for i, v in enumerate(values) if type(v) in wrong)
        raise _bad(f"{field}[{i}] must be an integer, got {reprlib.repr(v)}")
    try:
        return np.asarray(values, dtype=_I64).reshape(-1)
    except OverflowError:
        i, v = next((i, v) for i, v in enumerate(values) if not _I64_MIN <= v <= _I64_MAX)
        raise _bad(f"{field}[{i}] = {v} does not fit int64") from None


def _embeds(values: Any) -> np.ndarray:
    """A prefill_embeds request's ``(n, hidden)`` array, kept as given."""
    if not isinstance(values, np.ndarray) or values.ndim != 2 \
            or values.dtype not in _embed_names():
        what = (f"an array of {values.dtype} {values.shape}"
                if isinstance(values, np.ndarray) else reprlib.repr(values))
        raise _bad("embeds must be a 2-D (n, hidden) numpy array of "
                   f"{', '.join(_embed_names().values())} (the manifest's dtype), got {what}")
    if values.size and not np.isfinite(values).all():
        raise _bad("embeds must be finite, got NaN or infinity")
    return values


def _seconds(value: Any, field: str) -> float | None:
    if value is None:
        return None
    if type(value) is float or (isinstance(value, int | float | np.integer | np.floating)
                                and not isinstance(value, bool)):
        value = float(value)
        if not math.isnan(value):
            return value
    raise _bad(f"{field} must be a number of seconds or None, got {reprlib.repr(value)}")


def _priority(value: Any) -> int:
    value = _integer(value, "priority")
    if not PRIORITY_MIN <= value <= PRIORITY_MAX:
        raise _bad(f"priority must be in [{PRIORITY_MIN}, {PRIORITY_MAX}], got "
                   f"{reprlib.repr(value)}")
    return value


def _kind(value: Any) -> TaskKind:
    if type(value) is TaskKind:
        return value
    if isinstance(value, str):
        try:
            return TaskKind(value)
        except ValueError:
            pass
    raise _bad(f"kind must be one of {', '.join(k.value for k in TaskKind)}, got "
               f"{reprlib.repr(value)}")


def _engine(value: Any) -> EngineSlot:
    if type(value) is EngineSlot:
        return value
    if isinstance(value, int | np.integer) and not isinstance(value, bool):
        try:
            return EngineSlot(int(value))
        except ValueError:
            pass
    raise _bad(f"engine must be an EngineSlot ({', '.join(e.name for e in EngineSlot)}), "
               f"got {reprlib.repr(value)}")


def _target(value: Any) -> np.ndarray | None:
    if value is None:
        return None
    if not isinstance(value, np.ndarray) or value.dtype != np.float32 or value.ndim != 1 \
            or not value.flags.c_contiguous or not value.flags.writeable:
        what = (f"{value.dtype} {value.shape}" if isinstance(value, np.ndarray)
                else reprlib.repr(value))
        raise _bad(f"target must be a writeable contiguous 1-D float32 numpy array, got "
                   f"{what}")
    return value


@attrs.frozen
class Request:
    """One inference job: a prefill of ``tokens`` (or of embeddings) or a one-token
    decode, for one sequence.

    ``tokens`` holds token ids (1-D integers) or, for ``PREFILL_EMBEDS``, the ``(n,
    hidden)`` embeddings in the dtype the manifest's embedding tensor names (see
    :data:`EMBED_DTYPES`). ``past_len`` defaults to the first position (0 without
    positions); ``positions`` default to ``past_len, past_len+1, ...``. ``deadline_s``
    bounds the whole job from enqueue (the executor's admission/queue/execution timeouts
    apply inside it). ``target``, when given, is the caller's float32 array (at least
    ``vocab`` long) the logits are written into — no copy, no temporary of the
    vocabulary. ``priority`` (an integer in ``[PRIORITY_MIN, PRIORITY_MAX]``, default 0)
    orders admission among waiting jobs: higher goes first, equal ones first come first
    served, and a waiting job's priority grows as it waits, so later work passes it only
    for a bounded time (docs/architecture.md, Admission). Every field is checked here; a
    bad value raises InvalidArgument.
    """

    seq_id: int
    kind: TaskKind
    tokens: Any = None
    positions: Any = None
    past_len: int | None = None
    deadline_s: float | None = None
    target: np.ndarray | None = attrs.field(default=None, eq=False)
    seq_count: int = 1
    engine: EngineSlot = EngineSlot.AUTO
    priority: int = 0
    request_id: str | None = None

    def __attrs_post_init__(self) -> None:
        seq_id = self.seq_id
        if type(seq_id) is not int:
            _set(self, "seq_id", seq_id := _integer(seq_id, "seq_id"))
        kind = self.kind
        if type(kind) is not TaskKind:
            _set(self, "kind", kind := _kind(kind))
        tokens = self.tokens
        if tokens is None:
            raise _bad("tokens missing", seq_id=seq_id)
        if kind is TaskKind.PREFILL_EMBEDS:
            _set(self, "tokens", _embeds(tokens))
        elif not (type(tokens) is np.ndarray and tokens.dtype == _I64 and tokens.ndim == 1):
            # (a plain 1-D int64 array, a decode's own, is kept as it is, with no call)
            _set(self, "tokens", _int_array(tokens, "tokens"))
        past, positions = self.past_len, self.positions
        if past is not None and type(past) is not int:
            _set(self, "past_len", past := _integer(past, "past_len"))
        if positions is not None:
            if not (type(positions) is np.ndarray and positions.dtype == _I64
                    and positions.ndim == 1):
                _set(self, "positions", positions := _int_array(positions, "positions"))
            if past is None:
                _set(self, "past_len", positions.item(0) if len(positions) else 0)
        else:
            if past is None:
                _set(self, "past_len", past := 0)
            _set(self, "positions", np.arange(past, past + len(self.tokens), dtype=_I64))
        if self.deadline_s is not None:
            _set(self, "deadline_s", _seconds(self.deadline_s, "deadline_s"))
        if self.target is not None:
            _target(self.target)
        if type(self.seq_count) is not int:
            _set(self, "seq_count", _integer(self.seq_count, "seq_count"))
        if type(self.engine) is not EngineSlot:
            _set(self, "engine", _engine(self.engine))
        priority = self.priority
        if type(priority) is not int or not PRIORITY_MIN <= priority <= PRIORITY_MAX:
            _set(self, "priority", _priority(priority))
        if self.request_id is not None:
            check_request_id(self.request_id)

    @property
    def token_count(self) -> int:
        """Tokens (or embedding rows) in this job."""
        return len(self.tokens)

    @classmethod
    def prefill(cls, seq_id: int, tokens: Sequence[int], *, past_len: int = 0,
                **kw: Any) -> Request:
        """A prefill of token ids at positions ``past_len...``."""
        return cls(seq_id, TaskKind.PREFILL_IDS, tokens, past_len=past_len, **kw)

    @classmethod
    def prefill_embeds(cls, seq_id: int, embeds: np.ndarray, *, past_len: int = 0,
                       **kw: Any) -> Request:
        """A prefill of an ``(n, hidden)`` embeddings array (in the manifest's dtype of the
        embedding tensor) at positions ``past_len...``."""
        return cls(seq_id, TaskKind.PREFILL_EMBEDS, embeds, past_len=past_len, **kw)

    def with_token(self, token: int) -> Request:
        """This decode with ``token`` in place of its own (a step prepared ahead with a
        placeholder): every other field as it was checked. The token is checked to be
        an integer here; against the vocabulary by :func:`check_token`."""
        if self.kind is not TaskKind.DECODE:
            raise _bad(f"with_token is for a decode, not a {self.kind.value}",
                       seq_id=self.seq_id)
        new = _new(Request)
        for name in _FIELDS:
            _set(new, name, getattr(self, name))
        _set(new, "tokens", _one(token, "token"))
        return new

    @classmethod
    def decode(cls, seq_id: int, token: int, position: int, **kw: Any) -> Request:
        """One decode step: ``token`` at ``position``."""
        if type(token) is int and type(position) is int and 0 <= token <= _I64_MAX \
                and 0 <= position <= _I64_MAX:     # the usual case, without two calls
            return cls(seq_id, TaskKind.DECODE, np.array((token,), _I64),
                       np.array((position,), _I64), position, **kw)
        return cls(seq_id, TaskKind.DECODE, _one(token, "token"),
                   _one(position, "position"), position, **kw)


_new = object.__new__
_FIELDS = tuple(f.name for f in attrs.fields(Request))


def check_request_id(value: Any, *, field: str = "request_id") -> str:
    """``value`` if it is a request id: 1 to :data:`MAX_REQUEST_ID` visible ASCII
    characters (what an ``X-Request-Id`` header carries: no spaces, no controls)."""
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_REQUEST_ID \
            or not value.isascii() or not value.isprintable() or " " in value:
        raise _bad(f"{field} must be 1 to {MAX_REQUEST_ID} visible ASCII characters, got "
                   f"{reprlib.repr(value)}")
    return value


def check_request(request: Request, contract: SubmodelContract, *, seq_limit: int,
                  context: Mapping[str, Any]) -> None:
    """Check ``request`` against the sub-model ``contract`` it will run on.

    Every fact that depends only on the request and the contract (spec 6.3 checks 1-6):
    tokens present, ``past_len >= 0``, ``past_len + n <= max_seq``, one sequence per job
    within ``max_batch``, ``0 <= seq_id < seq_limit``, one position per token running
    ``past_len..past_len+n-1``, a decode carries one token, ``n`` within the token tensor,
    token ids in ``[0, vocab)`` or embeddings of the tensor's dtype and hidden size, and a
    target of at least ``vocab`` elements. Raises InvalidArgument with ``context`` (e.g.
    ``job_id``, ``seq_id``, ``generation``, ``stage``).
    """
    kind = request.kind
    if kind is not contract.kind:
        raise InvalidArgument(f"a {kind.value} request checked against the "
                              f"{contract.kind.value} contract", **context)
    n = len(request.tokens)
    past = request.past_len
    if n <= 0:
        raise InvalidArgument("token_count must be > 0", **context)
    if past < 0:
        raise InvalidArgument(f"past_len must be >= 0, got {past}", **context)
    if past + n > contract.max_seq:
        raise InvalidArgument(f"past_len {past} + token_count {n} exceeds max_seq "
                              f"{contract.max_seq}", **context)
    if request.seq_count != 1 or request.seq_count > contract.max_batch:
        raise InvalidArgument(f"the {kind.value} graph takes one sequence per job "
                              f"(max_batch {contract.max_batch}), got seq_count "
                              f"{request.seq_count}", **context)
    if not 0 <= request.seq_id < seq_limit:
        raise InvalidArgument(f"seq_id must be in [0, {seq_limit}), got {request.seq_id}",
                              **context)
    pos = request.positions
    if len(pos) != n:
        raise InvalidArgument(f"{n} tokens but {len(pos)} positions", **context)
    if kind is TaskKind.DECODE and n != 1:
        raise InvalidArgument(f"a decode job carries one token, got {n}", **context)
    if n > contract.max_tokens:
        raise InvalidArgument(f"{n} tokens exceed tensor {contract.token_or_embed.name!r} "
                              f"({contract.max_tokens} tokens)", **context)
    if pos.item(0) != past or (n > 1 and not np.array_equal(
            pos, np.arange(past, past + n))):
        raise InvalidArgument(f"positions must run {past}..{past + n - 1}", **context)
    vocab = contract.vocab
    if kind is TaskKind.PREFILL_EMBEDS:
        check_embeds(request.tokens, contract, context)
    else:
        toks = request.tokens
        if n == 1:          # a decode: no numpy reductions on the per-token path
            lo = hi = toks.item(0)
        else:
            lo, hi = int(toks.min()), int(toks.max())
        if lo < 0 or hi >= vocab:
            raise InvalidArgument(f"token ids must be in [0, {vocab}), got [{lo}, {hi}]",
                                  **context)
    target = request.target
    if target is not None and target.shape[0] < vocab:
        raise InvalidArgument(f"target holds {target.shape[0]} elements, fewer than the "
                              f"vocabulary of {vocab}", **context)


def check_token(request: Request, contract: SubmodelContract,
                context: Callable[[], Mapping[str, Any]]) -> None:
    """A decode's one token against ``contract``'s vocabulary: what
    :func:`check_request` checks of a request whose other fields were checked before
    (:meth:`Request.with_token`). Raises InvalidArgument with ``context()`` (built only
    then: this runs once per token)."""
    token = request.tokens.item(0)
    if not 0 <= token < contract.vocab:
        raise InvalidArgument(f"token ids must be in [0, {contract.vocab}), got "
                              f"[{token}, {token}]", **context())


def check_embeds(embeds: np.ndarray, contract: SubmodelContract,
                 context: Mapping[str, Any]) -> None:
    """Check an embeddings array fits the contract's embedding tensor: ``(n, hidden)`` in
    the tensor's dtype (:data:`EMBED_DTYPES`). Raises InvalidArgument with ``context``."""
    tensor = contract.token_or_embed
    want = _embed_dtypes().get(tensor.dtype)
    if want is None:
        raise InvalidArgument(f"embedding tensor {tensor.name!r} is {tensor.dtype.value}, "
                              "not a float dtype calfsm can write", **context)
    if embeds.dtype != want:
        got = _embed_names().get(embeds.dtype, str(embeds.dtype))
        raise InvalidArgument(f"embeds are {got}, tensor {tensor.name!r} takes "
                              f"{tensor.dtype.value}", **context)
    hidden = tensor.shape[-1]
    if embeds.ndim != 2 or embeds.shape[1] != hidden:
        raise InvalidArgument(f"embeds must be (n, {hidden}) for tensor {tensor.name!r} "
                              f"(hidden size {hidden}), got {embeds.shape}", **context)
