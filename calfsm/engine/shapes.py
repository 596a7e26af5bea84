"""Shape buckets: which of a kind's compiled graphs a step runs on, by what it costs.

Theory of operation
-------------------
A static calbin computes a graph's whole shape whatever a step carries: a decode graph
compiled for 64 rows costs 64 rows to a lone stream. A manifest may therefore carry
several graphs of one kind (shape buckets, keyed ``(kind, max_batch, max_seq)``:
:mod:`calfsm.manifest`), and each step runs on the cheapest graph that covers its rows
and their longest context (:meth:`ShapeBuckets.choose`). What a graph costs is measured
on the device, never assumed (the step-cost runner ``examples/vendor/step_costs.py``;
:mod:`calfsm.plan.buckets` reads its evidence into a :class:`ShapeBuckets`), and graphs
are switched between steps only where that evidence also proves a sequence's KV written
by one graph is continued bit-exact by another. Without it the executor keeps one graph
(the widest), as a manifest without buckets does.

The records here are plain and immutable: the submitter asks :meth:`ShapeBuckets.choose`
once per step, holding no lock.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Mapping

import attrs

from calfsm.manifest import SubmodelContract

__all__ = ["GraphCost", "ShapeBuckets"]


@attrs.frozen
class GraphCost:
    """What a decode step of one graph costs, as measured: ``decode_s`` the seconds of a
    step by the rows it carries (``(rows, seconds)``, rows ascending, at a short
    context), ``context_s_per_token`` what each token of the longest row's context adds
    (0 on a static graph: it attends over its whole window anyway)."""

    name: str
    max_batch: int
    max_seq: int
    decode_s: tuple[tuple[int, float], ...]
    context_s_per_token: float = 0.0
    #: the measured row counts of ``decode_s`` (derived once: :meth:`step_s` runs for
    #: every graph at every step's choice)
    counts: tuple[int, ...] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "counts", tuple(r for r, _ in self.decode_s))

    def step_s(self, rows: int, context: int = 0) -> float:
        """The expected seconds of a step of ``rows`` rows whose longest context is
        ``context`` tokens: linear between the measured row counts, the nearest beyond
        them."""
        points = self.decode_s
        if not points:
            return float("inf")
        counts = self.counts
        i = bisect.bisect_left(counts, rows)
        if i < len(points) and counts[i] == rows:
            base = points[i][1]
        elif i == 0:
            base = points[0][1]
        elif i == len(points):
            base = points[-1][1]
        else:
            (r0, s0), (r1, s1) = points[i - 1], points[i]
            base = s0 + (s1 - s0) * (rows - r0) / (r1 - r0)
        return base + self.context_s_per_token * max(0, context)


@attrs.frozen
class ShapeBuckets:
    """The decode graphs a step may run on (narrowest first) and what each costs (by
    exact name). One graph: nothing to choose."""

    graphs: tuple[SubmodelContract, ...]
    costs: Mapping[str, GraphCost]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(g.exact_name for g in self.graphs)

    def choose(self, rows: int, context: int, *,
               exclude: Collection[str] = ()) -> SubmodelContract | None:
        """The cheapest graph (not in ``exclude``) that takes ``rows`` rows whose longest
        context is ``context`` tokens; ties go to the narrower. None: no graph covers
        the step."""
        best: SubmodelContract | None = None
        best_s = float("inf")
        for g in self.graphs:
            if g.exact_name in exclude or g.max_batch < rows or g.max_seq < context:
                continue
            cost = self.costs.get(g.exact_name)
            s = cost.step_s(rows, context) if cost is not None else float("inf")
            if best is None or s < best_s:
                best, best_s = g, s
        return best

    def describe(self) -> str:
        """``decode b1 s8192 10.0 ms, b2 ...``: the graphs and their one-row cost."""
        parts = []
        for g in self.graphs:
            c = self.costs.get(g.exact_name)
            full = f"{c.step_s(g.max_batch) * 1e3:.2f} ms full" if c is not None else "?"
            parts.append(f"{g.exact_name} (b{g.max_batch} s{g.max_seq}: {full})")
        return ", ".join(parts)

    @classmethod
    def of(cls, graphs: tuple[SubmodelContract, ...],
           costs: Mapping[str, GraphCost]) -> ShapeBuckets:
        return cls(tuple(sorted(graphs, key=lambda g: (g.max_batch, g.max_seq))), dict(costs))
