"""Clocks: the executor and the drivers read time only through one of these.

A :class:`VirtualClock` makes tests deterministic: nothing sleeps, time moves only when
the party driving the test (a step scheduler, or the simulated device finishing a job)
advances it. :class:`RealClock` is ``time.monotonic`` for the threaded runtime and for
benchmarks with a real-time latency model.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

__all__ = ["Clock", "RealClock", "VirtualClock"]


class Clock(Protocol):
    """Monotonic seconds, and a way to let ``seconds`` pass."""

    virtual: bool

    def now(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class RealClock:
    """Wall-clock monotonic time."""

    virtual = False

    def now(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


class VirtualClock:
    """Deterministic time that only moves when advanced. Thread-safe."""

    virtual = True

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)
        self._lock = threading.Lock()

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError(f"cannot advance a clock by {seconds} s")
        with self._lock:
            self._now += seconds
            return self._now

    def advance_to(self, t: float) -> float:
        """Move to ``t`` if it is in the future; time never goes backwards."""
        with self._lock:
            if t > self._now:
                self._now = t
            return self._now

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            self.advance(seconds)

    def __repr__(self) -> str:
        return f"VirtualClock(now={self._now:.6f})"


class SteppedRealClock(RealClock):
    """Real time plus an offset a test moves with :meth:`jump`: threaded code sees time
    pass (a hung wait, a watchdog) without the test sleeping."""

    def __init__(self) -> None:
        self._offset = 0.0

    def now(self) -> float:
        return time.monotonic() + self._offset

    def jump(self, seconds: float) -> None:
        if not seconds >= 0:
            raise ValueError(f"a clock jumps forward only, got {seconds!r}")
        self._offset += seconds
