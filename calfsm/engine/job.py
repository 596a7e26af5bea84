"""Per-job records: the request, its context and timings, its result, and its handle.

Each job carries its own timings (``JobTimings``) and hands them back in its result:
nothing is kept in a map shared across sequences (defect S11). A :class:`JobHandle` feels
like a ``concurrent.futures.Future``: ``result(timeout)``, ``done()``, ``cancel()``,
callbacks run outside the lock, and ``await handle`` from asyncio without blocking the
event loop. The handle only records the end and opens its latch; the waiting on it (a
blocking ``result``, ``await``) is done by the :class:`~calfsm.engine.sync.Sync` it was
built with, the runtime's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import attrs
import numpy as np

from calfsm.drivers.base import EngineSlot
from calfsm.errors import CalfsmError, DeadlineExceeded
from calfsm.machines.job import JobState
from calfsm.manifest import TaskKind
from calfsm.request import Request

if TYPE_CHECKING:
    from calfsm.engine.buffers import BufferLease
    from calfsm.engine.kv import KvReservation
    from calfsm.engine.sync import Sync

__all__ = ["InferenceResult", "JobContext", "JobHandle", "JobTimings", "Request", "Successor"]

log = logging.getLogger("calfsm.job")


@attrs.define(slots=True)
class JobTimings:
    """Where one job's time went (spec ``JobTimings``). Clock seconds; durations in ms.

    ``released``: a step prepared ahead (a stream's next decode, staged while the one
    before ran) is accepted when it is staged, but asks for KV only when its token is
    known, at ``released`` (0.0 for a job that was not staged)."""

    accepted: float = 0.0
    admitted: float = 0.0
    queued: float = 0.0
    submitted: float = 0.0
    completed: float = 0.0
    h2d_ms: float = 0.0
    device_wait_ms: float = 0.0
    d2h_ms: float = 0.0
    postprocess_ms: float = 0.0
    released: float = 0.0
    #: the host's critical tail of the job's step: from its wait's return until the next
    #: steps its continuations decided were handed to the submitter (a batch's whole,
    #: the same in each of its rows): what the device waits for between two steps
    tail_ms: float = 0.0

    @property
    def total_ms(self) -> float:
        return (self.completed - self.accepted) * 1e3


@attrs.frozen
class InferenceResult:
    """The logits of one job (float32, ``vocab`` long) and where its time went."""

    job_id: int
    seq_id: int
    generation: int
    kind: TaskKind
    token_count: int
    logits: np.ndarray = attrs.field(eq=False, repr=False)
    timings: JobTimings

    def greedy(self) -> int:
        """Arg-max token (ties to the lowest index)."""
        return int(np.argmax(self.logits))


@attrs.define(slots=True, eq=False)
class JobContext:
    """Everything one in-flight job owns. Only the job's current owner mutates it."""

    job_id: int
    request: Request
    generation: int
    seq_id: int
    kind: TaskKind
    past_len: int
    token_count: int
    deadline: float                      # overall, clock time
    #: the request it serves (a stream's steps carry the stream's; calfsm/generate/liverequests.py)
    request_id: str | None = None
    state: str = JobState.CREATED.value
    cancel_requested: bool = False
    engine: EngineSlot = EngineSlot.AUTO
    lease: BufferLease | None = None
    kv: KvReservation | None = None
    queue_deadline: float = float("inf")
    execution_deadline: float = float("inf")   # set at submit: wait gives up after it
    #: a running stream's next step (not new work: never refused by ``max_waiting``,
    #: admitted during a graceful shutdown)
    continuing: bool = False
    #: the lifecycle's out-of-Ready seconds when the job was accepted: the admission
    #: budget is not charged for a recovery the job waited through
    unready_mark: float = 0.0
    holds_inflight: bool = False         # popped for submit, device not yet released
    #: observers were told it was accepted (a step prepared ahead: only at its release)
    announced: bool = True
    requeues: int = 0                    # times a transient submit error put it back
    ended: bool = False                  # resolved: its caller has the outcome
    waiting: bool = False                # counted among the jobs waiting for the device
    timings: JobTimings = attrs.field(factory=JobTimings)
    handle: JobHandle | None = None
    epoch: Any = None                    # the resources of its generation (an Epoch)
    #: a stream's next step, decided on the completion side: called with the job and its
    #: float32 logits once its output is checked, before its KV commit (the next step's
    #: is chained after it) and before its handle resolves; run once. It only decides:
    #: a :class:`Successor` it returns is run by the core itself (the step after it
    #: reaches the submitter first), so nothing on the way back climbs out of the core
    continuation: Callable[[JobContext, np.ndarray], Successor | None] | None = None
    #: the continuation's row of the native tail (calfsm/engine/tail.py), asked for
    #: once the job's output is judged, before its rows are converted: the token is then
    #: chosen in the same native call as the conversion. None (or returning None): the
    #: continuation chooses in Python
    tail: Callable[[JobContext], Any] | None = None
    #: the :class:`~calfsm.engine.tail.TailRow` the tail ran for this job (its token is
    #: the continuation's to take), from the conversion until the continuation took it
    tailed: Any = None
    #: called once a parked job is queued for the device, by a caller that blocks until
    #: its job is admitted (:func:`calfsm.runtime.waits.wait_admitted`)
    on_admitted: Callable[[], None] | None = None
    #: the rows of the one device job this job is a row of (itself first when it leads:
    #: its slot is the one the device runs), from claim to completion; None: a job alone
    batch: list[JobContext] | None = None
    #: a row of a batch another job leads: its own slot never reaches the device (its
    #: inputs were copied into the leader's), so a failure gives it back, never
    #: quarantines it
    rides: bool = False


