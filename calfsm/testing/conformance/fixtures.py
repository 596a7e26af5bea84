"""The fixtures of the driver conformance suite: every test runs once per registered
driver (:func:`calfsm.drivers.driver_names`).

A factory builds a fresh, unconfigured driver from keyword options that every driver
understands: ``faults`` (a :class:`~calfsm.drivers.faults.FaultPlan`), ``kv_capacity``
(token positions), ``latency`` (a :class:`~calfsm.drivers.sim.LatencyModel`) and
``seed``. It calls the class's ``virtual(**options)`` (a driver on a fresh virtual clock)
when the class has one, else the class itself. To add a driver, register it.

A ``conftest.py`` that runs these tests imports the fixtures:
``from calfsm.testing.conformance.fixtures import driver, driver_name, make_driver``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from calfsm.drivers import driver_class, driver_names
from calfsm.drivers.base import Driver

__all__ = ["driver", "driver_name", "factory", "make_driver"]


def factory(name: str) -> Callable[..., Driver]:
    """factory(**options) -> a fresh, unconfigured driver of the one registered as name."""
    cls = driver_class(name)
    return getattr(cls, "virtual", cls)


@pytest.fixture(params=driver_names())
def driver_name(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def make_driver(driver_name: str) -> Iterator[Callable[..., Driver]]:
    """``make_driver(faults=..., kv_capacity=..., latency=..., seed=...)``; every driver
    made is closed after the test."""
    made: list[Driver] = []
    make_one = factory(driver_name)

    def make(**options: Any) -> Driver:
        d = make_one(**options)
        made.append(d)
        return d

    yield make
    for d in made:
        d.close()


@pytest.fixture
def driver(make_driver: Callable[..., Driver]) -> Driver:
    """A fresh driver with default options."""
    return make_driver()
