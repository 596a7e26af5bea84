"""The sans-thread core of the executor: its parts, and what spans more than one of them.

Theory of operation
-------------------
A job flows through four *steps*, each a method that does one bounded piece of work,
returns what happened and never sleeps or reads a wall clock (time comes only from the
driver's injected clock):

``admit``     validate once -> exact sub-model -> KV reservation -> buffer lease
``prepare``   copy inputs, set slices, CSRs and KV sequence -> submit queue
``submit``    (the only caller of ``infer``) cancel/deadline check -> infer -> Submitted
``complete``  (the only caller of ``wait``, holding no lock) wait -> status -> output
              check -> BF16->FP32 into the target -> KV commit -> undo slices ->
              the job's continuation (a stream's next step to the submitter) ->
              resolve -> return the lease (spec 6.5's order)

Each part of the pipeline owns its own state and is a module of its own:

* :mod:`calfsm.engine.admission` (``pipe.admission``): accept, validate, admit and prepare; the
  parked jobs, the deferred work, the job ids;
* :mod:`calfsm.engine.overlap` (``pipe.overlap``): a stream's next step prepared ahead;
* :mod:`calfsm.engine.submission` (``pipe.device``): the submit queue, the in-flight slots, the
  jobs on the device and the only call of ``infer``;
* :mod:`calfsm.engine.completion` (``pipe.completion``): the only call of ``wait`` and the way
  back;
* :mod:`calfsm.engine.outcomes` (``pipe.outcomes``): every job's one end, the counters, the
  observers;

and :mod:`calfsm.engine.parts` holds what they share. This module builds them and does what
spans several at one instant: a cancel (wherever the job waits), a drain taking every job
that has not reached the device, the idle check, a dead worker, and step mode.

Who drives the steps is not this module's business: :mod:`calfsm.runtime.drive` runs them on a
submitter and a completion thread, :class:`calfsm.runtime.stepper.StepScheduler` one at a time
from a seed. The pipeline tells its driver that something changed through
:class:`~calfsm.engine.parts.Hooks` (the thread runtime rings doorbells there; step mode needs
nothing).

Every failure releases what was taken in reverse order. Before ``infer()`` succeeded a
lease goes back to the pool and the KV reservation rolls back; after it, only the
completion or recovery path touches them, and a failure leaves the KV ``Unknown`` and the
slot quarantined (the device may have written them). Every accepted job ends exactly once,
through :meth:`JobHandle._resolve`.

Lock order: lifecycle -> the runtime's condition -> device (``core.device_lock``) ->
queues (``core.lock``, one for every part's queues); the KV coordinator's, the pool's, a
handle's and the fault policy's locks are leaves (nothing is taken while holding one). No
runtime call is made holding the queue lock; ``wait`` is called holding no lock at all.
The device lock is held only around one ``infer`` (and its generation check) and the
reading of a finished output: recovery passes through it once after leaving Ready, so no
submit can race a reset.
"""

from __future__ import annotations

from collections.abc import Callable

from calfsm.drivers.base import Driver, EngineSlot
from calfsm.engine.admission import Admission
from calfsm.engine.completion import Completion
from calfsm.engine.job import JobContext
from calfsm.engine.lifecycle import Lifecycle
from calfsm.engine.observe import Observers
from calfsm.engine.outcomes import COUNTERS, Outcomes
from calfsm.engine.overlap import Overlap
from calfsm.engine.parts import Core, Hooks, PipelineTimeouts, job_ctx
from calfsm.engine.recovery import FaultPolicy, Verdict
from calfsm.engine.stepcost import ServiceModel
from calfsm.engine.submission import Submission
from calfsm.errors import CalfsmError, Cancelled, ExecutorBroken

__all__ = ["COUNTERS", "Hooks", "Pipeline", "PipelineTimeouts"]


