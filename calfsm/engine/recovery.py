"""The fault policy (spec sections 8 and 9.1): a classified error in, a decision out.

Theory of operation
-------------------
Every error a job meets is shown to :meth:`FaultPolicy.decide`, which reads the service
action of its category from the one table, :data:`calfsm.errors.ACTIONS`, and turns it
into a :class:`Decision`:

=============  =====================================  ===================================
category       table row (admission / action)         decision
=============  =====================================  ===================================
request        continue / record manifest diff        ``CONTINUE``: the job fails alone
programming    feature off / no reset                 ``CONTINUE``
transient      reduce / backoff, drain past threshold ``REQUEUE`` (when the job may be put
                                                      back and has retries left) or
                                                      ``BACK_OFF``, while the error budget
                                                      lasts; then ``DRAIN_AND_RESET``
lifecycle      pause / drain, check generation        ``DRAIN_AND_RESET``
device         stop now / quarantine, reset           ``DRAIN_AND_RESET``
unknown        pause / taint generation               ``DRAIN_AND_RESET``
artifact       reject generation / roll back model    ``ROLL_BACK``: reject the generation
                                                      and bring up the last known-good
                                                      model
compatibility  stop / operator fix                    ``STOP``: admission stops for good
=============  =====================================  ===================================

A generation that fails every job is not serving, whatever each error's row says: a
device that answers every job with a shape or dtype mismatch answers each with a request
code (``continue``), and without more the executor would fail every request while
calling itself Ready. (A refused CSR write needs no streak: NOT_FOUND for a CSR the
device declared is a device error, :func:`calfsm.errors.csr_refused`, drained at once.)
So the policy also counts the jobs that failed *in a row* with a code from the device
(any category but the transient ones, which the budget above handles, and but KV
exhaustion, which is capacity, not a fault); after ``RecoveryPolicy.failure_streak`` of
them with no success between, it answers ``DRAIN_AND_RESET`` ("generation fails every
job"). If the device still refuses, the warm-up golden of the next generation fails too
and the bring-up ends Failed: a 503 a supervisor acts on, not a 500 forever.

A row of a batch job that fails while the job ended ``DONE_OK`` (its ``row_status``) is
not judged by the table: the device ran the job, and the row's failure is the row's
(:meth:`FaultPolicy.row_failed`: ``CONTINUE``, counted in the streak above).

One decision is not about an error: when quarantine has taken every buffer slot of a
task kind (:meth:`FaultPolicy.slots_exhausted`; the pool tells, see
:mod:`calfsm.engine.buffers`), that kind's jobs could only wait for a buffer that never comes,
since a quarantined slot comes back only with a new generation. The decision is
``DRAIN_AND_RESET`` whatever put the slots there (even errors that alone only fail
their job), with the pool's reason; it spends no error budget.

The policy holds only the error budget (a token bucket) and the back-off streak; it
touches no executor, so it is unit-tested on its own. Whoever owns the lifecycle applies
the decision (:mod:`calfsm.engine.lifecycle`).
"""

from __future__ import annotations

import enum

import attrs

from calfsm.engine.sync import Sync
from calfsm.errors import (
    ACTIONS,
    AdmissionEffect,
    CalfsmError,
    CalrtCode,
    InvalidArgument,
    JobEffect,
    RecoveryAction,
)
from calfsm.manifest import TaskKind

__all__ = ["Decision", "FaultPolicy", "RecoveryPolicy", "Verdict"]

#: KV exhaustion is capacity, not a device fault: it never counts as a failed job
_ALLOC_FAILED = int(CalrtCode.ALLOC_FAILED)


def _non_negative(inst: object, attr: attrs.Attribute, value: float) -> None:
    if not value >= 0:      # also refuses NaN
        raise InvalidArgument(f"RecoveryPolicy.{attr.name} must be >= 0, got {value!r}",
                              stage="config")


@attrs.frozen
class RecoveryPolicy:
    """How the executor reacts to faults. Times are seconds on the driver's clock."""

    error_budget: float = attrs.field(default=5.0, validator=_non_negative)
    budget_refill_per_s: float = attrs.field(default=0.5, validator=_non_negative)
    backoff_base_s: float = attrs.field(default=0.005, validator=_non_negative)
    backoff_max_s: float = attrs.field(default=0.2, validator=_non_negative)
    grace_period_s: float = attrs.field(default=1.0, validator=_non_negative)
    zombie_wait_s: float = attrs.field(default=0.25, validator=_non_negative)
    progress_timeout_s: float = attrs.field(default=30.0, validator=_non_negative)
    retry_after_s: float = attrs.field(default=1.0, validator=_non_negative)
    auto_recover: bool = True
    max_attempts: int = attrs.field(default=3, validator=_non_negative)
    #: times a job refused by a transient submit error (DEVICE_BUSY: the graph did not
    #: run) goes back to the head of the queue after the back-off before it fails
    max_requeues: int = attrs.field(default=0, validator=_non_negative)
    #: jobs in a row failing with a device code (no success between) after which the
    #: generation is judged unable to serve and drained (0: never)
    failure_streak: int = attrs.field(default=8, validator=_non_negative)


class Decision(enum.Enum):
    """What happens after an error (the job itself always fails unless ``REQUEUE``)."""

    CONTINUE = "continue"                # only the job fails
    BACK_OFF = "back off"                # the submitter pauses until ``Verdict.until``
    REQUEUE = "requeue"                  # the job goes back to the queue after the pause
    DRAIN_AND_RESET = "drain and reset"  # the generation is suspect
    ROLL_BACK = "roll back"              # reject the generation, last known-good model
    STOP = "stop"                        # admission stops for good (Failed)


