"""uvicorn, told to stop, shuts a calfsm app down gracefully *before* it waits for the
connections to close.

How uvicorn stops (``uvicorn/server.py``): SIGINT or SIGTERM calls ``handle_exit``, which
sets ``should_exit`` (a second SIGINT sets ``force_exit``); ``main_loop`` sees it at its
next tick (every 0.1 s) and calls ``shutdown()``, which closes the listening sockets,
asks every connection to close once its response is complete, waits for the
connections up to ``timeout_graceful_shutdown`` (None: for ever), cancels the request
tasks still running (each logged as "Exception in ASGI application" with a traceback,
and answered with a plain-text 500 when nothing was sent yet), and only then sends the
ASGI lifespan shutdown to the app. So an app that begins its graceful shutdown in its
lifespan does so after uvicorn has already waited for its open streams and then cut
them: with streams open that was ~20 s (uvicorn's 10 s, then the executor's close) and
a traceback per request.

:class:`GracefulServer` turns the order round. ``handle_exit`` also marks the app as
shutting down at once (``/ready`` is 503 and new generation requests get a 503 with
Retry-After from the signal on). ``shutdown()`` first runs the app's own
:func:`calfsm.serve.app.shutdown`, while the listener still accepts (a request that
arrives meanwhile gets the 503, not a refused connection): running streams may finish
for ``ServerConfig.shutdown_grace_s``, then the rest are cut (each stream a terminal SSE
error event, each waiting client a JSON 503) and an owned executor is closed; a second
Ctrl-C (``force_exit``) cuts at once. Then uvicorn's own shutdown finds every response
complete, closes the connections at once, and the lifespan shutdown finds the work done.
The process exits within about the grace plus 0.5 s.

An app that is not one of :func:`calfsm.serve.create_app`'s is served as plain uvicorn
would.
"""

from __future__ import annotations

import socket
from types import FrameType
from typing import Any

import uvicorn

from calfsm.serve.app import shutdown

__all__ = ["GracefulServer"]


def _calfsm_state(app: Any) -> Any:
    """The state of an app made by ``create_app``, else None."""
    return getattr(getattr(app, "state", None), "calfsm", None)


class GracefulServer(uvicorn.Server):
    """``uvicorn.Server`` whose shutdown begins with the app's graceful shutdown
    (module docstring). Use it as ``uvicorn.Server``: ``GracefulServer(uvicorn.Config(
    create_app(...), ...)).run()``."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        state = _calfsm_state(self.config.app)
        if state is not None:
            state.closing = True     # a plain store: safe in a signal handler

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if _calfsm_state(self.config.app) is not None:
            await shutdown(self.config.app, force=lambda: self.force_exit)
        await super().shutdown(sockets)
