"""A stream's staged step (overlap scheduling) on every way its stream breaks, in step
mode with the interleaving chosen by the test, not found by luck.

While a stream's step runs, the stream prepares the decode after it
(``executor.stage``: a buffer slot leased and the inputs written, its token a
placeholder; the work is deferred to the admission side). The soak found a race there
(2 wedges in 35 runs, fixed in 5bbc3d3): the deferred staging ran after the step it was
for had already failed in a drain, took a decode slot in the next generation, and the
stream's replay then waited behind another stream's decode that waited for that slot.

Every test here drives a step-mode executor (virtual clock) with a
:class:`HoldingScheduler`, a seeded :class:`~calfsm.runtime.stepper.StepScheduler` that leaves
the actions a test holds back to the test, so the order that matters is written down:

- the wedge: a device fault on one stream's step drains the generation and fails the
  other stream's waiting step; that stream's staging, deferred when that step was
  enqueued, runs only after the recovery. It must take nothing (the stream has no live step to
  stage behind), and both streams, and a third started after the recovery whose decode
  would have queued behind the orphaned slot, finish with the reference's tokens;
- the other rollbacks of a staged step: a cancel, a stop token, the end at
  ``max_tokens`` and a drain, each with a step staged, give the slot back.

After each: every slot and KV reservation is back, one outcome per job, and the consumer
reads exactly the result's tokens (none delivered after the end).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.drivers.sim import SimDriver
from calfsm.engine.observe import JobEnded, Observer
from calfsm.errors import Unavailable
from calfsm.executor import DeviceExecutor
from calfsm.generate.sampling import SamplingParams
from calfsm.generate.stream import FinishReason, GenerationResult, Stream
from calfsm.machines.sequence import SequenceState
from calfsm.manifest import TaskKind
from calfsm.runtime.stepper import StepScheduler
from calfsm.tools.direct import DirectRunner, golden_prompts
from tests.helpers.executor import TINY, make_executor, reference_stream
from tests.helpers.streams import direct_runner, settled

pytestmark = pytest.mark.timeout(60)

PROMPTS = golden_prompts()
PROMPT_A, PROMPT_B, PROMPT_C = PROMPTS[5], PROMPTS[6], PROMPTS[7]
N_TOKENS = 8
GREEDY = SamplingParams(max_tokens=N_TOKENS)


@pytest.fixture(scope="module")
def runner() -> DirectRunner:
    """The direct synchronous path on its own simulated device: the reference."""
    return direct_runner()


# ---- helpers ------------------------------------------------------------------------

class HoldingScheduler(StepScheduler):
    """A seeded step scheduler that never picks an action in ``held``: the test runs
    those when it wants them (``held`` may change between calls)."""

    def __init__(self, executor: DeviceExecutor, seed: int = 0) -> None:
        super().__init__(executor, seed)
        self.held: frozenset[str] = frozenset()

    def enabled(self) -> list[str]:
        return [a for a in super().enabled() if a not in self.held]

    def run(self, predicate: Callable[[], bool], *, hold: Iterable[str] = ()) -> int:
        """Step, never picking an action of ``hold``, until ``predicate()`` holds."""
        self.held = frozenset(hold)
        try:
            return self.run_until(predicate)
        finally:
            self.held = frozenset()


class Books(Observer):
    """What the executor tells its observers: every job's end and every stream's
    replay and end."""

    def __init__(self) -> None:
        self.jobs: list[JobEnded] = []
        self.resumed: list[int] = []            # seq ids, in replay order
        self.ended: list[tuple[int, GenerationResult]] = []

    def job_ended(self, event: JobEnded) -> None:
        self.jobs.append(event)

    def stream_resumed(self, stream) -> None:
        self.resumed.append(stream.sequence.seq_id)

    def stream_ended(self, stream, result: GenerationResult) -> None:
        self.ended.append((stream.sequence.seq_id, result))

    def ended_jobs(self, seq_id: int, outcome: str | None = None) -> list[JobEnded]:
        return [j for j in self.jobs if j.seq_id == seq_id
                and (outcome is None or j.outcome == outcome)]

    def assert_one_outcome_per_job(self) -> None:
        twice = [jid for jid, n in Counter(j.job_id for j in self.jobs).items() if n > 1]
        assert not twice, f"jobs with more than one outcome: {twice}"


@contextmanager
def booked(seed: int, **config: Any
           ) -> Iterator[tuple[DeviceExecutor, Books, HoldingScheduler]]:
    """A step-mode executor (``make_executor("step", **config)``) with :class:`Books`
    watching it and a :class:`HoldingScheduler` of ``seed`` on it; closed on the way out."""
    ex = make_executor("step", **config)
    books = Books()
    ex.add_observer(books)
    with ex:
        yield ex, books, HoldingScheduler(ex, seed=seed)


def leased(ex: DeviceExecutor) -> int:
    return ex.epoch.pool.stats().leased


def decode_on_device(ex: DeviceExecutor, seq_id: int, past_len: int) -> bool:
    return any(j.seq_id == seq_id and j.kind == TaskKind.DECODE and j.past_len == past_len
               for j in ex.on_device())


def stage_behind_the_step_on_device(sched: HoldingScheduler, ex: DeviceExecutor) -> None:
    """Run the deferred work (a staging among it) while the step on the device stays
    there; then one step is on the device and its successor staged: two slots leased,
    nothing queued for submit."""
    sched.run(lambda: not ex.steps.can_run_deferred(), hold={"complete"})
    assert len(ex.on_device()) == 1 and not ex.steps.can_submit()
    assert leased(ex) == 2, f"no step was staged: {ex.epoch.pool.stats()}"


def read_all(stream: Stream, result: GenerationResult) -> None:
    """The consumer reads exactly the result's tokens: nothing was delivered after the
    stream ended (the executor has gone idle since, so a late token would be queued)."""
    got = [ev.token for ev in stream]
    assert got == list(result.tokens), (got, result)


def assert_all_back(ex: DeviceExecutor, sched: StepScheduler) -> None:
    """Idle, every slot back, no open or waiting KV reservation and the books balanced,
    no sequence holding KV."""
    sched.run_until(ex.idle)
    epoch = ex.epoch
    kv = epoch.kv.stats()
    assert epoch.pool.stats().leased == 0, epoch.pool.stats()
    assert kv.open == ex.stats().admitting == kv.budget_used == 0, kv
    assert kv.reserved == kv.committed + kv.rolled_back + kv.unknown, kv
    assert epoch.kv.sequences() == (), epoch.kv.sequences()
    assert ex.lifecycle_state == "Ready"


# ---- the wedge ----------------------------------------------------------------------

def test_staging_behind_a_step_failed_in_a_drain_takes_no_slot_and_every_stream_finishes(
        runner):
    """Stream A's decode at 129 waits behind stream B's step on the device when that
    step meets a CCU exception: generation 1 drains, A's waiting step fails (A's KV is
    not lost on its own side: it waits for Ready and replays), B's step is
    quarantined. The deferred
    work, A's staging for that failed step among it, is held until generation 2 is
    Ready, and then runs before anything else: before either replay.

    Without the guard in ``Stream._stage_next`` that staging leased a decode slot of
    generation 2 behind a step that had already ended. With one decode slot per engine,
    stream C, started after the recovery, then parked its first decode for that slot,
    A's replay prefill parked behind C (admission is first come, first served), and the
    slot would come back only when A's replay completed: a wedge."""
    want = {0: reference_stream(runner, PROMPT_A, GREEDY),
            1: reference_stream(runner, PROMPT_B, GREEDY),
            2: reference_stream(runner, PROMPT_C, GREEDY)}
    # B's third step (its prefill, then decodes at 128 and 129) meets the fault
    plan = FaultPlan.of(FaultRule("infer", "ccu_exception", seq_id=1, nth=3))
    with booked(0, faults=plan, slots_per_engine=1) as (ex, books, sched):
        a = ex.generate(PROMPT_A, GREEDY)
        b = ex.generate(PROMPT_B, GREEDY)
        assert (a.sequence.seq_id, b.sequence.seq_id) == (0, 1)

        # 1. up to the fault with every deferred staging held: B's step at 129 on the
        #    device with A's next step waiting behind it
        sched.run(lambda: decode_on_device(ex, 1, 129), hold={"deferred"})
        sched.run(lambda: ex.generation == 2 and ex.lifecycle_state == "Ready",
                  hold={"deferred"})
        a_failed = books.ended_jobs(0, "failed")
        assert [(j.generation, j.request.past_len) for j in a_failed] == [(1, 129)], \
            books.jobs
        assert [j.request.past_len for j in books.ended_jobs(1, "quarantined")] == [129]
        assert a.sequence.state == SequenceState.OPEN        # waits for Ready, not Lost
        assert not a.done() and not b.done() and books.resumed == []
        assert ex.steps.can_run_deferred()                   # A's staging still to run
        assert leased(ex) == 0

        # 2. the deferred work alone, in order (the stagings were deferred before the
        #    replays), until a stream replays or something takes a slot: until a stream
        #    replays it has no live step, so nothing may be staged for it
        ran_before_replay = 0
        while not books.resumed and leased(ex) == 0:
            assert ex.steps.can_run_deferred(), "no stream replayed"
            ex.steps.run_deferred()
            ran_before_replay += not books.resumed
        assert ran_before_replay >= 1           # A's staging ran after its step failed
        assert books.resumed == [0] and leased(ex) == 1, (
            f"a slot was taken behind a failed step: {ex.epoch.pool.stats()}, "
            f"replays so far {books.resumed}")     # A's replay prefill only

        # 3. stream C after the recovery, its first decode enqueued while the replays
        #    wait; then everything runs as it comes
        c = ex.generate(PROMPT_C, GREEDY)
        assert c.sequence.seq_id == 2
        sched.run(lambda: bool(books.ended_jobs(2, "succeeded")), hold={"deferred"})
        sched.run(lambda: all(settled(s)() for s in (a, b, c)))

        for s in (a, b, c):
            r = s.result(0)
            assert r.finish_reason == FinishReason.LENGTH, r
            assert list(r.tokens) == want[s.sequence.seq_id]
            read_all(s, r)
        assert a.result(0).resumes == b.result(0).resumes == 1
        assert c.result(0).resumes == 0
        assert_all_back(ex, sched)
        books.assert_one_outcome_per_job()
        assert len(books.ended) == 3


