"""Conformance: every effect of a FaultPlan, and the counting rules (faults.py). Run here
from :mod:`calfsm.testing.conformance.test_faults`, where the tests live (shipped with
calfsm, so a vendor runs them against the installed package)."""

from calfsm.testing.conformance.test_faults import *  # noqa: F403
