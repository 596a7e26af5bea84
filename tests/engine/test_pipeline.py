"""The sans-thread core on its own (issue 21, item 5): a :class:`~calfsm.engine.pipeline.Pipeline`
built directly, h11-style, with no DeviceExecutor, no runtime and no thread.

The lifecycle is the real :class:`~calfsm.engine.lifecycle.Lifecycle` record moved to Ready by
hand (start -> configured -> warmed, no warm-up run) with one epoch built on a simulated
driver on a virtual clock; the policy decisions and drains the pipeline asks for are only
recorded. The test calls each step itself, in order: ``admission.accept`` ->
``admission.start`` (validate, admit, prepare) -> ``device.claim`` / ``device.submit`` ->
``completion.next_completion`` / ``completion.run_completion``, and reads the books
(queue depths, in-flight slots, pool and KV stats) between them. Only public methods of
the pipeline and its parts are used.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from calfsm.drivers import refmodel
from calfsm.drivers.base import Calbin, EngineSlot
from calfsm.drivers.sim import SimDriver
from calfsm.engine.epoch import build_epoch
from calfsm.engine.job import JobContext, JobHandle, Request
from calfsm.engine.lifecycle import Lifecycle
from calfsm.engine.pipeline import Pipeline, PipelineTimeouts
from calfsm.engine.recovery import FaultPolicy, RecoveryPolicy, Verdict
from calfsm.engine.stepcost import ServiceModel
from calfsm.errors import Cancelled, DeadlineExceeded, InvalidArgument
from calfsm.machines.job import JobState
from calfsm.manifest import Manifest, TaskKind, builtin_manifest
from calfsm.runtime.sync import THREADS
from tests.helpers.executor import TINY, calls

VOCAB = TINY.submodel(TaskKind.DECODE).vocab


class Core:
    """A pipeline on a simulated driver, its lifecycle Ready on generation 1, and what it
    asked of the lifecycle (``verdicts`` applied, ``drains`` started)."""

    def __init__(self, *, slots_per_engine: int = 2, queue_s: float = 10.0,
                 admission_s: float = 10.0, manifest: Manifest = TINY, max_rows: int = 1,
                 batch_window_s: float = 0.0) -> None:
        self.driver = SimDriver(manifest, seed=0, trace=True)
        self.clock = self.driver.clock
        self.life = Lifecycle(self.clock, THREADS)
        self.life.fire("start")
        calbin = Calbin.from_manifest(manifest)
        self.epoch = build_epoch(self.driver, manifest, calbin, 1, max_inflight=1,
                                 slots_per_engine=slots_per_engine, token_budget=None,
                                 batch_rows=max_rows, sync=THREADS)
        self.life.install(self.epoch)
        self.life.fire("configured")
        self.life.warmed(manifest, calbin)
        self.verdicts: list[Verdict] = []
        self.drains: list[str] = []
        self.pipe = Pipeline(
            self.driver, self.life, FaultPolicy(RecoveryPolicy(), sync=THREADS),
            timeouts=PipelineTimeouts(admission_s=admission_s, queue_s=queue_s,
                                      default_deadline_s=60.0, zombie_wait_s=0.25),
            service=ServiceModel(manifest.timing, execution_timeout_s=None),
            max_inflight=1, engines=(EngineSlot.AUTO,),
            apply=self.verdicts.append, drain=self._drain, max_rows=max_rows,
            batch_window_s=batch_window_s)
        self.pool0 = self.epoch.pool.stats()
        self.kv0 = self.epoch.kv.stats()

    def _drain(self, reason: str) -> bool:
        self.drains.append(reason)
        return True

    # ---- the four steps, called by hand --------------------------------------------
    def start(self, request: Request) -> tuple[JobContext, JobHandle]:
        """accept + start without waiting: the job is queued, parked or failed. The
        handle is returned beside the job, which lets go of it when it ends."""
        job = self.pipe.admission.accept(request, self.pipe.cancel)
        handle = job.handle
        self.pipe.admission.start(job)
        return job, handle

    def submit(self) -> JobContext:
        """Claim the head of the submit queue and submit it."""
        job = self.pipe.device.claim()
        assert job is not None, "nothing to claim"
        assert self.pipe.inflight == 1
        self.pipe.device.submit(job)
        assert job.state == JobState.SUBMITTED, job.state
        return job

    def complete(self) -> JobContext:
        job = self.pipe.completion.next_completion()
        assert job is not None, "nothing to complete"
        self.pipe.completion.run_completion(job)
        return job

    def run(self, request: Request) -> Any:
        """One job through every step; its result."""
        job, handle = self.start(request)
        assert self.submit() is job
        assert self.complete() is job
        return handle.result(0)

    def infers(self) -> int:
        return len(calls(self.driver, "infer"))

    def assert_books_as_built(self) -> None:
        """Every lease back in the pool, no KV reservation open nor budget held, the
        pipeline idle and nothing counted as waiting or in flight."""
        pool = self.epoch.pool.stats()
        assert (pool.free, pool.leased, pool.quarantined) == \
            (self.pool0.free, 0, 0), pool
        kv = self.epoch.kv.stats()
        assert kv.open == 0 and kv.budget_used == self.kv0.budget_used, kv
        assert self.pipe.depths() == (0, 0)
        assert self.pipe.inflight == 0
        assert self.pipe.idle()


def _logits_of(tokens: list[int]) -> np.ndarray:
    """The reference model's float32 logits after ``tokens``."""
    want = refmodel.logits_bf16(refmodel.chain(tokens)[-1], VOCAB)
    return (want.astype(np.uint32) << 16).view(np.float32)


