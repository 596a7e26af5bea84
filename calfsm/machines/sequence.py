"""The sequence machine: one KV sequence handed out by ``executor.open_sequence()``.

Theory of operation
-------------------
A sequence is ``Open`` between jobs and ``Busy`` while one of its jobs is accepted and
has not ended (a second job on a busy sequence is refused: KV of one sequence is written
by one job at a time). A reset that loses its KV makes it ``Lost``: its next job is
refused (retryable) until it is reset, which starts it over at position 0 (``reset``).
Closing waits for the last job to end — one cancelled after submit included, since the
device still writes its KV — in ``Closing``; then the KV is released and the id goes back
to the allocator: ``Released``, terminal.
"""

from __future__ import annotations

import enum

from calfsm.machines._declared import DeclaredMachine

__all__ = ["SEQUENCE_MACHINE", "SequenceState"]


class SequenceState(enum.StrEnum):
    OPEN = "Open"
    BUSY = "Busy"
    LOST = "Lost"
    CLOSING = "Closing"
    RELEASED = "Released"


S = SequenceState

TRANSITIONS = [
    {"trigger": "start_job", "source": S.OPEN, "dest": S.BUSY},
    {"trigger": "job_ended", "source": S.BUSY, "dest": S.OPEN},
    {"trigger": "lose", "source": [S.OPEN, S.BUSY], "dest": S.LOST},
    {"trigger": "reset", "source": S.LOST, "dest": S.OPEN},
    {"trigger": "close", "source": [S.OPEN, S.BUSY, S.LOST], "dest": S.CLOSING},
    {"trigger": "released", "source": S.CLOSING, "dest": S.RELEASED},
]

SEQUENCE_MACHINE = DeclaredMachine(
    "sequence", [s.value for s in SequenceState], TRANSITIONS, initial=S.OPEN,
    terminal=[S.RELEASED])
