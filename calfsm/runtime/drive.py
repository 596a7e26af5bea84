"""Who drives the pipeline: worker threads (:class:`ThreadRuntime`) or a test's step
scheduler (:class:`StepRuntime`). Both drive the *same* steps of
:class:`~calfsm.engine.pipeline.Pipeline` and :class:`~calfsm.engine.lifecycle.DeviceLifecycle`.

Theory of operation (threads)
-----------------------------
The caller's thread runs admission and preparation of a blocking ``enqueue`` (waiting for
KV and buffers, bounded by the admission deadline); a job enqueued without blocking
(``enqueue_nowait``, ``await executor.submit``) that must wait is *parked*, holding no
thread, and an admission thread admits parked jobs in FIFO order whenever capacity may
have come free (the same admission step step mode runs). A submitter thread runs the
submit step (the only ``infer`` caller); a completion thread runs the complete step (the
only ``wait`` caller); a short-lived recovery thread runs a recovery once its drain
condition holds.

Hand-offs: the submitter and the completion thread sleep on their own
:class:`~calfsm.runtime.doorbell.Doorbell` (a C-level wake-up) and re-check the queues after
each ring, so a hand-off wakes only the thread that has work. When the completion thread
frees the device and a queued job can go at once, it lets the submitter call ``infer``
before it post-processes (bounded): with the GIL the device would otherwise idle for the
whole post-processing. On a small VM code run right after a thread wakes costs several
times its warm time, and every job wakes three threads, so the per-token path avoids
Python-level locking where a plain lock does.

A worker that raises outside its per-step guard does not die silently: the pipeline is
*broken* (:meth:`Pipeline.break_`), every pending job fails with
:class:`~calfsm.errors.ExecutorBroken`, the lifecycle ends ``Failed`` with the reason,
and nothing waits forever.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

from calfsm.engine.job import JobContext, JobHandle
from calfsm.engine.lifecycle import DeviceLifecycle, Lifecycle
from calfsm.engine.pipeline import Hooks, Pipeline
from calfsm.runtime.doorbell import Doorbell
from calfsm.runtime.stepper import StepScheduler

__all__ = ["StepRuntime", "Steps", "ThreadRuntime"]

log = logging.getLogger("calfsm.runtime")

#: longest the completion thread lets the submitter go first (a stuck submit must not
#: hold completions up)
_YIELD_TO_SUBMITTER_S = 0.002


class _Runtime(Hooks):
    """What both runtimes share: the parts they drive and a bounded step-mode drain."""

    threaded = False

    def __init__(self, pipeline: Pipeline, control: DeviceLifecycle, life: Lifecycle
                 ) -> None:
        self.pipeline = pipeline
        self.control = control
        self.life = life
        self.clock = pipeline.clock
        pipeline.hooks = self


class ThreadRuntime(_Runtime):
    """A submitter, a completion and (when due) a recovery thread."""

    threaded = True

    def __init__(self, pipeline: Pipeline, control: DeviceLifecycle, life: Lifecycle
                 ) -> None:
        super().__init__(pipeline, control, life)
        self._submit_bell = Doorbell()        # a job queued, a slot freed, a state change
        self._complete_bell = Doorbell()      # a job submitted, or a state change
        self._submitted_bell = Doorbell()     # the submitter finished a submit attempt
        self._admit_bell = Doorbell()         # a job parked, or capacity came free
        self._cond = threading.Condition()    # drains and recovery wait on this
        self._threads: list[threading.Thread] = []
        self._recoveries: list[threading.Thread] = []
        self._recovery_lock = threading.Lock()
        self._close_deadline = math.inf
        self._stopping = False        # stop(): the admission thread may leave when idle
        life.on_change(self._wake_all)

    # ---- starting and stopping -----------------------------------------------------
    def start(self) -> None:
        for name, loop in (("submitter", self._submitter_loop),
                           ("completion", self._completion_loop),
                           ("admission", self._admission_loop)):
            t = threading.Thread(target=self._guard, args=(name, loop),
                                 name=f"calfsm-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def _guard(self, name: str, loop: Callable[[], None]) -> None:
        """Run a worker loop; if it dies, break the pipeline instead of hanging callers."""
        try:
            loop()
        except BaseException as e:
            reason = f"the {name} thread died: {type(e).__name__}: {e}"
            log.critical("%s", reason, exc_info=e, extra={"stage": name})
            try:
                self.life.fail(reason)
                self.pipeline.break_(reason)
            finally:
                self._wake_all()

    def begin_close(self, timeout: float) -> None:
        self._close_deadline = time.monotonic() + timeout
        self._wake_all()

    def join_recovery(self, timeout: float) -> bool:
        """Wait for recoveries in progress to stop (shutdown); False if one did not."""
        with self._recovery_lock:
            threads = [t for t in self._recoveries if t is not threading.current_thread()]
        for t in threads:
            t.join(timeout)
        return not any(t.is_alive() for t in threads)

    def drain(self, timeout: float) -> list[JobContext]:
        """Let submitted jobs finish; returns those still on the device at the timeout."""
        p = self.pipeline
        with self._cond:
            self._cond.wait_for(p.idle, timeout=timeout)
        return p.device.on_device()

    def stop(self, timeout: float) -> list[str]:
        """Join the worker threads; returns the names of those still alive."""
        self._stopping = True
        self._wake_all()
        for t in self._threads:
            t.join(timeout=max(0.1, timeout))
        return [t.name for t in self._threads if t.is_alive()]

    def wait_drained(self, timeout: float) -> None:
        self.wait_until(self.control.drained, timeout)

    def wait_until(self, predicate: Callable[[], bool], timeout: float | None) -> bool:
        with self._cond:
            return self._cond.wait_for(predicate, timeout)

    def wait(self, handle: JobHandle, timeout: float | None) -> None:
        """Nothing to drive: the threads move the job."""

    # ---- hooks (called by the pipeline) --------------------------------------------
    def work_queued(self) -> None:
        self._submit_bell.ring()

    def job_submitted(self) -> None:
        self._complete_bell.ring()

    def job_parked(self) -> None:
        self._admit_bell.ring()

    def hand_off(self) -> None:
        # only the complete step calls this, so this is the completion thread: it freed
        # the device with a job queued, or queued a stream's next step. Let the
        # submitter call infer before this thread goes on (delivering the token,
        # returning the lease), bounded; not while the submitter holds a batch back for
        # rows still to come (submittable() says no then: it would only wait for them)
        if self.pipeline.device.submittable():
            self._submitted_bell.wait(_YIELD_TO_SUBMITTER_S)

    def changed(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _wake_all(self) -> None:
        """Wake every thread and waiter (rare events: lifecycle, shutdown, breakage)."""
        self.changed()
        self._submit_bell.ring()
        self._complete_bell.ring()
        self._admit_bell.ring()

    # ---- the loops -----------------------------------------------------------------
    def _submitter_loop(self) -> None:
        p, life, clock = self.pipeline, self.life, self.clock
        while True:
            if p.device.fail_expired():
                continue
            job = p.device.claim()
            if job is None:
                if life.closing and not p.device.has_queued():
                    return
                if p.broken is not None:
                    return
                backoff = p.faults.backoff_until
                if clock.virtual:
                    if p.device.submittable() and backoff > clock.now():
                        clock.advance_to(backoff)
                        continue
                    self._submit_bell.wait(0.05)   # deadlines move only when driven
                else:
                    self._submit_bell.wait(p.device.submit_wait_s())
                continue
            try:
                p.device.run_step(job, "submit", p.device.submit)
            finally:
                self._submitted_bell.ring()

    def _completion_loop(self) -> None:
        p, life = self.pipeline, self.life
        while True:
            job = p.completion.next_completion()
            if job is None:
                p.beat("completion")
                if p.broken is not None:
                    return
                if life.closing and ((p.inflight == 0 and not p.device.has_queued())
                                     or time.monotonic() > self._close_deadline):
                    return
                self._complete_bell.wait(0.05 if life.closing else None)
                continue
            if life.closing and time.monotonic() > self._close_deadline \
                    and job.ended:
                p.completion.drop_completion(job)
                return              # abandon a zombie: the device never let it go
            # only a submit after this step began counts for its hand_off()
            self._submitted_bell.wait(0)
            p.completion.run_completion(job)

    def _admission_loop(self) -> None:
        """Admit parked jobs, head first, while they move; then sleep until a job parks,
        capacity comes free, or the first admission deadline."""
        p, clock = self.pipeline, self.clock
        while True:
            # during close() it keeps running what the draining jobs defer (a stream's
            # end, a sequence's release): close() waits for that to be done
            if p.broken is not None or (self._stopping and not p.admission.has_parked()
                                        and not p.admission.has_deferred()):
                return
            if p.admission.run_deferred():
                continue
            p.admission.expire_parked()
            if p.admission.has_parked() and p.admission.admit_parked():
                continue
            wait = p.admission.wait_s()
            if clock.virtual and wait is not None:
                wait = 0.05                       # deadlines move only when driven
            self._admit_bell.wait(wait)

    # ---- recovery ------------------------------------------------------------------
    def recovery_wanted(self) -> None:
        """A drain wants a recovery (a hook): run it on its own thread once drained. The
        thread is started before it is recorded, so close() never joins an unstarted
        one."""
        with self._recovery_lock:
            if self.life.closing:
                return
            t = threading.Thread(target=self._recover_when_drained, name="calfsm-recovery",
                                 daemon=True)
            t.start()
            self._recoveries = [r for r in self._recoveries if r.is_alive()] + [t]

    def _recover_when_drained(self) -> None:
        control, life, clock = self.control, self.life, self.clock
        try:
            with self._cond:
                while not control.drained() and not life.closing:
                    if clock.virtual:
                        self._cond.wait(0.01)
                    else:
                        deadline = control.grace_deadline
                        remaining = 0.0 if deadline is None else deadline - clock.now()
                        self._cond.wait(max(0.001, remaining))
            if not life.closing:
                control.recover()
        except Exception as e:        # a bug in recovery must not leave it Draining
            reason = f"recovery crashed: {type(e).__name__}: {e}"
            log.critical("%s", reason, exc_info=e, extra={"stage": "recovery"})
            control.give_up(reason)


class Steps:
    """The public steppable interface of a step-mode executor: each action is one
    bounded step of the same code the threads run (see
    :class:`~calfsm.runtime.stepper.StepScheduler`)."""

    def __init__(self, pipeline: Pipeline, control: DeviceLifecycle) -> None:
        self.pipeline = pipeline
        self.control = control
        self.clock = pipeline.clock

    def enabled(self) -> list[str]:
        """The actions that may run now, in the scheduler's order (``expire`` first: a
        timer). One look at the parts: the scheduler asks at every step, so this is on
        every token's way and asks each part once."""
        p = self.pipeline
        parked_expired, admit, deferred = p.admission.due()
        queued_expired, submit, complete = p.device.due()
        acts = []
        if parked_expired or queued_expired:
            acts.append("expire")
        if admit:
            acts.append("admit")
        if submit:
            acts.append("submit")
        if complete:
            acts.append("complete")
        if self.control.recovery_pending and self.control.recovery_due():
            acts.append("recover")
        if deferred:
            acts.append("deferred")
        return acts

    def expire_due(self) -> bool:
        """A parked or queued job's deadline has passed (a timer: it fires first)."""
        return self.pipeline.next_deadline() <= self.clock.now()

    def can_admit(self) -> bool:
        return self.pipeline.admission.can_admit()

    def admission_fingerprint(self) -> int:
        return self.pipeline.admission.fingerprint()

    def can_submit(self) -> bool:
        return self.pipeline.device.submittable()

    def can_complete(self) -> bool:
        return self.pipeline.device.has_completions()

    def can_recover(self) -> bool:
        return self.control.recovery_due()

    def can_run_deferred(self) -> bool:
        return self.pipeline.admission.has_deferred()

    def run_deferred(self) -> bool:
        return self.pipeline.admission.run_deferred()

    def expire(self) -> None:
        self.pipeline.expire_waiting()

    def admit(self) -> bool:
        """Admit the head parked job; False if it must keep waiting."""
        return self.pipeline.admission.admit_parked()

    def submit(self) -> bool:
        return self.pipeline.submit_next()

    def complete(self) -> bool:
        return self.pipeline.complete_next()

    def recover(self) -> bool:
        return self.control.recover()

    def next_timer(self) -> float:
        """The next clock time at which something happens by itself."""
        targets = [self.pipeline.next_deadline()]
        grace = self.control.grace_deadline
        if grace is not None:
            targets.append(grace)
        backoff = self.pipeline.faults.backoff_until
        if backoff > self.clock.now():
            targets.append(backoff)
        return min(targets)

    def idle(self) -> bool:
        """No job waiting, queued or on the device, and no recovery pending."""
        return self.pipeline.idle() and not (
            self.control.recovery_pending and self.control.life.state == "Draining")


