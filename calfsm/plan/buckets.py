"""Which shape buckets the executor switches between, and why (issue 36; spec 14).

A manifest may carry several decode graphs (shape buckets, :mod:`calfsm.manifest`). Only
the device can say what a step of each costs and whether a sequence's KV written by one
graph can be continued by another, so the executor switches graphs between steps only
when an evidence file of the step-cost runner (``examples/vendor/step_costs.py``) in the
evidence directory proves both capabilities of :data:`REQUIRED_CAPABILITIES` for this
device, runtime and calbin, and measured every decode graph of the manifest (its
observation :data:`STEP_COSTS`, :func:`step_costs_observation`). It then runs each step
on the cheapest graph that covers it (:class:`~calfsm.engine.shapes.ShapeBuckets`).
Anything short of that keeps one graph, the widest, as a manifest without buckets, with
the reason in :attr:`BucketPlan.note` (``health().notes``, ``calfsm capabilities``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from calfsm.drivers.base import Driver
from calfsm.engine.shapes import GraphCost, ShapeBuckets
from calfsm.manifest import Manifest, SubmodelContract, TaskKind
from calfsm.plan.capabilities import EvidenceStore, device_identity, format_age

__all__ = ["REQUIRED_CAPABILITIES", "STEP_COSTS", "BucketPlan", "graph_cost_record",
           "parse_step_costs", "plan_buckets", "step_costs_observation"]

#: the capabilities switching graphs needs proven (both answered by the step-cost runner)
REQUIRED_CAPABILITIES = ("graph_step_costs", "graph_kv_continuity")
#: the step-cost runner's observation of what each graph's step costs
STEP_COSTS = "step_costs"


@attrs.frozen
class BucketPlan:
    """What the executor switches between: ``buckets`` (None: one graph, the widest, as
    today), ``note`` why not (or None: nothing to say), ``proof`` the evidence behind
    ``buckets``."""

    buckets: ShapeBuckets | None = None
    note: str | None = None
    proof: str | None = None


def graph_cost_record(sub: SubmodelContract, decode_s: Mapping[int, float], *,
                      context_s_per_token: float = 0.0,
                      prefill_s_per_token: float | None = None,
                      context_s: Mapping[int, float] | None = None) -> dict[str, Any]:
    """One graph's entry of the :data:`STEP_COSTS` observation, as the runner writes it:
    its name and key, a step's seconds by rows carried, what a context token adds, a
    prefilled token's seconds (prefill graphs), the raw seconds by context."""
    return {"name": sub.exact_name, "kind": sub.kind.value, "max_batch": sub.max_batch,
            "max_seq": sub.max_seq,
            "decode_s": {str(r): float(s) for r, s in sorted(decode_s.items())},
            "context_s": {str(c): float(s) for c, s in sorted((context_s or {}).items())},
            "context_s_per_token": float(context_s_per_token),
            "prefill_s_per_token": None if prefill_s_per_token is None
            else float(prefill_s_per_token)}


def step_costs_observation(graphs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The :data:`STEP_COSTS` observation: every measured graph's record."""
    return {"graphs": list(graphs)}


def _finite(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be a finite number >= 0, got {value!r}")
    return float(value)


def parse_step_costs(observation: Any) -> dict[str, GraphCost]:
    """The decode graphs' costs of a :data:`STEP_COSTS` observation, by exact name;
    ``ValueError`` naming what is malformed."""
    if not isinstance(observation, Mapping) or not isinstance(observation.get("graphs"),
                                                              list):
        raise ValueError(f"'{STEP_COSTS}' must be an object with a 'graphs' list")
    out: dict[str, GraphCost] = {}
    for i, g in enumerate(observation["graphs"]):
        at = f"{STEP_COSTS}.graphs[{i}]"
        if not isinstance(g, Mapping) or not isinstance(g.get("name"), str):
            raise ValueError(f"{at} needs a 'name'")
        if g.get("kind") != TaskKind.DECODE.value:
            continue
        points = g.get("decode_s")
        if not isinstance(points, Mapping) or not points:
            raise ValueError(f"{at}.decode_s must map rows to seconds")
        try:
            rows = sorted((int(r), _finite(s, f"{at}.decode_s[{r}]"))
                          for r, s in points.items())
        except (TypeError, ValueError) as e:
            raise ValueError(f"{at}.decode_s: {e}") from None
        for key in ("max_batch", "max_seq"):
            if isinstance(g.get(key), bool) or not isinstance(g.get(key), int):
                raise ValueError(f"{at}.{key} must be an integer")
        out[g["name"]] = GraphCost(
            g["name"], g["max_batch"], g["max_seq"], tuple(rows),
            _finite(g.get("context_s_per_token", 0.0), f"{at}.context_s_per_token"))
    return out


def plan_buckets(manifest: Manifest, driver: Driver, *,
                 evidence_dir: str | os.PathLike | None = None) -> BucketPlan:
    """The plan for ``manifest`` on ``driver``, judged on the evidence in
    ``evidence_dir`` (the one rule of :func:`calfsm.plan.capabilities.evidence_dir`)."""
    graphs = manifest.graphs(TaskKind.DECODE)
    if len(graphs) < 2:
        return BucketPlan()
    widest = manifest.submodel(TaskKind.DECODE)
    sizes = "/".join(f"b{g.max_batch}" for g in graphs)

    def one(why: str) -> BucketPlan:
        return BucketPlan(note=f"shape buckets ({len(graphs)} decode graphs, {sizes}): "
                               f"running one, {widest.exact_name}: {why}")

    store = EvidenceStore(evidence_dir)
    device, version = device_identity(driver), driver.version()
    answers = [store.capability(name, device=device, runtime_version=version,
                                calbin_sha256=manifest.calbin_sha256)
               for name in REQUIRED_CAPABILITIES]
    missing = [a for a in answers if not a.proven]
    if missing:
        return one("; ".join(f"{a.name} is {a.level.value}: {a.reason}" for a in missing))
    cost_answer = answers[0]
    assert cost_answer.evidence is not None and cost_answer.path is not None
    try:
        costs = parse_step_costs(cost_answer.evidence.observations.get(STEP_COSTS))
    except ValueError as e:
        return one(f"{cost_answer.path.name} proves graph_step_costs but its "
                   f"observation is malformed: {e}")
    unmeasured = [g.exact_name for g in graphs if g.exact_name not in costs]
    if unmeasured:
        return one(f"{cost_answer.path.name} measured no step of {', '.join(unmeasured)}")
    buckets = ShapeBuckets.of(graphs, {g.exact_name: costs[g.exact_name] for g in graphs})
    files = dict.fromkeys(f"{a.path.name} ({format_age(a.age_s)})" for a in answers
                          if a.path is not None)
    proof = (f"{', '.join(files)} proves {', '.join(REQUIRED_CAPABILITIES)} for {device} "
             f"runtime {version}: {buckets.describe()}")
    return BucketPlan(buckets, proof=proof)
