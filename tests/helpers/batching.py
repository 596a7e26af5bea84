"""Shared by the batching tests (tests/engine/test_batching.py, the llama.cpp-style API's
in tests/llama/): an executor on the batch calbin tiny-b8, on the simulated device or the
native emulator, whose evidence proves batching, and the rows per decode job it ran."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

from calfsm.clock import RealClock
from calfsm.drivers.calrt import CalrtDriver
from calfsm.drivers.faults import FaultPlan
from calfsm.drivers.sim import LatencyModel, SimDriver
from calfsm.executor import DeviceExecutor, ExecutorConfig
from calfsm.manifest import builtin_manifest
from calfsm.testing.batching import DecodeSteps
from tests.helpers.executor import batching

B8 = builtin_manifest("tiny-b8")
#: threaded mode: a real-time device whose batch step takes a few ms, so the rows of the
#: other streams are queued while one runs
REAL = LatencyModel.fixed(decode_s=0.002, prefill_per_token_s=1e-6, batch_row_share=0.05)


def make_driver(name: str, mode: str, faults: FaultPlan | None = None) -> Any:
    """The simulated device or the native emulator on tiny-b8: a virtual clock in step
    mode, real time with :data:`REAL` in threaded mode."""
    faults = faults or FaultPlan.none()
    if name == "sim":
        kw: dict[str, Any] = {"clock": RealClock(), "latency": REAL} \
            if mode == "threaded" else {}
        return SimDriver(B8, seed=0, faults=faults, **kw)
    if mode == "threaded":
        return CalrtDriver(B8, faults=faults, latency=REAL)
    return CalrtDriver.virtual(manifest_or_calbin=B8, faults=faults,
                               latency=LatencyModel.virtual_default())


def make_batched(mode: str, tmp_path: Path, *, faults: FaultPlan | None = None,
                 evidence: bool = True, device: str = "sim", **config: Any
                 ) -> DeviceExecutor:
    """An executor on tiny-b8 whose evidence proves batching (``evidence=False``: none);
    ``ex.steps_seen`` counts its decode jobs by rows from the end of the warm-up."""
    drv = make_driver(device, mode, faults)
    cfg = batching(tmp_path, drv) if evidence else {"evidence_dir": str(tmp_path)}
    ex = DeviceExecutor(drv, B8, ExecutorConfig(threaded=mode == "threaded", **cfg,
                                                **config))
    ex.steps_seen = log = DecodeSteps()    # type: ignore[attr-defined]
    ex.add_observer(log)
    return ex


def batch_sizes(ex: DeviceExecutor) -> collections.Counter:
    return ex.steps_seen.sizes             # type: ignore[attr-defined]
