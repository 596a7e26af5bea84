"""Model-checking your own ``transitions`` machine with ``calfsm.testing``.

An upload with a retry budget, declared as a plain ``transitions.Machine``:
``idle -> uploading -> verifying -> done``, with ``retry`` back to ``uploading`` while a
guard allows it and ``give_up`` to ``failed``. The first draft has two mistakes a review
easily misses — ``cancel`` leads to a state nothing leaves, and ``done`` still accepts
``retry`` — and :func:`calfsm.testing.explore` finds both without running anything (every
guard is tried both ways). The fixed machine explores clean, and
:func:`calfsm.testing.fuzz_machine` then fires random triggers on a live model (real
guards and callbacks) and checks an invariant after every step: the retry budget is never
overspent.

``python examples/modelcheck_machine.py`` prints both reports and runs the fuzzer; exit
status 0 when the draft's problems are found and the fixed machine passes.
"""

from __future__ import annotations

import sys
import unittest

from hypothesis import settings
from transitions import Machine

from calfsm.testing import explore, fuzz_machine

STATES = ["idle", "uploading", "verifying", "done", "failed", "cancelled"]
TERMINAL = ("done", "failed", "cancelled")
MAX_RETRIES = 3


class Upload:
    """The model: the machine sets ``state``; the callbacks keep the retry count."""

    def __init__(self) -> None:
        self.retries = 0

    def budget_left(self) -> bool:
        return self.retries < MAX_RETRIES

    def count_retry(self) -> None:
        self.retries += 1


def transitions_table(draft: bool) -> list[dict]:
    table = [
        {"trigger": "start", "source": "idle", "dest": "uploading"},
        {"trigger": "sent", "source": "uploading", "dest": "verifying"},
        {"trigger": "verified", "source": "verifying", "dest": "done"},
        {"trigger": "retry", "source": ["uploading", "verifying"], "dest": "uploading",
         "conditions": "budget_left", "after": "count_retry"},
        {"trigger": "give_up", "source": ["uploading", "verifying"], "dest": "failed"},
    ]
    if draft:
        table += [{"trigger": "cancel", "source": "uploading", "dest": "paused"},
                  {"trigger": "retry", "source": "done", "dest": "uploading"}]
    else:
        table += [{"trigger": "cancel", "source": ["idle", "uploading", "verifying"],
                   "dest": "cancelled"}]
    return table


def machine(draft: bool) -> Machine:
    states = STATES + (["paused"] if draft else [])
    return Machine(model=None, states=states, initial="idle", auto_transitions=False,
                   transitions=transitions_table(draft))


def within_budget(model: Upload) -> bool:
    return 0 <= model.retries <= MAX_RETRIES


def main(argv: list[str] | None = None) -> int:
    draft = explore(machine(draft=True), terminal=TERMINAL)
    print("draft:", "; ".join(draft.problems))
    fixed = explore(machine(draft=False), terminal=TERMINAL)
    print("fixed:", "; ".join(fixed.problems) or "no problems")
    print("shortest path to failed:", " -> ".join(fixed.shortest_path("failed")))
    if draft.ok or not fixed.ok:
        return 1
    m = machine(draft=False)

    def new_upload() -> Upload:
        model = Upload()
        m.add_model(model)
        return model

    case = fuzz_machine(m, make_model=new_upload, invariants=[within_budget],
                        terminal=TERMINAL,
                        settings=settings(max_examples=30, stateful_step_count=20,
                                          deadline=None)).TestCase
    result = unittest.TextTestRunner(stream=sys.stdout, verbosity=0).run(
        unittest.defaultTestLoader.loadTestsFromTestCase(case))
    print("fuzz:", "passed" if result.wasSuccessful() else "FAILED")
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
