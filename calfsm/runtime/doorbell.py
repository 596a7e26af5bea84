"""Doorbell: the cheapest cross-thread wake-up CPython offers, for the pipeline threads.

Why not a ``threading.Condition``: its ``wait`` and ``notify`` are Python code (a lock
allocated per wait, a waiter list, save/restore of the outer lock). On the executor's
critical path every job crosses two thread boundaries, and on a small VM the code a
thread runs right after waking costs several times its warm time, so the hand-off
itself must be short. A doorbell is one C-level lock used as a binary semaphore:

- ``ring()`` releases it (never blocks; ringing a bell that is already ringing is a
  no-op, so rings coalesce);
- ``wait(timeout)`` acquires it, i.e. sleeps in C, without the GIL, until rung.

It carries no data: the waiter re-checks its queues (under their own lock) after every
wake-up, so a coalesced or early ring is harmless, and a ring between the waiter's
check and its ``wait`` is not lost (the bell stays rung until consumed).
"""

from __future__ import annotations

import threading

__all__ = ["Doorbell"]

_MAX_WAIT_S = min(threading.TIMEOUT_MAX, 3600.0)


class Doorbell:
    """A binary semaphore for "there may be work": ring from anywhere, one waiter."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()                # not rung

    def ring(self) -> None:
        try:
            self._lock.release()
        except RuntimeError:                # already rung: coalesce
            pass

    def wait(self, timeout: float | None = None) -> bool:
        """Sleep until rung or ``timeout`` seconds (None: no limit); True if rung.
        Consumes the ring."""
        if timeout is None:
            return self._lock.acquire(True, _MAX_WAIT_S)
        if timeout <= 0:
            return self._lock.acquire(False)
        return self._lock.acquire(True, min(timeout, _MAX_WAIT_S))
