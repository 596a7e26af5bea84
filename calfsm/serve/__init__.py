"""Serving calfsm: an OpenAI-compatible reference server, its probes, and replicas.

``pip install -e ".[server]"`` for the app (Starlette, uvicorn, prometheus-client);
``".[ray]"`` for the Ray Serve deployment. Names are imported on first use, so
``calfsm.serve.realtime`` and ``calfsm serve --help`` work without the extras:

- :func:`create_app`, :class:`ServerConfig` (:mod:`calfsm.serve.app`): the ASGI app, with
  API keys and per-client limits;
- :func:`uvicorn_config`, :class:`ConnectionLimits` (:mod:`calfsm.serve.connections`):
  uvicorn as ``calfsm serve`` runs it, with the slow- and idle-client limits;
- :class:`ByteTokenizer` (:mod:`calfsm.serve.tokenizer`): text <-> token ids;
- :class:`GracefulServer` (:mod:`calfsm.serve.graceful`): uvicorn that shuts the app down
  gracefully on SIGTERM/Ctrl-C;
- :func:`realtime_sim` (:mod:`calfsm.serve.realtime`): the simulated device in real time;
- :func:`ray_deployment` (:mod:`calfsm.serve.ray_serve`): one replica per NPU;
- :func:`routed_deployment` (:mod:`calfsm.serve.ray_route`): the same behind a front that
  sends each prompt to the replica whose prompt cache holds its prefix.

See ``docs/serving.md``.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["ByteTokenizer", "ConnectionLimits", "GracefulServer", "ServerConfig",
           "create_app", "ray_deployment", "realtime_sim", "routed_deployment",
           "uvicorn_config"]

_WHERE = {"create_app": "app", "ServerConfig": "app", "ByteTokenizer": "tokenizer",
          "ConnectionLimits": "connection_limits", "uvicorn_config": "connections",
          "GracefulServer": "graceful", "realtime_sim": "realtime",
          "ray_deployment": "ray_serve", "routed_deployment": "ray_route"}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'calfsm.serve' has no attribute {name!r}")
    return getattr(importlib.import_module(f"calfsm.serve.{_WHERE[name]}"), name)
