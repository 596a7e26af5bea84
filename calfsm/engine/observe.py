"""Observers: how metrics, a dump sink or an embedder's own code hear what the executor
does, without the executor knowing any of them.

Theory of operation
-------------------
An observer is any object with some of the methods of :class:`Observer` (subclass it and
override what you need). ``executor.add_observer(obs)`` registers it in the executor's
:class:`Observers`; from then on each event calls the observers that implement it:

``job_accepted(JobAccepted)``      a job was accepted to run: every job ``enqueue`` or
                                   ``enqueue_nowait`` accepted (before the call returns),
                                   and a stream's step prepared ahead when its token is
                                   known and it is released to run (``staged``)
``job_refused(error, request)``    ``enqueue`` or ``enqueue_nowait`` raised ``error`` for
                                   ``request``: no job exists (a bad argument included)
``job_ended(JobEnded)``            every job, exactly once, just *before* its handle
                                   resolves (a caller that has the result sees it
                                   counted); with its timings, request, result or error.
                                   Every announced job's end follows its job_accepted;
                                   a step prepared ahead that was never released
                                   (``discarded``, or failed or taken by a drain or
                                   close before that) never ran, and ends with
                                   ``announced=False``
``stream_started(stream)``         a generation stream was created
``stream_resumed(stream)``         a stream replays its history after a reset lost its KV
``stream_ended(stream, result)``   a stream finished (once), with its GenerationResult
``request_rejected(error, reason)`` a request refused at once, before any job existed:
                                   ``reason`` is one of :data:`REJECTION_REASONS`
``device_step(DeviceStep)``        a job of a batch graph was submitted, with how many
                                   rows it carries (continuous batching) of how many

So ``job_accepted`` and ``job_refused`` account for every call of the two entries, and
the ends with ``announced`` pair one to one with the ``job_accepted`` before them (the
soak's job ledger and ``calfsm run``'s job count are such observers). An observer added
while jobs run sees the ends of jobs accepted before it came.

Observers are called on the executor's threads (the completion side, the admission side,
a caller's thread) holding none of the executor's locks, like a handle's done-callbacks.
They must be quick and must not block: the per-token path waits for them. An exception
in an observer is logged and swallowed; it never changes a job's outcome.

The registry is copy-on-write: each event name keeps a tuple of the bound methods that
override :class:`Observer`'s no-op, rebuilt on add and remove, so an event nobody
listens to costs one attribute load and a truth test (:attr:`Observers.jobs` is that
test for the per-job path).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import attrs
import numpy as np

from calfsm.engine.job import InferenceResult, JobTimings
from calfsm.engine.results import GenerationResult
from calfsm.engine.sync import Sync
from calfsm.errors import (
    CalfsmError,
    ExecutorBroken,
    ExecutorClosed,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from calfsm.manifest import TaskKind
from calfsm.request import Request

__all__ = ["EVENTS", "JOB_OUTCOMES", "REJECTION_REASONS", "DeviceStep", "JobAccepted", "JobEnded",
           "Observer", "Observers", "StreamView", "rejection_reason"]


class StreamView(Protocol):
    """What an observer is handed of a stream (:class:`calfsm.generate.stream.Stream` is one;
    the streams sit above this module, so they are named by what they offer)."""

    prompt: tuple[int, ...]
    params: Any                         # calfsm.generate.sampling.SamplingParams
    sequence: Any                       # calfsm.generate.sequence.Sequence
    request_id: str
    #: prompt tokens whose KV the prompt cache gave (not prefilled)
    cached: int

    @property
    def started(self) -> float: ...

    @property
    def arrival(self) -> float: ...

    def cancel(self) -> bool: ...

log = logging.getLogger("calfsm.observe")

#: the outcomes a job ends in (the executor's counters of the same names)
JOB_OUTCOMES = ("succeeded", "failed", "cancelled", "quarantined", "discarded")

#: why a request was refused before it became a job
REJECTION_REASONS = (
    "max_waiting",      # ExecutorConfig.max_waiting jobs already wait (429)
    "capacity",         # the admission estimate: it would not end in time (429)
    "sequences",        # every sequence id is open (429)
    "not_ready",        # the lifecycle is not Ready: draining, recovering, failed (503)
    "closed",           # the executor is closing or closed
    "broken",           # a worker thread died
)



def rejection_reason(err: CalfsmError, *, opening: bool = False) -> str | None:
    """The :data:`REJECTION_REASONS` entry of an error that refused a request at once
    (``opening``: raised by ``open_sequence``); None for a misuse such as a bad argument,
    which is not a rejection."""
    if isinstance(err, ExecutorClosed):
        return "closed"
    if isinstance(err, ExecutorBroken):
        return "broken"
    if isinstance(err, ResourceExhausted):
        return "sequences" if opening else (
            "capacity" if err.stage == "capacity" else "max_waiting")
    if isinstance(err, Unavailable):
        return "not_ready"
    return None


#: the observer methods the executor calls
EVENTS = ("job_accepted", "job_refused", "job_ended", "stream_started", "stream_resumed",
          "stream_ended", "request_rejected", "device_step")


@attrs.frozen(slots=True)
class JobAccepted:
    """One job accepted to run, as observers see it. ``staged``: a stream's step
    prepared ahead, announced when it is released with its real ``request`` (its token
    known); ``accepted`` is when the job was made (clock seconds)."""

    job_id: int
    seq_id: int
    generation: int
    kind: TaskKind
    request: Request
    accepted: float
    staged: bool = False
    #: the request the job serves (a stream's steps: the stream's id)
    request_id: str | None = None


@attrs.frozen(slots=True)
class JobEnded:
    """One job's end, as observers see it. ``timings`` are clock seconds (durations in
    ms); ``output`` is the raw BF16 output tensor of a job whose completion was judged bad
    (status, size or values; the slot is quarantined, so the array stays as the device
    left it), else None. ``announced``: see :class:`Observer`."""

    job_id: int
    seq_id: int
    generation: int
    kind: TaskKind
    outcome: str                          # one of JOB_OUTCOMES
    timings: JobTimings
    request: Request
    result: InferenceResult | None = None
    error: CalfsmError | None = None
    output: np.ndarray | None = attrs.field(default=None, eq=False, repr=False)
    #: job_accepted was called for this job (False: a step prepared ahead that ended
    #: before it was released; it never ran)
    announced: bool = True
    #: the request the job served (a stream's steps: the stream's id)
    request_id: str | None = None


@attrs.frozen(slots=True)
class DeviceStep:
    """One device job of a batch graph (or of a shape bucket) submitted: ``rows`` rows
    (streams' steps) of the graph's ``capacity`` (its ``max_batch``); the rest is
    padding. ``graph``: the graph's exact name."""

    kind: TaskKind
    rows: int
    capacity: int
    graph: str = ""


class Observer:
    """The observer protocol, as no-op methods: override the events you want."""

    def job_accepted(self, event: JobAccepted) -> None:
        """A job was accepted to run: by ``enqueue``/``enqueue_nowait`` (before it
        returns), or a stream's step prepared ahead, when it is released (``staged``).
        Its job_ended follows, once."""

    def job_refused(self, error: CalfsmError, request: Any) -> None:
        """``enqueue`` or ``enqueue_nowait`` raised ``error`` (what the caller got) for
        ``request``; no job exists. Unlike :meth:`request_rejected`, a misuse (a bad
        argument) is reported too, and ``open_sequence``/``generate`` refusals are not."""

    def job_ended(self, event: JobEnded) -> None:
        """A job ended (every job, once, before its handle resolves). A step prepared
        ahead that never ran ends ``announced=False`` (no job_accepted came for it)."""

    def stream_started(self, stream: StreamView) -> None:
        """A generation stream was created (its prefill is on its way)."""

    def stream_resumed(self, stream: StreamView) -> None:
        """A stream replays its prompt and tokens after a reset lost its KV."""

    def stream_ended(self, stream: StreamView, result: GenerationResult) -> None:
        """A stream finished; ``result`` is what ``stream.result()`` returns."""

    def request_rejected(self, error: CalfsmError, reason: str) -> None:
        """A request was refused at once (``error`` is what the caller got)."""

    def device_step(self, step: DeviceStep) -> None:
        """A job of a batch graph went to the device, carrying ``step.rows`` rows."""


class Observers:
    """The observers of one executor; every event is a method that calls them all."""

    __slots__ = ("_all", "_fns", "_lock", "accepts", "jobs")

    def __init__(self, sync: Sync) -> None:
        self._lock = sync.lock()        # adding and removing; calls read a snapshot
        self._all: tuple[Any, ...] = ()
        self._fns: dict[str, tuple[Any, ...]] = dict.fromkeys(EVENTS, ())
        #: someone listens to job_ended (the pipeline builds a JobEnded only then)
        self.jobs = False
        #: someone listens to job_accepted (the pipeline builds a JobAccepted only then)
        self.accepts = False

    def add(self, observer: Any) -> None:
        """Register ``observer`` (an :class:`Observer`, or any object with some of its
        methods). Adding the same object twice is a misuse (InvalidArgument)."""
        if not any(callable(getattr(observer, name, None)) for name in EVENTS):
            raise InvalidArgument(f"{observer!r} has none of the observer methods "
                                  f"{EVENTS}", stage="observe")
        with self._lock:
            if any(o is observer for o in self._all):
                raise InvalidArgument(f"{observer!r} is already observing this executor",
                                      stage="observe")
            self._bind((*self._all, observer))

    def remove(self, observer: Any) -> bool:
        """Stop calling ``observer``; False if it was not registered."""
        with self._lock:
            kept = tuple(o for o in self._all if o is not observer)
            if len(kept) == len(self._all):
                return False
            self._bind(kept)
            return True

    def __len__(self) -> int:
        return len(self._all)

    def _bind(self, observers: tuple[Any, ...]) -> None:
        fns = {}
        for name in EVENTS:
            base = getattr(Observer, name)
            fns[name] = tuple(getattr(o, name) for o in observers
                              if callable(getattr(o, name, None))
                              and getattr(type(o), name, None) is not base)
        self._all, self._fns = observers, fns
        self.jobs = bool(fns["job_ended"])
        self.accepts = bool(fns["job_accepted"])

    def _call(self, name: str, *args: Any) -> None:
        for fn in self._fns[name]:
            try:
                fn(*args)
            except Exception:
                log.exception("observer %r raised in %s", fn, name)

    # ---- the events ----------------------------------------------------------------
    def job_accepted(self, event: JobAccepted) -> None:
        self._call("job_accepted", event)

    def job_refused(self, error: CalfsmError, request: Any) -> None:
        if self._fns["job_refused"]:
            self._call("job_refused", error, request)

    def job_ended(self, event: JobEnded) -> None:
        self._call("job_ended", event)

    def stream_started(self, stream: StreamView) -> None:
        if self._fns["stream_started"]:
            self._call("stream_started", stream)

    def stream_resumed(self, stream: StreamView) -> None:
        if self._fns["stream_resumed"]:
            self._call("stream_resumed", stream)

    def stream_ended(self, stream: StreamView, result: GenerationResult) -> None:
        if self._fns["stream_ended"]:
            self._call("stream_ended", stream, result)

    def request_rejected(self, error: CalfsmError, reason: str) -> None:
        if self._fns["request_rejected"]:
            self._call("request_rejected", error, reason)

    def device_step(self, step: DeviceStep) -> None:
        if self._fns["device_step"]:
            self._call("device_step", step)
