"""What the parts of the sans-thread core share, and nothing else.

The pipeline (:mod:`calfsm.engine.pipeline`) is five parts, each the one owner of its own state:
admission (:mod:`calfsm.engine.admission`: the parked jobs, the deferred work), overlap
(:mod:`calfsm.engine.overlap`: the steps staged ahead), the device side
(:mod:`calfsm.engine.submission`: the submit queue, the in-flight slots, the jobs on the
device), completion (:mod:`calfsm.engine.completion`: the wait, the output check and the way
back) and the outcomes (:mod:`calfsm.engine.outcomes`: every job's one end, the counters, the
observers). What they all read is here: the driver and its clock, the lifecycle, the
fault policy and the two ways of acting on it, the timeouts, the hooks of whoever drives
the steps, one lock over every queue, and the device lock (both from the lifecycle's
:class:`~calfsm.engine.sync.Sync`: the engine names no thread primitive). All of them log as
``calfsm.pipeline``, the one logger an operator filters the core by.

The queue lock is re-entrant because an operation over several parts (a cancel, a drain
taking every waiting job, the idle check) holds it across the parts' own short sections,
so that it sees them all at one instant.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from calfsm.drivers.base import Driver, EngineSlot
from calfsm.engine.job import JobContext
from calfsm.engine.lifecycle import Lifecycle
from calfsm.engine.recovery import Decision, FaultPolicy, Verdict
from calfsm.engine.stepcost import ServiceModel
from calfsm.errors import Unavailable
from calfsm.machines.job import JobState
from calfsm.machines.lifecycle import LifecycleState

__all__ = ["READY", "Core", "Hooks", "PipelineTimeouts", "job_ctx"]

READY = LifecycleState.READY
#: the decisions that take the generation out and bring up the next one
_TAKES_OUT = frozenset({Decision.DRAIN_AND_RESET, Decision.ROLL_BACK})


class Hooks:
    """How the pipeline tells whoever drives it that work is there. The defaults do
    nothing (step mode: the scheduler looks for itself)."""

    #: every hook is the default's no-op (step mode), so the calls on a step's way may
    #: be skipped (issue 35 item 4). Worked out for each subclass, never set by hand:
    #: one that overrides any hook is not quiet.
    quiet: bool = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.quiet = all(getattr(cls, name) is getattr(Hooks, name) for name in _HOOKS)

    def work_queued(self) -> None:
        """A job was queued for submit, or an in-flight slot came free."""

    def job_submitted(self) -> None:
        """A job is waiting for its completion."""

    def job_parked(self) -> None:
        """A job waits for admission (KV or a buffer), or capacity may have come free:
        the admission step should run."""

    def hand_off(self) -> None:
        """Called by the complete step only, outside every lock, when it made work the
        submitter may take at once (it freed the device with a job queued, or a stream's
        continuation queued its next step): a threaded driver lets the submitter call
        ``infer`` before this step goes on (the device would otherwise idle through the
        step's host work)."""

    def changed(self) -> None:
        """Queues or in-flight accounting changed (drains and recovery wait for this).
        Called outside the queue lock, so it may take locks of its own."""

    def recovery_wanted(self) -> None:
        """A drain wants an automatic recovery, to run once the device drained (the
        thread runtime starts a recovery thread; step mode: the scheduler runs it as a
        step once ``DeviceLifecycle.recovery_due()`` holds)."""


#: the hooks :attr:`Hooks.quiet` looks at
_HOOKS = ("work_queued", "job_submitted", "job_parked", "hand_off", "changed",
          "recovery_wanted")


class PipelineTimeouts:
    """The timeouts of :class:`~calfsm.executor.ExecutorConfig` the steps use."""

    __slots__ = ("admission_s", "default_deadline_s", "max_waiting", "priority_aging_s",
                 "queue_s", "zombie_wait_s")

    def __init__(self, *, admission_s: float, queue_s: float,
                 default_deadline_s: float, zombie_wait_s: float,
                 max_waiting: int | None = None, priority_aging_s: float = 1.0) -> None:
        self.max_waiting = max_waiting
        self.priority_aging_s = priority_aging_s
        self.admission_s = admission_s
        self.queue_s = queue_s
        self.default_deadline_s = default_deadline_s
        self.zombie_wait_s = zombie_wait_s


class Core:
    """The context every part of the pipeline reads (see the module docstring)."""

    def __init__(self, driver: Driver, life: Lifecycle, faults: FaultPolicy, *,
                 timeouts: PipelineTimeouts, service: ServiceModel, max_inflight: int,
                 engines: tuple[EngineSlot, ...], apply: Callable[[Verdict], None],
                 drain: Callable[[str], bool], max_rows: int = 1,
                 batch_window_s: float = 0.0) -> None:
        self.driver = driver
        self.clock = driver.clock
        self.life = life
        self.faults = faults
        self.t = timeouts
        #: expected and measured step costs: the execution timeout, the estimates
        self.service = service
        self.max_inflight = max_inflight
        #: rows one device job of a batch graph's decode carries (1: no batching)
        self.max_rows = max_rows
        #: how long a partial batch may wait for rows being completed (threaded)
        self.batch_window_s = batch_window_s
        self.engines = engines
        #: the lifecycle carries out a policy decision ...
        self.apply = apply
        #: ... and starts a drain for a suspect device
        self.drain = drain
        self.hooks = Hooks()
        #: the locks and latches of this executor's engine (the runtime's)
        self.sync = sync = life.sync
        #: one lock over every queue of every part (a leaf but for the hooks it calls)
        self.lock = sync.rlock()
        #: a submit, or the reading of a finished output, against a reset of the device
        self.device_lock = sync.lock()
        #: why the pipeline stopped for good (a worker died), or None
        self.broken: str | None = None
        now = self.clock.now()
        #: clock time each worker last looked for work
        self.heartbeat = {"submitter": now, "completion": now}

    def holdable(self, job: JobContext) -> bool:
        """``job`` can wait through a reset for the next generation: it starts its
        sequence afresh (``past_len == 0``), was not staged ahead, and is still wanted."""
        return job.past_len == 0 and job.state != JobState.STAGED \
            and not job.cancel_requested and not job.ended and self.broken is None

    def decide(self, err: Any) -> None:
        """Show ``err`` to the fault policy now and carry out its decision.

        A 503 that took the generation out (a device fault met before submit) gets the
        lifecycle's retry-after hint: its caller may try again on the next generation,
        and a stream resumes there, instead of reading a bare 503 as final."""
        verdict = self.faults.decide(err, self.clock.now())
        self.apply(verdict)
        life = self.life
        # judged by the decision, not by the state now: a threaded recovery may be
        # over already (Ready again), and the next generation is what the hint is for
        if isinstance(err, Unavailable) and err.retry_after_s is None \
                and verdict.decision in _TAKES_OUT and not life.closing \
                and life.state != LifecycleState.FAILED:
            err.retry_after_s = life.retry_after_s


def job_ctx(job: JobContext, stage: str | None) -> dict[str, Any]:
    """The context an error or log line about ``job`` carries."""
    ctx: dict[str, Any] = {"job_id": job.job_id, "seq_id": job.seq_id,
                           "generation": job.generation, "request_id": job.request_id}
    if stage is not None:
        ctx["stage"] = stage
    return ctx
