"""Conformance: every fault point fails exactly the call it names, on its nth reaching call,
narrowed by each filter it has; nothing else changes (faults.FAULT_POINTS). Run here from
:mod:`calfsm.testing.conformance.test_fault_points`, where the tests live (shipped with
calfsm, so a vendor runs them against the installed package)."""

from calfsm.testing.conformance.test_fault_points import *  # noqa: F403
