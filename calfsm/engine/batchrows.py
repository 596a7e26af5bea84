"""One device job carrying several flows' next steps: which rows go, and how they are written.

Theory of operation
-------------------
On a batch graph (``max_batch`` B > 1, batching proven: :mod:`calfsm.plan.batching`) every
row is still a job of its own: its request, KV reservation, lease, continuation, handle
and outcome are its own, admitted, staged and queued as any job is. What rows share is
the one device job. When the submitter claims a decode of a batch graph it takes up to
``max_rows - 1`` more queued decodes of the same generation with it (:func:`gather`, in
queue order: first come, first served). The first row *leads*: its slot is the one the
device runs. The others *ride*: :func:`program_rows` copies each rider's token and
position (already written and checked in its own slot when it was prepared) into row
``r`` of the leader's input tensors and sets row ``r``'s KV sequence and CSRs on the
leader's input buffer; ``set_batch_rows`` says how many rows the job carries. A rider's
own slot never reaches the device, so whatever happens it is given back, never
quarantined (``JobContext.rides``).

After the one ``wait``, each row is read on its own (:func:`row_logits`: row ``r`` of
the output tensor, the tile layout per row; ``row_status``), and each row ends as a job
alone would: converted, continued, committed and resolved, or failed with its own
error (docs/architecture.md, Continuous batching).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from calfsm.engine.job import JobContext
from calfsm.machines.job import JobState
from calfsm.manifest import TaskKind

__all__ = ["batchable", "gather", "program_rows", "row_logits"]


def batchable(job: JobContext, max_rows: int) -> bool:
    """Whether ``job`` may share its device job with others: a decode of a batch graph (or
    prepared for the shape buckets, which move it to one at submit) while batching is on
    (prefills run alone: they would hold every row's step for the length of the longest
    prompt)."""
    return (max_rows > 1 and job.kind is TaskKind.DECODE and job.lease is not None
            and (job.lease.slot.contract.batched or job.epoch.buckets is not None))


def gather(leader: JobContext, queued: Iterable[JobContext], max_rows: int
           ) -> list[JobContext]:
    """The queued jobs that ride with ``leader`` (at most ``max_rows - 1``, in queue
    order): decodes of the same generation's batch graph, one per sequence."""
    riders: list[JobContext] = []
    seqs = {leader.seq_id}
    limit = max_rows - 1
    for job in queued:
        if len(riders) >= limit:
            break
        if job is leader or job.kind is not leader.kind or job.epoch is not leader.epoch \
                or job.lease is None or job.seq_id in seqs or job.state != JobState.QUEUED:
            continue
        riders.append(job)
        seqs.add(job.seq_id)
    return riders


def program_rows(rows: list[JobContext]) -> None:
    """Write rows ``1..`` into the leader's slot and say how many rows the job carries.
    Every code is checked (the classified error names the row's sequence)."""
    lease = rows[0].lease
    for r in range(1, len(rows)):
        row = rows[r]
        lease.load_row(r, row.lease.slot, row.seq_id, row.token_count, job_id=row.job_id)
    lease.set_rows(len(rows))


def row_logits(leader: JobContext, r: int) -> np.ndarray:
    """Row ``r``'s part of the leader's output tensor (BF16), laid out as a job alone's."""
    slot = leader.lease.slot
    per_row = slot.contract.rows * slot.contract.vocab
    return slot.logits_bf16[r * per_row:(r + 1) * per_row]
