"""Slow, idle and hostile connections: the limits uvicorn runs ``calfsm serve`` with.

:class:`ConnectionLimits` holds them; :func:`uvicorn_config` builds the ``uvicorn.Config``
that applies them. Where uvicorn has a knob it is used: ``timeout_keep_alive`` (an idle
connection between requests) and ``h11_max_incomplete_event_size`` (a backstop on the
bytes h11 buffers). What uvicorn does not offer is :class:`LimitedH11Protocol`, a small
subclass of uvicorn's h11 protocol (h11, not httptools: the pure-Python parser exposes
the state these checks read) that adds, per connection:

- a **header timeout**: from the connection's first moment, or from the first byte of a
  later request, the request line and headers must be complete within
  ``header_timeout_s``, else 408 (if a byte came) and close. One deadline, not reset by
  each byte, so a client sending its headers a byte at a time (slowloris) is cut as
  surely as one that never sends a byte;
- a **body timeout**: the declared body must arrive within ``body_timeout_s`` of the end
  of the headers, else 408 (if no answer was sent yet) and close. A Content-Length
  that lies (a shorter body than declared) holds a connection that long at most; the
  app sees a disconnect and logs the upload as abandoned;
- a **header size limit**: a request line and headers over ``max_header_bytes``, whether
  they come in one read or a byte at a time, are a 431 and close, checked before h11
  parses them (h11 limits only an incomplete head, and uvicorn answers that a 400);
- a **connection limit**: past ``max_connections`` open connections a new one is closed
  at once, before it can hold anything;
- **ambiguous framing closes**: a request with both ``Content-Length`` and
  ``Transfer-Encoding`` is read by its Transfer-Encoding (h11's rule) and answered with
  ``connection: close``, then its connection is closed (RFC 9112 section 6.1: the server
  MUST close it), so no byte after it is read as another request — the two framings
  disagree about where that request begins (request smuggling through a proxy that
  trusts the other header). h11 has no setting for it; uvicorn's own per-request
  ``keep_alive`` (what its graceful shutdown sets) and default headers do the closing.

The keep-alive timeout (``keep_alive_s``, default 75 s) must be *longer* than the idle
expiry of the clients' connection pools. A client reuses a pooled connection it believes
open; if the server closed it in the same instant, the request dies with a connection
error that the client cannot retry safely (a POST). httpx and the ``openai`` client
expire idle connections after 5 s: uvicorn's default keep-alive, also 5 s, made 13 of
31,125 POSTs fail that way. With the server outlasting the pool, the client always
closes first. 75 s is nginx's default and outlasts aiohttp (15 s) and the 60 s idle
timeout of the usual load balancers, so a proxy in front closes first as well. A client
that keeps idle connections longer (Go's default is 90 s) should lower its own expiry.

Timeouts and refusals are a client's doing: they log at DEBUG (uvicorn's own warning for
a malformed request too, through :class:`ClientErrorsAtDebug`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any, ClassVar

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from calfsm.serve.connection_limits import ConnectionLimits
from calfsm.serve.httperrors import error_body

__all__ = ["ClientErrorsAtDebug", "ConnectionLimits", "LimitedH11Protocol",
           "uvicorn_config"]

log = logging.getLogger("calfsm.serve.connections")

#: what h11 may buffer past max_header_bytes before its own 400 (a backstop: the
#: protocol's 431 comes first)
_H11_SLACK = 1 << 20
#: the blank line after the headers (h11 accepts a bare LF as a line end too)
_HEAD_END = re.compile(rb"\n\r?\n")
_CLOSE = (b"connection", b"close")


def _ambiguous_framing(headers: list[tuple[bytes, bytes]]) -> bool:
    """Both a Content-Length and a Transfer-Encoding (names lower-cased, as in an ASGI
    scope)."""
    names = {name for name, _ in headers}
    return b"content-length" in names and b"transfer-encoding" in names


def _error_json(status: int, message: str) -> bytes:
    code = "request_timeout" if status == 408 else "request_header_fields_too_large"
    return json.dumps(error_body(status, message, code=code)).encode()


def _raw_answer(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 answer that closes the connection, for when h11 cannot send one
    (no request was parsed yet)."""
    body = _error_json(status, message)
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the header and body timeouts, the header size limit
    and the connection limit of :attr:`limits` (see the module docstring). Use
    :meth:`with_limits` for a class bound to other limits."""

    limits: ClassVar[ConnectionLimits] = ConnectionLimits()

    @classmethod
    def with_limits(cls, limits: ConnectionLimits) -> type[LimitedH11Protocol]:
        return type("LimitedH11Protocol", (cls,), {"limits": limits})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._phase: str | None = None         # "header" / "body": what the timer waits for

    # ---- the connection ------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            log.debug("closing a connection from %s: %s connections are open already",
                      self._peer(), self.limits.max_connections)
            transport.close()
            return
        self._arm("header")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and self._head_too_big(data):
            return
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        # a pipelined request h11 holds already is parsed in super(): check its head first
        if self.conn.their_state is h11.DONE and not self.transport.is_closing() \
                and self._head_too_big(b""):
            return
        super().on_response_complete()
        self._follow()

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        cycle = self.cycle
        if cycle is not None and cycle is not before \
                and _ambiguous_framing(cycle.scope["headers"]):
            self._close_after(cycle)

    def _close_after(self, cycle: Any) -> None:
        """A request framed both ways: answered (its body read as chunked), then its
        connection closed; the answer says ``connection: close``."""
        log.debug("closing the connection from %s after its answer: the request has both "
                  "Content-Length and Transfer-Encoding", self._peer())
        cycle.keep_alive = False                 # uvicorn closes once the answer is sent
        if not cycle.response_started:
            cycle.default_headers = [*cycle.default_headers, _CLOSE]

    def _head_too_big(self, data: bytes) -> bool:
        """The next request's line and headers — what h11 holds of it plus ``data``, up
        to the blank line that ends them, or all of it if that has not come — are over
        the limit: then 431 and close."""
        held = self.conn.trailing_data[0]
        end = _HEAD_END.search(held + data if held else data)
        size = len(held) + len(data) if end is None else end.end()
        if size <= self.limits.max_header_bytes:
            return False
        log.debug("431 to %s: %s bytes of request line and headers", self._peer(), size)
        self._close_with(_raw_answer(
            431, "Request Header Fields Too Large",
            f"the request headers are over {self.limits.max_header_bytes} bytes"))
        return True

    # ---- which deadline applies ------------------------------------------------------
    def _follow(self) -> None:
        """After h11 has seen new bytes (or begun the next cycle): the deadline for
        what the client must send next, or none while the request is complete."""
        if self.transport.is_closing():
            self._disarm()
            return
        state = self.conn.their_state
        if state is h11.IDLE:
            pending = bool(self.conn.trailing_data[0])
            if pending and self._phase != "header":
                self._arm("header")            # a new request has begun
            elif not pending and self._phase == "body":
                self._disarm()
        elif state is h11.SEND_BODY:
            if self._phase != "body":
                self._arm("body")
        else:                                  # the request is in (or the connection done)
            self._disarm()

    def _arm(self, phase: str) -> None:
        self._disarm()
        wait = self.limits.header_timeout_s if phase == "header" \
            else self.limits.body_timeout_s
        self._phase = phase
        self._deadline = self.loop.call_later(wait, self._expired, phase)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._phase = None, None

    def _expired(self, phase: str) -> None:
        self._deadline, self._phase = None, None
        if self.transport.is_closing():
            return
        if phase == "header":
            got = len(self.conn.trailing_data[0])
            log.debug("closing a connection from %s: no complete request headers within "
                      "%s s (%s bytes came)", self._peer(), self.limits.header_timeout_s,
                      got)
            self._close_with(_raw_answer(
                408, "Request Timeout", "the request headers did not arrive within "
                f"{self.limits.header_timeout_s} s") if got else b"")
            return
        cycle = self.cycle
        log.debug("closing a connection from %s: the request body did not arrive within "
                  "%s s", self._peer(), self.limits.body_timeout_s)
        if cycle is None or cycle.response_started:
            self._close_with(b"")      # answered already (say a 413): only the body is late
            return
        cycle.scope["calfsm.body_timeout"] = True        # type: ignore[typeddict-unknown-key]
        body = _error_json(408, "the request body did not arrive within "
                                f"{self.limits.body_timeout_s} s")
        out = self.conn.send(h11.Response(
            status_code=408, reason=b"Request Timeout",
            headers=[(b"content-type", b"application/json"),
                     (b"content-length", str(len(body)).encode()),
                     (b"connection", b"close")]))
        out += self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage())
        self._close_with(out)

    def _close_with(self, data: bytes) -> None:
        """Write ``data`` (an answer, or nothing) and close; the app, if a request is in
        progress, sees a disconnect and its answer goes nowhere."""
        self._disarm()
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()
        if data:
            self.transport.write(data)
        self.transport.close()

    def _peer(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "?"


class ClientErrorsAtDebug(logging.Filter):
    """On uvicorn's ``uvicorn.error`` logger: its warnings about what a client sent (a
    malformed request, an upgrade nobody serves) become DEBUG records, shown only when
    that logger is enabled for DEBUG. A client's mistake is not the operator's problem."""

    PREFIXES = ("Invalid HTTP request received.", "Unsupported upgrade request.",
                "No supported WebSocket library detected.")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.WARNING and isinstance(record.msg, str) \
                and record.msg.startswith(self.PREFIXES):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


def uvicorn_config(app: Any, limits: ConnectionLimits | None = None,
                   **kwargs: Any) -> uvicorn.Config:
    """A ``uvicorn.Config`` serving ``app`` with ``limits`` (default
    :class:`ConnectionLimits`); ``kwargs`` go to ``uvicorn.Config`` (host, port,
    log_level, ...). Installs :class:`ClientErrorsAtDebug` on ``uvicorn.error``."""
    limits = limits or ConnectionLimits()
    config = uvicorn.Config(
        app, http=LimitedH11Protocol.with_limits(limits), ws="none",
        timeout_keep_alive=limits.keep_alive_s,      # type: ignore[arg-type]
        h11_max_incomplete_event_size=limits.max_header_bytes + _H11_SLACK, **kwargs)
    errors = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, ClientErrorsAtDebug) for f in errors.filters):
        errors.addFilter(ClientErrorsAtDebug())
    return config