class StepRuntime(_Runtime):
    """No thread: a :class:`~calfsm.runtime.stepper.StepScheduler` (or the executor's own
    blocking calls) run the steps one at a time."""

    def __init__(self, pipeline: Pipeline, control: DeviceLifecycle, life: Lifecycle
                 ) -> None:
        super().__init__(pipeline, control, life)
        self.steps = Steps(pipeline, control)

    def start(self) -> None:
        """Nothing to start."""

    def begin_close(self, timeout: float) -> None:
        """Nothing to wake."""

    def join_recovery(self, timeout: float) -> bool:
        return True

    def drain(self, timeout: float) -> list[JobContext]:
        """Finish submitted jobs here (bounded in wall time)."""
        p = self.pipeline
        device = p.device
        deadline = time.monotonic() + timeout
        while (device.has_completions() or device.has_queued()) \
                and time.monotonic() <= deadline:
            if not p.complete_next() and not p.submit_next():
                break
        return p.device.on_device()

    def stop(self, timeout: float) -> list[str]:
        return []

    def wait_drained(self, timeout: float) -> None:
        while not self.control.drained():
            if not self.pipeline.complete_next():
                break

    def wait(self, handle: JobHandle, timeout: float | None) -> None:
        """Drive the steps until ``handle`` is done (the sync entry in step mode)."""
        StepScheduler.for_steps(self.steps).run_until(handle.done)

