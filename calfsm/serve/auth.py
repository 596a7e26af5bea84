"""API keys: Bearer authentication on every route but the probes, and who a client is.

:class:`ApiKeys` holds the keys a server accepts (``calfsm serve --api-key KEY``, several
times for several; or ``CALFSM_API_KEY``, comma-separated; or ``ServerConfig(api_keys=...)``).
:class:`BearerAuth` is the ASGI middleware: a request must carry ``Authorization: Bearer
KEY`` with one of them, else it is answered 401 with an OpenAI body (``code``
``invalid_api_key``, as OpenAI answers) and ``WWW-Authenticate: Bearer``, before the
route runs and before its body is read. ``GET /health`` and ``GET /ready`` stay open: a
supervisor's probe carries no key. ``/metrics`` needs one (a Prometheus scrape config
sets ``authorization: {credentials: KEY}``).

The comparison is in constant time and does not short-circuit: the presented token and
every key are hashed to SHA-256 (so lengths do not show either) and compared with
:func:`hmac.compare_digest` against *every* key, whether or not one matched already.

Who a client is, for the per-client limits (:mod:`calfsm.serve.fairuse`):
:func:`client_of` gives ``key:<8 hex digits>`` (a fingerprint of the key: the key itself
is never logged) when keys are configured, else ``addr:<remote address>`` (uvicorn's
``scope["client"]``, which behind a proxy is the proxy unless ``--forwarded-allow-ips``
trusts it).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from calfsm.errors import InvalidArgument
from calfsm.serve.httperrors import ApiError

__all__ = ["ENV_VAR", "OPEN_PATHS", "ApiKeys", "BearerAuth", "client_of", "fingerprint",
           "keys_from_env"]

log = logging.getLogger("calfsm.serve")

#: the environment variable ``calfsm serve`` reads keys from (comma-separated)
ENV_VAR = "CALFSM_API_KEY"
#: routes answered without a key: the probes
OPEN_PATHS = frozenset({"/health", "/ready"})
_CLIENT = "calfsm.client"           # where the middleware leaves the client's identity


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


def fingerprint(key: str) -> str:
    """How logs and the books name a key: 8 hex digits of a hash, not the key."""
    return "key:" + hashlib.sha256(b"calfsm-client:" + key.encode()).hexdigest()[:8]


class ApiKeys:
    """The accepted keys. A key is 1-512 printable ASCII characters without spaces or
    commas (what a Bearer header and the comma-separated variable can carry)."""

    def __init__(self, keys: Iterable[str], *, source: str = "api_keys") -> None:
        checked = []
        for key in keys:
            if not isinstance(key, str) or not 0 < len(key) <= 512 \
                    or not all("!" <= c <= "~" and c != "," for c in key):
                raise InvalidArgument(
                    f"{source}: an API key must be 1-512 printable ASCII characters "
                    "without spaces or commas", stage="config")
            checked.append(key)
        self._digests = tuple(_digest(k) for k in checked)
        self._names = tuple(fingerprint(k) for k in checked)

    def __len__(self) -> int:
        return len(self._digests)

    def __repr__(self) -> str:
        return f"<ApiKeys: {len(self)}>"

    def match(self, token: str) -> str | None:
        """The fingerprint of the key ``token`` is, or None; constant time (see the
        module docstring)."""
        digest = _digest(token)
        hits = [hmac.compare_digest(digest, k) for k in self._digests]   # every key
        return next((name for name, hit in zip(self._names, hits) if hit), None)


def keys_from_env(environ: dict[str, str] | None = None) -> list[str]:
    """The keys of ``$CALFSM_API_KEY`` (comma-separated; blanks around commas ignored)."""
    value = (os.environ if environ is None else environ).get(ENV_VAR, "")
    return [k.strip() for k in value.split(",") if k.strip()]


def client_of(scope: Scope) -> str:
    """Who sent the request of ``scope``: its key's fingerprint, else its address."""
    name = scope.get(_CLIENT)
    if name:
        return name
    client = scope.get("client")
    return f"addr:{client[0]}" if client else "addr:unknown"


def _route_path(scope: Scope) -> str:
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


class BearerAuth:
    """ASGI middleware: 401 for an HTTP request without one of ``keys`` (see the module
    docstring); a request with one carries its client's fingerprint on."""

    def __init__(self, app: ASGIApp, keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _route_path(scope) in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        token = _bearer(scope)
        name = None if token is None else self.keys.match(token)
        if name is None:
            await self._refuse(scope, send, given=token is not None)
            return
        scope[_CLIENT] = name
        await self.app(scope, receive, send)

    async def _refuse(self, scope: Scope, send: Send, *, given: bool) -> None:
        client = scope.get("client")
        if given:
            message, challenge = "Incorrect API key provided.", \
                'Bearer error="invalid_token"'
        else:
            message, challenge = ("You didn't provide an API key: send it as "
                                  "'Authorization: Bearer KEY'."), "Bearer"
        log.debug("answering 401 to %s: %s", client[0] if client else "?", message)
        err = ApiError(401, message, code="invalid_api_key")
        body = err.json()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", challenge.encode())]})
        await send({"type": "http.response.body", "body": body})


def _bearer(scope: Scope) -> str | None:
    """The token of the request's ``Authorization: Bearer`` header, or None."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").strip().partition(" ")
            token = token.strip()
            return token if scheme.lower() == "bearer" and token else None
    return None
