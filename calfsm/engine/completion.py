"""The way back: the only caller of ``wait``, the output check, the KV commit, the result.

:meth:`Completion.complete` is spec 6.5's order for one job: wait (holding no lock) ->
status -> output check -> BF16->FP32 into the target -> undo slices -> the job's
continuation (a stream's next step handed to the submitter, its KV chained after this
job's) -> KV commit -> resolve -> return the lease. The in-flight slot is given back as
soon as the wait returns, so the next job goes to the device before this one's host
work. A Wait past the execution deadline (FI07), a completion of a retired generation
(FI14) and every failure on the way have their own ends here; what they give back is
the outcomes part's business.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from calfsm.drivers.base import OutputStatus
from calfsm.engine.batchrows import row_logits
from calfsm.engine.buffers import BufferSlot
from calfsm.engine.job import InferenceResult, JobContext
from calfsm.engine.outcomes import Outcomes, limited
from calfsm.engine.parts import Core, job_ctx
from calfsm.engine.readback import (
    check_job,
    check_output,
    convert_row,
    is_row_failure,
    read_output,
    row_failure,
)
from calfsm.engine.submission import Submission
from calfsm.engine.tail import tail_rows
from calfsm.errors import (
    CalfsmError,
    CalrtCode,
    Cancelled,
    DeadlineExceeded,
    ErrorCategory,
    Unavailable,
    from_calrt,
)
from calfsm.machines.job import JOB_MACHINE
from calfsm.machines.lifecycle import LifecycleState

__all__ = ["Completion"]

log = logging.getLogger("calfsm.pipeline")

_fire = JOB_MACHINE.fire
_fire_if = JOB_MACHINE.fire_if_declared


class Completion:
    """The complete step and its failures (see the module docstring)."""

    def __init__(self, core: Core, outcomes: Outcomes, device: Submission,
                 follow: Callable[..., None],
                 defer: Callable[[Callable[[], None]], None]) -> None:
        self.core = core
        self.outcomes = outcomes
        self.device = device
        #: runs what a continuation decided (the overlap part's)
        self._follow = follow
        #: hands work to the admission side (a batch's, once its next step went)
        self._defer = defer
        self._completing = 0        # jobs out of the complete queue, step not yet done

    def busy(self) -> bool:
        """A job was given out for completion and its step has not returned."""
        return bool(self._completing)

    def next_completion(self) -> JobContext | None:
        """Pop the oldest submitted job whose Wait is due; run it with
        :meth:`run_completion`."""
        with self.core.lock:
            job = self.device.pop_completion()
            if job is not None:
                self._completing += 1
            return job

    def drop_completion(self, job: JobContext) -> None:
        """Give up a job :meth:`next_completion` gave out without completing it (a
        shutdown abandoning a zombie the device never let go)."""
        with self.core.lock:
            self._completing -= 1
        self.core.hooks.changed()

    def run_completion(self, job: JobContext) -> None:
        """The complete step of a job :meth:`next_completion` gave out. Until it returns
        (the job resolved, its callbacks run) the pipeline is not idle: a stream's
        one-shot sequence is released from those callbacks."""
        try:
            self.device.run_step(job, "complete", self.complete)
        finally:
            with self.core.lock:
                self._completing -= 1
            if not self.core.hooks.quiet:
                self.core.hooks.changed()

    def completion_timeout_s(self, job: JobContext, now: float | None = None) -> float:
        """How long the Wait of ``job`` may block (its execution deadline; a slice for a
        job already given up); ``now``: the clock's time, if the caller has read it."""
        if job.ended:
            return self.core.t.zombie_wait_s
        if now is None:
            now = self.core.clock.now()
        return max(0.0, job.execution_deadline - now)

    def complete(self, job: JobContext) -> None:
        """The only caller of ``wait`` (spec 6.5); holds no lock while waiting."""
        if job.lease is None:       # abandoned by a shutdown that could not drain it
            return
        if job.batch is not None:
            self._complete_rows(job)
            return
        core = self.core
        clock, life = core.clock, core.life
        slot = job.lease.slot
        zombie = job.ended         # already failed by its execution deadline
        t0 = clock.now()
        rc = core.driver.wait(slot.out, self.completion_timeout_s(job, t0))
        t1 = clock.now()
        core.heartbeat["completion"] = t1
        job.timings.device_wait_ms += (t1 - t0) * 1e3
        if rc == CalrtCode.TIMEOUT:
            if not zombie:
                self._execution_timeout(job)
            if life.state == LifecycleState.FAILED and not life.closing:
                log.error("abandoning job %s on a failed device; its buffers stay "
                          "quarantined until the process exits", job.job_id,
                          extra=job_ctx(job, "wait"))
                return
            self.device.wait_again(job)     # keep waiting: the device still owns it
            return
        if self.device.release_inflight(job):   # the device is free: the next job first
            core.hooks.hand_off()
        job.lease.mark_off_device()
        if zombie:
            self._late_completion(job, rc)
            return
        out = self._output(job, rc, slot, t1)
        if out is None:
            return
        self._succeed(job, out[0], t1, start=out[1])

    # ---- a batch: one wait, every row on its own -----------------------------------
    def _complete_rows(self, leader: JobContext) -> None:
        """The complete step of a batch (calfsm/engine/batchrows.py): one ``wait`` on the
        leader's slot, then each row as a job alone (:meth:`_end_rows`). Until the last
        row's continuation ran, the submitter holds a partial batch back for the rows
        these continuations queue (``Submission.rows_following``)."""
        core = self.core
        rows = leader.batch
        assert rows is not None
        zombie = leader.ended
        t0 = core.clock.now()
        rc = core.driver.wait(leader.lease.slot.out, self.completion_timeout_s(leader))
        t1 = core.clock.now()
        core.heartbeat["completion"] = t1
        for row in rows:
            row.timings.device_wait_ms += (t1 - t0) * 1e3
        if rc == CalrtCode.TIMEOUT:
            if not zombie:
                self._execution_timeout_rows(rows)
            if core.life.state == LifecycleState.FAILED and not core.life.closing:
                log.error("abandoning a batch of %d rows led by job %s on a failed device",
                          len(rows), leader.job_id, extra=job_ctx(leader, "wait"))
                return
            self.device.wait_again(leader)
            return
        held = [len(rows)]

        def let_go() -> None:           # the submitter need wait for no more rows
            if held[0]:
                self.device.rows_following(-held[0])
                held[0] = 0
                core.hooks.hand_off()       # a batch held back for them may go now

        self.device.rows_following(len(rows))
        try:
            if self.device.release_inflight(leader, rows[1:]):
                core.hooks.hand_off()
            leader.lease.mark_off_device()
            self._end_rows(leader, rows, rc, zombie, t1, let_go)
        finally:
            let_go()
            for row in rows:
                row.batch = None
                row.rides = False

    def _end_rows(self, leader: JobContext, rows: list[JobContext], rc: int,
                  zombie: bool, waited: float, let_go: Callable[[], None]) -> None:
        """Each row of a finished batch ends as a job alone would: a job-level failure
        (the wait, the status, the output size) fails every row and is shown to the
        fault policy once, a row's own ending fails only it, every row that ran well is
        converted, continued, committed and resolved. Every row is converted before any
        resolves, so the leader's slot (holding every row's output) is given back only
        after the last row was read; every row's continuation runs before any commits,
        and then the submitter may go (``let_go``) with the next steps they queued while
        this thread commits and resolves."""
        core = self.core
        slot = leader.lease.slot
        if zombie:
            for row in rows:
                self._late_completion(row, rc)
            return
        with core.device_lock:
            current = leader.epoch is core.life.epoch and not leader.epoch.retired
            if current and rc == 0:
                reading = read_output(core.driver, slot.out, slot.contract)
                ends = [core.driver.row_status(slot.out, r)  # type: ignore[attr-defined]
                        for r in range(len(rows))]
        if not current:
            for row in rows:
                self._late_completion(row, rc)
            return
        for row in rows:
            _fire(row, "complete")
        results = self._row_results(leader, rc, reading if rc == 0 else None,
                                    ends if rc == 0 else [])
        continued = [not isinstance(result, CalfsmError)
                     and row.kv.prev_len <= row.kv.target_len
                     for row, result in zip(rows, results, strict=True)]
        later: list[Callable[[], None]] = []     # staging the steps after: off the path
        for row, result, early in zip(rows, results, continued, strict=True):
            if early:
                self._continue(row, result, later)
        let_go()
        tail_ms = (core.clock.now() - waited) * 1e3
        for row in rows:
            row.timings.tail_ms = tail_ms
        for fn in later:
            self._defer(fn)
        decided = False
        for row, result, early in zip(rows, results, continued, strict=True):
            if isinstance(result, CalfsmError):
                job_level = not is_row_failure(result)
                self._completion_failed(row, result, decide=not (job_level and decided))
                decided = decided or job_level
            else:
                self._succeed(row, result, waited, continued=early)

    def _row_results(self, leader: JobContext, rc: int, reading: Any,
                     ends: list[int]) -> list[Any]:
        """Each row's float32 logits (converted into its target), or its error: the
        job's (every row the same failure, each with its own context) or the row's own
        ending (stage ``row``)."""
        rows = leader.batch
        assert rows is not None
        contract = leader.lease.slot.contract

        def judged(ctx: dict[str, Any]) -> CalfsmError | None:
            try:
                if rc != 0:
                    raise from_calrt(rc, "wait", **ctx)
                check_job(reading, contract, ctx)
            except CalfsmError as e:
                return e
            return None

        if judged(job_ctx(leader, None)) is not None:    # the job failed: every row, once
            return [judged(job_ctx(row, None)) for row in rows]
        results: list[Any] = [None] * len(rows)
        ok = []
        for r, row in enumerate(rows):
            if ends[r] != OutputStatus.DONE_OK:
                results[r] = row_failure(ends[r], r, job_ctx(row, None))
            else:
                ok.append(r)
        tailed = tail_rows(leader.lease.slot.logits_bf16, reading, contract,
                           [(r * contract.rows * contract.vocab, rows[r]) for r in ok])
        for r, done in zip(ok, tailed, strict=True):
            row = rows[r]
            if done is not None:
                results[r] = done
                continue
            try:
                results[r] = convert_row(reading, row_logits(leader, r), contract,
                                         row.token_count, row.request.target,
                                         job_ctx(row, None))
            except CalfsmError as e:
                results[r] = e
        return results

    def _execution_timeout_rows(self, rows: list[JobContext]) -> None:
        """A batch's wait passed the execution deadline (FI07): every row as a job
        alone; the drain begins once."""
        self._execution_timeout(rows[0])
        for row in rows[1:]:
            err = DeadlineExceeded("execution deadline passed; the job may still be "
                                   "running on the device", category=ErrorCategory.TRANSIENT,
                                   calrt_code=int(CalrtCode.TIMEOUT), **job_ctx(row, "wait"))
            row.epoch.kv.mark_unknown(row.kv, "execution timeout")
            _fire(row, "quarantine")
            self.outcomes.finish(row, err, "quarantined")

    def _output(self, job: JobContext, rc: int, slot: BufferSlot,
                waited: float) -> tuple[Any, float] | None:
        """Read and check the output of a job whose Wait returned ``rc`` from ``slot``,
        its lease's (the slices are undone in the same device-lock section), and the clock
        when they were; None when the job ended on the way."""
        core = self.core
        contract = slot.contract
        undo_error: CalfsmError | None = None
        with core.device_lock:      # no reset between the fence check and device calls
            current = job.epoch is core.life.epoch and not job.epoch.retired
            if current and rc == 0:
                reading = read_output(core.driver, slot.out, contract)
                try:                # input slices are done with: the job ran (see below)
                    job.lease.undo_slices()
                except CalfsmError as e:    # the slot goes to quarantine on return (FI15)
                    undo_error = e
        if undo_error is not None:
            log.warning("undo_slices failed after the job ran: %s", undo_error,
                        extra=undo_error.context())
        if not current:
            self._late_completion(job, rc)
            return None
        _fire(job, "complete")
        try:
            if rc != 0:
                raise from_calrt(rc, "wait", **job_ctx(job, None))
            logits = None
            if job.tail is not None:    # a stream's step: its token in the same call
                check_job(reading, contract, job_ctx(job, None))
                if reading[3] is None or reading[3] == OutputStatus.DONE_OK:
                    logits = tail_rows(slot.logits_bf16, reading, contract, [(0, job)])[0]
            if logits is None:
                logits = check_output(reading, slot.logits_bf16, contract, job.token_count,
                                      job.request.target, job_ctx(job, None))
            # from the wait's return (the one clock read of the way, issue 35 item 4):
            # the output's reads, their checks and the conversion
            t2 = core.clock.now()
            job.timings.d2h_ms = (t2 - waited) * 1e3
        except CalfsmError as e:
            self._completion_failed(job, e)
            return None
        return logits, t2

    def _succeed(self, job: JobContext, logits: Any, waited: float, *,
                 continued: bool = False, start: float | None = None) -> None:
        """The job ran and its output is good: continuation, KV commit, resolve, lease
        (``continued``: a batch row whose continuation already ran, :meth:`_end_rows`).

        Spec 6.5 orders KV commit -> undo slices -> resolve -> return the lease. The
        slices were undone in :meth:`_output`, in the same device-lock section as the
        output reads (one lock trip per job): the commit is host bookkeeping of a KV the
        device has already written, and the undo touches only this slot's tensor views,
        so the two commute. The result is resolved before the lease goes back.
        ``start``: the clock as :meth:`_output` last read it (None: read it here)."""
        core = self.core
        t3 = core.clock.now() if start is None else start
        kv = job.kv
        # the next step first: it is reserved chained after this one (calfsm/engine/kv.py), so
        # it need not wait for this commit. Not after a rewinding prefill, whose commit
        # may trim on the device and fail: a step must never follow a KV nobody vouches for
        early = kv.prev_len <= kv.target_len
        if early and not continued:
            self._continue(job, logits)
            job.timings.tail_ms = (core.clock.now() - waited) * 1e3
        try:
            job.epoch.kv.commit(kv)
        except CalfsmError as e:
            # the books are closed and the sequence is Unknown (e.g. a rewinding prefill
            # whose trim failed): the logits are right, but the caller must not go on
            # with a sequence whose KV nobody vouches for
            self._kv_commit_failed(job, e)
            return
        if not early:
            self._continue(job, logits)
        now = core.clock.now()
        job.timings.completed = now
        job.timings.postprocess_ms = (now - t3) * 1e3
        lease, job.lease = job.lease, None
        if job.waiting:             # (it left the waiting books when it was submitted)
            self.outcomes.leave_waiting(job)
        if JOB_MACHINE.fire(job, "succeed"):
            self.outcomes.succeeded(job, InferenceResult(
                job.job_id, job.seq_id, job.generation, job.kind, job.token_count, logits,
                job.timings))
        else:                                       # cancelled after submit (FI12)
            _fire(job, "fail")
            self.outcomes.dropped(job, Cancelled(
                "cancelled after submit; the job ran, its result was dropped",
                **job_ctx(job, "complete")))
        # the slot and the KV came free: their on_freed wakes the admission step, and
        # only when a job waits for them (no wake-up per token otherwise)
        job.epoch.pool.release(lease)
        core.service.observe(job.kind, job.token_count, job.timings.queued, waited)
        core.faults.succeeded()

    def _continue(self, job: JobContext, logits: Any,
                  later: list[Callable[[], None]] | None = None) -> None:
        """Run the job's continuation (a stream's decision: sample, record) before the
        job resolves, and then what it decided: the step prepared ahead goes to the
        submitter with its token, so the device gets its next step before the caller's
        callbacks run. A continuation that raises is a bug of its owner, logged; its
        stream then goes on the ordinary way."""
        cont, job.continuation = job.continuation, None
        if cont is None or job.cancel_requested:
            return
        try:
            successor = cont(job, logits)
        except Exception:
            log.exception("the continuation of job %s raised", job.job_id,
                          extra=job_ctx(job, "continue"))
            return
        if successor is not None:
            if later is None:
                self._follow(job, successor)
                if not self.core.hooks.quiet:   # its next step may go before this one's end
                    self.core.hooks.hand_off()
            else:
                self._follow(job, successor, defer=later.append)

    def _kv_commit_failed(self, job: JobContext, err: CalfsmError) -> None:
        """The job ran and its slot is clean, but its KV could not be committed."""
        lease, job.lease = job.lease, None
        _fire(job, "fail")
        self.core.decide(err)                  # before the caller hears
        self.outcomes.finish(job, err, "failed")
        job.epoch.pool.release(lease)

    def _completion_failed(self, job: JobContext, err: CalfsmError, *,
                           decide: bool = True) -> None:
        """Wait error, CCU exception, bad or non-finite output: the job fails, the KV is
        Unknown (the device ran), the slot is quarantined, the fault policy decides
        (``decide=False``: a batch's other rows of one job-level failure it has seen).
        A row's own failure goes its own way (:meth:`_row_failed`)."""
        if is_row_failure(err):
            self._row_failed(job, err)
            return
        # the raw output, for observers (a dump sink): the slot is quarantined below, so
        # its host arrays stay as the device left them
        outcomes = self.outcomes
        output = job.lease.slot.logits_bf16 if outcomes.observers.jobs else None
        outcomes.withhold(job, str(err))
        _fire(job, "quarantine")
        if decide:
            self.core.decide(err)              # before the caller hears
        outcomes.finish(job, err, "quarantined", output=output)

    def _row_failed(self, job: JobContext, err: CalfsmError) -> None:
        """A row of a batch graph's job ended otherwise while the job ended DONE_OK
        (``row_status``): only this row fails. Its KV is Unknown (after submit nothing
        is proven: spec 7), so its sequence alone is reset before it goes on (a stream
        resumes or ends as its policy says). The job ran well, so nothing of the device
        is suspect: the slot goes back (a rider's never reached the device; a leader's
        job is over and wrote its whole output tensor, read before any row resolves),
        and the policy drains nothing (:meth:`FaultPolicy.row_failed`), so the other
        rows' streams go on without a resume."""
        outcomes = self.outcomes
        output = job.lease.slot.logits_bf16.copy() \
            if outcomes.observers.jobs and job.lease is not None else None
        outcomes.withhold(job, str(err), slot_clean=True)
        _fire(job, "fail")
        core = self.core
        core.apply(core.faults.row_failed(err))    # before the caller hears
        outcomes.finish(job, err, "failed", output=output)

    def _execution_timeout(self, job: JobContext) -> None:
        """Wait timed out past the execution deadline (FI07): no logits, KV Unknown,
        the buffers stay with the device (quarantined, kept alive), admission stops and
        recovery decides; the job's caller is told now."""
        err = DeadlineExceeded("execution deadline passed; the job may still be running "
                               "on the device", category=ErrorCategory.TRANSIENT,
                               calrt_code=int(CalrtCode.TIMEOUT), **job_ctx(job, "wait"))
        job.epoch.kv.mark_unknown(job.kv, "execution timeout")
        _fire(job, "quarantine")
        # the drain begins before the caller hears
        self.core.drain(f"execution deadline passed for job {job.job_id}")
        self.outcomes.finish(job, err, "quarantined")

    def _late_completion(self, job: JobContext, rc: int) -> None:
        """Wait returned for a job already failed by its execution deadline, or for a job
        of a retired generation (FI14): resolve only its own job, touch nothing of the
        current generation (no KV, no pool slot, no metric of it)."""
        old = job.epoch
        if old is not self.core.life.epoch or old.retired:
            self.outcomes.count("stale_completions")
            limited.warning("stale_completion", "stale completion of generation %s fenced",
                            job.generation, extra={**job_ctx(job, "stale_completion"),
                                                   "calrt_code": rc})
        self.outcomes.withhold(
            job, "completion after the job was given up or its generation reset")
        if not job.ended:
            _fire_if(job, "quarantine")
            self.outcomes.finish(job, Unavailable(
                f"completion of generation {job.generation} arrived after a reset; "
                "result discarded", **job_ctx(job, "stale_completion")), "quarantined")

