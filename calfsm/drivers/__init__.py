"""Device drivers. ``load_driver(name, **kwargs)`` builds one by name, importing it lazily
(the cffi driver needs the native library; the simulated one needs nothing)."""

from __future__ import annotations

import importlib
from typing import Any

from calfsm.drivers.base import (
    Calbin,
    Capabilities,
    Driver,
    EngineSlot,
    JobTag,
    OutputStatus,
    ResetKind,
)
from calfsm.errors import InvalidArgument

#: driver name -> (module, class)
BACKENDS: dict[str, tuple[str, str]] = {
    "sim": ("calfsm.drivers.sim", "SimDriver"),
    "calrt": ("calfsm.drivers.calrt", "CalrtDriver"),
}


def load_driver(name: str, **kwargs: Any) -> Driver:
    """Instantiate the driver registered as ``name``."""
    try:
        module, cls = BACKENDS[name]
    except KeyError:
        raise InvalidArgument(f"unknown driver {name!r} (have {sorted(BACKENDS)})",
                              stage="driver") from None
    return getattr(importlib.import_module(module), cls)(**kwargs)


__all__ = ["BACKENDS", "Calbin", "Capabilities", "Driver", "EngineSlot", "JobTag",
           "OutputStatus", "ResetKind", "load_driver"]