# ---- the other rollbacks of a staged step -------------------------------------------

def _staged_on_seq0(ex: DeviceExecutor, sched: HoldingScheduler, past_len: int) -> None:
    """Drive stream 0 until its decode at ``past_len`` is on the device with the next
    one staged behind it."""
    sched.run(lambda: decode_on_device(ex, 0, past_len))
    stage_behind_the_step_on_device(sched, ex)


def test_a_stream_cancelled_with_its_next_step_staged_gives_the_slot_back(runner):
    want = reference_stream(runner, PROMPT_A, GREEDY)
    with booked(1) as (ex, books, sched):
        s = ex.generate(PROMPT_A, GREEDY)
        start = len(PROMPT_A)
        _staged_on_seq0(ex, sched, start + 2)          # two tokens delivered so far
        assert s.cancel()
        sched.run(settled(s))
        r = s.result(0)
        assert r.finish_reason == FinishReason.CANCELLED
        # the step on the device ran to its end; its token is dropped
        assert list(r.tokens) == want[:3]
        read_all(s, r)
        staged = [j for j in books.jobs if j.request.past_len == start + 3]
        assert [j.outcome for j in staged] == ["discarded"], books.jobs
        assert_all_back(ex, sched)
        books.assert_one_outcome_per_job()


def test_a_stream_ending_at_a_stop_token_with_its_next_step_staged_gives_the_slot_back(
        runner):
    ref = reference_stream(runner, PROMPT_A, GREEDY)
    stop = ref[4]                                     # the token the step at +3 gives
    assert stop not in ref[:4]
    params = SamplingParams(max_tokens=N_TOKENS, stop_token_ids=(stop,))
    with booked(2) as (ex, books, sched):
        s = ex.generate(PROMPT_A, params)
        start = len(PROMPT_A)
        _staged_on_seq0(ex, sched, start + 3)
        sched.run(settled(s))
        r = s.result(0)
        assert r.finish_reason == FinishReason.STOP
        assert list(r.tokens) == ref[:4]               # the stop token is not delivered
        read_all(s, r)
        staged = [j for j in books.jobs if j.request.past_len == start + 4]
        assert [j.outcome for j in staged] == ["discarded"], books.jobs
        assert_all_back(ex, sched)
        books.assert_one_outcome_per_job()


