"""What the sequences and streams of one executor share above the engine.

:class:`Front` is built by the facade (:class:`~calfsm.executor.DeviceExecutor`) and
handed to every :class:`~calfsm.generate.sequence.Sequence` it opens: the engine's job
face (:class:`~calfsm.engine.face.JobFace`), the live requests and streams by id, the
tokenizer, and the one way a job is accepted from above the engine (booked by request
id, a refusal reported to the observers). The facade's own ``enqueue`` entries go
through it too, so a sequence's job and a caller's are accepted the same way, and
nothing here reaches back up into the facade.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from calfsm.engine.face import JobFace
from calfsm.engine.job import JobContext, JobHandle, Request
from calfsm.engine.observe import rejection_reason
from calfsm.errors import CalfsmError

if TYPE_CHECKING:
    from calfsm.generate.liverequests import LiveRequests
    from calfsm.generate.livestreams import LiveStreams

__all__ = ["Front"]


class Front:
    """The engine's jobs, the live books and the tokenizer of one executor."""

    __slots__ = ("clock", "jobs", "lifecycle", "live_requests", "live_streams",
                 "observers", "tokenizer")

    def __init__(self, jobs: JobFace, *, live_requests: LiveRequests,
                 live_streams: LiveStreams, tokenizer: Any = None) -> None:
        #: the engine's job-level face (accept, stage, the epoch, the lifecycle)
        self.jobs = jobs
        self.lifecycle = jobs.lifecycle
        self.clock = jobs.clock
        self.observers = jobs.observers
        #: the live streams and jobs by request id (abort, requests)
        self.live_requests = live_requests
        #: the live streams and the admission estimate for a new one
        self.live_streams = live_streams
        #: the streams' text (None: token ids only)
        self.tokenizer = tokenizer

    @property
    def epoch(self) -> Any:
        """The current generation's epoch (None before the first one is built)."""
        return self.lifecycle.epoch

    def accept(self, request: Request, *, continuing: bool = False) -> JobContext:
        """Accept ``request`` as a job: a caller's own job is booked by request id (a new
        one if it has none), a stream's step under its stream's; a refusal is reported
        to the observers and raised."""
        live = self.live_requests
        if isinstance(request, Request):        # else the admission refuses it below
            rid = request.request_id
            own = not live.is_stream(rid, request.seq_id)  # a stream's step: its entry
        else:
            rid, own = None, False
        try:
            if own and rid is None:
                rid = live.new_id()
            job = self.jobs.accept(request, continuing=continuing, request_id=rid)
        except CalfsmError as e:
            self.rejected(e)
            raise
        if own:
            handle = job.handle
            try:
                live.add(rid, "job", handle)
            except CalfsmError:
                handle.cancel()         # an id live elsewhere: this job must not run
                raise
            handle.add_done_callback(lambda h: live.discard(rid, h))
        return job

    def enqueue_nowait(self, request: Request, *, continuing: bool = False) -> JobHandle:
        """Accept ``request`` and admit it now, or park it (never blocks)."""
        job = self.accept(request, continuing=continuing)
        handle = job.handle         # the job drops it when it ends, maybe in start()
        self.jobs.start(job)
        return handle

    def rejected(self, err: CalfsmError, *, opening: bool = False) -> None:
        """Tell the observers of a request refused at once (``opening``: a sequence)."""
        reason = rejection_reason(err, opening=opening)
        if reason is not None:
            self.observers.request_rejected(err, reason)
