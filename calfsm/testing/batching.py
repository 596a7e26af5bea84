"""What tests and benchmarks of batching and shape buckets share: the evidence files the
vendor runners write (so an executor batches, or switches graphs, without running them)
and an observer of the decode steps the device ran, by rows and by graph.

The evidence written here claims what a simulated device does; on a real device the
runners (``examples/vendor/batch_semantics.py``, ``examples/vendor/step_costs.py``)
measure it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from calfsm.manifest import Manifest, TaskKind
from calfsm.plan.batching import MAX_ROWS_OBSERVATION
from calfsm.plan.batching import REQUIRED_CAPABILITIES as BATCH_CAPABILITIES
from calfsm.plan.buckets import REQUIRED_CAPABILITIES as BUCKET_CAPABILITIES
from calfsm.plan.buckets import STEP_COSTS, graph_cost_record, step_costs_observation
from calfsm.plan.capabilities import Evidence, Verdict, device_identity
from calfsm.telemetry.steps import DecodeSteps

__all__ = ["DecodeSteps", "write_batch_evidence", "write_step_costs"]


def write_batch_evidence(directory: str | Path, driver: Any, *, holds: bool = True,
                         max_rows: int = 8, name: str = "batch.json") -> Path:
    """An evidence file for ``driver`` as the batch runner writes it: every batch
    capability holds (or not), ``max_rows`` rows per job seen working."""
    ev = Evidence("batch_semantics", device_identity(driver), driver.version(), "0" * 64,
                  time.time(), {MAX_ROWS_OBSERVATION: max_rows},
                  {c: Verdict(holds, "observed" if holds else "rows mixed up")
                   for c in BATCH_CAPABILITIES})
    path = Path(directory) / name
    path.write_text(ev.to_json(), "utf-8")
    return path


def write_step_costs(directory: str | Path, driver: Any, manifest: Manifest, *,
                     decode_s: float, share: float, continuity: bool = True,
                     costs: bool = True, skip: tuple[str, ...] = (),
                     name: str = "step_costs.json") -> Path:
    """An evidence file as the step-cost runner writes it on a static device: a step of
    graph b costs ``decode_s * (1 + share * (b - 1))`` whatever rows it carries; KV
    continuity holds (or not); graphs in ``skip`` unmeasured."""
    graphs = [graph_cost_record(g, {r: decode_s * (1 + share * (g.max_batch - 1))
                                    for r in sorted({1, g.max_batch})})
              for g in manifest.graphs(TaskKind.DECODE) if g.exact_name not in skip]
    verdicts = dict(zip(BUCKET_CAPABILITIES, (
        Verdict(costs, "measured" if costs else "steps failed"),
        Verdict(continuity, "bit-exact" if continuity else "tokens differ")), strict=True))
    ev = Evidence("step_costs", device_identity(driver), driver.version(),
                  manifest.calbin_sha256, time.time(),
                  {STEP_COSTS: step_costs_observation(graphs)}, verdicts)
    path = Path(directory) / name
    path.write_text(ev.to_json(), "utf-8")
    return path
