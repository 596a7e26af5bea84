"""The conformance suite's helpers, moved to :mod:`calfsm.testing.conformance.util`
(re-exported here for the tests and benchmarks that import them from this path)."""

from calfsm.testing.conformance.util import *  # noqa: F403