def test_a_stream_ending_at_max_tokens_gives_back_any_step_staged_after_its_last(runner):
    """No decode follows the last token, so none is staged for it as it is submitted;
    a staging deferred for the step before it, run only once the last step is on its
    way, may still lease a slot behind the last step (it is for a position no step will
    use). Held here so that it does: the stream still ends ``length`` and that slot comes
    back with it."""
    want = reference_stream(runner, PROMPT_A, GREEDY)
    with booked(3) as (ex, books, sched):
        s = ex.generate(PROMPT_A, GREEDY)
        start = len(PROMPT_A)
        last = start + N_TOKENS - 2                     # the decode that gives token 8
        # the step before the one before the last on the device, nothing deferred
        sched.run(lambda: decode_on_device(ex, 0, last - 2))
        sched.run(lambda: not ex.steps.can_run_deferred(), hold={"complete"})
        # the step before the last is queued with its staging deferred, and completes
        # while that staging waits: the last step goes, then the staging runs
        sched.run(lambda: decode_on_device(ex, 0, last), hold={"deferred"})
        sched.run(lambda: not ex.steps.can_run_deferred(), hold={"complete"})
        assert leased(ex) <= 2
        sched.run(settled(s))
        r = s.result(0)
        assert r.finish_reason == FinishReason.LENGTH
        assert list(r.tokens) == want
        read_all(s, r)
        beyond = [j for j in books.jobs if j.request.past_len > last]
        assert len(beyond) <= 1 and all(j.outcome == "discarded" for j in beyond), \
            books.jobs
        assert_all_back(ex, sched)
        books.assert_one_outcome_per_job()


