"""The engine's job-level face: what :mod:`calfsm.generate` is built on.

Sequences and streams run their jobs through one :class:`JobFace` of the engine, built
by the facade (:class:`~calfsm.executor.DeviceExecutor`) over its pipeline and lifecycle
and handed down: they never reach up into the facade. It offers what a job-level client
needs and nothing of the facade's: accept and start a job, the current epoch, the
lifecycle, reset a sequence's KV, and the overlap plumbing of a stream (a step prepared
ahead while the one before it runs: stage, release, discard; work deferred to the
admission side). A prepared step has one owner, the overlap part
(:mod:`calfsm.engine.overlap`); a stream's flow keeps only the handle it will release.

Staging is here and not on the facade: a caller's request reaches the device only through
the validated entries (``enqueue``, a sequence's ``run``), and a staged step is checked
again when it is released.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from calfsm.engine.job import JobContext, JobHandle, Request
from calfsm.errors import Cancelled

if TYPE_CHECKING:
    from calfsm.engine.epoch import Epoch
    from calfsm.engine.lifecycle import Lifecycle
    from calfsm.engine.pipeline import Pipeline

__all__ = ["JobFace"]


class JobFace:
    """Jobs of one executor's engine, as its sequences and streams use them."""

    __slots__ = ("_admission", "_cancel", "_overlap", "clock", "lifecycle", "observers")

    def __init__(self, pipeline: Pipeline, life: Lifecycle) -> None:
        self._admission = pipeline.admission
        self._overlap = pipeline.overlap
        self._cancel = pipeline.cancel
        #: the lifecycle's owner: state, generation, gate, listeners
        self.lifecycle = life
        #: the driver's clock (virtual in step mode)
        self.clock = pipeline.clock
        #: who hears of every job's and stream's end (calfsm.engine.observe)
        self.observers = pipeline.observers

    @property
    def epoch(self) -> Epoch | None:
        """The current generation's model handles, KV coordinator and buffer pool."""
        return self.lifecycle.epoch

    # ---- jobs ----------------------------------------------------------------------
    def accept(self, request: Request, *, continuing: bool = False,
               request_id: str | None = None) -> JobContext:
        """Accept ``request`` as a job (validated, counted; not yet admitted): raises what
        refuses it at once. ``continuing``: a running stream's next step."""
        return self._admission.accept(request, self._cancel, continuing=continuing,
                                      request_id=request_id)

    def start(self, job: JobContext) -> None:
        """Admit ``job`` now, or park it for the admission step (never blocks)."""
        self._admission.start(job)

    def reset_sequence(self, seq_id: int) -> None:
        """Forget a sequence's KV (required after it went Unknown); it starts at 0."""
        self.lifecycle.epoch.kv.reset_sequence(seq_id)

    # ---- a stream's next step, prepared ahead --------------------------------------
    def stage(self, request: Request) -> JobHandle | None:
        """Prepare ``request`` (a stream's next step, its token a placeholder) while the
        step before it runs: a slot leased and the inputs written, no KV, no queue.
        None when that cannot be done now (the step then goes the ordinary way)."""
        job = self._overlap.stage(request, self._cancel)
        return None if job is None else job.handle

    def release(self, handle: JobHandle, request: Request) -> bool:
        """Run a staged step with its real ``request`` (the token now known), validated
        as any request is: KV reserved and queued for submit at once. False if the step
        is gone (it has its outcome)."""
        return self._overlap.release_staged(handle.context, request)

    def discard(self, handle: JobHandle) -> None:
        """A staged step that will not run: its slot comes back (outcome discarded)."""
        self._overlap.discard_staged(handle.context, Cancelled(
            "a step prepared ahead was not needed", stage="stage",
            job_id=handle.job_id, seq_id=handle.seq_id))

    def defer(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` soon on the admission side, outside every lock."""
        self._admission.defer(fn)

    def __repr__(self) -> str:
        life: Any = self.lifecycle
        return f"<JobFace gen={life.generation} {life.state}>"
