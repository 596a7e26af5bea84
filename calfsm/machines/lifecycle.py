"""The device lifecycle machine: whether the executor may take traffic (spec section 9.2).

Start-up: ``Unconfigured -> Configuring -> Warming -> Ready``. Recovery after a device
fault: ``Ready -> Draining -> Recovering -> Configuring -> Warming -> Ready``; recovery
bumps the generation and runs a golden prefill+decode in Warming before taking traffic.
A model switch drains and reconfigures after a configuration (or full) reset, without
going through Recovering (``Draining -> Configuring``); if
the new artifact fails to configure or warm, ``rollback`` returns to Configuring with the
last known-good model (guard ``has_known_good``). A bring-up that fails for a device
reason goes back to Recovering (``retry``) for another reset, a bounded number of times
(``RecoveryPolicy.max_attempts``). Any non-terminal state may go to
``Failed`` (with a reason; a supervisor restarts the process) or, on shutdown, ``Closed``.
Only ``Ready`` admits new work.
"""

from __future__ import annotations

import enum

from transitions import EventData

from calfsm.machines._declared import DeclaredMachine

__all__ = ["LIFECYCLE_MACHINE", "MOVING", "LifecycleState", "has_known_good"]


class LifecycleState(enum.StrEnum):
    UNCONFIGURED = "Unconfigured"
    CONFIGURING = "Configuring"
    WARMING = "Warming"
    READY = "Ready"
    DRAINING = "Draining"
    RECOVERING = "Recovering"
    FAILED = "Failed"
    CLOSED = "Closed"


def has_known_good(event: EventData) -> bool:
    """Guard of ``rollback``: there is a generation that warmed up successfully before."""
    return getattr(event.model, "known_good", None) is not None


L = LifecycleState
LIVE = [L.UNCONFIGURED, L.CONFIGURING, L.WARMING, L.READY, L.DRAINING, L.RECOVERING]
#: the live states the lifecycle leaves on its own (a drain, a reset, a bring-up or a
#: model switch under way: their procedures hold slots and run jobs of their own)
MOVING = frozenset(LIVE) - {L.UNCONFIGURED, L.READY}

TRANSITIONS = [
    {"trigger": "start", "source": L.UNCONFIGURED, "dest": L.CONFIGURING},
    {"trigger": "configured", "source": L.CONFIGURING, "dest": L.WARMING},
    {"trigger": "warmed", "source": L.WARMING, "dest": L.READY},
    {"trigger": "drain", "source": L.READY, "dest": L.DRAINING},
    {"trigger": "reset", "source": L.DRAINING, "dest": L.RECOVERING},
    {"trigger": "reconfigure", "source": [L.DRAINING, L.RECOVERING], "dest": L.CONFIGURING},
    {"trigger": "rollback", "source": [L.CONFIGURING, L.WARMING], "dest": L.CONFIGURING,
     "conditions": [has_known_good]},
    {"trigger": "retry", "source": [L.CONFIGURING, L.WARMING], "dest": L.RECOVERING},
    {"trigger": "fail", "source": LIVE, "dest": L.FAILED},
    {"trigger": "close", "source": LIVE, "dest": L.CLOSED},
]

LIFECYCLE_MACHINE = DeclaredMachine(
    "lifecycle", [s.value for s in LifecycleState], TRANSITIONS, initial=L.UNCONFIGURED,
    terminal=[L.FAILED, L.CLOSED])
