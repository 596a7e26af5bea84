"""The app's first layer: probes ahead of everything, a bound on generation at once.

A supervisor's probe must be answered in milliseconds however busy the server is (a
liveness probe that times out restarts a healthy pod). Everything on the event loop
shares one thread, so the way to keep probes fast is to do as little as possible for
them and to keep the rest of the loop's work bounded:

- ``GET``/``HEAD`` ``/health`` and ``/ready`` are answered here, in plain ASGI, before
  Starlette's middleware and routing and before anything reads a request: one
  ``executor.health()`` and a small JSON body (:mod:`calfsm.serve.probes`). Another
  method on those paths is a 405.
- The generation routes (``/v1/completions``, ``/v1/chat/completions``) are counted from
  arrival to the end of their answer. Past ``limit`` at once the next is answered here,
  at once, with a 429 and a Retry-After (a body built once, nothing read or parsed), so
  a flood of requests costs the loop little more than their HTTP parsing, instead of a
  body read, a JSON parse and an admission check each. The default limit is the
  executor's ``max_sequences``: a request needs a sequence per choice, so one past that
  could not run anyway.

Every other request goes on to the app unchanged.
"""

from __future__ import annotations

from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from calfsm.serve.httperrors import ApiError
from calfsm.serve.probes import ProbeAnswer

__all__ = ["ARRIVAL_KEY", "GENERATION_PATHS", "PROBE_PATHS", "Front"]

#: the scope key of a generation request's arrival (the executor's clock, read here,
#: before anything of it is read): where its TTFT and e2e start, as a client's do
ARRIVAL_KEY = "calfsm.arrival"

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
PROBE_PATHS = ("/health", "/ready")
#: Retry-After of a request refused for the limit: a running request usually ends by then
_BUSY_RETRY_S = 1.0


def _prebuilt(err: ApiError) -> ProbeAnswer:
    headers = tuple((k.encode(), v.encode()) for k, v in err.headers().items())
    return ProbeAnswer(err.status, err.json(), headers)


#: a generation request once shutdown began: another replica may serve it
_CLOSING = _prebuilt(ApiError(503, "the server is shutting down", code="unavailable",
                              retry_after_s=1.0))


class Front:
    """Pure-ASGI middleware (module docstring). ``server`` is the app's state: it has
    ``probe(path) -> ProbeAnswer``, ``closing`` (shutdown began: generation requests
    are a 503 with Retry-After here), ``request_limit`` (None: no limit yet),
    ``refused(reason)`` (counts a refusal made here) and ``now()`` (the executor's clock,
    stamped on a generation request as its arrival)."""

    def __init__(self, app: ASGIApp, server: Any) -> None:
        self.app = app
        self.server = server
        self.in_flight = 0                  # generation requests not yet answered
        self._busy: tuple[int, ProbeAnswer] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = _route_path(scope)
        if path in GENERATION_PATHS:
            if self.server.closing:
                self.server.refused("shutdown")
                await _send(send, _CLOSING, head=False)
                return
            limit = self.server.request_limit
            if limit is not None and self.in_flight >= limit:
                self.server.refused("concurrency")
                await _send(send, self._busy_answer(limit), head=False)
                return
            scope[ARRIVAL_KEY] = self.server.now()
            self.in_flight += 1
            try:
                await self.app(scope, receive, send)
            finally:
                self.in_flight -= 1
            return
        if path in PROBE_PATHS:
            method = scope["method"]
            if method in ("GET", "HEAD"):
                answer = self.server.probe(path)
            else:
                err = ApiError(405, f"{method} is not allowed on {path}")
                answer = ProbeAnswer(405, err.json(), ((b"allow", b"GET, HEAD"),))
            await _send(send, answer, head=method == "HEAD")
            return
        await self.app(scope, receive, send)

    def _busy_answer(self, limit: int) -> ProbeAnswer:
        if self._busy is None or self._busy[0] != limit:
            self._busy = (limit, _prebuilt(ApiError(
                429, f"the server is handling {limit} generation requests, its limit at "
                     "once; retry later", code="resource_exhausted",
                retry_after_s=_BUSY_RETRY_S)))
        return self._busy[1]


def _route_path(scope: Scope) -> str:
    """The path inside this app: the request's path without the root path the app is
    mounted under (which an ASGI path includes)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


async def _send(send: Send, answer: ProbeAnswer, *, head: bool) -> None:
    await send({"type": "http.response.start", "status": answer.status, "headers": [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(answer.body)).encode()), *answer.headers]})
    await send({"type": "http.response.body", "body": b"" if head else answer.body})