@pytest.fixture
def core() -> Core:
    return Core()


def test_a_prefill_and_a_decode_go_through_the_four_steps_with_the_reference_logits(
        core):
    pipe = core.pipe
    assert pipe.idle() and core.infers() == 0

    job, handle = core.start(Request.prefill(3, [1, 2, 3]))
    assert job.state == JobState.QUEUED and pipe.device.has_queued()
    assert not pipe.idle() and pipe.depths() == (0, 1)      # waiting, not in flight
    assert core.epoch.pool.stats().leased == 1 and core.epoch.kv.stats().open == 1
    assert core.infers() == 0                               # prepared, not submitted

    assert core.submit() is job
    assert core.infers() == 1 and pipe.device.on_device() == [job]
    assert pipe.depths() == (1, 0) and not pipe.device.has_queued()
    assert pipe.device.claim() is None                             # the one in-flight slot is out
    assert not handle.done()

    assert core.complete() is job
    first = handle.result(0)
    np.testing.assert_array_equal(first.logits, _logits_of([1, 2, 3]))
    assert first.token_count == 3 and first.generation == 1 and first.seq_id == 3
    assert core.epoch.kv.sequence_length(3) == 3            # committed
    t = first.timings
    assert t.accepted <= t.admitted <= t.queued <= t.submitted <= t.completed

    tok = first.greedy()
    second = core.run(Request.decode(3, tok, 3))
    np.testing.assert_array_equal(second.logits, _logits_of([1, 2, 3, tok]))
    assert core.epoch.kv.sequence_length(3) == 4
    counts, errors = pipe.counts()
    assert counts["accepted"] == counts["succeeded"] == 2 and errors == {}
    assert core.infers() == 2 and not core.verdicts and not core.drains
    pool = core.epoch.pool.stats()
    assert pool.leased == 0 and pool.free == core.pool0.free
    assert core.epoch.kv.stats().open == 0 and pipe.idle()


def test_cancelling_a_queued_job_gives_back_its_lease_and_kv(core):
    job, handle = core.start(Request.prefill(1, [4, 5, 6, 7]))
    assert job.state == JobState.QUEUED
    assert core.epoch.pool.stats().leased == 1
    assert core.epoch.kv.stats().budget_used > core.kv0.budget_used

    assert handle.cancel()                  # the canceller is Pipeline.cancel
    assert isinstance(handle.exception(0), Cancelled)
    assert not core.pipe.device.has_queued() and core.pipe.device.claim() is None
    assert core.infers() == 0
    kv = core.epoch.kv.stats()
    assert kv.reserved == 1 and kv.rolled_back == 1
    counts, errors = core.pipe.counts()
    assert counts["cancelled"] == 1 and errors == {"request": 1}
    core.assert_books_as_built()


def test_a_job_cancelled_on_the_device_is_waited_for_and_its_result_dropped(core):
    job, handle = core.start(Request.prefill(1, [4, 5]))
    assert core.submit() is job
    assert handle.cancel()
    assert not handle.done()                    # the device still runs it
    assert core.complete() is job               # its Wait is still made ...
    assert isinstance(handle.exception(0), Cancelled)
    assert core.epoch.kv.sequence_length(1) == 2     # ... and the KV it wrote committed
    counts, _ = core.pipe.counts()
    assert counts["cancelled"] == 1 and counts["succeeded"] == 0
    assert core.infers() == 1
    core.assert_books_as_built()


