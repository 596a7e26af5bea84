"""The declared state machines: job, KV transaction, device lifecycle, sequence and
stream flow.

Each is declared once as data (states, transitions, guards) and executed by one shared
``transitions.Machine``; see :mod:`calfsm.machines._declared` for why.
"""

from calfsm.machines._declared import DeclaredMachine, Listener, StateModel
from calfsm.machines.flow import FLOW_MACHINE, FlowState
from calfsm.machines.job import JOB_MACHINE, JobState
from calfsm.machines.kv import KV_MACHINE, KvState
from calfsm.machines.lifecycle import LIFECYCLE_MACHINE, LifecycleState
from calfsm.machines.sequence import SEQUENCE_MACHINE, SequenceState

ALL_MACHINES: tuple[DeclaredMachine, ...] = (JOB_MACHINE, KV_MACHINE, LIFECYCLE_MACHINE,
                                             SEQUENCE_MACHINE, FLOW_MACHINE)

__all__ = [
    "ALL_MACHINES",
    "FLOW_MACHINE",
    "JOB_MACHINE",
    "KV_MACHINE",
    "LIFECYCLE_MACHINE",
    "SEQUENCE_MACHINE",
    "DeclaredMachine",
    "FlowState",
    "JobState",
    "KvState",
    "LifecycleState",
    "Listener",
    "SequenceState",
    "StateModel",
]