def test_a_drain_with_a_stream_step_staged_gives_the_slot_back_and_the_stream_resumes(
        runner):
    want = reference_stream(runner, PROMPT_A, GREEDY)
    with booked(4) as (ex, books, sched):
        s = ex.generate(PROMPT_A, GREEDY)
        start = len(PROMPT_A)
        _staged_on_seq0(ex, sched, start + 2)
        assert ex.recover("a drain with a step staged")
        sched.run(lambda: ex.generation == 2 and ex.lifecycle_state == "Ready")
        staged = [j for j in books.jobs if j.request.past_len == start + 3]
        assert [(j.generation, j.outcome) for j in staged] == [(1, "failed")], books.jobs
        sched.run(settled(s))
        r = s.result(0)
        assert r.finish_reason == FinishReason.LENGTH, r
        assert list(r.tokens) == want and r.resumes == 1
        read_all(s, r)
        assert_all_back(ex, sched)
        books.assert_one_outcome_per_job()


# ---- a prepared step that ends before the step it follows ----------------------------

class FailingApply:
    """The simulated device, except that growing sequence 0's KV to ``target`` the
    first time raises a retryable Unavailable: the release of the step prepared for
    that position fails there and then, on the way back of the step before it, before
    that step has resolved, and the stream replays."""

    def __init__(self, inner: SimDriver, target: int, error: Exception | None = None
                 ) -> None:
        self._inner = inner
        self.target = target
        self.error = error or Unavailable("kv_apply: the device is busy",
                                          retry_after_s=0.0, stage="kv")
        self.failed = 0

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def kv_apply(self, seq_id: int, target: int) -> bool:
        if seq_id == 0 and target == self.target and not self.failed:
            self.failed += 1
            raise self.error
        return self._inner.kv_apply(seq_id, target)