def test_a_job_in_the_submitters_hand_keeps_the_pipeline_busy_until_it_ends(core):
    """Claimed and not yet submitted, a job is in no queue and not on the device, but it
    holds a lease: the pipeline is not idle (the soak once found ``leased 1`` after
    ``idle()`` said True, for a stream cancelled while its step was in this hand)."""
    job, handle = core.start(Request.prefill(1, [4, 5]))
    assert core.pipe.device.claim() is job
    assert not core.pipe.idle() and core.epoch.pool.stats().leased == 1
    assert handle.cancel()                      # the consumer goes away meanwhile
    assert not handle.done() and not core.pipe.idle()
    core.pipe.device.submit(job)                # the submitter sees the cancel
    assert isinstance(handle.exception(0), Cancelled)
    assert core.infers() == 0
    core.assert_books_as_built()


def test_a_job_past_its_queue_deadline_fails_before_submit():
    core = Core(queue_s=0.5)
    job, handle = core.start(Request.prefill(2, [1, 2]))
    assert not core.pipe.device.fail_expired()                 # not yet
    assert core.pipe.next_deadline() == pytest.approx(job.timings.queued + 0.5)
    core.clock.advance(0.5)
    idle_at_its_end = []            # out of the queue, it is busy until it has failed
    handle.add_done_callback(lambda _h: idle_at_its_end.append(core.pipe.idle()))
    assert core.pipe.device.fail_expired()
    assert idle_at_its_end == [False]
    assert core.pipe.device.claim() is None                    # taken out of the queue
    err = handle.exception(0)
    assert isinstance(err, DeadlineExceeded) and "queue deadline" in str(err), err
    assert core.infers() == 0
    counts, _ = core.pipe.counts()
    assert counts["failed"] == 1
    core.assert_books_as_built()


def test_parked_jobs_are_admitted_in_order_as_the_slot_frees():
    core = Core(slots_per_engine=1)             # one prefill slot
    pipe = core.pipe
    first, first_h = core.start(Request.prefill(0, [1, 2]))
    assert first.state == JobState.QUEUED
    second, second_h = core.start(Request.prefill(1, [3, 4]))
    third, third_h = core.start(Request.prefill(2, [5, 6]))
    assert pipe.admission.has_parked() and pipe.admission.can_admit()
    assert second.state == JobState.ADMITTED         # its KV reserved, no slot
    assert third.state == JobState.CREATED           # behind it, untried
    assert not pipe.admission.admit_parked()              # the slot is still out: nothing moves
    assert pipe.depths() == (0, 3)              # all three wait

    assert core.submit() is first and core.complete() is first
    assert first_h.exception(0) is None
    fourth, fourth_h = core.start(Request.prefill(3, [7, 8]))
    assert fourth.state == JobState.CREATED     # the slot is free, but it may not overtake
    assert pipe.admission.admit_parked()                  # the head goes first ...
    assert second.state == JobState.QUEUED and third.state != JobState.QUEUED
    assert not pipe.admission.admit_parked()              # ... and only the head
    assert core.submit() is second and core.complete() is second

    assert pipe.admission.admit_parked() and third.state == JobState.QUEUED
    assert core.submit() is third and core.complete() is third
    assert pipe.admission.admit_parked() and not pipe.admission.has_parked()
    assert core.submit() is fourth and core.complete() is fourth
    handles = (first_h, second_h, third_h, fourth_h)
    assert [h.result(0).seq_id for h in handles] == [0, 1, 2, 3]
    assert core.infers() == 4
    core.assert_books_as_built()


def test_cancelling_a_parked_job_gives_back_its_kv():
    core = Core(slots_per_engine=1)
    first, first_h = core.start(Request.prefill(0, [1, 2]))
    _, parked_h = core.start(Request.prefill(1, [3, 4, 5]))
    assert core.pipe.admission.has_parked()
    assert core.epoch.kv.stats().open == 2           # the parked job kept its reservation
    assert parked_h.cancel()
    assert isinstance(parked_h.exception(0), Cancelled)
    assert not core.pipe.admission.has_parked() and not core.pipe.admission.admit_parked()
    kv = core.epoch.kv.stats()
    assert kv.open == 1 and kv.rolled_back == 1
    assert core.submit() is first and core.complete() is first
    assert first_h.exception(0) is None
    assert core.infers() == 1
    core.assert_books_as_built()


@pytest.mark.parametrize("request_", [
    pytest.param(Request.prefill(4, [VOCAB]), id="token-beyond-the-vocabulary"),
    pytest.param(Request.decode(4, 1, 5), id="decode-over-a-hole-in-the-kv"),
    pytest.param(Request(4, TaskKind.PREFILL_IDS, [1, 2], [0, 2]), id="positions-skip"),
    pytest.param(Request.prefill(4, [1], deadline_s=0.0), id="deadline-already-past"),
])
def test_a_job_failing_validation_never_reaches_the_driver(core, request_):
    job, handle = core.start(request_)
    err = handle.exception(0)
    assert isinstance(err, InvalidArgument | DeadlineExceeded), err
    assert job.state == JobState.FAILED
    assert not core.pipe.device.has_queued() and core.pipe.device.claim() is None
    assert core.infers() == 0
    assert core.epoch.kv.stats().reserved == 0      # nothing was taken
    core.assert_books_as_built()


