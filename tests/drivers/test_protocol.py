"""Conformance: configuration, buffers, bad input and close (driver-protocol.md). Run here
from :mod:`calfsm.testing.conformance.test_protocol`, where the tests live (shipped with
calfsm, so a vendor runs them against the installed package)."""

from calfsm.testing.conformance.test_protocol import *  # noqa: F403
