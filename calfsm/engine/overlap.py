"""Overlap: a stream's next step, prepared ahead while the step before it runs.

The overlap part owns the staged steps: each holds a buffer slot with its inputs written
(the token a placeholder) and no KV. When the token is known the step is released: the
real request is checked as any request is and must be the step that was staged, its KV
is reserved chained after the step before it (:mod:`calfsm.engine.kv`), whose own KV has not
been committed yet, and it joins the submit queue. A staged step that will not run is
discarded with everything it took given back.

Why no KV at staging: a stream may take its ordinary path for the same position while a
staging is still under way (the staged step then comes too late and is discarded), and
a reservation taken ahead would then stand in that path's way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from calfsm.engine.admission import Admission
from calfsm.engine.epoch import WARMUP_SEQ
from calfsm.engine.job import JobContext, Request, Successor
from calfsm.engine.parts import READY, Core, job_ctx
from calfsm.errors import (
    CalfsmError,
    ErrorCategory,
    Internal,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from calfsm.machines.job import JOB_MACHINE
from calfsm.request import check_request, check_token

__all__ = ["Overlap"]

_fire = JOB_MACHINE.fire


class Overlap:
    """The steps staged ahead (see the module docstring)."""

    def __init__(self, core: Core, admission: Admission) -> None:
        self.core = core
        self.admission = admission
        self._staged: list[JobContext] = []

    def busy(self) -> bool:
        return bool(self._staged)

    def take_staged(self) -> list[JobContext]:
        """Remove and return every staged step."""
        with self.core.lock:
            jobs, self._staged = self._staged, []
        return jobs

    def _unstage(self, job: JobContext) -> bool:
        with self.core.lock:
            if job not in self._staged:
                return False
            self._staged.remove(job)
        return True

    def stage(self, request: Request, canceller: Callable[[JobContext], None]
              ) -> JobContext | None:
        """Prepare a stream's next step while the one before runs: lease a slot and
        write its inputs (the token is a placeholder), reserving no KV and queueing
        nothing. None, with nothing taken, when no slot is free now, a job waits for
        admission (a slot taken ahead must never starve it: first come, first served),
        or the executor is not Ready: the step then takes the ordinary path when its
        token is known."""
        core, admission = self.core, self.admission
        life = core.life
        epoch = life.epoch
        if epoch is None or not life.ready or core.broken is not None \
                or admission.blocks_staging():
            return None
        try:
            lease = epoch.pool.acquire(request.kind, request.engine)
        except (ResourceExhausted, Unavailable):
            return None
        try:
            job = admission.accept(request, canceller, continuing=True, staging=True)
        except CalfsmError:
            epoch.pool.release(lease)
            return None
        job.lease = lease
        try:
            if job.epoch is not epoch:
                raise Unavailable("the generation changed while staging",
                                  **job_ctx(job, "stage"))
            admission.validate(job)
            _fire(job, "stage")
            lease.bind(job_id=job.job_id, seq_id=job.seq_id)
            lease.load(job.seq_id, request.tokens, request.positions)
        except CalfsmError as e:
            admission.failed_to_start(job, e)
            return None
        with core.lock:
            self._staged.append(job)
        return job

    def release_staged(self, job: JobContext, request: Request) -> bool:
        """The token of a staged step is known: run the step with its real ``request``
        (checked as any request is, and against the step that was staged), its KV
        reserved and the step queued for submit. False if the step is gone (a drain or
        close took it: it has its outcome). A step whose KV must wait goes the ordinary
        way (parked)."""
        return self._release(job, request, self._checked)

    def follow(self, job: JobContext, successor: Successor, *,
               defer: Callable[[Callable[[], None]], None] | None = None) -> None:
        """Run what the continuation of ``job`` decided (:class:`~calfsm.engine.job.Successor`),
        on its way back: the staged step must be the one for the position ``job``
        fills; its request was checked when it was staged, so only the token is new,
        and only it is checked and written. ``defer`` takes the work after it (the
        admission side's by default; a batch collects it until its next step went)."""
        staged, token, then = successor
        if self._release(staged.context, (token, job), self._with_token) \
                and then is not None:
            (defer or self.admission.defer)(then)

    def _checked(self, job: JobContext, request: Request) -> Request:
        self._check(job, request)
        job.lease.write_inputs(request.tokens, request.positions)
        return request

    def _with_token(self, job: JobContext, given: tuple[int, JobContext]) -> Request:
        token, before = given
        if (job.seq_id, job.past_len) != (before.seq_id, before.past_len + before.token_count):
            raise InvalidArgument(
                f"the step staged for sequence {job.seq_id} at {job.past_len} does not "
                f"follow job {before.job_id} (sequence {before.seq_id}, ending at "
                f"{before.past_len + before.token_count})", **job_ctx(job, "stage"))
        request = job.request.with_token(token)
        check_token(request, job.epoch.contract(job.kind), lambda: job_ctx(job, "stage"))
        job.lease.write_token(request.tokens.item(0))
        return request

    def _release(self, job: JobContext, given: Any,
                 resolve: Callable[[JobContext, Any], Request]) -> bool:
        if not self._unstage(job):
            return False
        core, admission = self.core, self.admission
        job.timings.released = core.clock.now()
        try:
            try:
                job.request = resolve(job, given)
            finally:
                # it runs (or ends) from here: a job accepted, with its real request (the
                # caller's, even a bad one; else the one resolved, or the staged one)
                admission.outcomes.announce(
                    job, given if isinstance(given, Request) else job.request, staged=True)
            life = core.life
            if life.state != READY or job.epoch is not life.epoch:
                raise Unavailable(f"device is {life.state}",
                                  retry_after_s=life.retry_after_s,
                                  **job_ctx(job, "stage"))
            # chained after the step before it, whose KV commits after this call
            kv = job.epoch.kv.try_reserve(job.seq_id, job.past_len, job.token_count,
                                          job_id=job.job_id, chain=True)
            if kv is None:          # KV must wait: give the slot back, take the queue
                lease, job.lease = job.lease, None
                lease.undo_slices()
                job.epoch.pool.release(lease)
                _fire(job, "unstage")
                admission.start(job)
                return True
            job.kv = kv
            _fire(job, "admit")
            job.timings.admitted = now = core.clock.now()
            _fire(job, "prepare")
            admission.device.queue(job, now, "stage")
        except CalfsmError as e:
            admission.failed_to_start(job, e)
        except Exception as e:
            admission.failed_to_start(job, Internal(
                f"unexpected {type(e).__name__} releasing a staged step: {e}",
                category=ErrorCategory.UNKNOWN, **job_ctx(job, "stage")))
        return True

    def _check(self, job: JobContext, request: Request) -> None:
        """The real request is checked as any request is, and must be the step that was
        staged (its sequence, kind and position): a caller's bad argument never reaches
        the device, let alone resets it."""
        ctx = job_ctx(job, "stage")
        if not isinstance(request, Request):
            raise InvalidArgument(f"release_staged takes a Request, got "
                                  f"{type(request).__name__}", **ctx)
        staged = job.request
        if (request.seq_id, request.kind, request.past_len, request.token_count) != (
                staged.seq_id, staged.kind, staged.past_len, staged.token_count):
            raise InvalidArgument(
                f"the released request (sequence {request.seq_id}, {request.kind.value} "
                f"at {request.past_len}) is not the staged step (sequence "
                f"{staged.seq_id}, {staged.kind.value} at {staged.past_len})", **ctx)
        check_request(request, job.epoch.contract(job.kind), seq_limit=WARMUP_SEQ,
                      context=ctx)

    def discard_staged(self, job: JobContext, err: CalfsmError) -> None:
        """A staged step that will not run (its stream ended): everything comes back."""
        if self._unstage(job):
            self.admission.outcomes.fail_before_submit(job, err, outcome="discarded")
