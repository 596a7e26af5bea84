"""Shared by the tests of the vendor runners (examples/vendor/, not a package): load one
as a module to call its ``main``."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

VENDOR = Path(__file__).resolve().parents[2] / "examples" / "vendor"


def runner(name: str) -> ModuleType:
    """examples/vendor/``name``.py, loaded as the module ``vendor_<name>``."""
    spec = importlib.util.spec_from_file_location(f"vendor_{name}", VENDOR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
