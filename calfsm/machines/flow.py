"""The flow machine: who holds a stream's next step.

Theory of operation
-------------------
A stream's flow (:class:`calfsm.generate.flow.Flow`) is ``Prefilling`` while its prompt's prefill
(or, after a reset, the replay of prompt and tokens) is the step in flight, and
``Decoding`` while a decode is. While a step runs, the flow may prepare its successor
ahead (a slot leased, inputs written, the token a placeholder): ``Staged``. When the step's
token is known the successor is handed on, prepared or the ordinary way (``advance``:
``Decoding``). A step that fails because a reset lost the sequence's KV sends the flow to
``Resuming`` (``lose``, with the prepared step rolled back), where it waits for the device
to be Ready and replays (``replay``: ``Prefilling``). Every end (stop, length, cancel,
deadline, error, shutdown) is one trigger, ``end``, from any live state: ``Ended`` is
terminal, and nothing prepared survives it.
"""

from __future__ import annotations

import enum

from calfsm.machines._declared import DeclaredMachine

__all__ = ["FLOW_MACHINE", "FlowState"]


class FlowState(enum.StrEnum):
    PREFILLING = "Prefilling"
    DECODING = "Decoding"
    STAGED = "Staged"
    RESUMING = "Resuming"
    ENDED = "Ended"


F = FlowState
_LIVE = [F.PREFILLING, F.DECODING, F.STAGED, F.RESUMING]

TRANSITIONS = [
    {"trigger": "stage", "source": [F.PREFILLING, F.DECODING], "dest": F.STAGED},
    {"trigger": "advance", "source": [F.PREFILLING, F.DECODING, F.STAGED],
     "dest": F.DECODING},
    {"trigger": "lose", "source": [F.PREFILLING, F.DECODING, F.STAGED],
     "dest": F.RESUMING},
    {"trigger": "replay", "source": F.RESUMING, "dest": F.PREFILLING},
    {"trigger": "end", "source": _LIVE, "dest": F.ENDED},
]

FLOW_MACHINE = DeclaredMachine(
    "flow", [s.value for s in FlowState], TRANSITIONS, initial=F.PREFILLING,
    terminal=[F.ENDED])
