"""The blocking waits on the engine's state: the engine records and signals, a caller's
thread waits here (the engine imports no ``threading``: :mod:`calfsm.engine.sync`)."""

from __future__ import annotations

import math
import threading

from calfsm.engine.admission import Admission
from calfsm.engine.job import JobContext, JobHandle
from calfsm.engine.lifecycle import Lifecycle
from calfsm.errors import DeadlineExceeded

__all__ = ["wait_admitted", "wait_for_state"]


def wait_admitted(admission: Admission, job: JobContext, handle: JobHandle) -> None:
    """Block the calling thread until ``job`` has left the admission queue: queued for
    the device, or ended (failed, cancelled, past its admission deadline). A threaded
    ``enqueue`` waits here; the admission step ends every parked job in time."""
    if not admission.admitting(job):
        return                          # admitted at once (the common case), or ended
    left = threading.Event()
    limit = admission.watch_admission(job, handle, left.set)
    if limit is None or left.wait(None if limit == math.inf else limit):
        return
    if not admission.expire_admission(job):
        left.wait()                     # being admitted now: that step ends it


def wait_for_state(life: Lifecycle, states: tuple[str, ...], timeout: float | None) -> str:
    """Block until the lifecycle's state is one of ``states`` and return it;
    DeadlineExceeded on timeout. The lifecycle calls its change listeners after every
    transition and on close, outside its lock: one of them wakes this wait."""
    changed = threading.Condition()
    seen: list[str] = []

    def heard() -> None:
        with changed:
            changed.notify_all()

    def arrived() -> bool:
        state = life.state
        if state in states:
            seen.append(state)
            return True
        return False

    life.on_change(heard)
    try:
        with changed:
            if not changed.wait_for(arrived, timeout):
                raise DeadlineExceeded(
                    f"lifecycle still {life.state} after {timeout} s, wanted "
                    f"{' or '.join(states)}", stage="lifecycle", generation=life.generation)
    finally:
        life.remove_listener(heard)
    return seen[-1]