class Successor(NamedTuple):
    """What a job's continuation decided: run ``staged`` (a step prepared ahead for the
    position this job fills) with ``token`` in place of its placeholder, then defer
    ``then`` (preparing the step after it) to the admission side. The core checks the
    token and that ``staged`` is that step before anything reaches the device."""

    staged: JobHandle
    token: int
    then: Callable[[], None] | None = None


class JobHandle:
    """The caller's view of one job: a future with cancel, deadline and asyncio support."""

    __slots__ = ("_callbacks", "_canceller", "_error", "_latch", "_lock", "_result", "_sync",
                 "context", "job_id")

    def __init__(self, job: JobContext, canceller: Callable[[JobContext], None],
                 sync: Sync) -> None:
        self.job_id = job.job_id
        #: the job's own record (generation, KV reservation, timings), to inspect; only
        #: the executor changes it (an attribute, not a property: it is read on every
        #: token's way)
        self.context: JobContext = job
        self._canceller = canceller
        self._sync = sync
        self._lock = sync.lock()            # result, error and callbacks
        # Held until the job ends (the engine releases it, once); a waiter acquires it
        # and hands it on at once (Sync.wait_latch). A bare lock is a much shorter path
        # than a Condition (no waiter list, no per-wait lock allocated), and the
        # caller's wake-up is on every job's critical path.
        self._latch = sync.lock()
        self._latch.acquire()               # new: taken, never waited for
        self._result: InferenceResult | None = None
        self._error: CalfsmError | None = None
        self._callbacks: list[Callable[[JobHandle], None]] = []

    # ---- caller side ---------------------------------------------------------------
    @property
    def state(self) -> str:
        return self.context.state

    @property
    def seq_id(self) -> int:
        return self.context.seq_id

    @property
    def request_id(self) -> str | None:
        """The request the job serves (calfsm/generate/liverequests.py)."""
        return self.context.request_id

    def describe(self) -> tuple[str, int]:
        """Its state and tokens so far, for ``executor.requests()``: a job gives its
        logits when it ends, no tokens."""
        return self.context.state, 0

    def done(self) -> bool:
        return self._result is not None or self._error is not None

    def cancel(self) -> bool:
        """Ask for the job to stop. Before submit: nothing reaches the device and every
        resource comes back. After submit: the job is still waited for and its result
        dropped. Returns False if the job had already finished."""
        if self.done():
            return False
        self._canceller(self.context)
        return True

    def result(self, timeout: float | None = None) -> InferenceResult:
        """Block until the job ends; return its result or raise its error."""
        self._wait(timeout)
        error = self._error
        if error is not None:
            # Raising writes this frame into the error's traceback, and the error stays
            # on the handle: let the frame forget the handle (as concurrent.futures does)
            # or handle -> error -> traceback -> frame -> handle is a reference cycle.
            try:
                raise error.with_traceback(None)    # this raise's frames, no older ones
            finally:
                self = error = None
        assert self._result is not None
        return self._result

    def exception(self, timeout: float | None = None) -> CalfsmError | None:
        """Block until the job ends; its error, or None if it succeeded. Nothing is
        raised here (only a timeout), so the error gains no traceback of this call."""
        if self._result is None and self._error is None:     # not done(): wait
            self._wait(timeout)
        return self._error

    def _wait(self, timeout: float | None) -> None:
        """Return once the job has ended; DeadlineExceeded if ``timeout`` passed first."""
        if self._result is not None or self._error is not None \
                or self._sync.wait_latch(self._latch, timeout):     # done(), or once done
            return
        raise DeadlineExceeded(
            f"job {self.job_id} not finished within {timeout} s",
            job_id=self.job_id, seq_id=self.context.seq_id, stage="result")

    def add_done_callback(self, fn: Callable[[JobHandle], None]) -> None:
        """Call ``fn(handle)`` when the job ends (at once if it already has)."""
        with self._lock:
            if self._result is None and self._error is None:        # not done()
                self._callbacks.append(fn)
                return
        _run_callback(fn, self)

    def __await__(self):
        yield from self._sync.when_released(self.add_done_callback).__await__()
        try:
            return self.result(0)
        finally:
            self = None                 # an error raised here must not hold the handle

    def __repr__(self) -> str:
        return f"<JobHandle job={self.job_id} seq={self.context.seq_id} state={self.state}>"

    # ---- executor side -------------------------------------------------------------
    def _resolve(self, result: InferenceResult | None, error: CalfsmError | None) -> None:
        if error is not None:
            drop_tracebacks(error)
        with self._lock:
            if self._result is not None or self._error is not None:     # done()
                raise RuntimeError(f"job {self.job_id} resolved twice")
            self._result, self._error = result, error
            callbacks, self._callbacks = self._callbacks, []
            # The job ended: it lets go of its handle, so no JobContext <-> JobHandle
            # cycle outlives it (the cyclic collector's gen-0 passes would land on the
            # per-token latency).
            job = self.context
            job.ended = True
            job.handle = None
        self._latch.release()
        for fn in callbacks:            # _run_callback's guard, on every job's way
            try:
                fn(self)
            except Exception:
                log.exception("done-callback of job %s raised", self.job_id)


def drop_tracebacks(error: BaseException) -> None:
    """Forget where ``error`` (and every exception it chains) was raised.

    An error that becomes a job's or a stream's outcome was raised and caught inside the
    executor; its traceback holds those frames, and through them (their locals and the
    frames they were called from) the handle, the stream or the generation that ended
    with it: a reference cycle only the cyclic collector frees, with logits rows and
    buffer pools in it. The outcome keeps its type, message, context and causes; a
    caller that raises it gets a traceback of its own. Unexpected errors are logged with
    their traceback where they are caught."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        e.__traceback__ = None
        todo += (e.__cause__, e.__context__)


def _run_callback(fn: Callable[[JobHandle], None], handle: JobHandle) -> None:
    try:
        fn(handle)
    except Exception:
        log.exception("done-callback of job %s raised", handle.job_id)
