"""Conformance: same seed and plan -> the same behaviour and trace; swarm plans per seed.
Run here from :mod:`calfsm.testing.conformance.test_determinism`, where the tests live
(shipped with calfsm, so a vendor runs them against the installed package)."""

from calfsm.testing.conformance.test_determinism import *  # noqa: F403
