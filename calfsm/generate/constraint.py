"""Constrained decoding: a grammar decides which tokens a stream may choose next.

Theory of operation
-------------------
``SamplingParams(constraint=...)`` takes one of five values: :class:`JsonSchema` (a JSON
Schema, ``strict`` refusing the keywords the matcher does not implement, as OpenAI's
``strict`` refuses schemas outside its subset; not strict, they are ignored),
:class:`JsonObject` (any JSON object), :class:`Regex`, :class:`Choice` (one of some
strings) and :class:`Grammar` (a Lark grammar, llguidance's dialect). They are plain
values: built without the matcher, checked for their shape only.

The matcher is llguidance (the optional extra ``constraints``: ``pip install
"calfsm[constraints]"``), through its numpy interface. A constraint is *compiled* once per
tokenizer (:func:`compile_constraint`: the grammar, a matcher in its first state, and its
first mask), in a bounded cache shared by every stream, so a repeated schema costs a
dictionary look-up and a matcher copy. A missing extra, a schema the matcher does not
support, a grammar that does not parse: an :class:`~calfsm.errors.InvalidArgument` with
``field="constraint"`` (a 400), raised before anything is taken for the stream.

Each stream owns a :class:`RowConstraint`: its matcher, which follows the tokens the
stream generated. Its mask for the next token is a *plan*, made off the token path
(:meth:`RowConstraint.prepare`: the stream calls it while the device runs the step whose
logits it will mask, where overlap scheduling leaves the host idle) and applied on the
token path in one small step (:meth:`RowConstraint.apply`, after the logits processors
and the penalties, before logprobs and the choice), by whichever is cheapest for the
mask's size: keep a few allowed ids (gather, fill ``-inf``, scatter), ban a few ids
(scatter ``-inf``), or add a ``0 / -inf`` row (one vectorised add). A plan not ready when
the logits are (the host was late) is made there, on the path: never a stale one.

The matcher's state is a function of the stream's generated tokens alone: a history
shorter than what it consumed (the replay after a device reset samples the last token
again) resets it and consumes the tokens again, so a resumed stream's state is rebuilt
exactly. A grammar that allows only its end makes the stream end ``stop`` without a
token; a grammar that allows no token (a *dead end*: the processors banned every
allowed one, or a token the matcher refuses was forced by a user sampler) ends it
``error`` with an InvalidArgument naming ``constraint``, never an invalid output.
"""

from __future__ import annotations

import json
import logging
import reprlib
import threading
import weakref
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from calfsm.errors import CalfsmError, ErrorCategory, Internal, InvalidArgument

__all__ = ["COUNTS", "Choice", "Compiled", "Constraint", "Grammar", "JsonObject", "JsonSchema",
           "Regex", "RowConstraint", "compile_constraint", "constraints_available",
           "ll_tokenizer", "warm"]

log = logging.getLogger("calfsm.constraint")

_FIELD = "constraint"
_F32 = np.dtype(np.float32)
#: a plan keeps or bans ids by index when at most this many are kept or banned; past
#: it, a 0/-inf row is added (constant cost)
_INDEXED = 8192
#: compiled constraints kept (most recently used)
CACHE_SIZE = 512
#: how JSON is written under a constraint: no free whitespace (bounded, compact output,
#: as OpenAI's strict mode writes it), ", " and ": " as separators
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ",
                 "key_separator": ": "}


def _bad(message: str) -> InvalidArgument:
    return InvalidArgument(message, stage="request", field=_FIELD)


# ---- the values -----------------------------------------------------------------------