def test_a_batch_hold_whose_window_ended_leaves_the_submitter_no_wait():
    """A partial batch is held back for rows on their way, for at most the batch window,
    and nothing rings when the window ends. A submitter whose claim met the hold and
    which asks how long to sleep once the window has ended must be told not to sleep:
    it was told the first queue deadline (10 s), and the queued jobs expired there
    (seen once in CI: two prefills failed "queue deadline passed before submit" in a
    threaded batching test that takes 1.5 s)."""
    core = Core(manifest=builtin_manifest("tiny-b8"), max_rows=8, batch_window_s=0.002,
                slots_per_engine=4)
    dev = core.pipe.device
    for seq in range(3):
        core.run(Request.prefill(seq, [1, 2, 3]))
    for seq in range(3):
        core.start(Request.decode(seq, 5, 3))
    leader = core.submit()
    assert leader.batch is not None and len(leader.batch) == 3
    core.complete()
    # two of the three rows come back: fewer than that batch had, so they are held
    core.start(Request.decode(0, 6, 4))
    core.start(Request.decode(1, 6, 4))
    assert dev.claim() is None
    assert 0 < dev.submit_wait_s() <= 0.002         # sleep until the window's end
    core.clock.advance(0.002)                       # the window ends: nothing rings
    assert dev.submit_wait_s() == 0
    job = core.submit()
    assert job.batch is not None and [j.seq_id for j in job.batch] == [0, 1]
    core.complete()


def test_a_batch_row_cancelled_after_the_claim_never_runs_nor_commits():
    """A rider whose stream is cancelled after the submitter claimed its batch and before
    the submit (a threaded caller's cancel lands between the two) fails "before submit":
    the device job carries only the other rows, its KV is rolled back and never grows,
    and the other rows run, commit and equal the reference. (Once a cancelled rider was
    programmed into the job anyway: it ran, and its KV was committed.)"""
    core = Core(manifest=builtin_manifest("tiny-b8"), max_rows=8, slots_per_engine=4)
    dev = core.pipe.device
    prompt = [1, 2, 3]
    for seq in range(3):
        core.run(Request.prefill(seq, prompt))
    handles = [core.start(Request.decode(seq, 5, len(prompt)))[1] for seq in range(3)]
    before = core.epoch.kv.stats()
    leader = dev.claim()
    assert leader is not None and leader.seq_id == 0
    assert leader.batch is not None and [j.seq_id for j in leader.batch] == [0, 1, 2]
    assert handles[1].cancel()          # claimed, not yet submitted
    assert not handles[1].done()        # nobody but the submitter can fail it now
    dev.submit(leader)
    assert handles[1].done(), "the cancelled rider went to the device"
    err = handles[1].exception(0)
    assert isinstance(err, Cancelled) and "before submit" in str(err), err
    assert calls(core.driver, "set_batch_rows")[-1]["rows"] == 2
    assert {c["seq"] for c in calls(core.driver, "set_kv_seq") if c.get("row")} == {2}
    assert core.complete() is leader
    for seq in (0, 2):
        got = handles[seq].result(0)
        np.testing.assert_array_equal(got.logits, _logits_of([*prompt, 5]))
        assert core.epoch.kv.sequence_length(seq) == len(prompt) + 1
    assert core.epoch.kv.sequence_length(1) == len(prompt)          # never committed
    assert core.epoch.kv.allocation(1) == len(prompt)               # nor grown on it
    after = core.epoch.kv.stats()
    assert (after.committed - before.committed, after.rolled_back - before.rolled_back,
            after.unknown - before.unknown) == (2, 1, 0)
    counts, _ = core.pipe.counts()
    assert counts["cancelled"] == 1 and not core.verdicts and not core.drains
    core.assert_books_as_built()


def test_whether_a_job_can_be_submitted_is_read_under_the_lock(core):
    """The completion thread asks ``submittable()`` (the runtime's ``hand_off``) while
    the submitter changes the submit queue: the queue is read under the core's lock, so
    a thread asking waits while another holds it. Without the lock, a 64-row batch run
    under load failed with 'deque mutated during iteration' (bench_scale --load 2)."""
    core.start(Request.prefill(3, [1, 2, 3]))
    answers: list[bool] = []
    asking = threading.Thread(target=lambda: answers.append(core.pipe.device.submittable()))
    with core.pipe.core.lock:
        asking.start()
        asking.join(0.2)
        assert asking.is_alive() and not answers     # it waits for the lock
    asking.join(10)
    assert answers == [True]
