"""Conformance: KV manager, device-side checks, queueing, timing, resets. Run here from
:mod:`calfsm.testing.conformance.test_execution`, where the tests live (shipped with
calfsm, so a vendor runs them against the installed package)."""

from calfsm.testing.conformance.test_execution import *  # noqa: F403
