"""Testing helpers that ship with calfsm.

- :func:`explore` and :func:`fuzz_machine` (:mod:`calfsm.testing.modelcheck`) model-check
  any ``transitions`` machine; the fuzzer needs hypothesis, imported when it is called.
- :mod:`calfsm.testing.conformance`: the driver conformance suite (needs pytest), run as
  ``python -m pytest --pyargs calfsm.testing.conformance``.
- :mod:`calfsm.testing.refmodel_pure`: the independent pure-Python oracle of the
  reference model that the suite checks drivers against.
- :class:`ScriptedTokenizer` (:mod:`calfsm.testing.scripted`): the simulated model's
  output read as a scripted reply (a tool call, an answer), for tests of what reads it.
- :mod:`calfsm.testing.batching`: the batch and step-cost runners' evidence as they write
  it on a simulated device, and an observer of the decode steps by rows and by graph
  (the batching and shape-bucket tests' and benchmarks').

Importing this package needs neither pytest nor hypothesis.
"""

from typing import Any

from calfsm.testing.modelcheck import Edge, ExplorationReport, MachineLike, explore, fuzz_machine

__all__ = ["END", "Edge", "ExplorationReport", "MachineLike", "ScriptedTokenizer", "explore",
           "fuzz_machine"]


def __getattr__(name: str) -> Any:
    """``ScriptedTokenizer`` and ``END`` on first use: importing the package stays as
    light as it was (no tokenizers)."""
    if name in ("END", "ScriptedTokenizer"):
        from calfsm.testing import scripted
        return getattr(scripted, name)
    raise AttributeError(f"module 'calfsm.testing' has no attribute {name!r}")