class Pipeline:
    """The core's parts, built on one :class:`~calfsm.engine.parts.Core`, and the operations
    that span them."""

    def __init__(self, driver: Driver, life: Lifecycle, faults: FaultPolicy, *,
                 timeouts: PipelineTimeouts, service: ServiceModel, max_inflight: int,
                 engines: tuple[EngineSlot, ...], apply: Callable[[Verdict], None],
                 drain: Callable[[str], bool], max_rows: int = 1,
                 batch_window_s: float = 0.0) -> None:
        self.core = core = Core(driver, life, faults, timeouts=timeouts, service=service,
                                max_inflight=max_inflight, engines=engines, apply=apply,
                                drain=drain, max_rows=max_rows,
                                batch_window_s=batch_window_s)
        self.outcomes = Outcomes(core)
        self.device = Submission(core, self.outcomes, self._hold)
        self.admission = Admission(core, self.outcomes, self.device)
        self.overlap = Overlap(core, self.admission)
        self.completion = Completion(core, self.outcomes, self.device, self.overlap.follow,
                                     self.admission.defer)
        #: the KV books or the pool gave something back (their ``on_freed``): the
        #: admission's own check, with no hop between, as it runs at every token's commit
        self.capacity_freed: Callable[[], None] = self.admission.capacity_freed
        #: who releases KV nobody is using when the device refuses room for a reservation
        #: (the executor's prompt cache; None: nobody). Called with no KV lock held
        self.kv_room: Callable[[], None] | None = None

    def _hold(self, jobs: list[JobContext]) -> None:
        """The device side met jobs that cannot run in this generation (it left Ready
        under them): the admission parks them for the next one. A method, not the
        admission's own, because the device side is built first."""
        self.admission.hold(jobs)

    # ---- what the parts share, read by the lifecycle and the runtimes --------------
    @property
    def clock(self):
        return self.core.clock

    @property
    def faults(self) -> FaultPolicy:
        return self.core.faults

    @property
    def max_inflight(self) -> int:
        return self.core.max_inflight

    @property
    def hooks(self) -> Hooks:
        return self.core.hooks

    @hooks.setter
    def hooks(self, hooks: Hooks) -> None:
        self.core.hooks = hooks

    @property
    def observers(self) -> Observers:
        return self.outcomes.observers

    @property
    def inflight(self) -> int:
        return self.device.inflight

    @property
    def broken(self) -> str | None:
        """Why the pipeline stopped for good (a worker died), or None."""
        return self.core.broken

    # ---- observation over the parts ------------------------------------------------
    def counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """(counters, errors by category), a consistent snapshot."""
        return self.outcomes.counts()

    def count(self, name: str) -> None:
        self.outcomes.count(name)

    def depths(self) -> tuple[int, int]:
        """(in flight, waiting: accepted and not yet on the device)."""
        with self.core.lock:
            return self.device.inflight, self.outcomes.waiting

    def heartbeat(self, worker: str) -> float:
        return self.core.heartbeat[worker]

    def beat(self, worker: str) -> None:
        """A worker is alive and looking for work (clock time)."""
        self.core.heartbeat[worker] = self.core.clock.now()

    def idle(self) -> bool:
        """Nothing waits, is queued, on the device or waiting for its completion, and no
        deferred work is left."""
        with self.core.lock:
            return not (self.admission.busy() or self.overlap.busy()
                        or self.device.busy() or self.completion.busy())

    def next_deadline(self) -> float:
        """Earliest deadline a parked or queued job waits for."""
        with self.core.lock:
            return min(self.admission.first_deadline(), self.device.first_queue_deadline())

    # ---- what the lifecycle's procedures use (calfsm.engine.lifecycle.PipelineControl) ----
    def device_barrier(self) -> None:
        self.device.device_barrier()

    def idle_on_device(self) -> bool:
        return self.device.idle_on_device()

    def completion_idle_s(self) -> float | None:
        return self.device.completion_idle_s()

    # ---- across the parts ----------------------------------------------------------
    def cancel(self, job: JobContext) -> None:
        """Stop a job. Whoever owns it sees the flag at its next step boundary; a job
        still waiting in the submit queue or for admission is finished here at once."""
        with self.core.lock:
            job.cancel_requested = True
            removed = self.device.unqueue(job) or self.admission.unpark(job)
        self.core.hooks.changed()
        if removed:
            self.outcomes.fail_before_submit(job, Cancelled("cancelled before submit",
                                                            **job_ctx(job, "cancel")))

    def take_waiting(self) -> list[JobContext]:
        """Remove and return every job that has not reached the device."""
        with self.core.lock:
            jobs = (self.admission.take_parked() + self.device.take_queued()
                    + self.overlap.take_staged())
        self.core.hooks.changed()
        return jobs

    def fail_waiting(self, err: CalfsmError) -> None:
        """Fail every job that has not reached the device (each with its own copy)."""
        for job in self.take_waiting():
            self.outcomes.fail_before_submit(job, _copy(err))

    def hold_waiting(self, err: CalfsmError) -> None:
        """The device is about to be reset (a drain): what has not reached it waits for
        the next generation where it can run there, and fails with ``err`` where it
        cannot. A job that starts its sequence afresh (``past_len == 0``: a prefill of a
        new prompt, a stream's first step or its replay) gives back what it took in this
        generation and is parked again, ahead of anything newer. A job that continues a
        sequence's KV (a stream's next step) cannot run after a reset, which loses that
        KV: it fails, retryable, and its stream resumes. A step staged ahead is
        discarded the same way."""
        held = []
        for job in self.take_waiting():
            if self.core.holdable(job):
                held.append(job)
            else:
                self.outcomes.fail_before_submit(job, _copy(err))
        self.admission.hold(held)

    def kv_full(self) -> None:
        """The device refused KV for a reservation (the KV books' ``on_full``): whoever
        keeps KV warm for nobody gives some back (its release calls ``on_freed``), and
        the admission step asks the device again after a back-off, whatever else frees."""
        self.admission.device_refused()
        room = self.kv_room
        if room is not None:
            room()

    def recovery_wanted(self) -> None:
        """A drain wants an automatic recovery: whoever drives the pipeline runs it."""
        self.core.hooks.recovery_wanted()

    def wake_waiters(self) -> None:
        """Wake whoever waits for the pipeline to change (a drain, a close), so it sees
        a changed lifecycle. Nobody waits inside the KV books or the pool."""
        self.core.hooks.changed()

    def break_(self, reason: str) -> None:
        """A worker died: admit nothing more and fail every job that has not ended, so
        nobody waits forever. Jobs on the device keep their (quarantined) buffers."""
        self.core.broken = reason
        stuck = self.device.take_held()
        for job in self.take_waiting():
            self.outcomes.fail_before_submit(job, ExecutorBroken(
                f"executor is broken: {reason}", **job_ctx(job, "broken")))
        self.abandon(stuck, lambda job: ExecutorBroken(f"executor is broken: {reason}",
                                                       **job_ctx(job, "broken")))
        self.wake_waiters()

    def abandon(self, jobs: list[JobContext],
                error: Callable[[JobContext], CalfsmError]) -> None:
        """Give up jobs the device still holds (shutdown past its timeout, a dead
        worker): each is resolved with ``error(job)``, its KV marked Unknown and its slot
        quarantined; a Wait that returns later finds nothing to do."""
        for job in dict.fromkeys(jobs):
            if not job.ended:
                self.outcomes.abandon(job, error(job))
        self.core.hooks.changed()

    # ---- step mode -----------------------------------------------------------------
    def expire_waiting(self) -> None:
        """Fail every parked job past its admission deadline and every queued job past
        its queue deadline."""
        self.admission.expire_parked()
        self.device.fail_expired()

    def submit_next(self) -> bool:
        """Expire, then submit the head of the queue if an in-flight slot is free (on a
        virtual clock a back-off is jumped over). True if anything moved."""
        device, clock, faults = self.device, self.core.clock, self.core.faults
        if device.fail_expired():
            return True
        backoff = faults.backoff_until       # 0: none (no clock read then)
        if backoff and clock.virtual and backoff > clock.now() and device.submittable():
            clock.advance_to(backoff)
        job = device.claim()
        if job is None:
            return False
        device.run_step(job, "submit", device.submit)
        return True

    def complete_next(self) -> bool:
        job = self.completion.next_completion()
        if job is None:
            return False
        self.completion.run_completion(job)
        return True


def _copy(err: CalfsmError) -> CalfsmError:
    """A fresh error of the same kind and message, for one of many jobs."""
    return type(err)(err.message, category=err.category, stage=err.stage,
                     retry_after_s=err.retry_after_s)
