"""The live requests of one executor, by request id: what ``abort(request_id)`` and
``requests()`` read.

Theory of operation
-------------------
Every stream and every job has a request id, given by the caller (``generate(...,
request_id=...)``, ``Request(..., request_id=...)``, the server's ``X-Request-Id``) or
generated here; an id names one live request at a time (a given id already live is an
:class:`~calfsm.errors.InvalidArgument`). A stream's steps carry the stream's id, so
their errors, log lines and observer events name it, but only the stream is entered
here: aborting it cancels whichever step it has wherever that step is. A job enqueued
on its own is entered as itself. ``n > 1`` streams of one generate share a *parent* id:
each child is ``parent-i``, and aborting the parent aborts every child.

An entry is added when its request is made and dropped when it ends (the stream's end,
the job's handle resolving), so the table holds only live requests; a lookup or an
abort costs a dict access under this module's own lock, which is a leaf: nothing else
is taken while it is held, and a cancel is called after it is released.
"""

from __future__ import annotations

import itertools
import secrets
import threading
from typing import Any, Protocol

import attrs

from calfsm.errors import InvalidArgument
from calfsm.request import MAX_REQUEST_ID, check_request_id

__all__ = ["LiveRequests", "RequestInfo"]


class Live(Protocol):
    """What the table needs of a live stream or job handle."""

    def cancel(self) -> bool: ...

    def describe(self) -> tuple[str, int]:
        """The request's state and its tokens so far."""
        ...


@attrs.frozen
class RequestInfo:
    """One live request: its id, ``"stream"`` or ``"job"``, its state (a stream's flow
    state, a job's state), how long ago it was made (seconds, the executor's clock), the
    tokens it has produced so far (a job: 0 until it ends), and its parent (``n > 1``)."""

    request_id: str
    kind: str
    state: str
    age_s: float
    tokens: int
    parent: str | None = None


@attrs.define
class _Entry:
    kind: str
    what: Live
    created: float
    parent: str | None


class LiveRequests:
    """The table of live requests (see the module docstring)."""

    def __init__(self, clock: Any) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._by_id: dict[str, _Entry] = {}
        self._children: dict[str, list[str]] = {}
        self._prefix = f"req-{secrets.token_hex(3)}-"
        self._n = itertools.count(1)

    def new_id(self) -> str:
        """A fresh id, unique in this executor (not live and never generated before)."""
        while True:
            rid = f"{self._prefix}{next(self._n)}"
            if rid not in self._by_id and rid not in self._children:
                return rid

    def add(self, request_id: str | None, kind: str, what: Live, *,
            parent: str | None = None) -> str:
        """Enter ``what`` under ``request_id`` (None: a new id); returns the id. A given
        id that is live (or a live parent) is refused."""
        if request_id is not None:
            check_request_id(request_id)
        with self._lock:
            rid = request_id if request_id is not None else self.new_id()
            if rid in self._by_id or rid in self._children:
                raise InvalidArgument(f"request id {rid!r} is already live in this "
                                      "executor", stage="request", request_id=rid)
            self._by_id[rid] = _Entry(kind, what, self._clock.now(), parent)
            if parent is not None:
                self._children.setdefault(parent, []).append(rid)
        return rid

    def reserve_parent(self, parent: str | None, n: int) -> tuple[str, list[str]]:
        """A parent id for ``n`` children (None: a new one) and the children's ids,
        checked free; nothing is entered yet."""
        if parent is not None:
            check_request_id(parent)
            if len(parent) + len(f"-{n - 1}") > MAX_REQUEST_ID:
                raise InvalidArgument(
                    f"request_id of {len(parent)} characters leaves no room for the "
                    f"'-{n - 1}' of n={n} choices' ids (at most {MAX_REQUEST_ID} in all)",
                    stage="request")
        with self._lock:
            rid = parent if parent is not None else self.new_id()
            ids = [f"{rid}-{i}" for i in range(n)]
            taken = [x for x in (rid, *ids) if x in self._by_id or x in self._children]
            if taken:
                raise InvalidArgument(f"request id {taken[0]!r} is already live in this "
                                      "executor", stage="request", request_id=rid)
            return rid, ids

    def discard(self, request_id: str, what: Any) -> None:
        """Drop ``request_id`` if it still names ``what`` (idempotent)."""
        with self._lock:
            entry = self._by_id.get(request_id)
            if entry is None or entry.what is not what:
                return
            del self._by_id[request_id]
            parent = entry.parent
            if parent is not None:
                kids = self._children.get(parent)
                if kids is not None:
                    kids.remove(request_id)
                    if not kids:
                        del self._children[parent]

    def is_stream(self, request_id: str | None, seq_id: int) -> bool:
        """Whether ``request_id`` names a live stream on sequence ``seq_id`` (a job of
        that stream carries its id and is not entered on its own)."""
        if request_id is None:
            return False
        entry = self._by_id.get(request_id)
        return entry is not None and entry.kind == "stream" \
            and entry.what.sequence.seq_id == seq_id

    def abort(self, request_id: str) -> bool:
        """Cancel the request (or every child of a parent id); False if nothing live has
        that id or it had already ended."""
        with self._lock:
            entry = self._by_id.get(request_id)
            targets = [entry.what] if entry is not None else [
                self._by_id[k].what for k in self._children.get(request_id, ())]
        cancelled = False
        for what in targets:                 # outside the lock: a cancel takes others
            cancelled = bool(what.cancel()) or cancelled
        return cancelled

    def snapshot(self) -> list[RequestInfo]:
        """Every live request, oldest first."""
        now = self._clock.now()
        with self._lock:
            entries = sorted(self._by_id.items(), key=lambda kv: kv[1].created)
        out = []
        for rid, e in entries:
            state, tokens = e.what.describe()
            out.append(RequestInfo(rid, e.kind, state, max(0.0, now - e.created), tokens,
                                   e.parent))
        return out
