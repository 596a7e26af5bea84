"""Every job's one end: what it gives back, how it is counted, who is told.

The outcomes part owns the pipeline's books of jobs (the counters, the errors by category,
how many accepted jobs wait for the device) and the observers. Every job that ends goes
through :meth:`Outcomes.finish` (a failure) or the success path of
:mod:`calfsm.engine.completion`, which counts and tells the observers before the handle resolves:
a caller that has the outcome finds it counted.
"""

from __future__ import annotations

import logging
from typing import Any

from calfsm.engine.job import InferenceResult, JobContext, Request
from calfsm.engine.observe import JobAccepted, JobEnded, Observers
from calfsm.engine.parts import Core, job_ctx
from calfsm.errors import CalfsmError, Cancelled, ResourceExhausted
from calfsm.machines.job import JOB_MACHINE
from calfsm.util.lograte import RateLimitedLog

__all__ = ["COUNTERS", "Outcomes"]

log = logging.getLogger("calfsm.pipeline")
#: the warnings a fault storm repeats, a burst per minute each (calfsm/util/lograte.py)
limited = RateLimitedLog(log)

_fire_if = JOB_MACHINE.fire_if_declared

#: the counters :meth:`Outcomes.counts` reports, each bumped under the queue lock
COUNTERS = ("accepted", "succeeded", "failed", "cancelled", "quarantined", "discarded",
            "stale_completions", "recoveries", "requeued")