def _schema_text(schema: Any) -> str:
    """``schema`` (a mapping, or its JSON text) as compact JSON text (the keys in their
    order: the properties are written in it)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise _bad(f"JsonSchema: the schema is not valid JSON: {e}") from None
    if isinstance(schema, bool):
        raise _bad("JsonSchema: a boolean schema constrains nothing useful; give an object")
    if not isinstance(schema, Mapping):
        raise _bad(f"JsonSchema: the schema must be a JSON object (a dict or its text), "
                   f"got {reprlib.repr(schema)}")
    try:
        return json.dumps(schema, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise _bad(f"JsonSchema: the schema is not JSON data: {e}") from None


@attrs.frozen
class JsonSchema:
    """Output that is one JSON value valid against ``schema`` (a dict or its JSON text).
    ``strict``: a keyword the matcher does not implement is refused (a 400), else it is
    ignored (the output may then not satisfy it)."""

    schema: dict[str, Any] | str = attrs.field(eq=False, hash=False)
    strict: bool = True
    #: the schema as canonical JSON text: what equality and the cache compare
    text: str = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "text", _schema_text(self.schema))
        if not isinstance(self.strict, bool):
            raise _bad(f"JsonSchema: strict must be a boolean, got "
                       f"{reprlib.repr(self.strict)}")


@attrs.frozen
class JsonObject:
    """Output that is one JSON object, any (OpenAI's ``json_object``)."""


@attrs.frozen
class Regex:
    """Output that matches ``pattern`` whole (llguidance's regex syntax: Rust's
    ``regex`` crate, no look-around or back-references)."""

    pattern: str

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.pattern, str) or not self.pattern:
            raise _bad(f"Regex: pattern must be a non-empty string, got "
                       f"{reprlib.repr(self.pattern)}")


@attrs.frozen
class Choice:
    """Output that is exactly one of ``options`` (non-empty strings)."""

    options: tuple[str, ...] = attrs.field(converter=lambda v: tuple(v)
                                           if isinstance(v, list | tuple) else v)

    def __attrs_post_init__(self) -> None:
        opts = self.options
        if not isinstance(opts, tuple) or not opts:
            raise _bad(f"Choice: options must be a non-empty sequence of strings, got "
                       f"{reprlib.repr(opts)}")
        for i, o in enumerate(opts):
            if not isinstance(o, str) or not o:
                raise _bad(f"Choice: options[{i}] must be a non-empty string, got "
                           f"{reprlib.repr(o)}")


@attrs.frozen
class Grammar:
    """Output in the language of ``lark``, a Lark grammar in llguidance's dialect
    (``start`` is the whole output; ``%json {...}`` embeds a JSON schema)."""

    lark: str

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.lark, str) or not self.lark.strip():
            raise _bad(f"Grammar: lark must be a non-empty string, got "
                       f"{reprlib.repr(self.lark)}")


#: what ``SamplingParams.constraint`` takes
Constraint = JsonSchema | JsonObject | Regex | Choice | Grammar
CONSTRAINT_TYPES = (JsonSchema, JsonObject, Regex, Choice, Grammar)


def check_constraint(value: Any) -> Constraint | None:
    """``value`` if it is a constraint (or None), else InvalidArgument naming it."""
    if value is None or isinstance(value, CONSTRAINT_TYPES):
        return value
    raise _bad(f"constraint must be JsonSchema, JsonObject, Regex, Choice or Grammar "
               f"(calfsm.generate.constraint), got {reprlib.repr(value)}")


# ---- llguidance -----------------------------------------------------------------------

_llg_lock = threading.Lock()
_llg: Any = None


def _llguidance() -> Any:
    """The llguidance module, or InvalidArgument (a 400) saying which extra is missing."""
    global _llg
    if _llg is None:
        with _llg_lock:
            try:
                import llguidance
                import llguidance.numpy
            except ImportError as e:
                raise _bad(f"constrained decoding needs llguidance: pip install "
                           f"\"calfsm[constraints]\" ({e})") from None
            _llg = llguidance
    return _llg


def constraints_available() -> bool:
    """Whether the ``constraints`` extra (llguidance) is installed."""
    try:
        _llguidance()
    except InvalidArgument:
        return False
    return True


def _grammar(c: Constraint, llg: Any) -> str:
    """llguidance's grammar for ``c``."""
    m = llg.LLMatcher
    if isinstance(c, JsonSchema):
        return m.grammar_from_json_schema(
            c.text, defaults=_JSON_OPTIONS, overrides={"lenient": not c.strict})
    if isinstance(c, JsonObject):
        return m.grammar_from_json_schema('{"type":"object"}', defaults=_JSON_OPTIONS)
    if isinstance(c, Regex):
        return m.grammar_from_regex(c.pattern)
    if isinstance(c, Choice):
        return m.grammar_from_lark(
            "start: " + " | ".join(json.dumps(o, ensure_ascii=False) for o in c.options))
    return m.grammar_from_lark(c.lark)


