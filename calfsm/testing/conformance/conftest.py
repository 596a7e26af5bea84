"""Fixtures for ``python -m pytest --pyargs calfsm.testing.conformance``."""

from calfsm.testing.conformance.fixtures import driver, driver_name, make_driver

__all__ = ["driver", "driver_name", "make_driver"]
