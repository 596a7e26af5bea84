"""Conformance: batch graphs (docs/driver-protocol.md, Batches). Run here from
:mod:`calfsm.testing.conformance.test_batch`, where the tests live (shipped with calfsm,
so a vendor runs them against the installed package)."""

from calfsm.testing.conformance.test_batch import *  # noqa: F403
