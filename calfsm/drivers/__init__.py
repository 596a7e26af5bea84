"""Device drivers, found by name in the one registry (:mod:`calfsm.drivers.registry`):
``driver_names()``, ``driver_class(name)`` and ``load_driver(name, **kwargs)``. A driver's
module is imported only when it is asked for (the cffi driver needs the native library;
the simulated one needs nothing)."""

from __future__ import annotations

from calfsm.drivers.base import (
    Calbin,
    Capabilities,
    Driver,
    EngineSlot,
    JobTag,
    OutputStatus,
    ResetKind,
)
from calfsm.drivers.registry import driver_class, driver_names, load_driver

__all__ = ["Calbin", "Capabilities", "Driver", "EngineSlot", "JobTag", "OutputStatus",
           "ResetKind", "driver_class", "driver_names", "load_driver"]
