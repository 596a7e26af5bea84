"""The independent pure-Python oracle of the reference model ships as
:mod:`calfsm.testing.refmodel_pure` (the driver conformance suite checks drivers against
it); re-exported here for calfsm's own tests."""

from calfsm.testing.refmodel_pure import *  # noqa: F403
