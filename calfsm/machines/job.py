"""The job machine: one inference job from acceptance to exactly one terminal state.

Theory of operation
-------------------
A job is owned by exactly one party at a time — the request thread (Created ->
Preparing), the submit queue (Queued), the device (Submitted), the completion thread
(Completing) — and only its owner fires its triggers. Another thread that wants the job
to stop (``JobHandle.cancel``) sets the job's ``cancel_requested`` flag; the owner sees
it at its next step boundary and fires ``cancel``. That keeps triggers single-threaded
per job without a lock per job.

``Staged`` is a stream's next step prepared ahead (overlap scheduling): its buffer
slot is leased and its inputs written while the step before it runs, but it holds no KV
yet and is in no queue. When the token it carries is known it is ``admit``-ted (its KV
reserved) and queued; if its KV must wait it is ``unstage``-d (slot returned) and takes
the ordinary path.

A job that has not reached the device when a drain begins, and that starts its
sequence afresh, is ``hold``-en: it gives back what it took in the generation about to
be reset and waits, Created again, for the next one.

``CancelRequested`` exists only before submit: once ``infer()`` succeeded the device owns
the buffers, so a cancel merely stops delivery (the ``deliverable`` guard of ``succeed``)
and the job still goes through ``complete``. A job in Submitted leaves only through its
Wait() result (``complete``) or through recovery (``quarantine``).

Terminal states: Succeeded, Failed (error delivered, every resource returned cleanly) and
Quarantined (error delivered, buffers or KV withheld because the device may still own
them or their contents cannot be trusted).
"""

from __future__ import annotations

import enum

from transitions import EventData

from calfsm.machines._declared import DeclaredMachine

__all__ = ["JOB_MACHINE", "JobState", "deliverable"]


class JobState(enum.StrEnum):
    CREATED = "Created"
    STAGED = "Staged"
    ADMITTED = "Admitted"
    PREPARING = "Preparing"
    QUEUED = "Queued"
    SUBMITTED = "Submitted"
    COMPLETING = "Completing"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    CANCEL_REQUESTED = "CancelRequested"
    QUARANTINED = "Quarantined"


def deliverable(event: EventData) -> bool:
    """Guard of ``succeed``: a result is delivered only to a job nobody cancelled."""
    return not getattr(event.model, "cancel_requested", False)


S = JobState
BEFORE_SUBMIT = [S.CREATED, S.STAGED, S.ADMITTED, S.PREPARING, S.QUEUED]

TRANSITIONS = [
    {"trigger": "stage", "source": S.CREATED, "dest": S.STAGED},
    {"trigger": "unstage", "source": S.STAGED, "dest": S.CREATED},
    {"trigger": "admit", "source": [S.CREATED, S.STAGED], "dest": S.ADMITTED},
    {"trigger": "prepare", "source": S.ADMITTED, "dest": S.PREPARING},
    {"trigger": "hold", "source": [S.ADMITTED, S.QUEUED], "dest": S.CREATED},
    {"trigger": "enqueue", "source": S.PREPARING, "dest": S.QUEUED},
    {"trigger": "submit", "source": S.QUEUED, "dest": S.SUBMITTED},
    {"trigger": "complete", "source": S.SUBMITTED, "dest": S.COMPLETING},
    {"trigger": "succeed", "source": S.COMPLETING, "dest": S.SUCCEEDED,
     "conditions": [deliverable]},
    {"trigger": "cancel", "source": BEFORE_SUBMIT, "dest": S.CANCEL_REQUESTED},
    {"trigger": "fail", "source": [*BEFORE_SUBMIT, S.CANCEL_REQUESTED, S.COMPLETING],
     "dest": S.FAILED},
    {"trigger": "quarantine", "source": [S.SUBMITTED, S.COMPLETING], "dest": S.QUARANTINED},
]

JOB_MACHINE = DeclaredMachine(
    "job", [s.value for s in JobState], TRANSITIONS, initial=S.CREATED,
    terminal=[S.SUCCEEDED, S.FAILED, S.QUARANTINED])
