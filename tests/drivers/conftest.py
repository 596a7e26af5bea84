"""The conformance fixtures (one run per registered driver) for the suite's modules that
``tests/drivers`` runs from :mod:`calfsm.testing.conformance`."""

from calfsm.testing.conformance.fixtures import driver, driver_name, make_driver

__all__ = ["driver", "driver_name", "make_driver"]
