"""Conformance: parallel mode, the in-flight limit, the phased timing and its timeline,
drain, close and resets. Run here from :mod:`calfsm.testing.conformance.test_parallel`,
where the tests live (shipped with calfsm, so a vendor runs them against the installed
package)."""

from calfsm.testing.conformance.test_parallel import *  # noqa: F403
