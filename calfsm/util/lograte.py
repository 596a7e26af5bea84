"""Rate-limited logging for events that repeat in a fault storm.

A device that fails every few seconds makes the same warnings over and over: a failed
job, a quarantined slot, a sequence's KV Unknown, a stream resuming, a drain and a
recovery. One line each is right for the first few; thousands of them bury the one that
matters and cost the process (17,000-19,000 lines were seen in a 3.5-minute fault run).
:class:`RateLimitedLog` lets each kind of event (a *key*) through ``burst`` times per
``period_s`` of wall time and counts the rest; the first record of a kind after a
suppressed stretch says how many of that kind were left out, so nothing disappears
without a trace. Every such event is also counted by the executor's metrics, whatever
the log shows.

Wall time, not the driver's clock: this is about what a person reads, and a virtual
clock can run hours ahead in a minute. No executor decision reads it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["RateLimitedLog", "reset"]

_instances: list[RateLimitedLog] = []


def reset() -> None:
    """Forget every limiter's windows (a test suite starts each test afresh)."""
    for limiter in tuple(_instances):
        with limiter._lock:
            limiter._windows.clear()


class RateLimitedLog:
    """``burst`` records per ``period_s`` per key to ``logger``; the rest counted."""

    def __init__(self, logger: logging.Logger, *, burst: int = 10, period_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.burst = burst
        self.period_s = period_s
        self._clock = clock
        self._lock = threading.Lock()
        self._windows: dict[str, list[float]] = {}   # key -> [start, sent, suppressed]
        _instances.append(self)

    def log(self, level: int, key: str, msg: str, *args: Any, **kw: Any) -> bool:
        """Log ``msg % args`` at ``level`` unless ``key`` used up its burst in this
        period; True if it was logged."""
        kw.setdefault("stacklevel", 2)      # the record names the caller, not this module
        return self._log(level, key, msg, args, kw)

    def warning(self, key: str, msg: str, *args: Any, **kw: Any) -> bool:
        kw.setdefault("stacklevel", 2)
        return self._log(logging.WARNING, key, msg, args, kw)

    def _log(self, level: int, key: str, msg: str, args: tuple, kw: dict) -> bool:
        kw["stacklevel"] += 1
        if not self.logger.isEnabledFor(level):
            return False
        now = self._clock()
        with self._lock:
            w = self._windows.get(key)
            if w is None or now - w[0] >= self.period_s:
                left_out = 0 if w is None else int(w[2])
                w = self._windows[key] = [now, 0.0, 0.0]
            else:
                left_out = 0
            if w[1] >= self.burst:
                w[2] += 1
                return False
            w[1] += 1
        if left_out:
            msg = f"{msg} [{left_out} more like this were not logged in the last " \
                  f"{self.period_s:g} s]"
        self.logger.log(level, msg, *args, **kw)
        return True

    def suppressed(self, key: str) -> int:
        """How many records of ``key`` this period has left out so far."""
        with self._lock:
            w = self._windows.get(key)
            return 0 if w is None else int(w[2])
