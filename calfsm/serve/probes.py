"""Liveness and readiness, the two questions a supervisor asks, in wall time.

*Liveness* (``GET /health``): is the process alive and the device making progress? A
daemon thread, ``calfsm-liveness``, looks at the jobs on the device
(``executor.on_device()``) every ``poll_s`` and remembers, on ``time.monotonic``, when it
first saw each; a job still on the device ``hang_after_s`` after that means the device
stopped making progress. This holds whatever clock the driver runs on (a hung job on a
virtual clock never ages on it), and it is at most ``poll_s`` late. The answer is also
"not live" when the executor ended ``Failed`` or broken, or never came up: then only a
restart helps. A recovery in progress is live (it is progress), but not ready.

*Readiness* (``GET /ready``): should this replica get traffic now? The lifecycle is
Ready, the pipeline is not broken (``executor.health().ready``, which also runs the
executor's own no-progress watchdog) and admission is open (not closing).

``hang_after_s`` must exceed the longest job the device legitimately runs (a full
prefill of the longest prompt), or a slow prefill reads as a hang.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import attrs

from calfsm.errors import InvalidArgument
from calfsm.executor import DeviceExecutor

__all__ = ["Liveness", "LivenessMonitor", "readiness"]


@attrs.frozen
class Liveness:
    """One liveness answer: live or not, why not, and what was seen."""

    live: bool
    reason: str | None
    oldest_job_s: float          # wall seconds the oldest job on the device has been there
    jobs_on_device: int


class LivenessMonitor:
    """Watches one executor's device for progress in wall time (module docstring)."""

    def __init__(self, executor: DeviceExecutor, *, hang_after_s: float = 5.0,
                 poll_s: float | None = None) -> None:
        if not (isinstance(hang_after_s, int | float) and hang_after_s > 0):
            raise InvalidArgument(f"hang_after_s must be > 0, got {hang_after_s!r}",
                                  stage="config")
        self.executor = executor
        self.hang_after_s = float(hang_after_s)
        self.poll_s = poll_s if poll_s is not None else min(0.25, max(0.01,
                                                                      hang_after_s / 10))
        self._seen: dict[int, float] = {}        # job id -> wall time first seen
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="calfsm-liveness",
                                        daemon=True)
        self._thread.start()

    def _sample(self) -> tuple[float, int]:
        """(age of the oldest job on the device, jobs on the device), in wall time."""
        now = time.monotonic()
        ids = {job.job_id for job in self.executor.on_device()}
        with self._lock:
            seen = {i: self._seen.get(i, now) for i in ids}
            self._seen = seen
        return (now - min(seen.values()) if seen else 0.0), len(seen)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.executor.lifecycle.closing:
                return
            self._sample()

    def check(self) -> Liveness:
        age, n = self._sample()
        ex = self.executor
        health = ex.health()
        if health.broken is not None:
            return Liveness(False, f"executor broken: {health.broken}", age, n)
        if health.state == "Failed":
            return Liveness(False, f"executor failed: {health.reason}", age, n)
        if age > self.hang_after_s:
            return Liveness(False, f"no device progress: a job on the device for "
                                   f"{age:.3f} s (hang_after_s {self.hang_after_s:g})",
                            age, n)
        return Liveness(True, None, age, n)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)


def readiness(executor: DeviceExecutor) -> tuple[bool, dict[str, Any]]:
    """(ready, what the answer shows)."""
    health = executor.health()
    ready = health.ready and not executor.lifecycle.closing
    return ready, {"state": health.state, "generation": health.generation,
                   "reason": health.reason, "inflight": health.inflight,
                   "queue_depth": health.queue_depth}