class Outcomes:
    """The books of jobs and their ends (see the module docstring)."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.observers = Observers(core.sync)    # told of every job's end (metrics, dump sink)
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._errors_by_category: dict[str, int] = {}
        self._waiting = 0               # accepted, not submitted nor ended

    # ---- the books -----------------------------------------------------------------
    def counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """(counters, errors by category), a consistent snapshot."""
        with self.core.lock:
            return dict(self._counts), dict(self._errors_by_category)

    def count(self, name: str) -> None:
        with self.core.lock:
            self._counts[name] += 1

    @property
    def waiting(self) -> int:
        """Accepted jobs not yet on the device nor ended."""
        return self._waiting

    def enter_waiting(self, request: Request, continuing: bool, inflight: int) -> None:
        """The bounded wait queue: refuse new work at once, with a Retry-After estimate
        from the measured service time, when ``max_waiting`` jobs already wait (429 now
        instead of a 504 later). A running stream's next step (``continuing``) is never
        refused here: its stream was admitted, and its steps wait their turn."""
        limit = self.core.t.max_waiting
        with self.core.lock:
            if continuing or limit is None or self._waiting < limit:
                self._waiting += 1
                return
            depth = self._waiting
        est = max(0.001, (depth + inflight) * self.core.service.decode_service_s())
        raise ResourceExhausted(
            f"{depth} jobs already wait for the device (max_waiting {limit})",
            stage="admission", seq_id=request.seq_id, retry_after_s=round(est, 3))

    def leave_waiting(self, job: JobContext) -> None:
        if job.waiting:
            job.waiting = False
            with self.core.lock:
                self._waiting -= 1

    # ---- telling the observers -----------------------------------------------------
    def announce(self, job: JobContext, request: Request, *, staged: bool) -> None:
        """job_accepted for ``job`` (``request``: a staged step's real one)."""
        job.announced = True
        if self.observers.accepts:
            self.observers.job_accepted(JobAccepted(
                job.job_id, job.seq_id, job.generation, job.kind, request,
                job.timings.accepted, staged, job.request_id))

    def observe(self, job: JobContext, outcome: str, result: InferenceResult | None,
                err: CalfsmError | None, output: Any = None) -> None:
        """Tell the observers a job ended, before its handle resolves (holding no lock):
        a caller that has the outcome finds it counted."""
        self.observers.job_ended(JobEnded(
            job.job_id, job.seq_id, job.generation, job.kind, outcome, job.timings,
            job.request, result, err, output, job.announced, job.request_id))

    # ---- ending a job --------------------------------------------------------------
    def succeeded(self, job: JobContext, result: InferenceResult) -> None:
        """The job ran and its result stands: counted, observed, resolved."""
        with self.core.lock:        # count("succeeded"), inline: every step ends here
            self._counts["succeeded"] += 1
        if self.observers.jobs:
            self.observe(job, "succeeded", result, None)
        job.handle._resolve(result, None)

    def dropped(self, job: JobContext, err: Cancelled) -> None:
        """The job ran but was cancelled after submit (FI12): its result is dropped."""
        self.count_outcome("cancelled", err)
        if self.observers.jobs:
            self.observe(job, "cancelled", None, err)
        job.handle._resolve(None, err)

    def finish(self, job: JobContext, err: CalfsmError, outcome: str, *,
               output: Any = None) -> None:
        """``job`` fails with ``err``, counted as ``outcome``; its caller is told."""
        err.with_context(**job_ctx(job, None))
        job.timings.completed = self.core.clock.now()
        self.leave_waiting(job)
        self.count_outcome(outcome, err)
        if isinstance(err, Cancelled):
            pass
        elif err.http_status < 500:     # the caller's side (400, 429): not a fault here
            log.debug("job failed: %s", err.message, extra=err.context())
        else:
            limited.warning("job_failed", "job failed: %s", err.message,
                            extra=err.context())
        if not job.ended:
            if self.observers.jobs:
                self.observe(job, outcome, None, err, output)
            job.handle._resolve(None, err)

    def count_outcome(self, outcome: str, err: CalfsmError) -> None:
        cat = err.category.value
        with self.core.lock:
            self._counts[outcome] += 1
            if outcome != "discarded":      # not an error: a step that was not needed
                self._errors_by_category[cat] = self._errors_by_category.get(cat, 0) + 1

    def fail_before_submit(self, job: JobContext, err: CalfsmError, *,
                           outcome: str | None = None) -> None:
        """Fail a job the device never ran: undo slices, return the lease, roll back KV.
        ``outcome``: the counter it ends in (default: cancelled or failed)."""
        if isinstance(err, Cancelled):
            _fire_if(job, "cancel")
        kv_error = self.give_back(job)
        _fire_if(job, "fail")
        self.finish(job, err, outcome or (
            "cancelled" if isinstance(err, Cancelled) else "failed"))
        hooks = self.core.hooks
        hooks.job_parked()              # what it held came free
        hooks.changed()                 # it left the waiting books: idle may hold now
        if kv_error is not None:
            self.core.decide(kv_error)

    def give_back(self, job: JobContext) -> CalfsmError | None:
        """What a job the device never ran took goes back: slices undone (a failed undo
        is logged and quarantines the slot on return, FI15), the lease returned, the KV
        rolled back. Returns the rollback's error (the books are closed and the sequence
        is Unknown), else None."""
        epoch = job.epoch
        if job.lease is not None:
            try:
                job.lease.undo_slices()
            except CalfsmError as e:
                log.warning("undo_slices failed while giving a job's slot back: %s", e,
                            extra=e.context())
            lease, job.lease = job.lease, None
            epoch.pool.release(lease)
        if job.kv is not None and job.kv.state == "Reserved":
            try:
                epoch.kv.rollback(job.kv)
            except CalfsmError as e:
                log.warning("KV rollback failed while giving a job's KV back: %s", e,
                            extra=e.context())
                return e
        return None

    def withhold(self, job: JobContext, reason: str, *, slot_clean: bool = False) -> None:
        """The device may have run (or may still run) the job: never claim a rollback.
        An open KV reservation becomes Unknown and the slot is quarantined, both in the
        job's own generation (a retired one is fenced: no device call). ``slot_clean``:
        the device is done with the slot and its job ended well (a row's own failure in
        a DONE_OK job), so the slot goes back instead."""
        if job.kv is not None and job.kv.state in ("Reserved", "Submitted"):
            job.epoch.kv.mark_unknown(job.kv, reason)
        if job.lease is not None:
            lease, job.lease = job.lease, None
            if job.rides or slot_clean:     # a row of another's job, or a clean slot
                job.epoch.pool.release(lease)
            else:
                job.epoch.pool.quarantine(lease, reason)

    def abandon(self, job: JobContext, err: CalfsmError) -> None:
        """Give up a job the device may still hold: its KV Unknown, its slot
        quarantined, resolved with ``err`` (a Wait that returns later finds nothing)."""
        if job.ended:
            return
        self.withhold(job, "abandoned on the device")
        if not _fire_if(job, "quarantine"):
            _fire_if(job, "fail")
        self.finish(job, err, "quarantined")
