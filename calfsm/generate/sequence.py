"""Sequences: a KV sequence of an executor, and the ids they are handed out from.

Theory of operation
-------------------
:class:`Sequence` is a KV sequence id handed out by ``executor.open_sequence()`` from the
executor's allocator. It knows its position (how many tokens its KV holds), runs one job
at a time (a second one is refused), and follows the sequence machine
(:mod:`calfsm.machines.sequence`): Open, Busy, Lost (a reset lost its KV), Closing,
Released. Closing waits for its last job to end — one cancelled after submit included —
then releases the KV and gives the id back.

A sequence runs the jobs of the :class:`~calfsm.generate.stream.Stream` it generates
(:meth:`Sequence.generate`); the stream knows it only as a
:class:`~calfsm.generate.stream.StreamSequence`. ``calfsm.generate.streams``, the module
both once were, is this one (calfsm/_moved.py), so its names are exported here too.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

from calfsm.engine.job import JobHandle
from calfsm.engine.kv import SeqState
from calfsm.engine.results import FinishReason, GenerationResult, TokenEvent, Usage
from calfsm.errors import (
    CalfsmError,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from calfsm.generate.front import Front
from calfsm.generate.sampling import SamplingParams
from calfsm.generate.stream import Stream
from calfsm.machines.sequence import SEQUENCE_MACHINE, SequenceState
from calfsm.request import Request
from calfsm.util.lazy import asyncio_module

__all__ = ["FinishReason", "GenerationResult", "Sequence", "SequenceAllocator", "Stream",
           "TokenEvent", "Usage"]

#: one logger for sequences and streams (operators filter by it)
log = logging.getLogger("calfsm.streams")

_fire = SEQUENCE_MACHINE.fire
_fire_if = SEQUENCE_MACHINE.fire_if_declared


class SequenceAllocator:
    """Sequence ids ``0 .. limit-1``, lowest free first; thread-safe."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise InvalidArgument(f"max_sequences must be >= 1, got {limit}",
                                  stage="config")
        self.limit = limit
        self._free = list(range(limit - 1, -1, -1))     # a stack, lowest id on top
        self._lock = threading.Lock()

    def take(self) -> int:
        with self._lock:
            if not self._free:
                raise ResourceExhausted(f"all {self.limit} sequence ids are open",
                                        stage="open_sequence", retry_after_s=0.1)
            return self._free.pop()

    def give_back(self, seq_id: int) -> None:
        with self._lock:
            self._free.append(seq_id)
            self._free.sort(reverse=True)

    @property
    def in_use(self) -> int:
        with self._lock:
            return self.limit - len(self._free)


