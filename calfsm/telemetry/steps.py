"""The decode steps the device ran, counted by rows and by graph: what shows whether an
executor batched and on which shape buckets (the soak's report, the batching tests and
benchmarks)."""

from __future__ import annotations

import collections

from calfsm.engine.observe import DeviceStep
from calfsm.manifest import TaskKind

__all__ = ["DecodeSteps"]


class DecodeSteps:
    """The decode jobs the device ran (an observer of ``device_step``): ``sizes``, jobs
    by rows carried; ``steps``, ``rows`` and ``padded`` (rows that carried nothing), by
    graph."""

    def __init__(self) -> None:
        self.sizes: collections.Counter[int] = collections.Counter()
        self.steps: collections.Counter[str] = collections.Counter()
        self.rows: collections.Counter[str] = collections.Counter()
        self.padded: collections.Counter[str] = collections.Counter()

    def device_step(self, step: DeviceStep) -> None:
        if step.kind is TaskKind.DECODE:
            self.sizes[step.rows] += 1
            self.steps[step.graph] += 1
            self.rows[step.graph] += step.rows
            self.padded[step.graph] += step.capacity - step.rows