class _ByteVocab:
    """calfsm's byte tokenizer as llguidance sees it: ids 0..255 are the bytes, the
    rest special tokens (escapes: never text a grammar matches), the first of them the
    end."""

    bos_token_id = None

    def __init__(self, vocab: int) -> None:
        self.eos_token_id = 256
        self.tokens = [bytes([i]) for i in range(256)] + [
            b"<|calfsm_%d|>" % i for i in range(256, vocab)]
        self.special_token_ids = list(range(256, vocab))

    def __call__(self, s: str | bytes) -> list[int]:
        return list(s if isinstance(s, bytes) else s.encode())


_tokenizers: weakref.WeakKeyDictionary[Any, dict[int, Any]] = weakref.WeakKeyDictionary()
_tok_lock = threading.Lock()


def ll_tokenizer(tokenizer: Any, vocab: int) -> Any:
    """llguidance's tokenizer for ``tokenizer`` (calfsm's) and a model vocabulary of
    ``vocab`` ids, built once per tokenizer (a Hugging Face one takes ~1-3 s at 151,936
    ids). Supported: :class:`~calfsm.generate.tokenizer.HFTokenizer` (its end-of-sequence
    token is the grammar's end), the byte tokenizer (id 256 is the end), or any object
    with ``llguidance_tokenizer(vocab)``. Anything else: InvalidArgument."""
    if tokenizer is None:
        raise _bad("a constraint is matched on the stream's text, which needs the "
                   "executor's tokenizer (DeviceExecutor(..., tokenizer=...))")
    llg = _llguidance()
    with _tok_lock:
        try:
            per = _tokenizers.setdefault(tokenizer, {})
        except TypeError:           # not weakly referenceable: built each time
            per = {}
        found = per.get(vocab)
    if found is not None:
        return found
    own = getattr(tokenizer, "llguidance_tokenizer", None)
    hf = getattr(tokenizer, "tokenizer", None)
    try:
        if callable(own):
            made = own(vocab)
        elif hf is not None and callable(getattr(hf, "to_str", None)):
            eos = getattr(tokenizer, "eos_token_id", None)
            if eos is None:
                raise _bad("a constraint needs the tokenizer's end-of-sequence token "
                           "(HFTokenizer(..., eos_token=...)): it is the grammar's end")
            made = llg.LLTokenizer(hf.to_str(), n_vocab=vocab, eos_token=eos)
        elif getattr(tokenizer, "byte_level", False) and vocab > 256:
            made = llg.LLTokenizer(llg.TokenizerWrapper(_ByteVocab(vocab)), n_vocab=vocab)
        else:
            raise _bad(f"constrained decoding does not know the tokenizer "
                       f"{type(tokenizer).__name__}: use an HFTokenizer or the byte "
                       f"tokenizer, or give it llguidance_tokenizer(vocab)")
    except CalfsmError:
        raise
    except Exception as e:
        raise _bad(f"llguidance cannot read the tokenizer: {type(e).__name__}: {e}") \
            from None
    if made.vocab_size != vocab:
        raise _bad(f"the tokenizer has {made.vocab_size} ids, the model {vocab}")
    per[vocab] = made
    return made


def warm(tokenizer: Any, vocab: int) -> None:
    """Read ``tokenizer`` into llguidance now (a server at start-up: the first
    constrained request then does not pay the ~1-8 s), if the extra is installed; a
    tokenizer it cannot read is left for the requests to refuse."""
    try:
        ll_tokenizer(tokenizer, vocab)
    except InvalidArgument as e:
        log.info("constrained decoding is not warmed: %s", e.message)


# ---- compiled constraints ---------------------------------------------------------------

@attrs.frozen(eq=False)
class Plan:
    """A mask made ready for the token path: ``kind`` ``keep`` (only ``ids`` allowed),
    ``ban`` (``ids`` not allowed; ids in no particular order), ``add`` (``row`` is 0 /
    -inf, added), ``end`` (only the grammar's end is allowed: no token is chosen) or
    ``dead`` (nothing is)."""

    kind: str
    ids: np.ndarray | None = None
    row: np.ndarray | None = None