def _through_a_failing_release(runner, error: Exception | None = None,
                               observer: Callable[[DeviceExecutor], Observer] | None = None):
    """Run one greedy stream on a device whose KV grows for the sixth decode raise
    ``error`` once (a retryable Unavailable by default), in step mode, with
    ``observer(ex)`` watching if given; check what every such run must hold (the
    consumer read exactly the result, one outcome per job, every slot and the KV back).
    Returns the driver, the result and the reference's tokens."""
    prompt = PROMPTS[0]
    want = reference_stream(runner, prompt, GREEDY)
    drv = FailingApply(SimDriver(TINY, seed=0, faults=FaultPlan.none(), trace=True),
                       len(prompt) + 6, error)
    with booked(0, driver=drv) as (ex, books, sched):
        if observer is not None:
            ex.add_observer(observer(ex))
        stream = ex.generate(prompt, GREEDY)
        sched.run(settled(stream))
        result = stream.result(0)
        read_all(stream, result)
        books.assert_one_outcome_per_job()
        assert_all_back(ex, sched)
    return drv, result, want


def test_a_staged_step_failing_at_release_leaves_its_predecessors_token_delivered_once(
        runner):
    """Each decision is taken by its own step's end only. The decode staged for the
    sixth token's position fails as the core releases it (its KV reservation raises a
    retryable error), inside the way back of the step before it, whose token the
    stream has just recorded: that failure's callback runs first and must not take the
    decision of the step before, or that step decides again when it resolves and
    records its token twice (found with the submitter failing a released step before
    its predecessor resolved: the replay then reproduced the wrong token)."""
    drv, result, want = _through_a_failing_release(runner)
    assert drv.failed == 1
    assert result.finish_reason is FinishReason.LENGTH, result
    assert list(result.tokens) == want and result.resumes == 1, (result, want)


def test_a_stream_ended_by_its_staged_steps_release_frees_its_sequence_after_both_steps(
        runner):
    """The same failure, not retryable (the driver raised a plain exception): the
    stream ends with it while the step before is still on its way back, its KV
    reservation open. The one-shot sequence is released once both steps have ended,
    not at the stream's end (its KV reset was refused then, and the id came back with
    the KV still held)."""
    _, result, want = _through_a_failing_release(runner, RuntimeError("kv_apply broke"))
    assert result.finish_reason is FinishReason.ERROR, result
    assert "kv_apply broke" in result.error.message
    assert list(result.tokens) == want[:6], (result, want)


class DeferredWorkBeforeResolve(Observer):
    """Runs the executor's deferred work (the admission side) from inside the job end
    of the decode at ``past_len``, before that job resolves: in step mode, what the
    admission thread may do while the completion thread is between a job's successor
    and its resolve."""

    def __init__(self, ex: DeviceExecutor, past_len: int) -> None:
        self.ex = ex
        self.past_len = past_len
        self.ran = 0

    def job_ended(self, event: JobEnded) -> None:
        if event.kind is TaskKind.DECODE and event.request.past_len == self.past_len \
                and event.outcome == "succeeded" and not self.ran:
            while self.ex.steps.run_deferred():
                self.ran += 1


def test_a_replay_waits_for_the_step_its_failed_successor_followed(runner):
    """The staged step fails as it is released (retryable), and the stream's replay,
    deferred to the admission side, runs before the step it followed has resolved (the
    threaded runtime interleaves so: found in test_no_cycles, 1 run in 2 beside another
    suite, 'sequence 0 is Busy'). The replay waits until that step has ended; the
    stream then gives the fault-free tokens."""
    early: list[DeferredWorkBeforeResolve] = []

    def watch(ex: DeviceExecutor) -> Observer:
        early.append(DeferredWorkBeforeResolve(ex, len(PROMPTS[0]) + 4))
        return early[0]

    drv, result, want = _through_a_failing_release(runner, observer=watch)
    assert drv.failed == 1 and early[0].ran >= 1
    assert result.finish_reason is FinishReason.LENGTH, result
    assert list(result.tokens) == want and result.resumes == 1, (result, want)
