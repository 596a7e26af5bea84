"""The one driver registry: name -> driver class, imported only when asked for.

The drivers calfsm ships are :data:`BUILTIN`; other distributions add theirs through the
entry-point group :data:`GROUP` (``calfsm.drivers``), e.g. in their pyproject.toml::

    [project.entry-points."calfsm.drivers"]
    mydevice = "mypackage.driver:MyDriver"

calfsm's own pyproject declares its two drivers in that group too, so
``importlib.metadata.entry_points(group="calfsm.drivers")`` lists every driver an
environment has. Nothing is imported until :func:`driver_class` is asked for a name.
"""

from __future__ import annotations

import importlib
from typing import Any

from calfsm.drivers.base import Driver
from calfsm.errors import InvalidArgument

__all__ = ["BUILTIN", "GROUP", "driver_class", "driver_names", "load_driver"]

#: the entry-point group drivers are registered in
GROUP = "calfsm.drivers"

#: the drivers shipped with calfsm: name -> ``"module:Class"`` (also declared in GROUP by
#: pyproject.toml, so a source tree that was never installed still has them)
BUILTIN: dict[str, str] = {
    "sim": "calfsm.drivers.sim:SimDriver",
    "calrt": "calfsm.drivers.calrt:CalrtDriver",
}


def entry_points(group: str) -> Any:
    """The entry points of ``group``; importlib.metadata is imported at the first call
    (it adds ~15 ms to ``import calfsm``, which seldom asks for a driver by name)."""
    from importlib import metadata
    return metadata.entry_points(group=group)


def _targets() -> dict[str, list[str]]:
    """name -> the distinct ``"module:Class"`` targets registered for it, built-ins first."""
    targets = {name: [target] for name, target in BUILTIN.items()}
    for ep in entry_points(GROUP):
        have = targets.setdefault(ep.name, [])
        if ep.value not in have:
            have.append(ep.value)
    return targets


def driver_names() -> list[str]:
    """The registered driver names, sorted (nothing is imported)."""
    return sorted(_targets())


def driver_class(name: str) -> type[Driver]:
    """The class registered as ``name``, importing its module now.

    Raises :class:`~calfsm.errors.InvalidArgument` naming the known drivers for an unknown
    name; also for a name two distributions register with different targets (never
    resolved by luck of install order) and for a target that does not import."""
    targets = _targets()
    found = targets.get(name) if isinstance(name, str) else None
    if not found:
        raise InvalidArgument(f"driver: unknown driver {name!r} (known: "
                              f"{', '.join(sorted(targets))})", stage="driver")
    if len(found) > 1:
        raise InvalidArgument(f"driver: {name!r} is registered more than once in the "
                              f"entry-point group {GROUP!r}: {', '.join(found)}",
                              stage="driver")
    target = found[0]
    module, _, attr = target.partition(":")
    try:
        cls: Any = importlib.import_module(module)
        for part in attr.split(".") if attr else ():
            cls = getattr(cls, part)
    except (ImportError, AttributeError) as e:
        raise InvalidArgument(f"driver: {name!r} is registered as {target!r}, which does "
                              f"not import: {e}", stage="driver") from None
    if not isinstance(cls, type):
        raise InvalidArgument(f"driver: {name!r} is registered as {target!r}, which is not "
                              "a class", stage="driver")
    return cls


def load_driver(name: str, **kwargs: Any) -> Driver:
    """A new driver of the class registered as ``name``, built with ``kwargs``."""
    return driver_class(name)(**kwargs)