def _plan(words: np.ndarray, vocab: int, eos: int, stopped: bool) -> Plan:
    """The plan of a bitmask (int32 words, bit ``i`` of word ``w`` is id ``32w + i``)."""
    u = words.view(np.uint32)
    k = int(np.bitwise_count(u).sum())
    if stopped or k == 0:
        return Plan("end" if stopped else "dead")
    if k == 1 and (u[eos >> 5] >> np.uint32(eos & 31)) & 1:
        return Plan("end")
    if k <= _INDEXED:
        return Plan("keep", _ids(u))
    if vocab - k <= _INDEXED:
        ids = _ids(~u)
        return Plan("ban", ids[ids < vocab])
    bits = np.unpackbits(u.view(np.uint8), bitorder="little")[:vocab]
    return Plan("add", row=np.take(_ADD, bits))


_ADD = np.array([-np.inf, 0.0], _F32)


def _ids(u: np.ndarray) -> np.ndarray:
    """The ids of the set bits of ``u`` (uint32 words), in no particular order: the
    lowest set bit of every word still holding one, until none does (as many passes as
    the most bits in a word; each pass over the words left), so the cost follows the
    ids, not the vocabulary."""
    nz = np.flatnonzero(u)
    w = u[nz]
    out = []
    one = np.uint32(1)
    while w.shape[0]:
        low = w & (~w + one)
        out.append(nz * 32 + np.bitwise_count(low - one))
        w = w ^ low
        more = w != 0
        if not more.all():
            w, nz = w[more], nz[more]
    return np.concatenate(out).astype(np.intp) if out else np.empty(0, np.intp)


class Compiled:
    """One constraint compiled for one tokenizer: a matcher in its first state (each
    stream copies it) and its first plan."""

    __slots__ = ("constraint", "eos", "first", "matcher", "tokenizer", "vocab")

    def __init__(self, constraint: Constraint, tokenizer: Any, vocab: int) -> None:
        llg = _llguidance()
        self.constraint = constraint
        self.tokenizer = tokenizer
        self.vocab = vocab
        self.eos = int(tokenizer.eos_token)
        try:
            grammar = _grammar(constraint, llg)
        except (ValueError, TypeError) as e:
            raise _bad(f"{type(constraint).__name__}: {e}") from None
        m = llg.LLMatcher(tokenizer, grammar, log_level=0)     # never raises: is_error
        if m.is_error():
            raise _bad(f"{type(constraint).__name__} is not supported: "
                       f"{_first_lines(m.get_error())}")
        self.matcher = m
        words = llg.numpy.allocate_token_bitmask(1, vocab)
        llg.numpy.fill_next_token_bitmask(m, words)
        if m.is_error():
            raise _bad(f"{type(constraint).__name__}: {_first_lines(m.get_error())}")
        self.first = _plan(words[0], vocab, self.eos, m.is_stopped())
        if self.first.kind == "dead":
            raise _bad(f"{type(constraint).__name__} allows no first token with this "
                       f"tokenizer")

    def start(self) -> RowConstraint:
        """A stream's own matcher, in the first state."""
        return RowConstraint(self)


def _first_lines(text: str, n: int = 3) -> str:
    return " | ".join(line for line in text.strip().splitlines()[:n])


_cache: OrderedDict[tuple[int, Constraint], Compiled] = OrderedDict()
_cache_lock = threading.Lock()


def compile_constraint(constraint: Constraint, tokenizer: Any, vocab: int) -> Compiled:
    """``constraint`` compiled for calfsm's ``tokenizer`` and a model of ``vocab`` ids,
    from the cache when it was compiled before (the :data:`CACHE_SIZE` most recent are
    kept). Raises InvalidArgument (``field="constraint"``) for a missing extra, a
    tokenizer it cannot read, or a grammar it does not support."""
    check_constraint(constraint)
    llt = ll_tokenizer(tokenizer, vocab)
    key = (id(llt), constraint)
    with _cache_lock:
        found = _cache.get(key)
        if found is not None:
            _cache.move_to_end(key)
            return found
    compiled = Compiled(constraint, llt, vocab)     # outside the lock: ~1 ms to 100s
    with _cache_lock:
        _cache[key] = compiled
        while len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)
    return compiled


# ---- one stream's matcher -----------------------------------------------------------------

@attrs.define
class MaskCounts:
    """How the masks were made, over the process (for benchmarks and tests): ``ahead``
    off the token path, ``late`` on it (the host was late, or nothing ran ahead)."""

    ahead: int = 0
    late: int = 0


