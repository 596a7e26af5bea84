"""A stream's flow: the one owner of everything about its next step.

Theory of operation
-------------------
A :class:`~calfsm.generate.stream.Stream` is the consumer's face (events, result, cancel); its
:class:`Flow` holds what the next device step needs and nothing else: the step in flight
and the position its token goes to, the successor prepared ahead while it runs (overlap
scheduling: a slot leased, inputs written, the token a placeholder), the two logits rows
the steps alternate between, the replay check and the resume budget. Its life is the
declared flow machine (:mod:`calfsm.machines.flow`): Prefilling, Decoding, Staged,
Resuming, Ended.

The rule that keeps slots from leaking or wedging: a successor is prepared only behind a
live step that holds its own slot (a step that already ended, e.g. failed before the
stream replays, has nothing to stage behind: the replay's prefill could wait for the very
slot staged here), and for the position the step in flight will fill, once. Every way a
flow stops going on (it is lost to a reset, or it ends for any reason) goes through one
place, :meth:`Flow._drop_staged`, that hands the prepared step back.

The flow is driven by its stream from job completions; it shares the stream's lock (one
lock per stream: the stream's events and the flow's step change together).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

import numpy as np

from calfsm.engine.job import JobHandle
from calfsm.errors import CalfsmError, Unavailable
from calfsm.machines.flow import FLOW_MACHINE, FlowState
from calfsm.machines.job import JobState
from calfsm.manifest import TaskKind
from calfsm.request import Request

__all__ = ["Flow", "FlowPort"]

_fire = FLOW_MACHINE.fire
_F = FlowState


class FlowPort(Protocol):
    """What a flow needs to prepare a step ahead and hand it back (its sequence offers
    it, over the executor's core)."""

    def stage(self, request: Request) -> JobHandle | None: ...

    def discard(self, staged: JobHandle) -> None: ...

    def defer(self, fn: Callable[[], None]) -> None: ...


class Flow:
    """The next step of one stream (see the module docstring)."""

    def __init__(self, port: FlowPort, lock: threading.Condition, *, seq_id: int,
                 vocab: int, resume: bool, max_resumes: int) -> None:
        self.state: str = FLOW_MACHINE.initial
        self.seq_id = seq_id
        self._port = port
        self._lock = lock
        self._vocab = vocab
        # two logits rows: the step on the device writes one while the next is staged
        # with the other (a row is the sampler's to consume until its step's token is out)
        self._rows: tuple[np.ndarray, np.ndarray] | None = (
            np.empty(vocab, dtype=np.float32), np.empty(vocab, dtype=np.float32))
        self._flip = 0
        #: the step in flight (the last one handed on), None before the first
        self.inflight: JobHandle | None = None
        self.next_pos = -1              # where the token of the step in flight goes
        self._staged: JobHandle | None = None
        self._staged_pos = -1
        #: the highest position whose decode was handed on (staged or the ordinary way):
        #: a step staged for it later would hold a slot nobody will use
        self._handed = -1
        self.resume = resume
        self.max_resumes = max_resumes
        self.resumes = 0
        #: after a replay, the token the replay must reproduce (the last one delivered)
        self.replay_check: int | None = None
        #: the stream will not go on (cancelled, or ending): nothing more is staged. Set
        #: by the stream, holding the lock the two share
        self.stopping = False

    @property
    def ended(self) -> bool:
        return self.state == _F.ENDED

    # ---- rows ----------------------------------------------------------------------
    def row(self) -> np.ndarray:
        """The logits row for the next step (alternating). An ended flow has let its rows
        go: a step that races its end (its token is dropped) gets a row of its own."""
        rows = self._rows
        if rows is None:
            return np.empty(self._vocab, dtype=np.float32)
        self._flip ^= 1
        return rows[self._flip]

    def staged_row(self, staged: JobHandle | None) -> np.ndarray:
        """The row a step writes: the prepared step's own, else the next one."""
        return staged.context.request.target if staged is not None else self.row()

    # ---- the step in flight --------------------------------------------------------
    def handed_on(self, handle: JobHandle, request: Request) -> None:
        """``request`` is the step in flight now (called with the lock held)."""
        self.inflight = handle
        self.next_pos = request.past_len + len(request.tokens)     # its token_count
        if request.kind is TaskKind.DECODE and self.state != _F.ENDED:
            _fire(self, "advance")

    # ---- overlap: the successor prepared ahead -------------------------------------
    def stage_next(self, *, deadline_s: float | None, priority: int,
                   request_id: str | None) -> None:
        """Prepare the decode that will carry the in-flight step's token (its token a
        placeholder; the stream's ``deadline_s`` left, ``priority`` and ``request_id``).
        Runs deferred, off the completion path."""
        with self._lock:
            if self.stopping or self.state not in (_F.PREFILLING, _F.DECODING):
                return
            pos = self.next_pos
            inflight = self.inflight
        # only behind a live step that holds its own slot: a staged step waits for the
        # one before it, so that one must never wait for a slot (no deadlock). A step
        # that already ended (a fault: the stream may replay, whose prefill could wait
        # for the very slot staged here) has nothing to stage behind.
        if inflight is None or inflight.state in (JobState.CREATED, JobState.STAGED) \
                or inflight.done():
            return
        staged = self._port.stage(Request.decode(
            self.seq_id, 0, pos, target=self.row(), deadline_s=deadline_s,
            priority=priority, request_id=request_id))
        if staged is None:
            return
        with self._lock:
            keep = not self.stopping and self.state in (_F.PREFILLING, _F.DECODING) \
                and self.next_pos == pos and self._handed < pos and not self._taken(pos)
            if keep:
                self._staged, self._staged_pos = staged, pos
                _fire(self, "stage")
        if not keep:                     # the step it was for completed meanwhile
            self._port.discard(staged)

    def _taken(self, pos: int) -> bool:
        """The decode at ``pos`` already went the ordinary way."""
        handle = self.inflight
        return handle is not None and handle.context.past_len >= pos

    def take(self, pos: int) -> JobHandle | None:
        """The step prepared for ``pos``, if one was; from here the decode at ``pos`` is
        handed on, so a staging still under way for it discards its step (else that
        step would hold a slot the ordinary job for ``pos`` may be waiting for: the soak
        found two streams' orphaned steps holding both decode slots)."""
        with self._lock:
            staged, self._staged = self._staged, None
            self._handed = max(self._handed, pos)
            ok = staged is not None and self._staged_pos == pos
        if staged is not None and not ok:
            self._port.discard(staged)
        return staged if ok else None

    # ---- breaks: lost, ended -------------------------------------------------------
    def resumable(self, lost: bool, err: CalfsmError) -> bool:
        """Whether the flow replays after ``err`` (``lost``: the sequence's KV is gone)."""
        return self.resume and self.resumes < self.max_resumes and (
            lost or (isinstance(err, Unavailable) and err.retry_after_s is not None))

    def lose(self) -> None:
        """A reset took the sequence's KV: wait to replay (the prepared step goes back)."""
        with self._lock:
            if self.state in (_F.PREFILLING, _F.DECODING, _F.STAGED):
                _fire(self, "lose")
        self._drop_staged()

    def begin_replay(self, delivered: list[int]) -> bool:
        """The replay's prefill goes now: under greedy sampling it must reproduce the last
        token delivered; one resume is spent. False if the flow is not waiting to
        resume (it ended meanwhile)."""
        with self._lock:
            if self.state != _F.RESUMING:
                return False
            _fire(self, "replay")
        self.replay_check = delivered[-1] if delivered else None
        self.resumes += 1
        return True

    def end(self) -> None:
        """The flow goes no further: Ended, the rows let go (a finished stream the caller
        keeps holds its result, not 2 x vocab floats), the prepared step handed back."""
        with self._lock:
            if self.state != _F.ENDED:
                _fire(self, "end")
            self._rows = None
            self.inflight = None
        self._drop_staged()

    def _drop_staged(self) -> None:
        """The one place a prepared step is rolled back when the flow does not go on."""
        with self._lock:
            staged, self._staged = self._staged, None
        if staged is not None:
            self._port.discard(staged)
