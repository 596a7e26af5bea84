"""Fault plans: which device call misbehaves, and how — as frozen, serialisable data.

Theory of operation
-------------------
A :class:`FaultPlan` is a tuple of :class:`FaultRule`\\ s. A rule names a *point* and an
*effect* (``"code"``, ``"hang"``, ``"nan"``, ...). :data:`FAULT_POINTS` lists every point
(a :class:`FaultPoint`: the driver calls that reach it, its effects, filters and default
code): each protocol call that returns a CalRT code or a KV answer reaches exactly one,
named after it (``infer_fixed`` reaches ``infer``; every reset kind ``reset``); the calls
of :data:`UNFAULTED_CALLS` return no code. Both drivers that take a plan —
:class:`~calfsm.drivers.sim.SimDriver` and the native emulator behind ``CalrtDriver`` —
apply it with the same counting rules, so one plan means the same thing on both:

1. A call *reaches* its point when it would otherwise succeed: every argument check of
   ``docs/driver-protocol.md`` passed (``kv_can_allocate``/``kv_apply``: the honest answer
   would be True; ``wait``: the buffer's job is still pending; ``model``: the name was
   found; ``kv_release``: also for a sequence that has nothing to release). Calls that
   fail on their own never count and are never replaced.
2. Each rule has optional filters (:attr:`FaultPoint.filters` says which point has which):

   - ``seq_id``: at ``infer`` the job's :class:`~calfsm.drivers.base.JobTag` ``seq_id``
     (without a tag: the input buffer's KV sequence; on a batch job also any row's KV
     sequence); at ``wait`` and ``output_bytes`` the
     KV sequence of the buffer's last job; at ``kv_apply``, ``kv_release`` and
     ``set_kv_seq`` the ``seq`` argument; at ``set_csr``, ``set_batch_rows``, ``map_buffer``,
     ``slice_tensor``, ``undo_slice`` and ``destroy_buffers`` the KV sequence the input
     buffer is set to at that moment (none on an output buffer or before ``set_kv_seq``:
     the rule does not match);
   - ``job_id``: the JobTag's ``job_id`` of the job at ``infer``, ``wait`` and
     ``output_bytes`` (no tag: no match);
   - ``name``: the CSR name (``set_csr``), tensor name (``map_buffer``, ``slice_tensor``,
     ``undo_slice``, ``output_bytes``) or model name (``model``).

   A filter at a point that has nothing to match is refused when the rule is built, so a
   rule can never silently not fire; so is a value outside the C type the emulator gets
   (``code`` a non-zero int32; ``seq_id`` below 2**31; the counters and ``job_id``
   int64; ``name`` under 256 UTF-8 bytes). A rule's *match ordinal* counts the calls
   that reached its point and passed its filters: 1, 2, 3, ...
3. A rule fires at match ordinals ``nth, nth + every, nth + 2*every, ...`` (only ``nth``
   when ``every`` is None), at most ``count`` times (None: once without ``every``,
   unlimited with it). :meth:`FaultRule.always` fires on every match.
4. Rules are tried in plan order; the first one that fires decides the call. Every
   rule's match ordinal advances on every matching call whether it fired or not.

Effects by point (:data:`EFFECTS`):

- ``code`` (every point but the two KV answers): the call returns ``code`` instead and
  changes nothing (``wait``: time does not move either, the job stays pending; calls that
  return ``(code, value)`` return ``(code, None)``). Default codes per point are in
  :data:`DEFAULT_CODES` (``set_csr`` NOT_FOUND, ``infer`` DEVICE_BUSY, ``wait`` TIMEOUT,
  ``reset`` SOFT_RESET_FAILED, ...).
- ``refuse`` (``kv_can_allocate``, ``kv_apply``): the call returns False, nothing changes.
- job effects, chosen at ``infer``/``infer_fixed`` (the submit succeeds and returns 0):
  ``ccu_exception`` (the job ends ``DONE_CCU_EXCEPTION`` and writes nothing),
  ``short_output`` (only ``n_bytes`` bytes of the output are written and
  ``output_bytes`` reports ``n_bytes``; default half the tensor), ``nan`` / ``inf``
  (BF16 NaN 0x7FC0 / +Inf 0x7F80 written at element ``index`` of the row holding the
  last token's logits), ``hang`` (the job never finishes until a reset aborts it, so
  ``wait`` times out), ``stale`` (a reset does not abort the job: it finishes at its
  time anyway and writes its old output array, but no KV), ``row_ccu_exception`` (a
  batch job runs, but the rows whose KV sequence the rule's ``seq_id`` names — row 0
  without one — end ``DONE_CCU_EXCEPTION`` in ``row_status`` and write nothing; on a
  batch-1 model it is ``ccu_exception``). On a batch job (``docs/driver-protocol.md``,
  Batches) ``seq_id`` at ``infer`` matches any row's KV sequence; ``nan``/``inf`` hit
  the matched row (row 0 without a ``seq_id``), the other job effects the whole job.

:meth:`FaultPlan.swarm` draws random plans swarm-style for soak and property tests.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from calfsm.drivers.base import SEQ_LIMIT
from calfsm.errors import CalrtCode, InvalidArgument
from calfsm.util.boundedio import load_json, read_or_raise

__all__ = [
    "BATCH_SWARM_KINDS",
    "DEFAULT_CODES",
    "EFFECTS",
    "FAULT_POINTS",
    "FILTERS",
    "JOB_EFFECTS",
    "MAX_FILE_BYTES",
    "NAME_MAX_BYTES",
    "POINTS",
    "SWARM_KINDS",
    "UNFAULTED_CALLS",
    "FaultPlan",
    "FaultPoint",
    "FaultRule",
]

#: job effects, attached at submit (point ``infer``; ``infer_fixed`` counts as ``infer``)
JOB_EFFECTS = ("ccu_exception", "short_output", "nan", "inf", "hang", "stale",
               "row_ccu_exception")

#: the largest fault plan file read (a plan of a thousand rules is ~150 KiB)
MAX_FILE_BYTES = 4 << 20

_I32 = (-(2**31), 2**31 - 1)
_I64_MAX = 2**63 - 1
#: a name the C ABI can carry: fewer than CALRT_NAME_MAX (256) UTF-8 bytes, no NUL
NAME_MAX_BYTES = 255


@attrs.frozen
class FaultPoint:
    """One place a fault plan can make a device call misbehave.

    ``calls`` are the :class:`~calfsm.drivers.base.Driver` methods that reach it,
    ``filters`` the :class:`FaultRule` fields that can narrow a rule on it (every rule can
    use ``nth``/``every``/``count``). :attr:`fail_effect` is the effect that fails the
    call: ``code`` (it returns the rule's code, else :attr:`default_code`) or ``refuse``
    (a KV call answers False)."""

    name: str
    calls: tuple[str, ...]
    effects: tuple[str, ...]
    filters: frozenset[str] = frozenset()
    default_code: int | None = None

    @property
    def fail_effect(self) -> str:
        return self.effects[0]


def _point(name: str, default: CalrtCode | None, *filters: str,
           calls: tuple[str, ...] = (), effects: tuple[str, ...] = ("code",)) -> FaultPoint:
    return FaultPoint(name, calls or (name,), effects, frozenset(filters),
                      None if default is None else int(default))


_BUF = ("seq_id", "name")   # a buffer's KV sequence at that moment, the tensor/CSR name
_JOB = ("seq_id", "job_id")

#: every fault point, in the order of the Driver protocol: each call the executor makes
#: (but :data:`UNFAULTED_CALLS`) reaches exactly one of them
FAULT_POINTS: tuple[FaultPoint, ...] = (
    _point("configure", CalrtCode.INVALID_CALBIN),
    _point("get_all_models", CalrtCode.UNEXPECTED),
    _point("model", CalrtCode.NOT_FOUND, "name"),
    _point("create_buffers", CalrtCode.ALLOC_FAILED),
    _point("destroy_buffers", CalrtCode.DEVICE_BUSY, "seq_id"),
    _point("map_buffer", CalrtCode.MAP_BROKEN, *_BUF),
    _point("slice_tensor", CalrtCode.OUT_OF_RANGE, *_BUF),
    _point("undo_slice", CalrtCode.OUT_OF_RANGE, *_BUF),
    _point("set_csr", CalrtCode.NOT_FOUND, *_BUF),
    _point("set_kv_seq", CalrtCode.INVALID_VALUE, "seq_id"),
    _point("set_batch_rows", CalrtCode.INVALID_VALUE, "seq_id"),
    _point("infer", CalrtCode.DEVICE_BUSY, *_JOB, calls=("infer", "infer_fixed"),
           effects=("code", *JOB_EFFECTS)),
    _point("wait", CalrtCode.TIMEOUT, *_JOB),
    _point("output_bytes", CalrtCode.INVALID_STATE, *_JOB, "name"),
    _point("kv_can_allocate", None, effects=("refuse",)),
    _point("kv_apply", None, "seq_id", effects=("refuse",)),
    _point("kv_release", CalrtCode.UNEXPECTED, "seq_id"),
    _point("reset", CalrtCode.SOFT_RESET_FAILED),
    _point("enable_parallel_mode", CalrtCode.DEVICE_BUSY),
)

#: Driver methods with no fault point: they return no CalRT code (``status`` reports how
#: a job ended; a ``ccu_exception`` job effect changes what it reports)
UNFAULTED_CALLS = ("version", "capabilities", "status", "row_status", "close")

POINTS = tuple(p.name for p in FAULT_POINTS)
#: point -> the effects a rule at that point may have
EFFECTS: dict[str, tuple[str, ...]] = {p.name: p.effects for p in FAULT_POINTS}
#: point -> the filters a rule at that point may use
FILTERS: dict[str, frozenset[str]] = {p.name: p.filters for p in FAULT_POINTS}
#: the code an effect ``code`` returns when the rule does not name one
DEFAULT_CODES: dict[str, int] = {p.name: p.default_code for p in FAULT_POINTS
                                 if p.default_code is not None}

_FIELDS = ("point", "effect", "nth", "every", "count", "seq_id", "job_id", "name", "code",
           "n_bytes", "index")
_INT_FIELDS = ("nth", "every", "count", "seq_id", "job_id", "code", "n_bytes", "index")


def _opt_int(name: str, lo: int, hi: int, *, nonzero: bool = False, hint: str = "",
             optional: bool = True):
    """An integer field in ``[lo, hi]`` (the range of the C field it is pushed down as, or
    narrower), or None when ``optional``; bools and other types are refused."""
    what = (hint or f"an integer in [{lo}, {hi}]") + (" or null" if optional else "")

    def check(_inst: Any, _attr: Any, value: int | None) -> None:
        if value is None and optional:
            return
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi \
                or (nonzero and value == 0):
            raise InvalidArgument(f"{name}: must be {what}, got {value!r}", stage="faults")
    return check


def _positive(name: str, optional: bool = True):
    return _opt_int(name, 1, _I64_MAX, hint="a positive integer below 2**63",
                    optional=optional)


def _check_name(_inst: Any, _attr: Any, value: str | None) -> None:
    if value is None:
        return
    if not isinstance(value, str):
        problem = f"must be a string or null, got {value!r}"
    elif "\0" in value:
        problem = f"must not contain NUL, got {value!r}"
    elif len(value.encode("utf-8", "surrogatepass")) > NAME_MAX_BYTES:
        problem = (f"must be at most {NAME_MAX_BYTES} UTF-8 bytes (a CalRT name), got "
                   f"{len(value.encode('utf-8', 'surrogatepass'))}")
    else:
        return
    raise InvalidArgument(f"name: {problem}", stage="faults")


@attrs.frozen
class FaultRule:
    """One injected misbehaviour. See the module docstring for the exact rules."""

    point: str
    effect: str
    nth: int = attrs.field(default=1, validator=_positive("nth", optional=False))
    every: int | None = attrs.field(default=None, validator=_positive("every"))
    count: int | None = attrs.field(default=None, validator=_positive("count"))
    seq_id: int | None = attrs.field(default=None, validator=_opt_int(
        "seq_id", 0, SEQ_LIMIT - 1, hint="a KV sequence id in [0, 2**31 - 1]"))
    job_id: int | None = attrs.field(default=None, validator=_opt_int(
        "job_id", -(2**63), _I64_MAX, hint="a 64-bit signed integer"))
    name: str | None = attrs.field(default=None, validator=_check_name)
    code: int | None = attrs.field(default=None, validator=_opt_int(
        "code", *_I32, nonzero=True, hint="a non-zero 32-bit signed integer (a CalRT code)"))
    n_bytes: int | None = attrs.field(default=None, validator=_opt_int("n_bytes", 0, _I64_MAX))
    index: int = attrs.field(default=0, validator=_opt_int("index", 0, _I64_MAX,
                                                               optional=False))

    def __attrs_post_init__(self) -> None:
        if self.point not in EFFECTS:
            raise InvalidArgument(f"point: unknown point {self.point!r} (one of "
                                  f"{', '.join(POINTS)})", stage="faults")
        if self.effect not in EFFECTS[self.point]:
            raise InvalidArgument(f"effect: unknown effect {self.effect!r} for point "
                                  f"{self.point!r} (one of {', '.join(EFFECTS[self.point])})",
                                  stage="faults")
        for f in ("seq_id", "job_id", "name"):
            if getattr(self, f) is not None and f not in FILTERS[self.point]:
                have = ", ".join(sorted(FILTERS[self.point])) or "none"
                raise InvalidArgument(f"{f}: point {self.point!r} has no {f} to match "
                                      f"(its filters: {have})", stage="faults")

    # ---- construction helpers ---------------------------------------------------------
    @classmethod
    def always(cls, point: str, effect: str, **kw: Any) -> FaultRule:
        """A rule that fires on every matching call."""
        return cls(point, effect, nth=1, every=1, **kw)

    @property
    def effective_code(self) -> int:
        """The code an effect ``code`` returns (the rule's, else the point's default)."""
        return int(self.code if self.code is not None else DEFAULT_CODES[self.point])

    @property
    def limit(self) -> int | None:
        """How many times the rule may fire (None: unlimited)."""
        if self.count is not None:
            return self.count
        return None if self.every is not None else 1

    def fires_at(self, ordinal: int, fired: int) -> bool:
        """Whether the rule fires at match ordinal ``ordinal`` having fired ``fired`` times."""
        limit = self.limit
        if limit is not None and fired >= limit:
            return False
        if ordinal < self.nth:
            return False
        if self.every is None:
            return ordinal == self.nth
        return (ordinal - self.nth) % self.every == 0

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data; fields at their default are left out."""
        out: dict[str, Any] = {"point": self.point, "effect": self.effect}
        defaults = {"nth": 1, "index": 0}
        for f in _FIELDS[2:]:
            v = getattr(self, f)
            if v is None or defaults.get(f) == v:
                continue
            out[f] = v
        return out

    def describe(self) -> str:
        when = f"#{self.nth}" + (f"+{self.every}k" if self.every else "")
        flt = "".join(f" {f}={getattr(self, f)}" for f in ("seq_id", "job_id", "name")
                      if getattr(self, f) is not None)
        extra = f" code={self.effective_code}" if self.effect == "code" else ""
        return f"{self.point}{when}{flt} -> {self.effect}{extra}"


def _rule_from_dict(i: int, data: Any) -> FaultRule:
    at = f"rules[{i}]"
    if not isinstance(data, Mapping):
        raise InvalidArgument(f"{at}: must be an object, got {data!r}", stage="faults")
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise InvalidArgument(f"{at}.{unknown[0]}: unknown field (fields are "
                              f"{', '.join(_FIELDS)})", stage="faults")
    for f in ("point", "effect"):
        if f not in data:
            raise InvalidArgument(f"{at}.{f}: required field missing", stage="faults")
        if not isinstance(data[f], str):
            raise InvalidArgument(f"{at}.{f}: must be a string, got {data[f]!r}",
                                  stage="faults")
    if data["point"] not in EFFECTS:
        raise InvalidArgument(f"{at}.point: unknown point {data['point']!r} (one of "
                              f"{', '.join(POINTS)})", stage="faults")
    try:
        return FaultRule(**data)
    except InvalidArgument as e:
        raise InvalidArgument(f"{at}.{e.message}", stage="faults") from None
    except TypeError as e:  # pragma: no cover - attrs signature errors
        raise InvalidArgument(f"{at}: {e}", stage="faults") from None


@attrs.frozen
class FaultPlan:
    """An ordered tuple of :class:`FaultRule`\\ s; empty means a well-behaved device."""

    rules: tuple[FaultRule, ...] = attrs.field(default=(), converter=tuple)
    name: str = ""

    @classmethod
    def none(cls) -> FaultPlan:
        return _NONE

    @classmethod
    def of(cls, *rules: FaultRule, name: str = "") -> FaultPlan:
        return cls(tuple(rules), name)

    def __bool__(self) -> bool:
        return bool(self.rules)

    def __add__(self, other: FaultPlan) -> FaultPlan:
        return FaultPlan(self.rules + other.rules, self.name or other.name)

    def by_point(self) -> dict[str, list[tuple[int, FaultRule]]]:
        """``point -> [(rule index, rule), ...]`` in plan order (what a driver indexes)."""
        out: dict[str, list[tuple[int, FaultRule]]] = {}
        for i, r in enumerate(self.rules):
            out.setdefault(r.point, []).append((i, r))
        return out

    # ---- serialisation ----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"version": 1, "name": self.name, "rules": [r.to_dict() for r in self.rules]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=False)

    @classmethod
    def from_dict(cls, data: Any) -> FaultPlan:
        if isinstance(data, list):
            data = {"rules": data}
        if not isinstance(data, Mapping):
            raise InvalidArgument(f"fault plan must be an object, got {type(data).__name__}",
                                  stage="faults")
        unknown = sorted(set(data) - {"version", "name", "rules"})
        if unknown:
            raise InvalidArgument(f"{unknown[0]}: unknown field of a fault plan",
                                  stage="faults")
        if data.get("version", 1) != 1:
            raise InvalidArgument(f"version: unsupported fault plan version "
                                  f"{data.get('version')!r}", stage="faults")
        rules = data.get("rules", [])
        if not isinstance(rules, list):
            raise InvalidArgument("rules: must be a list", stage="faults")
        name = data.get("name", "")
        if not isinstance(name, str):
            raise InvalidArgument(f"name: must be a string, got {name!r}", stage="faults")
        return cls(tuple(_rule_from_dict(i, r) for i, r in enumerate(rules)), name)

    @classmethod
    def from_json(cls, text: str | bytes) -> FaultPlan:
        """A plan from its JSON text, nested at most
        :data:`~calfsm.util.boundedio.MAX_DEPTH` deep (a plan needs 3)."""
        try:
            data = load_json(text)
        except ValueError as e:     # malformed, not UTF-8, or nested too deep
            raise InvalidArgument(f"fault plan does not parse: {e}", stage="faults") from None
        return cls.from_dict(data)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(self.to_json() + "\n", "utf-8")
        return path

    @classmethod
    def load(cls, path: str | Path) -> FaultPlan:
        """The plan in the file ``path``: a regular file (a FIFO or a device is refused
        at once, never read) of at most :data:`MAX_FILE_BYTES`."""
        return cls.from_json(read_or_raise(
            path, max_bytes=MAX_FILE_BYTES, error=lambda why: InvalidArgument(
                f"cannot read fault plan {str(path)!r}: {why}", stage="faults")))

    # ---- random plans -----------------------------------------------------------------
    @classmethod
    def swarm(cls, seed: int, *, kinds: Iterable[str] | None = None, rate: float = 0.05,
              rates: Mapping[str, float] | None = None, p_enable: float = 0.5,
              p_none: float = 0.125) -> FaultPlan:
        """A random plan, deterministic per ``seed`` (swarm testing).

        With probability ``p_none`` the plan is empty; otherwise each kind of
        :data:`SWARM_KINDS` (or of ``kinds``) is enabled with probability ``p_enable``
        (at least one). An enabled kind fires on about ``rate`` of the calls at its
        point (``rates[kind]`` overrides), starting at a random early ordinal.
        """
        rng = random.Random(seed)
        pool = list(SWARM_KINDS) if kinds is None else list(kinds)
        for k in pool:
            if k not in _SWARM:
                raise InvalidArgument(f"kinds: unknown swarm kind {k!r} (one of "
                                      f"{', '.join(sorted(_SWARM))})", stage="faults")
        if not pool or rng.random() < p_none:
            return cls((), f"swarm-{seed}")
        enabled = [k for k in pool if rng.random() < p_enable]
        if not enabled:
            enabled = [rng.choice(pool)]
        rules = []
        for k in enabled:
            r = (rates or {}).get(k, rate)
            if not 0 < r <= 1:
                raise InvalidArgument(f"rates[{k!r}]: must be in (0, 1], got {r!r}",
                                      stage="faults")
            rules.append(_SWARM[k](rng, r))
        return cls(tuple(rules), f"swarm-{seed}")

    def targeting(self, seq_ids: Sequence[int], seed: int = 0) -> FaultPlan:
        """The same plan with each rule that can filter by sequence pointed at one of
        ``seq_ids`` (chosen with ``random.Random(seed)``). A workload's faults then hit
        the workload, not the executor's own warm-up golden; rules of points without a
        sequence (KV admission, reset, configure) stay global."""
        if not seq_ids:
            raise InvalidArgument("targeting needs at least one sequence id",
                                  stage="faults")
        rng = random.Random(seed)
        rules = []
        for r in self.rules:
            try:
                rules.append(attrs.evolve(r, seq_id=int(rng.choice(list(seq_ids)))))
            except InvalidArgument:
                rules.append(r)
        return FaultPlan(tuple(rules), self.name)

    def describe(self) -> str:
        return "; ".join(r.describe() for r in self.rules) or "no faults"


_NONE = FaultPlan((), "none")


def _periodic(point: str, effect: str, **kw: Any):
    def make(rng: random.Random, rate: float) -> FaultRule:
        period = max(1, round(1 / rate))
        every = max(1, rng.randint(max(1, period // 2), max(1, period * 3 // 2)))
        nth = rng.randint(1, max(1, period))
        return FaultRule(point, effect, nth=nth, every=every, **kw)
    return make


def _code_from(point: str, codes: Sequence[int]):
    def make(rng: random.Random, rate: float) -> FaultRule:
        return attrs.evolve(_periodic(point, "code")(rng, rate), code=int(rng.choice(codes)))
    return make


def _short(rng: random.Random, rate: float) -> FaultRule:
    return attrs.evolve(_periodic("infer", "short_output")(rng, rate),
                        n_bytes=2 * rng.randint(0, 255))


def _always(point: str, effect: str):
    def make(rng: random.Random, rate: float) -> FaultRule:
        return FaultRule.always(point, effect)
    return make


_SWARM = {
    "csr_rejected": _code_from("set_csr", [CalrtCode.NOT_FOUND, CalrtCode.INVALID_VALUE]),
    "submit_busy": _code_from("infer", [CalrtCode.DEVICE_BUSY]),
    "submit_unavailable": _code_from("infer", [CalrtCode.DEVICE_UNAVAILABLE]),
    "submit_code": _code_from("infer", [CalrtCode.UNEXPECTED, CalrtCode.MAP_BROKEN,
                                        CalrtCode.DEVICE_CRASHED, CalrtCode.UNKNOWN]),
    "wait_timeout": _code_from("wait", [CalrtCode.TIMEOUT]),
    "wait_code": _code_from("wait", [CalrtCode.UNEXPECTED, CalrtCode.DEVICE_CRASHED,
                                     CalrtCode.MAP_BROKEN]),
    "ccu_exception": _periodic("infer", "ccu_exception"),
    "short_output": _short,
    "nan": _periodic("infer", "nan"),
    "inf": _periodic("infer", "inf"),
    "hang": _periodic("infer", "hang"),
    "stale": _periodic("infer", "stale"),
    "kv_can_allocate_false": _periodic("kv_can_allocate", "refuse"),
    "kv_apply_false": _periodic("kv_apply", "refuse"),
    "reset_fails": _code_from("reset", [CalrtCode.SOFT_RESET_FAILED,
                                        CalrtCode.HARD_RESET_FAILED]),
    "kv_can_allocate_always_false": _always("kv_can_allocate", "refuse"),
    "row_ccu_exception": _periodic("infer", "row_ccu_exception"),
}

#: kinds :meth:`FaultPlan.swarm` draws from by default ("always false" KV admission stalls
#: every job, so it is opt-in through ``kinds``; a row fault only means something on a
#: batch calbin: :data:`BATCH_SWARM_KINDS`)
SWARM_KINDS: tuple[str, ...] = tuple(k for k in _SWARM if k not in (
    "kv_can_allocate_always_false", "row_ccu_exception"))
#: the default kinds and the row fault of a batch job (a batch calbin's swarm)
BATCH_SWARM_KINDS: tuple[str, ...] = (*SWARM_KINDS, "row_ccu_exception")

