"""Per-client fair use: one client cannot hold every sequence or fill the server.

A client is its API key when keys are configured, else its remote address
(:func:`calfsm.serve.auth.client_of`). :class:`ClientBooks` keeps two counts per client:

- **streams**: the choices it holds, each a library stream, from ``executor.generate``
  to the stream's end (finished, failed or cancelled, whatever ended it). A request whose
  choices would take the client past ``max_streams`` is a 429 at once;
- **waiting**: its requests that wait for their streams: read, parsed, not yet started
  (a slow upload waits here). Past ``max_waiting`` a request is a 429 before its body is
  read.

Both 429s carry ``Retry-After`` (:data:`RETRY_AFTER_S`): a slot frees when one of the
client's own streams ends, which the server cannot foresee. A request that asks for
more choices than ``max_streams`` could ever hold is a 400 naming ``n`` instead.

The streams are counted from the executor's own events, so no path can leave a count
behind: the books are an :class:`~calfsm.engine.observe.Observer`, and a stream that the
server opens inside :meth:`ClientBooks.opening` is booked to that client in
``stream_started`` (called synchronously inside ``generate``, before any of the stream's
steps can end it) and unbooked in ``stream_ended``, which the executor calls exactly
once for every stream it started. The waiting count is a context manager around the
handler's own code. A client with nothing held leaves no entry behind.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import attrs

from calfsm.engine.observe import Observer
from calfsm.serve.httperrors import ApiError

if TYPE_CHECKING:
    from calfsm.generate.stream import GenerationResult, Stream

__all__ = ["RETRY_AFTER_S", "ClientBooks", "ClientUsage", "default_client_limit"]

#: the Retry-After of a per-client 429
RETRY_AFTER_S = 1.0

#: the client whose streams are being opened on this thread now (inside ``opening``)
_OPENING: contextvars.ContextVar[tuple[str, list[Stream]] | None] = \
    contextvars.ContextVar("calfsm_opening", default=None)


def default_client_limit(max_sequences: int) -> int:
    """The per-client default of both limits: half of the executor's sequences (at least
    one), so one client leaves at least half of the device to the others."""
    return max(1, max_sequences // 2)


@attrs.frozen
class ClientUsage:
    """What one client holds now."""

    streams: int = 0
    waiting: int = 0


class ClientBooks(Observer):
    """The per-client counts and their limits (see the module docstring). Thread-safe:
    ``stream_ended`` comes from the executor's completion side."""

    def __init__(self, max_streams: int, max_waiting: int) -> None:
        self.max_streams = max_streams
        self.max_waiting = max_waiting
        self._lock = threading.Lock()
        self._owner: dict[Stream, str] = {}
        self._streams: dict[str, int] = {}
        self._waiting: dict[str, int] = {}

    # ---- waiting -------------------------------------------------------------------
    @contextlib.contextmanager
    def waiting(self, client: str) -> Iterator[None]:
        """Count one request of ``client`` as waiting for its streams while the block
        runs; 429 at once if it already has ``max_waiting``."""
        with self._lock:
            held = self._waiting.get(client, 0)
            if held >= self.max_waiting:
                raise _limited(f"this client already has {held} requests waiting to "
                               f"start, the most one client may (max_client_waiting)")
            self._waiting[client] = held + 1
        try:
            yield
        finally:
            with self._lock:
                _decrement(self._waiting, client)

    # ---- streams -------------------------------------------------------------------
    @contextlib.contextmanager
    def opening(self, client: str, count: int) -> Iterator[list[Stream]]:
        """Open ``count`` streams for ``client`` in the block (``executor.generate``):
        each one started there is booked to ``client`` until it ends. 429 at once if
        the client would hold more than ``max_streams``; 400 if ``count`` alone is
        more. Yields the streams started so far (to cancel them if the block fails).
        The block must not await: the check and the bookings are then one step of the
        event loop, so two requests of one client cannot both pass the check."""
        if count > self.max_streams:
            raise ApiError(400, f"{count} choices asked for; one client may hold at most "
                                f"{self.max_streams} at once (max_client_streams)",
                           code="invalid_argument", param="n")
        with self._lock:
            held = self._streams.get(client, 0)
        if held + count > self.max_streams:
            raise _limited(f"this client holds {held} streams; {count} more would pass "
                           f"the {self.max_streams} one client may hold at once "
                           "(max_client_streams)")
        started: list[Stream] = []
        token = _OPENING.set((client, started))
        try:
            yield started
        finally:
            _OPENING.reset(token)

    def stream_started(self, stream: Stream) -> None:
        opening = _OPENING.get()
        if opening is not None:
            client, started = opening
            with self._lock:
                self._owner[stream] = client
                self._streams[client] = self._streams.get(client, 0) + 1
            started.append(stream)

    def stream_ended(self, stream: Stream, result: GenerationResult) -> None:
        with self._lock:
            client = self._owner.pop(stream, None)
            if client is not None:
                _decrement(self._streams, client)

    # ---- reading -------------------------------------------------------------------
    def usage(self) -> dict[str, ClientUsage]:
        """Every client that holds something now, and what."""
        with self._lock:
            return {c: ClientUsage(self._streams.get(c, 0), self._waiting.get(c, 0))
                    for c in sorted(self._streams.keys() | self._waiting.keys())}


def _decrement(counts: dict[str, int], client: str) -> None:
    left = counts.get(client, 0) - 1
    if left > 0:
        counts[client] = left
    else:
        counts.pop(client, None)


def _limited(message: str) -> ApiError:
    return ApiError(429, message, code="rate_limit_exceeded", retry_after_s=RETRY_AFTER_S)
