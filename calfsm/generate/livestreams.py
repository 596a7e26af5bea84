"""The live streams of one executor, and whether one more can finish in time.

Theory of operation
-------------------
A device that runs one step at a time serves its streams in turn: each stream has at
most one step waiting, and a step that completes queues the stream's next one at the
back. So the device is *shared* among the live streams, each getting an equal part of
its time. For that discipline (processor sharing) the finishing times are exact: with
the streams' remaining device work ``w_0 <= w_1 <= ... <= w_{n-1}`` (seconds), stream
``i`` finishes ``sum(w_j for j < i) + (n - i) * w_i`` from now.

:class:`LiveStreams` keeps the executor's streams from start to end. Before a new stream
starts, :meth:`LiveStreams.admit` adds its work (its prefill and up to ``max_tokens``
decode steps, bounded by the context) to the remaining work of the live ones, each
costed with the measured service times (:mod:`calfsm.engine.stepcost`), and checks that every
stream with a deadline — the new one and every one already admitted, which the new one
slows down — still finishes before it, with ``slack`` to spare. If one that would have
been in time without it would be late with it, the stream is refused at once with
:class:`~calfsm.errors.ResourceExhausted` (429) and a Retry-After of when the first live
stream is expected to end: a request that cannot be served in time
is told so now, not timed out later, and admitting it never makes the others late. A
stream whose deadline is too short for its ``max_tokens`` even on an idle device is not
refused on its own account (waiting would not help it): it runs and ends ``deadline``.

The estimate is a model, not a promise: it assumes nothing else uses the device (plain
jobs are not counted) and that the measured service time holds. A running stream's next
steps are never judged again; only a new stream is.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from calfsm.engine.stepcost import ServiceModel
from calfsm.errors import ResourceExhausted
from calfsm.manifest import TaskKind

__all__ = ["LiveStreams", "finish_times", "stream_work_s"]


def stream_work_s(service: ServiceModel, *, prompt_tokens: int, left: int,
                  prefilled: bool) -> float:
    """Device seconds a stream with ``left`` tokens to go still needs at most: its
    prefill (unless done) gives the first of them, each decode one more."""
    if prefilled:
        return left * service.decode_service_s()
    return service.service_s(TaskKind.PREFILL_IDS, prompt_tokens) \
        + max(0, left - 1) * service.decode_service_s()


class Stream(Protocol):
    """What the estimate needs of a stream (:class:`calfsm.generate.stream.Stream` is one)."""

    def remaining_work(self, service: ServiceModel) -> tuple[float, float]: ...

    def abort(self, error: Any) -> bool: ...


def finish_times(work: list[float]) -> list[float]:
    """Seconds from now until each of ``work`` (remaining device seconds of the streams
    sharing the device) is done under processor sharing, in the order given."""
    order = sorted(range(len(work)), key=work.__getitem__)
    out = [0.0] * len(work)
    done = 0.0                   # the work of the streams that finished before
    n = len(work)
    for rank, i in enumerate(order):
        out[i] = done + (n - rank) * work[i]
        done += work[i]
    return out


class LiveStreams:
    """The streams of one executor that have not ended, and the admission estimate."""

    def __init__(self, service: ServiceModel, clock: object, *, slack: float,
                 enabled: bool = True) -> None:
        self._service = service
        self._clock = clock
        self._slack = slack
        self._enabled = enabled
        self._lock = threading.Condition(threading.Lock())
        self._streams: dict[int, Stream] = {}

    def __len__(self) -> int:
        return len(self._streams)

    def live(self) -> list[Stream]:
        """The streams not yet ended, oldest first."""
        with self._lock:
            return list(self._streams.values())

    def add(self, stream: Stream) -> None:
        with self._lock:
            self._streams[id(stream)] = stream

    def remove(self, stream: Stream) -> None:
        with self._lock:
            self._streams.pop(id(stream), None)
            if not self._streams:
                self._lock.notify_all()

    def wait_empty(self, timeout: float | None, drive: Callable[[], bool] | None = None
                   ) -> bool:
        """Block until no stream is live (True) or ``timeout`` wall seconds passed.
        ``drive``: a step-mode executor's one step (False when nothing moved), run
        between the checks instead of sleeping."""
        if drive is None:
            with self._lock:
                return self._lock.wait_for(lambda: not self._streams, timeout)
        end = math.inf if timeout is None else time.monotonic() + timeout
        while self._streams and time.monotonic() < end:
            if not drive():
                break
        return not self._streams

    # ---- the estimate --------------------------------------------------------------
    def admit(self, *, prompt_tokens: int, max_new: int, deadline: float,
              seq_id: int | None = None) -> None:
        """Refuse (ResourceExhausted, 429, with a Retry-After) a new stream of
        ``prompt_tokens`` and up to ``max_new`` tokens if it, or a live stream it would
        slow down, is estimated to miss its deadline (clock time; inf: none)."""
        if not self._enabled:
            return
        svc = self._service
        now = self._clock.now()
        live = self.live()
        work, deadlines = [], []
        for s in live:
            w, dl = s.remaining_work(svc)
            work.append(w)
            deadlines.append(dl)
        new = stream_work_s(svc, prompt_tokens=prompt_tokens, left=max_new, prefilled=False)
        if all(math.isinf(d) for d in deadlines) and math.isinf(deadline):
            return
        slack = self._slack
        before = finish_times(work)
        after = finish_times([*work, new])
        # late because of the new stream: a live one that would have been in time, and
        # the new one itself if it could be in time alone (a deadline too short for
        # max_tokens even on an idle device is the caller's: that stream runs and ends
        # "deadline"; turning it away would not help, and retrying later neither)
        hurt = sum(1 for b, a, dl in zip(before, after, deadlines)
                   if now + slack * a > dl >= now + slack * b)
        own = now + slack * after[-1] > deadline >= now + slack * new
        if not hurt and not own:
            return
        first_end = min(before, default=new)
        who = f"{hurt} running stream(s) of {len(live)}" if hurt else "it"
        raise ResourceExhausted(
            f"the device cannot serve this stream in time: with {len(live)} stream(s) "
            f"live, {who} would miss the deadline (about {sum(work) + new:.3f} s of "
            "device work in all)", stage="capacity", seq_id=seq_id,
            retry_after_s=round(max(0.05, slack * first_end), 3))
