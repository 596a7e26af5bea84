"""The module paths calfsm had before its folders drew its layers, kept importable.

``calfsm.sampling`` is now :mod:`calfsm.generate.sampling`, ``calfsm.metrics``
:mod:`calfsm.telemetry.metrics`, and so on (docs/architecture.md, "The layout"). Code
written against the old paths goes on working: importing one imports the module where
it lives now and binds it under the old name too, so both names are the same module
object (one set of globals, one ``isinstance`` identity). Nothing in calfsm imports an
old path; new code should use the new ones.
"""

from __future__ import annotations

import importlib
import sys
from importlib.machinery import ModuleSpec
from types import ModuleType

__all__ = ["MOVED", "install"]

#: old module (under ``calfsm.``) -> where it lives now
MOVED = {
    "admission": "engine.admission",
    "batching": "plan.batching",
    "batchjob": "engine.batchrows",
    "boundedio": "util.boundedio",
    "buffers": "engine.buffers",
    "capabilities": "plan.capabilities",
    "capabilities_cli": "tools.capabilities_cli",
    "capacity": "generate.livestreams",
    "cli": "tools.cli",
    "completion": "engine.completion",
    "core": "engine.parts",
    "diagrams": "tools.diagrams",
    "direct": "tools.direct",
    "doorbell": "runtime.doorbell",
    "dump": "telemetry.dump",
    "epoch": "engine.epoch",
    "errortable": "tools.errortable",
    "flow": "generate.flow",
    "inflight": "plan.inflight",
    "job": "engine.job",
    "kv": "engine.kv",
    "lazy": "util.lazy",
    "lifecycle": "engine.lifecycle",
    "liverequests": "generate.liverequests",
    "logits": "engine.logits",
    "logprobs": "generate.logprobs",
    "lograte": "util.lograte",
    "metrics": "telemetry.metrics",
    "observe": "engine.observe",
    "outcomes": "engine.outcomes",
    "overlap": "engine.overlap",
    "parked": "engine.parked",
    "pipeline": "engine.pipeline",
    "processors": "generate.processors",
    "promptcache": "generate.promptcache",
    "recovery": "engine.recovery",
    "refmodel": "drivers.refmodel",
    "results": "engine.results",
    "sampling": "generate.sampling",
    "scheduler": "runtime.stepper",
    "service": "engine.stepcost",
    "soak": "tools.soak",
    "soak_gates": "tools.soak_gates",
    "soak_plots": "tools.soak_plots",
    "staging": "engine.readback",
    "stopstrings": "generate.stopstrings",
    "streams": "generate.sequence",
    "submission": "engine.submission",
    "tokenizer": "generate.tokenizer",
    "vendor_runner": "tools.vendor_runner",
    # a module split inside its folder (its old path is public): the sequence module
    # exports the stream module's names too
    "generate.streams": "generate.sequence",
}


class _Alias:
    """A loader that hands out the module at its new path."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """The module was executed under its new name already: keep its own spec (the
        import system set the alias's on it)."""
        module.__spec__ = self.spec


class _MovedFinder:
    """Finds the old paths (a meta path finder; importlib.abc is not imported, to keep
    ``import calfsm`` light)."""

    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> ModuleSpec | None:
        prefix, _, rest = fullname.partition(".")
        if prefix != "calfsm" or rest not in MOVED:
            return None
        new = f"calfsm.{MOVED[rest]}"
        return ModuleSpec(fullname, _Alias(new))


def install() -> None:
    """Let the old paths import (once per process)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
