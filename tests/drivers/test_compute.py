"""Conformance: the device computes the reference model bit for bit (reference-model.md).
Run here from :mod:`calfsm.testing.conformance.test_compute`, where the tests live
(shipped with calfsm, so a vendor runs them against the installed package)."""

from calfsm.testing.conformance.test_compute import *  # noqa: F403
