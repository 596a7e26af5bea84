"""The device side of the core: the submit queue, the in-flight slots, the jobs on the device.

It owns what is queued for the device (the submit queue, each job with its queue
deadline), what holds it (the in-flight slots, one job per fixed engine with ping/pong)
and what the device holds (the on-device list and the completion queue, in the order
their waits are due). :meth:`Submission.submit` is the only caller of ``infer`` (spec
6.4); it holds the device lock around the generation check and the call, so no reset
races a submit (:meth:`Submission.device_barrier`).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable

from calfsm.drivers.base import EngineSlot, JobTag
from calfsm.engine.batchrows import batchable, gather, program_rows
from calfsm.engine.job import JobContext
from calfsm.engine.observe import DeviceStep
from calfsm.engine.outcomes import Outcomes
from calfsm.engine.parts import READY, Core, job_ctx
from calfsm.engine.recovery import Decision
from calfsm.errors import (
    CalfsmError,
    Cancelled,
    DeadlineExceeded,
    ErrorCategory,
    Internal,
    ResourceExhausted,
    Unavailable,
    from_calrt,
)
from calfsm.machines.job import JOB_MACHINE, JobState
from calfsm.manifest import TaskKind

__all__ = ["Submission"]

#: the categories of an ``infer`` refusal that prove the graph did not run (FI05)
_NOT_RUN = (ErrorCategory.TRANSIENT, ErrorCategory.REQUEST, ErrorCategory.PROGRAMMING,
            ErrorCategory.LIFECYCLE)

log = logging.getLogger("calfsm.pipeline")

_fire = JOB_MACHINE.fire
_fire_if = JOB_MACHINE.fire_if_declared


class Submission:
    """Queued for, holding and held by the device (see the module docstring)."""

    def __init__(self, core: Core, outcomes: Outcomes,
                 hold: Callable[[list[JobContext]], None]) -> None:
        self.core = core
        self.outcomes = outcomes
        self._hold = hold               # admission parks a job for the next generation
        self._submit_q: deque[JobContext] = deque()
        self._complete_q: deque[JobContext] = deque()
        self._on_device: list[JobContext] = []      # submitted, wait not returned
        self._inflight = 0
        self._expiring = 0          # taken out of the queue past their deadline, not failed yet
        #: ping/pong: the job each fixed engine runs now (one per engine, spec 6.4);
        #: empty with one in flight on the AUTO engine
        self._engine_busy: dict[EngineSlot, JobContext] = {}
        #: batching: rows of a batch being completed whose next steps may still join the
        #: queue (the submitter holds a partial batch for them, within the window)
        self._rows_following = 0
        #: the rows of the batch completed last, and when its last continuation ran
        self._last_rows = 0
        self._followed_at = 0.0
        #: batching: the last job claimed was a prefill (the next claim prefers decodes,
        #: so prompts arriving never starve the running streams)
        self._prefill_last = False

    # ---- observation ---------------------------------------------------------------
    @property
    def inflight(self) -> int:
        return self._inflight

    def busy(self) -> bool:
        """A job is queued, in the submitter's hand (claimed, not yet on the device: it
        holds a lease and may still fail before submit), being failed past its queue
        deadline, on the device or waiting for its completion."""
        return bool(self._submit_q or self._complete_q or self._on_device or self._inflight
                    or self._expiring)

    def has_queued(self) -> bool:
        return bool(self._submit_q)

    def has_completions(self) -> bool:
        return bool(self._complete_q)

    def due(self) -> tuple[bool, bool, bool]:
        """What a step driver asks of the device side at every step, in one look: (a
        queued job's queue deadline passed, :meth:`submittable`,
        :meth:`has_completions`). The clock is read only when a job is queued."""
        queue = self._submit_q
        if not queue:
            return False, False, bool(self._complete_q)
        now = self.core.clock.now()
        expired = False
        with self.core.lock:        # first_queue_deadline() <= now, inline: every step
            for j in queue:
                if j.queue_deadline <= now:
                    expired = True
                    break
            claimable = self._claimable() is not None
        return expired, claimable, bool(self._complete_q)

    def first_queue_deadline(self) -> float:
        """The earliest queue deadline among the queued jobs (inf: none queued)."""
        if not self._submit_q:
            return math.inf
        with self.core.lock:
            first = math.inf
            for j in self._submit_q:
                if j.queue_deadline < first:
                    first = j.queue_deadline
            return first

    def on_device(self) -> list[JobContext]:
        with self.core.lock:
            return list(self._on_device)

    def oldest_on_device(self) -> tuple[float, JobContext | None]:
        """(clock seconds the oldest job on the device has been there, that job), or
        (0.0, None) when the device holds none."""
        with self.core.lock:
            job = self._on_device[0] if self._on_device else None
        if job is None:
            return 0.0, None
        return max(0.0, self.core.clock.now() - job.timings.submitted), job

    def idle_on_device(self) -> bool:
        """No job holds the device (submitted or about to be)."""
        with self.core.lock:
            return not self._on_device and self._inflight <= len(self._on_device)

    def completion_idle_s(self) -> float | None:
        """Seconds since the completion side last made progress while jobs are on the
        device (None: nothing on the device)."""
        if self._inflight == 0:
            return None
        return self.core.clock.now() - self.core.heartbeat["completion"]

    # ---- the submit queue ----------------------------------------------------------
    def queue(self, job: JobContext, now: float, stage: str) -> None:
        """A prepared job joins the submit queue (its queue deadline starts now), unless
        it was cancelled or the executor is closing: then Cancelled."""
        core = self.core
        job.timings.queued = now
        job.queue_deadline = job.deadline if job.continuing \
            else min(job.deadline, now + core.t.queue_s)
        with core.lock:
            queued = not (job.cancel_requested or core.life.closing)
            if queued:
                _fire(job, "enqueue")
                self._submit_q.append(job)
                if not core.hooks.quiet:
                    core.hooks.work_queued()
        if not queued:
            raise Cancelled("cancelled before submit", **job_ctx(job, stage))

    def unqueue(self, job: JobContext) -> bool:
        """Take a cancelled job out of the submit queue; False if it is not there."""
        with self.core.lock:
            if job.state == JobState.QUEUED and job in self._submit_q:
                self._submit_q.remove(job)
                return True
        return False

    def take_queued(self) -> list[JobContext]:
        """Remove and return every queued job."""
        with self.core.lock:
            jobs = list(self._submit_q)
            self._submit_q.clear()
        return jobs

    def fail_expired(self) -> bool:
        """Fail every queued job whose queue deadline passed (spec 9.1: never submitted,
        so its KV reservation rolls back and its lease returns); True if there was one.
        Out of the queue they still hold their leases: busy until the last has failed."""
        core = self.core
        with core.lock:
            if not self._submit_q:
                return False
            now = core.clock.now()
            expired = []
            for j in self._submit_q:        # a loop, not a comprehension: no call per step
                if j.queue_deadline <= now:
                    expired.append(j)
            for j in expired:
                self._submit_q.remove(j)
            self._expiring += len(expired)
        if not expired:
            return False
        outcomes = self.outcomes

        def fail(job: JobContext) -> None:
            outcomes.fail_before_submit(job, _queue_deadline_passed(job))

        try:
            for job in expired:
                self.run_step(job, "queue", fail)
        finally:
            with core.lock:
                self._expiring -= len(expired)
            core.hooks.changed()        # they were what kept it busy: idle may hold now
        return True

    # ---- claim and submit ----------------------------------------------------------
    def submittable(self) -> bool:
        """A job is queued whose engine is free, an in-flight slot is free and the device
        takes work."""
        # the usual answer (nothing queued) without a call: the scheduler asks every step.
        # Under the lock: the completion thread asks too (the runtime's hand_off) while
        # the submitter changes the queue
        if not self._submit_q:
            return False
        with self.core.lock:
            return self._claimable() is not None

    def _claimable(self) -> int | None:
        """Index of the queued job :meth:`claim` would take now (back-off aside), or None.
        Core lock held: the submitter changes the queue while others ask."""
        core = self.core
        if not (self._submit_q and self._inflight < core.max_inflight
                and core.life.state == READY):
            return None
        # the usual case without a call: no engine busy, no batch preferring decodes
        i = 0 if not self._engine_busy and not (self._prefill_last and core.max_rows > 1) \
            else self._next_claim()
        if i is None or (core.max_rows > 1 and self._hold_for_rows(self._submit_q[i])):
            return None
        return i

    def _hold_for_rows(self, job: JobContext) -> bool:
        """Hold a partial batch back for rows on their way: while the completion side
        runs the continuations of a finished batch (each may queue its stream's next
        step: a bounded wait, never longer than that batch's host work), and then for at
        most ``batch_window_s`` while fewer rows are queued than that batch had."""
        core = self.core
        if not batchable(job, core.max_rows):
            return False
        queued = sum(1 for j in self._submit_q if j.kind is job.kind)
        if queued >= core.max_rows:
            return False
        if self._rows_following:
            return True
        return queued < self._last_rows \
            and core.clock.now() < self._followed_at + core.batch_window_s

    def rows_following(self, n: int) -> None:
        """The completion side is about to run (``n`` > 0) or has run (``-n``) the
        continuations of ``n`` rows of a batch; when none is left, a held batch may go
        (at once, or at the end of the window)."""
        core = self.core
        with core.lock:
            if n > 0 and not self._rows_following:
                self._last_rows = n
            self._rows_following += n
            if self._rows_following == 0:
                self._followed_at = core.clock.now()
                if self._submit_q:
                    core.hooks.work_queued()

    def _next_claim(self) -> int | None:
        """Index of the first queued job whose engine runs nothing now (ping/pong: one
        job per fixed engine), or None. Jobs of one sequence never wait side by side, so
        taking a later job first reorders only independent sequences. Core lock held."""
        busy = self._engine_busy
        if self._prefill_last and self.core.max_rows > 1:
            for i, job in enumerate(self._submit_q):
                if job.kind is TaskKind.DECODE and (
                        job.lease is None or job.lease.slot.engine not in busy):
                    return i
        if not busy:
            return 0 if self._submit_q else None
        for i, job in enumerate(self._submit_q):
            lease = job.lease
            if lease is None or lease.slot.engine not in busy:
                return i
        return None

    def submittable_now(self) -> bool:
        """Submittable, and no error back-off in force."""
        return self.submittable() and self.core.faults.backoff_until <= self.core.clock.now()

    def claim(self) -> JobContext | None:
        """Pop the head of the submit queue with an in-flight slot, if it may go now."""
        core = self.core
        with core.lock:
            core.heartbeat["submitter"] = now = core.clock.now()
            i = self._claimable()
            if i is None or core.faults.backoff_until > now:
                return None
            if i == 0:
                job = self._submit_q.popleft()
            else:
                job = self._submit_q[i]
                del self._submit_q[i]
            if batchable(job, core.max_rows):
                riders = gather(job, self._submit_q, core.max_rows)
                if riders:          # alone, it goes the way of any job (one row)
                    for r in riders:
                        self._submit_q.remove(r)
                        r.rides = True
                    job.batch = rows = [job, *riders]
                    for r in riders:
                        r.batch = rows
            self._prefill_last = job.kind.is_prefill
            self._inflight += 1
            job.holds_inflight = True
            engine = job.lease.slot.engine if job.lease is not None else EngineSlot.AUTO
            if engine is not EngineSlot.AUTO:
                self._engine_busy[engine] = job
            return job

    def submit_wait_s(self) -> float | None:
        """How long a submitter with nothing to claim may sleep: until the first queue
        deadline, the end of a batch hold or of a back-off; none if a job may go now
        (None: nothing queued)."""
        core = self.core
        with core.lock:
            if not self._submit_q:
                return None
            now = core.clock.now()
            # a job may go now: a hold the claim saw has ended since (a window ends
            # silently, nobody rings), so a wait until the first queue deadline would
            # strand the queue
            go = self._claimable() is not None
            first = min(j.queue_deadline for j in self._submit_q) - now
            held_until = self._followed_at + core.batch_window_s
            if self._last_rows and not self._rows_following and held_until > now:
                first = min(first, held_until - now)    # a held batch goes then
        backoff = core.faults.backoff_until - now
        if go:
            return max(0.0, backoff)            # only a back-off keeps it waiting
        return max(0.0, min(first, backoff) if backoff > 0 else first)

    def submit(self, job: JobContext) -> None:
        """The only caller of ``infer`` (spec 6.4). Holds an in-flight slot on entry."""
        if job.kind is TaskKind.DECODE and job.epoch.buckets is not None \
                and job.lease is not None:
            alone = _fit_graph(job)     # usually none: no lock taken then
            if alone:
                self._requeue_rows(alone)
        if job.batch is not None:
            self._submit_rows(job)
            return
        core, life, outcomes = self.core, self.core.life, self.outcomes
        if (err := _not_submittable(job, life.closing, core.clock.now())) is not None:
            self.release_inflight(job)      # ends here: the device never hears of it
            outcomes.fail_before_submit(job, err)
            return
        epoch = job.epoch
        slot = job.lease.slot
        tag = JobTag(job.job_id, job.seq_id, job.generation)
        handle = slot.model         # its graph's: the kind's widest, or a shape bucket
        driver = core.driver
        refused: CalfsmError | None = None
        with core.device_lock:      # no reset between this check and the job on the device
            if epoch is not life.epoch or epoch.retired or life.state != READY:
                rc = None
            elif slot.batch_rows != 1 and (refused := _programmed([job])) is not None:
                rc = -1                 # it led a batch before: back to one row failed
            elif slot.engine is EngineSlot.AUTO:
                rc = driver.infer(handle, slot.inp, slot.out, tag=tag)
            else:
                rc = driver.infer_fixed(handle, slot.inp, slot.out, slot.engine, tag=tag)
            if rc == 0:
                job.timings.submitted = now = core.clock.now()
                job.execution_deadline = now + core.service.execution_timeout_s(
                    job.kind, job.token_count)
                outcomes.leave_waiting(job)
                job.lease.mark_on_device()
                epoch.kv.mark_submitted(job.kv)
                with core.lock:
                    _fire(job, "submit")
                    self._on_device.append(job)
                    self._complete_q.append(job)
                    if not core.hooks.quiet:
                        core.hooks.job_submitted()
        if refused is not None:
            self._program_refused([job], refused)
            return
        if rc == 0:
            if slot.contract.batched or epoch.buckets is not None:  # the rest padding
                outcomes.observers.device_step(DeviceStep(
                    job.kind, 1, slot.contract.max_batch, slot.contract.exact_name))
            return
        if rc is None:
            self.release_inflight(job)
            self._left_ready(job)
            return
        self._submit_failed(job, from_calrt(rc, "submit", **job_ctx(job, None)))

    # ---- shape buckets: the graph a step runs on ---------------------------------------
    # ---- a batch: one device job, several rows ------------------------------------
    def _submit_rows(self, leader: JobContext) -> None:
        """Submit ``leader`` with the rows :meth:`claim` gathered (calfsm/engine/batchrows.py).
        Each row is checked as a job alone is (a cancelled or expired row fails alone,
        before the device hears of it); the leader's failing before submit puts the
        others back at the head of the queue, in order."""
        rows = self._rows_still_wanted(leader)
        if rows is None:
            return
        core, life = self.core, self.core.life
        epoch, slot = leader.epoch, leader.lease.slot
        tag = JobTag(leader.job_id, leader.seq_id, leader.generation)
        handle = slot.model         # its graph's: the kind's widest, or a shape bucket
        refused: CalfsmError | None = None
        with core.device_lock:      # programmed and run against no reset in between
            if epoch is not life.epoch or epoch.retired or life.state != READY:
                rc = None
            elif (refused := _programmed(rows)) is not None:
                rc = -1
            elif slot.engine is EngineSlot.AUTO:
                rc = core.driver.infer(handle, slot.inp, slot.out, tag=tag)
            else:
                rc = core.driver.infer_fixed(handle, slot.inp, slot.out, slot.engine,
                                             tag=tag)
            if rc == 0:
                self._rows_on_device(rows)
        if rc == 0:
            self.outcomes.observers.device_step(DeviceStep(
                leader.kind, len(rows), slot.contract.max_batch, slot.contract.exact_name))
            return
        if refused is not None:
            self._program_refused(rows, refused)
            return
        self.release_inflight(leader)
        _unbatch(rows)
        self._rows_not_submitted(rows, rc)

    def _rows_still_wanted(self, leader: JobContext) -> list[JobContext] | None:
        """The rows to submit: a cancelled or expired rider fails alone; a cancelled or
        expired leader fails and puts the others back (None: nothing to submit)."""
        outcomes, closing = self.outcomes, self.core.life.closing
        rows = leader.batch
        assert rows is not None
        now = self.core.clock.now()
        live: list[JobContext] = []
        for row in rows:
            err = _not_submittable(row, closing, now)
            if err is None:
                live.append(row)
                continue
            if row is leader:
                self._requeue_rows(rows[1:])
                self.release_inflight(leader)
                _unbatch([leader])
                outcomes.fail_before_submit(leader, err)
                return None
            _unbatch([row])
            outcomes.fail_before_submit(row, err)
        leader.batch = live
        for row in live[1:]:
            row.batch = live
        return live

    def _program_refused(self, rows: list[JobContext], e: CalfsmError) -> None:
        """Writing the rows into the leader's slot failed (:func:`_programmed`): the row
        the device refused fails alone (the others go back to the head of the queue)
        and the policy sees it."""
        leader = rows[0]
        culprit = next((r for r in rows if r.job_id == e.job_id), leader)
        self.release_inflight(leader)
        self._requeue_rows([r for r in rows if r is not culprit])
        _unbatch([culprit])
        self.core.decide(e)
        self.outcomes.fail_before_submit(culprit, e)

    def _rows_on_device(self, rows: list[JobContext]) -> None:
        """``infer`` took the job (device lock held): every row is submitted, each with
        its own execution deadline; only the leader's slot is on the device."""
        core, leader = self.core, rows[0]
        now = core.clock.now()
        timeout = core.service.execution_timeout_s(leader.kind, leader.token_count,
                                                   rows=len(rows))
        leader.lease.mark_on_device()
        for row in rows:
            row.timings.submitted = now
            row.execution_deadline = now + timeout
            self.outcomes.leave_waiting(row)
            row.epoch.kv.mark_submitted(row.kv)
        with core.lock:
            for row in rows:
                _fire(row, "submit")
                self._on_device.append(row)
            self._complete_q.append(rows[0])
            core.hooks.job_submitted()

    def _left_ready(self, job: JobContext) -> None:
        """The device left Ready (or the job's generation ended) before ``infer`` took
        ``job``: it waits for the next generation if it may, else it ends 503."""
        life = self.core.life
        if self.core.holdable(job) and not life.closing:
            self._hold([job])
            return
        self.outcomes.fail_before_submit(job, Unavailable(
            f"device left Ready ({life.state}) before the job was submitted",
            retry_after_s=life.retry_after_s, **job_ctx(job, "submit")))

    def _rows_not_submitted(self, rows: list[JobContext], rc: int | None) -> None:
        """``infer`` did not take the job: each row ends (or waits, or goes back) as a job
        alone would (:meth:`submit`, :meth:`_submit_failed`); the policy sees it once."""
        core, outcomes, leader = self.core, self.outcomes, rows[0]
        if rc is None:
            for row in rows:
                self._left_ready(row)
            return
        now = core.clock.now()
        err = from_calrt(rc, "submit", **job_ctx(leader, None))
        not_run = err.category in _NOT_RUN
        verdict = core.faults.decide(err, now, requeues=leader.requeues if not_run else None)
        if verdict.decision is Decision.REQUEUE:
            leader.requeues += 1
            self._requeue_rows(rows)
            outcomes.count("requeued")
            log.info("batch of %d rows led by job %s requeued after %s", len(rows),
                     leader.job_id, err.message, extra=err.context())
            return
        core.apply(verdict)
        for row in rows:
            row_err = from_calrt(rc, "submit", **job_ctx(row, None))
            if verdict.until > now and row_err.retry_after_s is None:
                row_err.retry_after_s = round(verdict.until - now, 6)
            if not_run:
                outcomes.fail_before_submit(row, row_err)
            else:
                outcomes.withhold(row, str(row_err))
                _fire(row, "fail")
                outcomes.finish(row, row_err, "failed")

    def _requeue_rows(self, rows: list[JobContext]) -> None:
        """Rows that did not go back to the head of the submit queue, in their order."""
        _unbatch(rows)
        with self.core.lock:
            self._submit_q.extendleft(reversed(rows))
            if rows:
                self.core.hooks.work_queued()

    def _submit_failed(self, job: JobContext, err: CalfsmError) -> None:
        """``infer`` returned an error. Busy and request errors prove the graph did not
        run: roll back (FI05), or requeue when the policy says so. Device or unknown
        errors leave the KV Unknown (FI06)."""
        core = self.core
        not_run = err.category in _NOT_RUN
        now = core.clock.now()
        verdict = core.faults.decide(err, now, requeues=job.requeues if not_run else None)
        if verdict.until > now and err.retry_after_s is None:
            err.retry_after_s = round(verdict.until - now, 6)   # e.g. DEVICE_BUSY
        if verdict.decision is Decision.REQUEUE:
            job.requeues += 1
            with core.lock:
                self._submit_q.appendleft(job)
                self.outcomes.count("requeued")
            self.release_inflight(job)
            log.info("job %s requeued after %s", job.job_id, err.message,
                     extra=err.context())
            return
        self.release_inflight(job)
        core.apply(verdict)                 # a drain begins before the caller hears
        if not_run:
            self.outcomes.fail_before_submit(job, err)
        else:
            self.outcomes.withhold(job, str(err))
            _fire(job, "fail")
            self.outcomes.finish(job, err, "failed")

    def device_barrier(self) -> None:
        """Wait for a submit in progress to finish. Called by recovery after the
        lifecycle left Ready: from then on no ``infer`` can reach the device until the
        new generation is Ready, so a reset never races a submit."""
        with self.core.device_lock:
            pass

    def run_step(self, job: JobContext, stage: str, step: Callable[[JobContext], None]
                 ) -> None:
        """One step of one job; an unexpected exception never strands the job (or stops
        the thread running it): see :meth:`step_crashed`."""
        try:
            step(job)
        except Exception as e:
            self.step_crashed(job, stage, e)

    def step_crashed(self, job: JobContext, stage: str, exc: BaseException) -> None:
        """An unexpected exception in a submit or completion step (a bug, or a driver
        raising where it must return a code). Never stuck: the job fails with Internal,
        its in-flight slot comes back if it still held one, its slot and KV are treated
        as suspect, and the generation is recovered like after an unknown error."""
        log.error("unexpected error in the %s step of job %s", stage, job.job_id,
                  exc_info=exc, extra=job_ctx(job, stage))
        self.release_inflight(job)
        err = Internal(f"unexpected {type(exc).__name__} in {stage}: {exc}",
                       category=ErrorCategory.UNKNOWN, **job_ctx(job, stage))
        try:
            self.outcomes.withhold(job, str(err))
        except Exception:
            log.exception("cleaning up after the crashed step of job %s", job.job_id)
        # the device's recovery begins before the job's caller is told: one that has the
        # error finds the executor draining, not still Ready on the suspect generation
        self.core.decide(err)
        if not job.ended:
            if not _fire_if(job, "quarantine"):
                _fire_if(job, "fail")
            self.outcomes.finish(job, err, "failed")

    def release_inflight(self, job: JobContext,
                         riders: list[JobContext] | None = None) -> bool:
        """The job no longer occupies the device: off the on-device list (with the
        ``riders`` of its batch), its in-flight slot given back (idempotent), whoever
        drives the pipeline told. True if a queued job may be submitted at once (the
        complete step then hands off: ``Hooks.hand_off``)."""
        core = self.core
        hand_off = False
        with core.lock:
            for j in (job, *(riders or ())):
                if j in self._on_device:
                    self._on_device.remove(j)
            if job.holds_inflight:
                job.holds_inflight = False
                self._inflight -= 1
                for engine, holder in list(self._engine_busy.items()):
                    if holder is job:
                        del self._engine_busy[engine]
                hand_off = not core.life.closing and self.submittable_now()
                if (self._submit_q or core.life.closing) and not core.hooks.quiet:
                    core.hooks.work_queued()
        if not core.hooks.quiet:
            core.hooks.changed()
        return hand_off

    # ---- the completion queue ------------------------------------------------------
    def pop_completion(self) -> JobContext | None:
        """The oldest submitted job whose Wait is due (called under the queue lock by
        the completion part, which counts it as being completed)."""
        with self.core.lock:
            return self._complete_q.popleft() if self._complete_q else None

    def wait_again(self, job: JobContext) -> None:
        """A Wait timed out and the device still owns ``job``: wait for it again."""
        with self.core.lock:
            self._complete_q.append(job)
            self.core.hooks.job_submitted()

    def take_held(self) -> list[JobContext]:
        """Every job the device holds, the completion queue emptied (a dead worker)."""
        with self.core.lock:
            jobs = list(self._complete_q) + list(self._on_device)
            self._complete_q.clear()
        return jobs


def _fit_graph(job: JobContext) -> list[JobContext]:
    """Move ``job`` (and the rows it leads) to the cheapest graph that covers the
    step, by the measured costs (calfsm/engine/shapes.py): a free slot of that graph
    on the same engine is leased, the job's row written into it from the slot it was
    prepared in (which goes back), its KV sequence and CSRs set. The KV is the
    sequence's, whichever graph wrote it (the evidence proved it continues
    bit-exact). No free slot there: the next cheapest that has one; none at all
    (every covering slot busy), it runs alone where it is: the rows it leads are
    returned, for the submit queue."""
    epoch = job.epoch
    buckets = epoch.buckets
    assert buckets is not None and job.lease is not None
    rows = job.batch if job.batch is not None else [job]
    current = job.lease.slot
    context = max(int(r.lease.slot.positions[r.token_count - 1]) + 1
                  for r in rows if r.lease is not None)
    tried: set[str] = set(epoch.graph_failures)
    while (best := buckets.choose(len(rows), context, exclude=tried)) is not None:
        if best.exact_name == current.contract.exact_name:
            return []           # prepared in it: runs where it is
        tried.add(best.exact_name)
        try:
            moved = epoch.pool.acquire(TaskKind.DECODE, current.engine,
                                       graph=best.exact_name)
        except ResourceExhausted:
            continue            # none free now: the next cheapest
        except CalfsmError:
            return []           # the generation retired: the submit below says so
        try:
            moved.bind(job_id=job.job_id, seq_id=job.seq_id)
            moved.load_row(0, current, job.seq_id, job.token_count, job_id=job.job_id)
        except CalfsmError as e:
            log.warning("job %s not moved to %s: %s", job.job_id, best.exact_name, e,
                        extra=e.context())
            epoch.pool.release(moved)
            break
        prepared, job.lease = job.lease, moved
        epoch.pool.release(prepared)
        return []
    if len(rows) > current.contract.max_batch:     # it cannot carry them: alone
        _unbatch(rows)
        return rows[1:]
    return []


def _unbatch(rows: list[JobContext]) -> None:
    """The rows no longer share a device job (each goes on, or ends, alone)."""
    for row in rows:
        row.batch = None
        row.rides = False


def _programmed(rows: list[JobContext]) -> CalfsmError | None:
    """Write the rows into the leader's slot (device lock held); the error of the row
    the device refused, to be handled once the lock is given back."""
    try:
        program_rows(rows)
    except CalfsmError as e:
        return e
    return None


def _not_submittable(job: JobContext, closing: bool, now: float) -> CalfsmError | None:
    """Why ``job`` may not go to the device (spec 9.1): cancelled, the executor
    closing, or past its queue deadline; None when it may."""
    if job.cancel_requested or closing:
        return Cancelled("cancelled before submit", **job_ctx(job, "submit"))
    if now >= job.queue_deadline:
        return _queue_deadline_passed(job)
    return None


def _queue_deadline_passed(job: JobContext) -> DeadlineExceeded:
    return DeadlineExceeded("queue deadline passed before submit", **job_ctx(job, "queue"))