#: the process's counts (plain increments: a figure, not a book)
COUNTS = MaskCounts()


def dead_end(why: str) -> InvalidArgument:
    """The error a row that can go no further ends with."""
    return InvalidArgument(f"the constraint allows no token here (a dead end): {why}",
                           stage="sample", field=_FIELD)


class RowConstraint:
    """One stream's matcher and its plan for the next token (see the module). The
    stream's completion side (:meth:`apply`) and its off-path preparation
    (:meth:`prepare`) may call it from two threads: a lock keeps them in turn."""

    __slots__ = ("_compiled", "_consumed", "_lock", "_m", "_plan", "_plan_at", "_words",
                 "eos", "vocab")

    def __init__(self, compiled: Compiled) -> None:
        self._compiled = compiled
        self._m = compiled.matcher.deep_copy()
        self._lock = threading.Lock()
        self._consumed = 0              # generated tokens the matcher has consumed
        self._plan: Plan | None = compiled.first
        self._plan_at = 0               # the plan is for this many generated tokens
        self._words = None
        self.eos = compiled.eos
        self.vocab = compiled.vocab

    def prepare(self, tokens: Sequence[int], start: int) -> None:
        """Off the token path: make the plan for the token after ``tokens`` (the prompt,
        then what was generated from ``start`` on). A history older than the matcher's
        (the path went ahead meanwhile) is left alone; errors wait for :meth:`apply`."""
        with self._lock:
            n = len(tokens) - start
            if n < self._consumed or (self._plan is not None and self._plan_at == n):
                return
            try:
                self._advance(tokens, start, n)
            except CalfsmError:
                self._plan = None       # apply() meets it again, on the path
            else:
                COUNTS.ahead += 1

    def plan(self, tokens: Sequence[int], start: int) -> Plan:
        """The plan for the token after ``tokens`` (made now if it is not ready; a
        shorter history than the matcher's is a replay: the matcher starts over)."""
        with self._lock:
            n = len(tokens) - start
            if n < self._consumed:
                self._m.reset()
                self._consumed = 0
                self._plan = None
            if self._plan is None or self._plan_at != n:
                self._advance(tokens, start, n)
                COUNTS.late += 1
            return self._plan

    def _advance(self, tokens: Sequence[int], start: int, n: int) -> None:
        m = self._m
        if n > self._consumed:
            new = [int(tokens[i]) for i in range(start + self._consumed, start + n)]
            if not m.consume_tokens(new):
                self._consumed = n
                self._plan = None
                raise dead_end(f"token {new[-1]} is not allowed "
                               f"({_first_lines(m.get_error(), 1)})")
            self._consumed = n
        if n == 0 and not m.is_error():
            plan = self._compiled.first
        else:
            llg = _llguidance()
            words = self._words
            if words is None:
                words = self._words = llg.numpy.allocate_token_bitmask(1, self.vocab)
            llg.numpy.fill_next_token_bitmask(m, words)
            if m.is_error():
                raise _matcher_error(m.get_error())
            plan = _plan(words[0], self.vocab, self.eos, m.is_stopped())
        self._plan, self._plan_at = plan, n

    def apply(self, x: np.ndarray, plan: Plan) -> None:
        """Mask ``x`` (the float32 row of the vocabulary, in place) by ``plan``: the one
        step of the token path (a native tail may take the plan's ids or row instead)."""
        kind = plan.kind
        if kind == "keep":
            ids = plan.ids
            keep = x[ids]
            x.fill(-np.inf)
            x[ids] = keep
        elif kind == "ban":
            x[plan.ids] = -np.inf
        elif kind == "add":
            np.add(x, plan.row, out=x)
        elif kind == "dead":
            raise dead_end("the grammar allows no token after this output")


def _matcher_error(text: str) -> CalfsmError:
    """The matcher stopped with an error of its own: its limits (a grammar too complex
    for them: the request's) or anything else (Internal)."""
    first = _first_lines(text, 1)
    if "too complex" in text.lower() or "limit" in text.lower() or "fuel" in text.lower():
        return dead_end(f"the matcher's limits: {first}")
    return Internal(f"the constraint's matcher failed: {first}",
                    category=ErrorCategory.UNKNOWN, stage="sample")
