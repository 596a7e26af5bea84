"""Shared by the shape-bucket tests: the step-cost runner's evidence as it writes it (a
static device: a graph's step costs its whole batch), an executor on tiny-buckets on
either driver in step or threaded mode, and the graphs its steps ran on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from calfsm.clock import RealClock
from calfsm.drivers.calrt import CalrtDriver
from calfsm.drivers.sim import LatencyModel, SimDriver
from calfsm.executor import DeviceExecutor, ExecutorConfig
from calfsm.manifest import Manifest, builtin_manifest
from calfsm.testing import batching
from calfsm.testing.batching import DecodeSteps, write_batch_evidence

BUCKETS = builtin_manifest("tiny-buckets")
DECODE_S, SHARE = 0.002, 0.05
#: threaded mode: a real-time static device whose steps take a few ms
REAL = LatencyModel.fixed(decode_s=DECODE_S, prefill_per_token_s=1e-6,
                          batch_row_share=SHARE, shape_cost="graph")
VIRTUAL = LatencyModel.fixed(decode_s=0.01, prefill_per_token_s=2e-4, batch_row_share=SHARE,
                             shape_cost="graph")


def write_step_costs(directory: Path, driver: Any, manifest: Manifest = BUCKETS, *,
                     continuity: bool = True, costs: bool = True,
                     skip: tuple[str, ...] = (), name: str = "step_costs.json") -> Path:
    """An evidence file as the step-cost runner writes it on a static device: a step of
    graph b costs ``DECODE_S (1 + SHARE (b - 1))`` whatever rows it carries; KV
    continuity holds (or not); graphs in ``skip`` unmeasured."""
    return batching.write_step_costs(directory, driver, manifest, decode_s=DECODE_S,
                                     share=SHARE, continuity=continuity, costs=costs,
                                     skip=skip, name=name)


def make_driver(device: str, mode: str, inner: Any = None) -> Any:
    """tiny-buckets on the simulated device or the emulator: a virtual clock in step
    mode, real time in threaded mode, a static device's costs either way."""
    if device == "sim":
        if mode == "threaded":
            return SimDriver(BUCKETS, seed=0, clock=RealClock(), latency=REAL)
        return SimDriver(BUCKETS, seed=0, latency=VIRTUAL)
    if mode == "threaded":
        return CalrtDriver(BUCKETS, latency=REAL)
    return CalrtDriver.virtual(manifest_or_calbin=BUCKETS, latency=VIRTUAL)


def make_bucketed(device: str, mode: str, tmp_path: Path, *, evidence: bool = True,
                  max_rows: int = 16, driver: Any = None, **step_costs: Any
                  ) -> DeviceExecutor:
    """An executor on tiny-buckets whose evidence proves batching (``max_rows`` rows) and,
    unless ``evidence=False``, the step costs and KV continuity (``step_costs``: as
    :func:`write_step_costs`); ``ex.graphs`` logs its decode steps by graph."""
    drv = driver if driver is not None else make_driver(device, mode)
    write_batch_evidence(tmp_path, drv, max_rows=max_rows)
    if evidence:
        write_step_costs(tmp_path, drv, **step_costs)
    ex = DeviceExecutor(drv, BUCKETS, ExecutorConfig(threaded=mode == "threaded",
                                                     evidence_dir=str(tmp_path)))
    ex.graphs = log = DecodeSteps()            # type: ignore[attr-defined]
    ex.add_observer(log)
    return ex


def graphs_of(ex: DeviceExecutor) -> DecodeSteps:
    return ex.graphs                        # type: ignore[attr-defined]
