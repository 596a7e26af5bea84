"""The KV transaction machine: one reservation of KV cache for one job (spec section 7).

``Reserved`` -> ``Submitted`` -> ``Committed`` is the happy path: reserve before the job is
prepared, mark submitted when ``infer()`` succeeded, commit only after the device finished
and the output checked out. ``Reserved`` -> ``RolledBack`` is allowed only while the device
cannot have run the job (nothing submitted, or submit returned a code that proves it did
not run). Once ``infer()`` succeeded, any failure ends in ``Unknown``: calfsm never claims
a rollback it cannot prove, and the coordinator refuses the sequence until it is reset.
A submit whose outcome is ambiguous (e.g. DeviceUnavailable) also goes Reserved ->
Unknown.
"""

from __future__ import annotations

import enum

from calfsm.machines._declared import DeclaredMachine

__all__ = ["KV_MACHINE", "KvState"]


class KvState(enum.StrEnum):
    RESERVED = "Reserved"
    SUBMITTED = "Submitted"
    COMMITTED = "Committed"
    ROLLED_BACK = "RolledBack"
    UNKNOWN = "Unknown"


K = KvState
TRANSITIONS = [
    {"trigger": "mark_submitted", "source": K.RESERVED, "dest": K.SUBMITTED},
    {"trigger": "commit", "source": K.SUBMITTED, "dest": K.COMMITTED},
    {"trigger": "rollback", "source": K.RESERVED, "dest": K.ROLLED_BACK},
    {"trigger": "mark_unknown", "source": [K.RESERVED, K.SUBMITTED], "dest": K.UNKNOWN},
]

KV_MACHINE = DeclaredMachine(
    "kv", [s.value for s in KvState], TRANSITIONS, initial=K.RESERVED,
    terminal=[K.COMMITTED, K.ROLLED_BACK, K.UNKNOWN])
