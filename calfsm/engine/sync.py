"""What the engine needs of whoever runs it: locks, and latches it opens.

The engine is sans-thread: it starts no thread, never waits and names no thread
primitive, yet the runtime's threads (and a caller's own threads, ``asyncio.to_thread``)
call into it at once, so its state needs locks. Whoever builds the engine gives it a
:class:`Sync` (:data:`calfsm.runtime.sync.THREADS`, in both runtimes: step mode is called
from several threads too). The engine takes short lock sections and opens latches; every
wait on something that has not happened yet (a job's end, its admission, a lifecycle
state) is the runtime's: :mod:`calfsm.runtime.waits`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

__all__ = ["Lock", "Sync"]


class Lock(Protocol):
    """A mutual-exclusion lock (``threading.Lock`` and ``RLock`` are ones)."""

    def acquire(self, blocking: bool = ..., timeout: float = ...) -> bool: ...

    def release(self) -> None: ...

    def __enter__(self) -> bool: ...

    def __exit__(self, *exc: object) -> Any: ...


class Sync(Protocol):
    """The locks the engine's state is kept whole with, and the waits on its latches.

    A *latch* is a :meth:`lock` the engine takes when something starts (a job accepted)
    and releases once when it ends: releasing it is the engine's signal, and whoever
    waits for the end waits on it through :meth:`wait_latch`, outside the engine."""

    def lock(self) -> Lock:
        """A new lock (not re-entrant)."""
        ...

    def rlock(self) -> Lock:
        """A new re-entrant lock."""
        ...

    def holds(self, rlock: Lock) -> bool:
        """Whether the calling thread holds ``rlock`` (one of :meth:`rlock`'s)."""
        ...

    def wait_latch(self, latch: Lock, timeout: float | None) -> bool:
        """Block until ``latch`` is released (and leave it released for the next
        waiter); False if ``timeout`` seconds passed first (0: do not block)."""
        ...

    def when_released(self, on_release: Callable[[Callable[[Any], None]], None]
                      ) -> Awaitable[None]:
        """An awaitable for the running event loop that is done once the callback
        handed to ``on_release`` is called, from any thread (``await handle``)."""
        ...