class Sequence:
    """One KV sequence of an executor: position, one job at a time, release on close.

    Use as a context manager (``with ex.open_sequence() as seq`` or ``async with``)."""

    def __init__(self, front: Front, seq_id: int, allocator: SequenceAllocator) -> None:
        #: what the executor's sequences and streams share (calfsm/generate/front.py)
        self.front = front
        self.seq_id = seq_id
        self._jobs = front.jobs         # the engine's job face: jobs, staging, the epoch
        self._life = front.lifecycle
        self.state: str = SequenceState.OPEN.value
        self._allocator = allocator
        self._lock = threading.Condition(threading.Lock())
        self._position = 0
        self._last: JobHandle | None = None
        #: the job ``_last`` was booked to follow (:meth:`follow`) until it has ended: a
        #: step that fails as it is released ends before the step it follows
        self._prev: JobHandle | None = None
        #: a job is being started (Busy, not yet in ``_last``): close() waits for it
        self._starting = False
        self._settled: JobHandle | None = None      # the last job already booked

    @property
    def position(self) -> int:
        """Tokens the sequence's KV holds: the next token goes at this position."""
        return self._position

    @property
    def last_job(self) -> JobHandle | None:
        """The handle of the sequence's most recent job (None before the first)."""
        return self._last

    # ---- jobs ----------------------------------------------------------------------
    def prefill(self, tokens: Seq[int], **kw: Any) -> JobHandle:
        """A prefill of ``tokens`` after what the sequence holds."""
        return self.run(Request.prefill(self.seq_id, tokens, past_len=self._position, **kw))

    def decode(self, token: int, **kw: Any) -> JobHandle:
        """One decode step of ``token`` at the sequence's position."""
        return self.run(Request.decode(self.seq_id, token, self._position, **kw))

    def run(self, request: Request, *, continuing: bool = False) -> JobHandle:
        """Enqueue ``request`` (of this sequence) without blocking; refused while busy,
        lost or closed. ``continuing``: the next step of a running stream (never refused
        by ``max_waiting``, still admitted during a graceful shutdown)."""
        if request.seq_id != self.seq_id:
            raise InvalidArgument(f"request for sequence {request.seq_id} run on sequence "
                                  f"{self.seq_id}", stage="sequence", seq_id=self.seq_id)
        with self._lock:
            self._settle_finished_locked()
            self._check_lost_locked()
            state = self.state
            if state != SequenceState.OPEN:
                cls = FailedPrecondition
                raise cls(f"sequence {self.seq_id} is {state}"
                          + (": one job at a time" if state == SequenceState.BUSY else ""),
                          stage="sequence", seq_id=self.seq_id)
            _fire(self, "start_job")
            self._starting = True
        try:
            handle = self.front.enqueue_nowait(request, continuing=continuing)
        except BaseException:
            with self._lock:
                _fire_if(self, "job_ended")
                self._started_locked(None)
            raise
        with self._lock:
            self._started_locked(handle)
        handle.add_done_callback(self._job_done)
        return handle

    def _started_locked(self, handle: JobHandle | None) -> None:
        """The job being started is ``_last`` now (or none was): a close() waiting to
        know which job to wait for may go on."""
        if handle is not None:
            self._last = handle
        self._starting = False
        self._lock.notify_all()

    def stage(self, request: Request) -> JobHandle | None:
        """Prepare this sequence's next step while its current one runs (overlap
        scheduling); None if it cannot be prepared now."""
        if request.seq_id != self.seq_id or self.state == SequenceState.LOST:
            return None
        return self._jobs.stage(request)

    def discard(self, staged: JobHandle) -> None:
        """A step prepared by :meth:`stage` that will not run: its slot comes back."""
        self._jobs.discard(staged)

    def defer(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` soon on the executor's admission side, outside every lock."""
        self._jobs.defer(fn)

    def release(self, staged: JobHandle, request: Request) -> JobHandle | None:
        """Run a staged step with its real request; None (nothing run) if the sequence
        cannot take it now or the step is gone — the caller then runs it the ordinary
        way."""
        with self._lock:
            ok = not self._kv_lost() and self.state == SequenceState.OPEN
            if ok:
                _fire(self, "start_job")
                self._starting = True
        if not ok:
            self._jobs.discard(staged)
            return None
        if not self._jobs.release(staged, request):
            with self._lock:
                _fire_if(self, "job_ended")
                self._started_locked(None)
            return None
        with self._lock:
            self._started_locked(staged)
        staged.add_done_callback(self._job_done)
        return staged

    def follow(self, staged: JobHandle, *, after: JobHandle) -> bool:
        """Book ``staged`` (a step prepared by :meth:`stage`) as the sequence's job right
        after ``after``, its running job, whose output is checked and whose handle has
        not resolved yet: the sequence stays Busy, with no Open in between. The core
        runs the step (a stream's continuation returns it). False, the step handed
        back, if the sequence cannot take it (its KV is lost, or ``after`` is not its
        running job)."""
        with self._lock:
            ok = not self._kv_lost() and self.state == SequenceState.BUSY \
                and self._last is after
            if ok:
                self._prev = after
                self._started_locked(staged)
        if not ok:
            self._jobs.discard(staged)
            return False
        staged.add_done_callback(self._job_done)
        return True

    def _check_lost_locked(self) -> None:
        """A reset lost this sequence's KV while it was idle: say so before a job fails."""
        if self.state == SequenceState.OPEN and self._kv_lost():
            _fire(self, "lose")
        if self.state == SequenceState.LOST:
            raise Unavailable(f"the KV of sequence {self.seq_id} was lost (a device reset, "
                              "or a failed step the device may have run); reset() the "
                              "sequence and send the prompt again",
                              stage="sequence", seq_id=self.seq_id,
                              retry_after_s=self._life.retry_after_s)

    def _kv_lost(self) -> bool:
        epoch = self._life.epoch
        return epoch is not None and epoch.kv.sequence_state(self.seq_id) is SeqState.UNKNOWN

    def _job_done(self, handle: JobHandle) -> None:
        with self._lock:
            self._settle_locked(handle)

    def _settle_finished_locked(self) -> None:
        """Book the jobs that have ended but whose done-callbacks have not run yet (a
        caller whose ``result()`` has returned may go on before them), the one a step
        followed first."""
        if self.state == SequenceState.BUSY:
            for job in (self._prev, self._last):
                if job is not None and job.done():
                    self._settle_locked(job)

    def _running_locked(self) -> JobHandle | None:
        """A job of the sequence still running (the device may write its KV), if any."""
        return next((job for job in (self._prev, self._last)
                     if job is not None and not job.done()), None)

    def idle(self) -> bool:
        """No job of the sequence is running, and the ended ones are booked."""
        with self._lock:
            self._settle_finished_locked()
            return self._running_locked() is None

    def when_idle(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` once no job of the sequence is left running: now if none is,
        else from the done-callback of the one running (holding no lock)."""
        with self._lock:
            running = self._running_locked()
        if running is None:
            fn()
        else:
            running.add_done_callback(lambda _handle: self.when_idle(fn))

    def _settle_locked(self, handle: JobHandle) -> None:
        """Book a finished job once: its position, a lost KV, Busy -> Open. Run by its
        done-callback, or earlier by the next ``run`` (a caller whose ``result()`` has
        returned may go on before the callbacks have run)."""
        if self._settled is handle:
            return
        self._settled = handle
        err = handle.exception(0)
        if err is None:
            job = handle.context
            self._position = job.past_len + job.token_count
        elif self._kv_lost():
            _fire_if(self, "lose")
        if handle is self._prev:        # the step that followed it may have ended first
            self._prev = None
            ended = self._last is not None and self._last.done()
        else:                           # else a step chained after it runs: still Busy
            ended = handle is self._last and self._prev is None
        if ended:
            _fire_if(self, "job_ended")

    def forget_ended_jobs(self) -> None:
        """Let go of the ended jobs the sequence remembers (their results hold a stream's
        logits rows) while it is kept idle for later (the prompt cache). No-op while a
        job runs."""
        with self._lock:
            self._settle_finished_locked()
            if self._running_locked() is None and not self._starting:
                self._last = self._prev = self._settled = None

    def truncate(self, keep_len: int) -> None:
        """Drop the KV from position ``keep_len`` on (llama.cpp's ``seq_rm`` of a tail):
        the next job goes on at ``keep_len``, and a prefill from there equals a fresh
        run of the shorter history. Nothing changes at or past the position. Refused
        (FailedPrecondition) while a job runs, and once the KV is lost or the sequence
        closed."""
        if isinstance(keep_len, bool) or not isinstance(keep_len, int) or keep_len < 0:
            raise InvalidArgument(f"keep_len must be an integer >= 0, got {keep_len!r}",
                                  stage="sequence", seq_id=self.seq_id)
        with self._lock:
            self._settle_finished_locked()
            self._check_lost_locked()
            if self.state != SequenceState.OPEN or self._running_locked() is not None:
                raise FailedPrecondition(f"sequence {self.seq_id} is {self.state}",
                                         stage="sequence", seq_id=self.seq_id)
            if keep_len < self._position:
                self._life.epoch.kv.truncate_sequence(self.seq_id, keep_len)
                self._position = keep_len

    def reset(self) -> None:
        """Forget the KV (after it was lost, or to start over): position 0, Open."""
        with self._lock:
            self._settle_finished_locked()
            if self.state not in (SequenceState.OPEN, SequenceState.LOST):
                raise FailedPrecondition(f"sequence {self.seq_id} is {self.state}",
                                         stage="sequence", seq_id=self.seq_id)
            self._jobs.reset_sequence(self.seq_id)
            self._position = 0
            _fire_if(self, "reset")

    # ---- generation ----------------------------------------------------------------
    def generate(self, prompt: Seq[int] | str, params: SamplingParams | None = None, *,
                 deadline_s: float | None = None, resume: bool = True,
                 max_resumes: int = 2, request_id: str | None = None,
                 priority: int = 0, arrival: float | None = None) -> Stream:
        """Start a stream: prefill ``prompt`` (token ids, or text with the executor's
        tokenizer) after what the sequence holds, then sample and decode until a finish
        reason. ``priority``: every step's (see :class:`Stream`). A prompt or a
        ``max_tokens`` the context cannot hold after the sequence's position is refused
        here, at once (InvalidArgument, :mod:`calfsm.generate.arguments`); ``params`` None: the
        default ``max_tokens`` clipped to the room left."""
        return Stream(self, prompt, params, deadline_s=deadline_s,
                      resume=resume, max_resumes=max_resumes, request_id=request_id,
                      priority=priority, arrival=arrival)

    # ---- closing -------------------------------------------------------------------
    def close(self, timeout: float | None = 30.0) -> None:
        """Wait for the last job to end, release the KV, give the id back. Idempotent."""
        self._close(timeout, wait=True)

    def close_when_done(self) -> None:
        """Close without waiting: the KV and the id come back now if the last job has
        ended, else the moment it ends (a one-shot stream's sequence, at its end)."""
        self._close(None, wait=False)

    def _close(self, timeout: float | None, *, wait: bool) -> None:
        with self._lock:
            if self.state in (SequenceState.CLOSING, SequenceState.RELEASED):
                return
            _fire(self, "close")
            # a job being started now is the one to wait for, not the one before it
            # (its starter never blocks: this wait is short)
            self._lock.wait_for(lambda: not self._starting, timeout)
            jobs = (self._prev, self._last)
        for job in jobs:
            if wait and job is not None and not job.done():
                try:
                    # exception(), not result(): the job's own error must not be raised
                    # here, or its traceback would hold this frame (and the sequence)
                    job.exception(timeout)
                except CalfsmError:
                    pass                # a timeout; its outcome is its caller's
        # the device may still write this sequence's KV until its last job has ended
        self.when_idle(self._release)

    def _release(self) -> None:
        """Release the KV and give the id back (the sequence's last job has ended)."""
        try:
            # a sequence that ran no job holds no KV: nothing to ask the device
            if (self._last is not None or self._position) \
                    and self._life.epoch is not None \
                    and not self._life.closing:
                self._jobs.reset_sequence(self.seq_id)
        except CalfsmError as e:
            # the text, not the error: a handler that keeps records (pytest's does) would
            # keep the error's frames, and with them this sequence and its last job
            log.warning("releasing the KV of sequence %s failed: %s", self.seq_id, str(e),
                        extra=e.context())
        finally:
            with self._lock:
                _fire(self, "released")
            self._allocator.give_back(self.seq_id)

    async def aclose(self) -> None:
        await asyncio_module().to_thread(self.close)

    def __enter__(self) -> Sequence:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Sequence:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<Sequence {self.seq_id} {self.state} at {self._position}>"
