"""The thread primitives the engine is built with (:class:`calfsm.engine.sync.Sync`).

One implementation for both runtimes: in step mode a test's scheduler drives the steps,
but callers still come in from their own threads and ``asyncio.to_thread``, so the
engine's state keeps real locks there too. The factories are the C-level ``threading``
ones, called directly: a lock taken on every token costs no Python frame more than
before the engine stopped naming them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from calfsm.util.lazy import asyncio_module

__all__ = ["THREADS", "ThreadSync"]


class ThreadSync:
    """:class:`calfsm.engine.sync.Sync` over ``threading`` and asyncio."""

    __slots__ = ()

    lock = staticmethod(threading.Lock)
    rlock = staticmethod(threading.RLock)

    @staticmethod
    def holds(rlock: Any) -> bool:
        return rlock._is_owned()

    @staticmethod
    def wait_latch(latch: Any, timeout: float | None) -> bool:
        if timeout is None:
            got = latch.acquire()
        elif timeout > 0:
            got = latch.acquire(True, timeout)
        else:
            got = latch.acquire(False)
        if got:
            latch.release()             # the next waiter, if any, passes too
        return got

    @staticmethod
    def when_released(on_release: Callable[[Callable[[Any], None]], None]) -> Any:
        loop = asyncio_module().get_running_loop()
        fut = loop.create_future()

        def transfer(_: Any) -> None:
            loop.call_soon_threadsafe(_settle, fut)

        on_release(transfer)
        return fut


def _settle(fut: Any) -> None:
    if not fut.done():
        fut.set_result(None)


#: the one instance both runtimes build the engine with
THREADS = ThreadSync()
