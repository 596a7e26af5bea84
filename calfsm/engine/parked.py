"""The parked jobs, in admission order: the highest effective priority first.

A parked job's *effective priority* is its request's ``priority`` plus one for each
``aging_s`` seconds (``ExecutorConfig.priority_aging_s``) it has waited since it was
accepted, on the executor's clock::

    effective(job, t) = job.priority + (t - job.accepted) / aging_s

The admission step takes the parked job whose effective priority is highest; among
equals, the one accepted first (the lower job id). Every parked job ages at the same
rate, so the order of two parked jobs never changes while they wait: it is the order of
their *rank* ``accepted - priority * aging_s`` (lowest first), fixed when the job is
accepted. Aging thus needs no pass over the queue and no re-sort: the queue is a binary
heap of ranks, O(log n) to park or take the first job, O(1) to take out any other (a
cancel, an expiry; its heap entry is dropped lazily).

The bound it gives: a job accepted at ``t`` with priority ``p`` is passed by a job
accepted later only if that job's priority ``q`` is higher and it was accepted before
``t + (q - p) * aging_s``; whatever is accepted after ``t + (PRIORITY_MAX - p) *
aging_s`` queues behind it.

One exception to the order: a job whose admission has *begun* — it was tried, granted its
KV reservation and found no buffer slot — keeps what it took for its next try and is
parked ahead of every ranked job (begun ones in the order they were parked). Ranked, it
could see later work of a higher priority go ahead and wait, until its admission
deadline, for the very KV it holds; giving that KV back at each try instead would call
the device and free capacity only to take it again. In the common case only the head the
admission step just tried has begun, so a job waits for at most that one beyond the
rule.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from calfsm.engine.job import JobContext

__all__ = ["ParkedQueue"]


class ParkedQueue:
    """The jobs waiting to be admitted, ordered by rank (see the module docstring). Not
    thread-safe: its owner (:class:`~calfsm.engine.admission.Admission`) holds the core lock."""

    __slots__ = ("_aging_s", "_begun", "_count", "_heap", "_live", "size")

    def __init__(self, aging_s: float) -> None:
        self._aging_s = aging_s
        #: jobs whose admission has begun (they hold a KV reservation): first, in order
        self._begun: deque[JobContext] = deque()
        #: [rank, job id, push number, job]; the job is None once taken out by remove()
        self._heap: list[list] = []
        self._live: dict[int, list] = {}        # job id -> its entry in the heap
        self._count = itertools.count()         # two entries never compare their jobs
        #: jobs parked (``len``, as a plain attribute: admission reads it every step)
        self.size = 0

    def rank(self, job: JobContext) -> float:
        """Lower goes first: ``accepted - priority * aging_s``."""
        return job.timings.accepted - job.request.priority * self._aging_s

    def __len__(self) -> int:
        return self.size

    def __bool__(self) -> bool:
        return self.size > 0

    def __contains__(self, job: JobContext) -> bool:
        entry = self._live.get(job.job_id)
        return (entry is not None and entry[3] is job) or job in self._begun

    def __iter__(self) -> Iterator[JobContext]:
        """Every parked job: the begun ones, then the others in the order they were
        parked (not admission order)."""
        yield from self._begun
        yield from (entry[3] for entry in self._live.values())

    def push(self, job: JobContext, *, begun: bool = False) -> None:
        """Park ``job``: at its place by rank (a job put back keeps its place: its rank
        depends only on when it was accepted and its priority), or, ``begun`` (its
        admission has begun: it holds a KV reservation), after the begun ones, ahead of
        every ranked job."""
        if job in self:
            raise ValueError(f"job {job.job_id} is already parked")
        self.size += 1
        if begun:
            self._begun.append(job)
            return
        entry = [self.rank(job), job.job_id, next(self._count), job]
        self._live[job.job_id] = entry
        heapq.heappush(self._heap, entry)

    def pop(self) -> JobContext:
        """Remove and return the first job; IndexError if none is parked."""
        if self._begun:
            self.size -= 1
            return self._begun.popleft()
        heap = self._heap
        while heap:
            entry = heapq.heappop(heap)
            job = entry[3]
            if job is not None:
                del self._live[entry[1]]
                self.size -= 1
                return job
        raise IndexError("no job is parked")

    def remove(self, job: JobContext) -> bool:
        """Take ``job`` out wherever it is; False if it is not parked."""
        entry = self._live.get(job.job_id)
        if entry is None or entry[3] is not job:
            try:
                self._begun.remove(job)
            except ValueError:
                return False
            self.size -= 1
            return True
        self._live.pop(job.job_id)[3] = None
        self.size -= 1
        if len(self._heap) > 2 * len(self._live) + 32:     # mostly dropped entries
            self._heap = [e for e in self._heap if e[3] is not None]
            heapq.heapify(self._heap)
        return True

    def take_all(self) -> list[JobContext]:
        """Remove and return every parked job, in admission order."""
        jobs = [*self._begun, *(entry[3] for entry in sorted(self._live.values()))]
        self._begun.clear()
        self._heap.clear()
        self._live.clear()
        self.size = 0
        return jobs
