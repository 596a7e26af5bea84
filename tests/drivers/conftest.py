"""The driver conformance fixture: every test in this folder runs once per driver.

A factory builds a fresh, unconfigured driver from keyword options that every driver
understands: ``faults`` (a :class:`~calfsm.drivers.faults.FaultPlan`), ``kv_capacity``
(token positions), ``latency`` (a :class:`~calfsm.drivers.sim.LatencyModel`) and
``seed``. To add a driver, add one line to :data:`DRIVER_FACTORIES`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from calfsm.drivers.base import Driver
from calfsm.drivers.sim import SimDriver

DriverFactory = Callable[..., Driver]

#: name -> factory(**options) -> a fresh, unconfigured driver
DRIVER_FACTORIES: dict[str, DriverFactory] = {
    "sim": lambda **kw: SimDriver(**kw),
    "calrt": lambda **kw: __import__("calfsm.drivers.calrt").drivers.calrt.CalrtDriver.virtual(**kw),  # noqa: E501
}


@pytest.fixture(params=sorted(DRIVER_FACTORIES))
def driver_name(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def make_driver(driver_name: str) -> Iterator[Callable[..., Driver]]:
    """``make_driver(faults=..., kv_capacity=..., latency=..., seed=...)``; every driver
    made is closed after the test."""
    made: list[Driver] = []

    def make(**options: Any) -> Driver:
        d = DRIVER_FACTORIES[driver_name](**options)
        made.append(d)
        return d

    yield make
    for d in made:
        d.close()


@pytest.fixture
def driver(make_driver: Callable[..., Driver]) -> Driver:
    """A fresh driver with default options."""
    return make_driver()
