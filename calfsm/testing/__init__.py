"""Testing helpers that ship with calfsm.

- :func:`explore` and :func:`fuzz_machine` (:mod:`calfsm.testing.modelcheck`) model-check
  any ``transitions`` machine; the fuzzer needs hypothesis, imported when it is called.
- :mod:`calfsm.testing.conformance`: the driver conformance suite (needs pytest), run as
  ``python -m pytest --pyargs calfsm.testing.conformance``.
- :mod:`calfsm.testing.refmodel_pure`: the independent pure-Python oracle of the
  reference model that the suite checks drivers against.

Importing this package needs neither pytest nor hypothesis.
"""

from calfsm.testing.modelcheck import Edge, ExplorationReport, MachineLike, explore, fuzz_machine

__all__ = ["Edge", "ExplorationReport", "MachineLike", "explore", "fuzz_machine"]
