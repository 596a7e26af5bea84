"""Fault plans: which device call misbehaves, and how — as frozen, serialisable data.

Theory of operation
-------------------
A :class:`FaultPlan` is a tuple of :class:`FaultRule`\\ s. A rule names a *point* (a driver
call: ``"infer"``, ``"wait"``, ``"set_csr"``, ...) and an *effect* (``"code"``, ``"hang"``,
``"nan"``, ...). Both drivers that take a plan — :class:`~calfsm.drivers.sim.SimDriver`
and the native emulator behind ``CalrtDriver`` — apply it with the same counting rules,
so one plan means the same thing on both:

1. A call *reaches* its point when it would otherwise succeed: every argument check of
   ``docs/driver-protocol.md`` passed (``kv_can_allocate``/``kv_apply``: the honest answer
   would be True; ``wait``: the buffer's job is still pending). Calls that fail on their
   own never count and are never replaced.
2. Each rule has an optional filter (:data:`FILTERS` says which point has which):

   - ``seq_id``: at ``infer``/``wait`` the job's :class:`~calfsm.drivers.base.JobTag`
     ``seq_id`` (without a tag: the input buffer's KV sequence); at ``kv_apply`` and
     ``set_kv_seq`` the ``seq`` argument; at ``set_csr``/``slice_tensor``/``map_buffer``
     the KV sequence the input buffer is set to at that moment (none on an output buffer
     or before ``set_kv_seq``: the rule does not match);
   - ``job_id``: the JobTag's ``job_id`` at ``infer``/``wait`` (no tag: no match);
   - ``name``: the CSR or tensor name of ``set_csr``/``map_buffer``/``slice_tensor``.

   A filter at a point that has nothing to match is refused when the rule is built, so a
   rule can never silently not fire. A rule's *match ordinal* counts the calls that
   reached its point and passed its filter: 1, 2, 3, ...
3. A rule fires at match ordinals ``nth, nth + every, nth + 2*every, ...`` (only ``nth``
   when ``every`` is None), at most ``count`` times (None: once without ``every``,
   unlimited with it). :meth:`FaultRule.always` fires on every match.
4. Rules are tried in plan order; the first one that fires decides the call. Every
   rule's match ordinal advances on every matching call whether it fired or not.

Effects by point (:data:`EFFECTS`):

- ``code``: the call returns ``code`` instead and changes nothing (``wait``: time does not
  move either, the job stays pending). Default codes per point are in
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
  time anyway and writes its old output array, but no KV).

:meth:`FaultPlan.swarm` draws random plans swarm-style for soak and property tests.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from calfsm.errors import CalrtCode, InvalidArgument

__all__ = [
    "DEFAULT_CODES",
    "EFFECTS",
    "FILTERS",
    "JOB_EFFECTS",
    "POINTS",
    "SWARM_KINDS",
    "FaultPlan",
    "FaultRule",
]

#: job effects, attached at submit (point ``infer``; ``infer_fixed`` counts as ``infer``)
JOB_EFFECTS = ("ccu_exception", "short_output", "nan", "inf", "hang", "stale")

#: point -> the effects a rule at that point may have
EFFECTS: dict[str, tuple[str, ...]] = {
    "configure": ("code",),
    "create_buffers": ("code",),
    "map_buffer": ("code",),
    "slice_tensor": ("code",),
    "set_csr": ("code",),
    "set_kv_seq": ("code",),
    "infer": ("code", *JOB_EFFECTS),
    "wait": ("code",),
    "kv_can_allocate": ("refuse",),
    "kv_apply": ("refuse",),
    "reset": ("code",),
    "enable_parallel_mode": ("code",),
}
POINTS = tuple(EFFECTS)

#: point -> the filters a rule at that point may use
FILTERS: dict[str, frozenset[str]] = {p: frozenset() for p in POINTS}
FILTERS.update({
    "infer": frozenset({"seq_id", "job_id"}),
    "wait": frozenset({"seq_id", "job_id"}),
    "kv_apply": frozenset({"seq_id"}),
    "set_kv_seq": frozenset({"seq_id"}),
    "set_csr": frozenset({"seq_id", "name"}),
    "slice_tensor": frozenset({"seq_id", "name"}),
    "map_buffer": frozenset({"seq_id", "name"}),
})

#: the code an effect ``code`` returns when the rule does not name one
DEFAULT_CODES: dict[str, int] = {
    "configure": CalrtCode.INVALID_CALBIN,
    "create_buffers": CalrtCode.ALLOC_FAILED,
    "map_buffer": CalrtCode.MAP_BROKEN,
    "slice_tensor": CalrtCode.OUT_OF_RANGE,
    "set_csr": CalrtCode.NOT_FOUND,
    "set_kv_seq": CalrtCode.INVALID_VALUE,
    "infer": CalrtCode.DEVICE_BUSY,
    "wait": CalrtCode.TIMEOUT,
    "reset": CalrtCode.SOFT_RESET_FAILED,
    "enable_parallel_mode": CalrtCode.DEVICE_BUSY,
}

_FIELDS = ("point", "effect", "nth", "every", "count", "seq_id", "job_id", "name", "code",
           "n_bytes", "index")
_INT_FIELDS = ("nth", "every", "count", "seq_id", "job_id", "code", "n_bytes", "index")


def _opt_positive(name: str):
    def check(_inst: Any, _attr: Any, value: int | None) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise InvalidArgument(f"{name}: must be a positive integer or null, got {value!r}",
                                  stage="faults")
    return check


def _opt_int(name: str, minimum: int | None = None):
    def check(_inst: Any, _attr: Any, value: int | None) -> None:
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int) or (
                minimum is not None and value < minimum):
            bound = f" >= {minimum}" if minimum is not None else ""
            raise InvalidArgument(f"{name}: must be an integer{bound} or null, got {value!r}",
                                  stage="faults")
    return check


@attrs.frozen
class FaultRule:
    """One injected misbehaviour. See the module docstring for the exact rules."""

    point: str
    effect: str
    nth: int = attrs.field(default=1, validator=_opt_positive("nth"))
    every: int | None = attrs.field(default=None, validator=_opt_positive("every"))
    count: int | None = attrs.field(default=None, validator=_opt_positive("count"))
    seq_id: int | None = attrs.field(default=None, validator=_opt_int("seq_id", 0))
    job_id: int | None = attrs.field(default=None, validator=_opt_int("job_id"))
    name: str | None = None
    code: int | None = attrs.field(default=None, validator=_opt_int("code", 1))
    n_bytes: int | None = attrs.field(default=None, validator=_opt_int("n_bytes", 0))
    index: int = attrs.field(default=0, validator=_opt_int("index", 0))

    def __attrs_post_init__(self) -> None:
        if self.point not in EFFECTS:
            raise InvalidArgument(f"point: unknown point {self.point!r} (one of "
                                  f"{', '.join(POINTS)})", stage="faults")
        if self.effect not in EFFECTS[self.point]:
            raise InvalidArgument(f"effect: unknown effect {self.effect!r} for point "
                                  f"{self.point!r} (one of {', '.join(EFFECTS[self.point])})",
                                  stage="faults")
        if self.name is not None and not isinstance(self.name, str):
            raise InvalidArgument(f"name: must be a string or null, got {self.name!r}",
                                  stage="faults")
        for f in ("seq_id", "job_id", "name"):
            if getattr(self, f) is not None and f not in FILTERS[self.point]:
                have = ", ".join(sorted(FILTERS[self.point])) or "none"
                raise InvalidArgument(f"{f}: point {self.point!r} has no {f} to match "
                                      f"(its filters: {have})", stage="faults")
        if self.nth is None:
            raise InvalidArgument("nth: must be a positive integer", stage="faults")

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
    def from_json(cls, text: str) -> FaultPlan:
        try:
            data = json.loads(text)
        except ValueError as e:
            raise InvalidArgument(f"fault plan does not parse: {e}", stage="faults") from None
        return cls.from_dict(data)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(self.to_json() + "\n", "utf-8")
        return path

    @classmethod
    def load(cls, path: str | Path) -> FaultPlan:
        try:
            text = Path(path).read_text("utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidArgument(f"cannot read fault plan {str(path)!r}: {e}",
                                  stage="faults") from None
        return cls.from_json(text)

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
}

#: kinds :meth:`FaultPlan.swarm` draws from by default ("always false" KV admission stalls
#: every job, so it is opt-in through ``kinds``)
SWARM_KINDS: tuple[str, ...] = tuple(k for k in _SWARM if k != "kv_can_allocate_always_false")

