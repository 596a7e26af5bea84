"""Scale-out on Ray Serve: one replica per NPU, each its own executor and device.

One executor owns one device; past one device (or one machine) the replicas run on an
engine that already does placement, routing and restarts. :func:`ray_deployment` makes a
Ray Serve deployment whose replica builds an executor with ``build()`` (in the replica's
process, so each gets its own device), serves :func:`~calfsm.serve.create_app` over it,
and asks for one unit of the custom resource ``resource`` ("calculet_npu";
Ray itself reserves "NPU" for Ascend devices): start each Ray node
with as many as it has devices (``ray start --resources '{"calculet_npu": 4}'``) and Ray places at
most that many replicas there. Its ``check_health`` is the app's liveness
(:func:`calfsm.serve.app.liveness`): a device that hung, failed or broke makes Ray kill
the replica and start another, which builds a fresh executor on the device. Nothing here
balances load or places work: Ray's proxy and router do. To send each prompt to the
replica whose prompt cache holds its prefix, see :mod:`calfsm.serve.ray_route`.

Ray pickles ``build`` to send it to the replicas: use a module-level function or a
closure over picklable values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ray import serve

from calfsm.errors import CalfsmError
from calfsm.executor import DeviceExecutor
from calfsm.serve.app import ServerConfig, create_app, liveness

__all__ = ["CalfsmReplica", "ExecutorReplica", "device_deployment", "ray_deployment"]


class ExecutorReplica:
    """What every calfsm replica is (:class:`CalfsmReplica`, and
    :class:`~calfsm.serve.ray_route.CalfsmBackend`): one executor built in the replica's
    process, the reference app over it, its liveness as the health check, the executor
    closed with the replica."""

    def __init__(self, build: Callable[[], DeviceExecutor],
                 config: ServerConfig | None = None) -> None:
        self.executor = build()
        self.asgi = create_app(self.executor, config)

    def check_health(self) -> None:
        live = liveness(self.asgi)
        if not live.live:
            raise RuntimeError(f"calfsm replica not live: {live.reason}")

    def __del__(self) -> None:
        executor = getattr(self, "executor", None)
        if executor is not None:
            try:
                executor.close()
            except CalfsmError:
                pass            # the device did not drain; the process is going anyway


@serve.ingress()
class CalfsmReplica(ExecutorReplica):
    """A Ray Serve replica: one executor, the reference app over it as its HTTP ingress,
    its liveness as the health check."""

    def __serve_build_asgi_app__(self) -> Any:
        return self.asgi


def device_deployment(cls: type, *, name: str, resource: str, num_replicas: int,
                      health_check_period_s: float, health_check_timeout_s: float,
                      num_cpus: float, **options: Any) -> Any:
    """``serve.deployment`` of ``cls`` with one unit of ``resource`` (one device) per
    replica and the health checks' timing (:func:`ray_deployment`'s, and
    :func:`~calfsm.serve.ray_route.routed_deployment`'s backends)."""
    return serve.deployment(
        cls, name=name, num_replicas=num_replicas,
        ray_actor_options={"resources": {resource: 1}, "num_cpus": num_cpus},
        health_check_period_s=health_check_period_s,
        health_check_timeout_s=health_check_timeout_s, **options)


def ray_deployment(build: Callable[[], DeviceExecutor], *,
                   config: ServerConfig | None = None, resource: str = "calculet_npu",
                   num_replicas: int = 1, name: str = "calfsm",
                   health_check_period_s: float = 2.0,
                   health_check_timeout_s: float = 10.0,
                   num_cpus: float = 1.0, **options: Any) -> Any:
    """The bound Ray Serve application of ``num_replicas`` calfsm replicas, each on one
    unit of ``resource``; ``serve.run(ray_deployment(build, num_replicas=2))``. Other
    keyword arguments go to ``serve.deployment`` (e.g. ``max_ongoing_requests``)."""
    deployment = device_deployment(
        CalfsmReplica, name=name, resource=resource, num_replicas=num_replicas,
        health_check_period_s=health_check_period_s,
        health_check_timeout_s=health_check_timeout_s, num_cpus=num_cpus, **options)
    return deployment.bind(build, config)