@attrs.frozen
class Verdict:
    """A decision with its reason and, for a pause, until when (clock time)."""

    decision: Decision
    reason: str
    until: float = 0.0


#: the table's recovery action -> the decision (TRANSIENT is the budgeted exception)
_BY_ACTION: dict[RecoveryAction, Decision] = {
    RecoveryAction.RECORD_MANIFEST_DIFF: Decision.CONTINUE,
    RecoveryAction.NO_RESET: Decision.CONTINUE,
    RecoveryAction.DRAIN_CHECK_GENERATION: Decision.DRAIN_AND_RESET,
    RecoveryAction.QUARANTINE_RESET: Decision.DRAIN_AND_RESET,
    RecoveryAction.TAINT_GENERATION: Decision.DRAIN_AND_RESET,
    RecoveryAction.ROLLBACK_MODEL: Decision.ROLL_BACK,
    RecoveryAction.OPERATOR_FIX: Decision.STOP,
    RecoveryAction.BACKOFF_THEN_DRAIN: Decision.BACK_OFF,
}


class FaultPolicy:
    """The error budget and back-off of one executor; thread-safe with the locks of
    ``sync`` (every thread that meets a device error decides here)."""

    def __init__(self, policy: RecoveryPolicy | None = None, *, sync: Sync) -> None:
        self.policy = policy or RecoveryPolicy()
        self._lock = sync.lock()
        self._tokens = self.policy.error_budget
        self._last_refill: float | None = None
        self._streak = 0
        #: clock time before which the submitter must not call ``infer`` (0: none); only
        #: this policy writes it (a plain attribute: the submitter reads it every submit)
        self.backoff_until = 0.0
        self._failed_in_a_row = 0

    def decide(self, err: CalfsmError, now: float, *, requeues: int | None = None
               ) -> Verdict:
        """The decision for ``err`` met at clock time ``now``.

        ``requeues``: how often the job was already put back, or None when it cannot be
        (the device may have run it). A requeue or back-off spends the error budget."""
        action = ACTIONS[err.category]
        decision = _BY_ACTION[action.action]
        if decision is Decision.CONTINUE and self._fails_the_generation(err):
            return Verdict(Decision.DRAIN_AND_RESET,
                           f"generation fails every job: {self._failed_in_a_row} in a row "
                           f"failed with a device code, the last: {err}")
        if decision is not Decision.BACK_OFF:
            return Verdict(decision, f"{err.category.value} error: {err}")
        with self._lock:
            if not self._spend_locked(now):
                return Verdict(Decision.DRAIN_AND_RESET,
                               f"error budget exhausted by {type(err).__name__}: "
                               f"{err.message}")
            self._streak += 1
            p = self.policy
            delay = min(p.backoff_max_s, p.backoff_base_s * 2 ** (self._streak - 1))
            self.backoff_until = max(self.backoff_until, now + delay)
            until = self.backoff_until
        if requeues is not None and action.job is JobEffect.FAIL_OR_REQUEUE \
                and requeues < self.policy.max_requeues:
            return Verdict(Decision.REQUEUE, f"requeued after {err}", until)
        return Verdict(Decision.BACK_OFF, f"backing off after {err}", until)

    def row_failed(self, err: CalfsmError) -> Verdict:
        """The decision for a row of a batch job that failed while the job ended DONE_OK
        (``row_status``): the row's own failure, so only it fails (``CONTINUE``). The
        category's row of the table is not read: the job, which the table judges, ran
        well. It counts toward the failure streak, so a generation whose every row fails
        is still drained as one failing every job."""
        streak = self._failed_again()
        if streak:
            return Verdict(Decision.DRAIN_AND_RESET,
                           f"generation fails every job: {streak} in a row failed, the "
                           f"last a row: {err}")
        return Verdict(Decision.CONTINUE, f"row failed alone: {err}")

    def slots_exhausted(self, kind: TaskKind, reason: str) -> Verdict:
        """The decision when no slot of ``kind`` is left to lend in this generation
        (``reason``: the pool's account of it). Only a reset rebuilds the pool, and a
        drain answers whoever waits for that kind with a retryable 503 at once."""
        return Verdict(Decision.DRAIN_AND_RESET,
                       f"no usable {kind.value} buffer slot left: {reason}")

    def succeeded(self) -> None:
        """A job completed: the back-off streak and the failure streak start over."""
        self._streak = 0
        self._failed_in_a_row = 0

    def reset(self) -> None:
        """A new generation came up: a full budget and no back-off."""
        with self._lock:
            self._tokens = self.policy.error_budget
            self._streak = 0
            self.backoff_until = 0.0
            self._failed_in_a_row = 0

    def _fails_the_generation(self, err: CalfsmError) -> bool:
        """Count a job that failed with a code from the device; True once
        ``failure_streak`` of them came in a row."""
        if err.calrt_code is None or err.calrt_code == _ALLOC_FAILED:
            return False
        return bool(self._failed_again())

    def _failed_again(self) -> int:
        """Count one more failure in a row: how many came in a row once they reach
        ``failure_streak``, else 0 (and always 0 when the streak is off)."""
        limit = self.policy.failure_streak
        if not limit:
            return 0
        with self._lock:
            self._failed_in_a_row += 1
            streak = self._failed_in_a_row
        return streak if streak >= limit else 0

    def _spend_locked(self, now: float) -> bool:
        p = self.policy
        if self._last_refill is not None:
            self._tokens = min(p.error_budget,
                               self._tokens + (now - self._last_refill) * p.budget_refill_per_s)
        self._last_refill = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False


# The table is the source: a row this module cannot map fails at import, not in service.
assert set(_BY_ACTION) == set(RecoveryAction), "every recovery action needs a decision"
assert {a.admission for a in ACTIONS.values()} <= set(AdmissionEffect)
