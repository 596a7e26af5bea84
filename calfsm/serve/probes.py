"""Liveness and readiness, the two questions a supervisor asks, answered by the library.

Both answers come from ``executor.health()`` (``calfsm/executor.py``), which is cheap,
safe from any thread and judged on the driver's clock (wall time on the real-time
simulated device and on a real device):

*Liveness* (``GET /health``): is only a restart going to help? Not live when the executor
ended ``Failed`` or broken, or when a job has been on the device longer than
``ExecutorConfig.hang_after_s`` and its own execution timeout plus the drain's grace
(the executor's own hang recovery did not get the device back); and not live before the
first start-up finished (what a startup probe waits for). Draining and recovering are
progress: live.

*Readiness* (``GET /ready``): should this replica get traffic now? Not while the
lifecycle is not Ready (draining, recovering, switching, failed), while a job has been
on the device past half its execution timeout (a suspected hang), while the pipeline is
broken, nor once shutdown began (the server's or the executor's).

:func:`live_answer` and :func:`ready_answer` build the two HTTP answers; the front of
the app (:mod:`calfsm.serve.front`) sends them before any routing or request parsing,
so a saturated generation path does not delay them.
"""

from __future__ import annotations

import json
import math
from typing import Any

import attrs

from calfsm.config import Health
from calfsm.executor import DeviceExecutor

__all__ = ["Liveness", "ProbeAnswer", "live_answer", "liveness_of", "ready_answer"]


@attrs.frozen
class Liveness:
    """One liveness answer: live or not, why not, and what was seen."""

    live: bool
    reason: str | None
    oldest_job_s: float          # clock seconds the oldest job on the device has been there
    jobs_on_device: int


@attrs.frozen
class ProbeAnswer:
    """An HTTP answer of a probe: status, JSON body, extra headers."""

    status: int
    body: bytes
    headers: tuple[tuple[bytes, bytes], ...] = ()


def liveness_of(health: Health) -> Liveness:
    """The liveness an executor's ``health()`` says."""
    return Liveness(health.live, health.live_reason, health.oldest_job_s, health.inflight)


def _answer(status: int, body: dict[str, Any], retry_after_s: float | None = None
            ) -> ProbeAnswer:
    headers: tuple[tuple[bytes, bytes], ...] = ()
    if retry_after_s is not None:
        headers = ((b"retry-after", str(max(1, math.ceil(retry_after_s))).encode()),)
    return ProbeAnswer(status, json.dumps(body).encode(), headers)


def live_answer(executor: DeviceExecutor | None, not_started: str | None) -> ProbeAnswer:
    """``GET /health``: 200 when live, else 503 with the reason. ``executor`` None: the
    server has none yet, ``not_started`` says why (starting, or its start-up failed)."""
    if executor is None:
        return _answer(503, {"live": False, "reason": not_started or "starting"})
    health = executor.health()
    return _answer(200 if health.live else 503, {
        "live": health.live, "reason": health.live_reason,
        "jobs_on_device": health.inflight, "oldest_job_s": round(health.oldest_job_s, 6),
        "state": health.state, "generation": health.generation})


def ready_answer(executor: DeviceExecutor | None, not_started: str | None, *,
                 closing: bool, start_failed: bool = False) -> ProbeAnswer:
    """``GET /ready``: 200 when ready, else 503 with the reason and, unless only a
    restart helps (Failed, a failed start-up), a Retry-After. ``closing``: the server's
    shutdown began."""
    if executor is None or closing:
        reason = not_started if executor is None else "shutting down"
        return _answer(503, {"ready": False, "reason": reason or "starting"},
                       None if start_failed else 1.0)
    health = executor.health()
    shown = {"ready": health.ready, "state": health.state, "generation": health.generation,
             "reason": health.ready_reason, "hang_suspected": health.hang_suspected,
             "inflight": health.inflight, "queue_depth": health.queue_depth}
    if health.ready:
        return _answer(200, shown)
    final = health.state == "Failed" or not health.live
    return _answer(503, shown, None if final else executor.lifecycle.retry_after_s)
