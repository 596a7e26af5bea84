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
The server's shutdown ends within about the grace plus 0.5 s of the signal; it logs how
long it took (``shutdown: done in S s``, at INFO) and keeps it as
:attr:`GracefulServer.shutdown_s`. What the interpreter does after that to exit (its
own finalization) is not the server's, and on a busy machine can take seconds more.

An app that is not one of :func:`calfsm.serve.create_app`'s is served as plain uvicorn
would.
"""

from __future__ import annotations

import logging
import socket
import time
from types import FrameType
from typing import Any

import uvicorn

from calfsm.serve.app import shutdown

__all__ = ["GracefulServer"]

log = logging.getLogger("calfsm.serve")


def _calfsm_state(app: Any) -> Any:
    """The state of an app made by ``create_app``, else None."""
    return getattr(getattr(app, "state", None), "calfsm", None)


class GracefulServer(uvicorn.Server):
    """``uvicorn.Server`` whose shutdown begins with the app's graceful shutdown
    (module docstring). Use it as ``uvicorn.Server``: ``GracefulServer(uvicorn.Config(
    create_app(...), ...)).run()``."""

    #: when the first stop signal was handled (``time.monotonic``), else None
    signalled_at: float | None = None
    #: seconds from the first stop signal (or from the start of the shutdown when none
    #: came) to the end of the shutdown; None until it ended
    shutdown_s: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.signalled_at is None:
            self.signalled_at = time.monotonic()     # plain stores: safe in a handler
        super().handle_exit(sig, frame)
        state = _calfsm_state(self.config.app)
        if state is not None:
            state.closing = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        began = time.monotonic() if self.signalled_at is None else self.signalled_at
        state = _calfsm_state(self.config.app)
        if state is not None:
            await shutdown(self.config.app, force=lambda: self.force_exit)
        await super().shutdown(sockets)
        self.shutdown_s = time.monotonic() - began
        if state is not None:       # the server's own account, apart from process exit
            log.info("shutdown: done in %.2f s (grace %g s)", self.shutdown_s,
                     state.config.shutdown_grace_s)
