"""Generation streams and sequences through the executor (issue 13, "Must show"), in step
mode (a seeded :class:`~calfsm.runtime.stepper.StepScheduler` on the virtual clock) and in
threaded mode (real time, zero device latency; :class:`HoldAfterWaits` holds one chosen
step on the device instead of sleeping).

- Greedy streams equal the reference: the 100 golden prompts (lengths 1..4096) give the
  tokens of :class:`~calfsm.tools.direct.DirectRunner`, four streams at a time.
- Seeded sampling equals sampling the reference's logits with the same seed, on
  SimDriver and on the native emulator; the same seed repeats, other seeds differ.
- Finish reasons: a stop token ends ``stop`` and is not delivered; ``max_tokens`` and
  ``max_seq`` end ``length``.
- Cancel mid-stream, with the next step queued (FI11: it never reaches the device) or on
  the device (FI12: it runs, its token is dropped), from another thread or by the
  consumer: ``cancelled``, nothing delivered after the cancel returned, everything freed
  and the sequence id reused.
- A fault mid-stream (an infer refused DEVICE_UNAVAILABLE, a CCU exception, a forced
  ``recover()``) with resume gives the fault-free tokens; without resume the stream ends
  ``error`` with a retryable 503 carrying Retry-After.
- The bounded wait queue refuses a burst at once with 429; the accepted jobs complete.
- Sequences: one job at a time, close waits for the last job and releases the KV, ids
  are reused, ``max_sequences`` is a 429.

The asyncio side (``async for``, task cancel, ``await submit``, the event loop's
lateness) is in ``tests/generate/test_streams_async.py``.
"""

from __future__ import annotations

import sys
import threading

import pytest

from calfsm.drivers.calrt import CalrtDriver
from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.drivers.sim import LatencyModel
from calfsm.errors import (
    CalfsmError,
    CalrtCode,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
)
from calfsm.executor import DeviceExecutor, step_port
from calfsm.generate.front import Front
from calfsm.generate.sampling import SamplingParams
from calfsm.generate.sequence import Sequence
from calfsm.generate.stream import FinishReason, GenerationResult, Stream
from calfsm.machines.sequence import SequenceState
from calfsm.manifest import TaskKind
from calfsm.request import Request
from calfsm.runtime.stepper import StepScheduler
from calfsm.tools.direct import DirectRunner
from tests.helpers.executor import (
    TINY,
    GatedDriver,
    HeldReset,
    HoldAfterWaits,
    calls,
    drive,
    eventually,
    finish,
    gated_executor,
    make_executor,
    make_sim,
    reference_stream,
)
from tests.helpers.streams import (
    GREEDY,
    N_TOKENS,
    PROMPT,
    PROMPTS,
    assert_freed,
    assert_id_reused,
    direct_runner,
    golden_tokens,
    run_streams,
    settle,
)

CONTRACT = TINY.submodel(TaskKind.DECODE)
VOCAB, MAX_SEQ = CONTRACT.vocab, CONTRACT.max_seq
SEEDED = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=7, max_tokens=N_TOKENS)
DRAWS = {
    "temperature": SamplingParams(temperature=1.0, seed=1, max_tokens=N_TOKENS),
    "top_k": SamplingParams(temperature=0.7, top_k=5, seed=2, max_tokens=N_TOKENS),
    "top_p": SamplingParams(temperature=1.2, top_p=0.5, seed=3, max_tokens=N_TOKENS),
    "all": SEEDED,
}
UNAVAILABLE = int(CalrtCode.DEVICE_UNAVAILABLE)

pytestmark = pytest.mark.timeout(60)


# ---- helpers ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def runner() -> DirectRunner:
    """The direct synchronous path on its own simulated device: the reference."""
    return direct_runner()


@pytest.fixture(scope="module")
def golden() -> list[list[int]]:
    return golden_tokens(PROMPTS, N_TOKENS)


reference = reference_stream


def generate(ex: DeviceExecutor, prompt: list[int], params: SamplingParams, *,
             seed: int = 0, **kw) -> GenerationResult:
    return settle(ex, ex.generate(prompt, params, **kw), seed)


def open_again(ex: DeviceExecutor, seq) -> None:
    """Until the sequence's last job has ended on its side too (threaded: a handle is
    done just before its done-callbacks run, the sequence's among them)."""
    drive(ex, lambda: seq.state == SequenceState.OPEN)


# ---- greedy: the reference model ----------------------------------------------------

def test_greedy_streams_equal_the_reference_on_the_100_golden_prompts(mode, golden):
    with make_executor(mode) as ex:
        got = run_streams(ex, PROMPTS, GREEDY, lanes=4)
        assert max(map(len, PROMPTS)) == 4096 and min(map(len, PROMPTS)) == 1
        for i, prompt in enumerate(PROMPTS):
            r, events = got[i]
            assert list(r.tokens) == golden[i], f"prompt {i} (len {len(prompt)})"
            assert r.finish_reason == FinishReason.LENGTH and r.error is None
            assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), 16)
            assert [e.token for e in events] == golden[i]
        assert_freed(ex)
        st = ex.stats()
        assert st.succeeded == len(PROMPTS) * N_TOKENS and st.failed == st.cancelled == 0


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_greedy_streams_under_seeded_interleavings(seed, golden):
    sample = PROMPTS[:10] + PROMPTS[50:60]         # the edge lengths and ten more
    with make_executor("step") as ex:
        got = run_streams(ex, sample, GREEDY, lanes=6, seed=seed)
        for i in range(len(sample)):
            want = golden[i] if i < 10 else golden[40 + i]
            assert list(got[i][0].tokens) == want
        assert_freed(ex)


def test_events_carry_position_index_and_timings(mode):
    with make_executor(mode) as ex:
        s = ex.generate(PROMPT, SamplingParams(max_tokens=5))
        r = settle(ex, s)
        events = list(s)
        assert [e.index for e in events] == list(range(5))
        assert [e.position for e in events] == [len(PROMPT) + i for i in range(5)]
        assert [e.token for e in events] == list(r.tokens)
        assert r.ttft_s is not None and r.ttft_s > 0
        assert len(r.inter_token_s) == 4 and all(t >= 0 for t in r.inter_token_s)
        if mode == "step":          # the virtual clock: each step is the device's time
            assert all(t > 0 for t in r.inter_token_s)


# ---- seeded sampling ----------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(DRAWS))
def test_seeded_stream_equals_sampling_the_reference_logits(mode, runner, name):
    params = DRAWS[name]
    with make_executor(mode) as ex:
        for prompt in (PROMPTS[0], PROMPT, PROMPTS[9]):
            assert list(generate(ex, prompt, params).tokens) == \
                reference(runner, prompt, params)
        assert_freed(ex)


def test_same_seed_same_tokens_other_seeds_differ(mode):
    def params(seed: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, seed=seed, max_tokens=N_TOKENS)

    with make_executor(mode) as ex:
        # two streams with one seed at once: the interleaving changes nothing
        a, b = ex.generate(PROMPT, params(11)), ex.generate(PROMPT, params(11))
        first, second = settle(ex, a).tokens, settle(ex, b).tokens
        others = [generate(ex, PROMPT, params(s)).tokens for s in range(5)]
    with make_executor(mode) as ex:
        again = generate(ex, PROMPT, params(11)).tokens
    assert first == second == again and len(first) == N_TOKENS
    assert len({first, *others}) == 6, "different seeds gave the same tokens"


def _emulator(mode: str) -> CalrtDriver:
    if mode == "step":
        return CalrtDriver.virtual(manifest_or_calbin=TINY)
    return CalrtDriver(TINY, latency=LatencyModel.zero())


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_native_emulator_streams_the_same_tokens(mode, runner, params):
    with make_executor(mode, driver=_emulator(mode)) as ex:
        assert ex.driver.name == "calrt"
        for prompt in (PROMPTS[1], PROMPT, PROMPTS[8]):          # lengths 2, 127, 4095
            assert list(generate(ex, prompt, params).tokens) == \
                reference(runner, prompt, params)
        assert_freed(ex)


# ---- finish reasons -----------------------------------------------------------------

def test_stop_token_ends_with_stop_and_is_not_delivered(mode, golden):
    want = golden[5]
    k = next(i for i in range(1, N_TOKENS) if want[i] not in want[:i])
    stop = SamplingParams(max_tokens=N_TOKENS, stop_token_ids=(VOCAB - 1, want[k]))
    with make_executor(mode) as ex:
        s = ex.generate(PROMPT, stop)
        r = settle(ex, s)
        assert r.finish_reason == FinishReason.STOP and r.error is None
        assert list(r.tokens) == want[:k] and r.usage.completion_tokens == k
        assert [e.token for e in s] == want[:k]
        assert_freed(ex)


def test_stop_token_first_ends_with_no_token(mode, golden):
    with make_executor(mode) as ex:
        r = generate(ex, PROMPT, SamplingParams(stop_token_ids=(golden[5][0],)))
        assert r.finish_reason == FinishReason.STOP
        assert r.tokens == () and r.ttft_s is None and r.inter_token_s == ()
        assert_freed(ex)


@pytest.mark.parametrize("n", [1, 5])
def test_max_tokens_ends_with_length(mode, golden, n):
    with make_executor(mode) as ex:
        r = generate(ex, PROMPT, SamplingParams(max_tokens=n))
        assert r.finish_reason == FinishReason.LENGTH and list(r.tokens) == golden[5][:n]
        assert_freed(ex)
        assert ex.stats().succeeded == n                    # no step beyond the last


@pytest.mark.parametrize("room", [1, 3])
def test_sequence_reaching_max_seq_ends_with_length(mode, runner, room):
    """A prompt ``room`` tokens short of ``max_seq``: ``room`` tokens fit (prompt and
    generated tokens together fill the context, as OpenAI counts it) and the stream ends
    ``length``; one more is refused at once (calfsm/generate/arguments.py, issue 34), and so is a
    prompt that leaves no room."""
    prompt = (PROMPTS[9] * 3)[:MAX_SEQ - room]
    with make_executor(mode) as ex:
        r = generate(ex, prompt, SamplingParams(max_tokens=room))
        assert r.finish_reason == FinishReason.LENGTH and r.error is None
        assert list(r.tokens) == runner.generate(0, prompt, room)
        with pytest.raises(InvalidArgument, match="context holds"):
            ex.generate(prompt, SamplingParams(max_tokens=room + 1))
        with pytest.raises(InvalidArgument, match="leaves no room"):
            ex.generate((PROMPTS[9] * 3)[:MAX_SEQ])
        assert_freed(ex)


# ---- cancel -------------------------------------------------------------------------

def _infers(ex: DeviceExecutor, seq_id: int) -> int:
    """infer calls that carried a job of sequence ``seq_id`` (its JobTag)."""
    return sum(1 for c in calls(ex.driver, "infer") if c["tag"][1] == seq_id)


def _assert_cancelled(ex: DeviceExecutor, s: Stream, delivered: list[int],
                      golden_tokens: list[int], *, jobs_cancelled: int | None = None
                      ) -> None:
    """``delivered``: what the consumer read up to the cancel; nothing may follow. Every
    job has one outcome and none failed; ``jobs_cancelled``: how many of them were
    cancelled (a step prepared ahead and not needed is ``discarded`` instead)."""
    r = settle(ex, s)
    assert r.finish_reason == FinishReason.CANCELLED
    assert list(r.tokens) == delivered == golden_tokens[:len(delivered)]
    assert list(s) == []                    # nothing left to read after the cancel
    assert s.sequence.state == SequenceState.RELEASED
    assert ex.epoch.kv.sequence_length(s.sequence.seq_id) == 0
    assert_freed(ex)
    st = ex.stats()
    assert st.failed == 0 and st.accepted == st.succeeded + st.cancelled + st.discarded, st
    if jobs_cancelled is not None:
        assert st.cancelled == jobs_cancelled, st
    assert_id_reused(ex, s.sequence.seq_id)


@pytest.mark.parametrize("k", [1, 4])
def test_step_cancel_with_next_step_queued_never_reaches_the_device(golden, k):
    """FI11 mid-stream: after ``k`` tokens the next decode is queued; cancel removes it."""
    with make_executor("step") as ex:
        sched = StepScheduler(ex, 0)
        s = ex.generate(PROMPT, GREEDY)
        sched.run_until(lambda: ex.stats().succeeded == k)
        assert ex.stats().queued == 1 and not ex.on_device()
        delivered = [e.token for e in (next(s) for _ in range(k))]
        infers = _infers(ex, s.sequence.seq_id)
        assert s.cancel()
        _assert_cancelled(ex, s, delivered, golden[5])
        assert _infers(ex, 0) == infers == k


@pytest.mark.parametrize("k", [1, 4])
def test_step_cancel_with_a_step_on_the_device_drops_its_token(golden, k):
    """FI12 mid-stream: step ``k + 1`` is on the device; it runs to its end (its wait is
    made) and its token is not delivered."""
    with make_executor("step") as ex:
        sched = StepScheduler(ex, 0)
        s = ex.generate(PROMPT, GREEDY)
        sched.run_until(lambda: ex.stats().succeeded == k and bool(ex.on_device()))
        waits = len(calls(ex.driver, "wait"))
        assert s.cancel()
        assert _infers(ex, 0) == k + 1
        delivered = [next(s).token for _ in range(k)]    # the k tokens before it
        _assert_cancelled(ex, s, delivered, golden[5], jobs_cancelled=1)
        assert len(calls(ex.driver, "wait")) == waits + 1


@pytest.mark.parametrize("who", ["another thread", "the consumer"])
@pytest.mark.parametrize("k", [1, 4])
def test_threaded_cancel_mid_stream(golden, who, k):
    """Step ``k + 1`` is held on the device with ``k`` tokens delivered; the stream is
    cancelled by the test thread while a consumer thread blocks in ``next()``, or by the
    consumer between two events. Nothing arrives after the cancel returned."""
    gated = HoldAfterWaits(make_sim("threaded"))
    with make_executor("threaded", driver=gated) as ex:
        try:
            gated.hold_after(k)
            s = ex.generate(PROMPT, GREEDY)
            got: list[int] = []
            after_cancel: list[int] = []
            cancelled = threading.Event()

            def consume() -> None:
                for ev in s:
                    (after_cancel if cancelled.is_set() else got).append(ev.token)
                    if who == "the consumer" and len(got) == k:
                        assert gated.held.wait(5)
                        assert s.cancel()
                        cancelled.set()

            consumer = threading.Thread(target=consume)
            consumer.start()
            assert gated.held.wait(5)
            if who == "another thread":
                assert s.cancel()
                cancelled.set()
            assert cancelled.wait(5)
            gated.gate.set()
            consumer.join(10)
            assert not consumer.is_alive()
            if who == "the consumer":
                assert after_cancel == []
            else:   # tokens delivered before the cancel may still be read after it
                got += after_cancel
            _assert_cancelled(ex, s, got, golden[5], jobs_cancelled=1)
            assert len(got) == k
        finally:
            gated.gate.set()


def test_cancel_before_the_prefill_reaches_the_device(mode):
    """FI11 at the start: the stream's prefill waits behind a job held on the device."""
    with gated_executor(mode) as (ex, gated):
        gated.gate.clear()
        blocker = ex.enqueue_nowait(Request.prefill(200, [1, 2, 3]))
        drive(ex, lambda: bool(ex.on_device()))
        s = ex.generate(PROMPT, GREEDY)
        assert ex.stats().queued == 1
        assert s.cancel()
        gated.gate.set()
        drive(ex, blocker.done)
        ex.reset_sequence(200)
        _assert_cancelled(ex, s, [], [], jobs_cancelled=1)
        assert _infers(ex, s.sequence.seq_id) == 0


def test_cancel_while_a_token_is_sampled_delivers_nothing_more(mode, golden):
    """A cancel that lands while step ``k + 1``'s logits are being sampled (its job has
    already succeeded, so only the stream can drop the token): step mode cancels from
    inside the sampler, threaded mode from the test thread while the sampler waits."""
    k = 3
    sampling, cancelled = threading.Event(), threading.Event()
    stream: list[Stream] = []
    seen = 0

    def argmax(row) -> int:
        nonlocal seen
        seen += 1
        if seen == k + 1:
            if mode == "step":
                assert stream[0].cancel()
            else:
                sampling.set()
                assert cancelled.wait(5)
        return int(row.argmax())

    with make_executor(mode) as ex:
        s = ex.generate(PROMPT, SamplingParams(sampler=argmax, max_tokens=N_TOKENS))
        stream.append(s)
        if mode == "threaded":
            assert sampling.wait(5)
            assert s.cancel()
            cancelled.set()
        settle(ex, s)
        delivered = [e.token for e in s]
        assert len(delivered) == k and seen == k + 1
        _assert_cancelled(ex, s, delivered, golden[5])


def test_cancel_after_the_end_is_refused(mode):
    with make_executor(mode) as ex:
        s = ex.generate(PROMPT, SamplingParams(max_tokens=2))
        settle(ex, s)
        assert not s.cancel()
        assert s.result(0).finish_reason == FinishReason.LENGTH


def test_user_sampler_that_raises_ends_with_error_and_frees_everything(mode):
    def broken(row) -> int:
        raise ValueError("no token today")

    with make_executor(mode) as ex:
        r = generate(ex, PROMPT, SamplingParams(sampler=broken))
        assert r.finish_reason == FinishReason.ERROR and r.tokens == ()
        assert "ValueError: no token today" in r.error.message
        assert not r.error.retryable and r.error.http_status == 500
        r = generate(ex, PROMPT, SamplingParams(sampler=lambda row: VOCAB))
        assert r.finish_reason == FinishReason.ERROR and "not a token id" in r.error.message
        assert_freed(ex)


def test_stream_deadline_ends_with_deadline():
    """Virtual clock: a 127-token prefill (25.4 ms), then 10 ms a decode; a 75 ms
    deadline ends the stream after its in-flight step, well before max_tokens."""
    with make_executor("step") as ex:
        r = generate(ex, PROMPT, GREEDY, deadline_s=0.075)
        assert r.finish_reason == FinishReason.DEADLINE
        assert 1 <= len(r.tokens) < N_TOKENS
        assert r.error is not None and r.error.http_status == 504
        assert_freed(ex)


# ---- faults mid-stream --------------------------------------------------------------

FAULTS = {
    "infer DEVICE_UNAVAILABLE": FaultRule("infer", "code", seq_id=0, nth=6, code=UNAVAILABLE),
    "ccu exception": FaultRule("infer", "ccu_exception", seq_id=0, nth=6),
    "recover()": None,
}


def _faulted_run(mode: str, fault: str, params: SamplingParams, *, resume: bool
                 ) -> tuple[DeviceExecutor, Sequence | None, GenerationResult]:
    """A stream on sequence 0 whose sixth step (five tokens delivered) meets ``fault``:
    a fault plan rule, or ``ex.recover()`` forced while that step is queued (step mode)
    or on the device (threaded). With resume it is a one-shot ``ex.generate``; without,
    it runs on a sequence the caller closes once the executor is Ready again (a sequence
    released during the recovery is another defect:
    ``test_sequence_closed_during_a_recovery_is_not_lost_in_the_next``)."""
    rule = FAULTS[fault]
    gated = HoldAfterWaits(make_sim(mode, faults=FaultPlan.of(rule) if rule else None))
    ex = make_executor(mode, driver=gated)
    try:
        if rule is None and mode == "threaded":
            gated.hold_after(5)
        seq = None if resume else ex.open_sequence()
        s = ex.generate(PROMPT, params) if resume else \
            seq.generate(PROMPT, params, resume=False)
        if rule is None:
            if mode == "threaded":
                assert gated.held.wait(5)
            else:
                StepScheduler(ex, 0).run_until(lambda: ex.stats().succeeded == 5)
            assert ex.recover("forced mid-stream")
            gated.gate.set()
        if resume:
            return ex, None, settle(ex, s)
        drive(ex, s.done)
        return ex, seq, s.result(0)
    except BaseException:
        gated.gate.set()
        ex.close()
        raise


@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_fault_mid_stream_with_resume_gives_the_fault_free_tokens(mode, runner, fault,
                                                                   params):
    want = reference(runner, PROMPT, params)
    ex, _, r = _faulted_run(mode, fault, params, resume=True)
    with ex:
        assert r.finish_reason == FinishReason.LENGTH, r.error
        assert list(r.tokens) == want
        assert r.resumes >= 1 and ex.generation == 2
        assert_freed(ex)


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_fault_mid_stream_without_resume_is_a_retryable_503(mode, golden, fault):
    ex, seq, r = _faulted_run(mode, fault, GREEDY, resume=False)
    with ex:
        assert r.finish_reason == FinishReason.ERROR and r.resumes == 0
        err = r.error
        assert isinstance(err, CalfsmError)
        assert err.retryable and err.http_status == 503, err
        assert err.retry_after_s is not None and err.retry_after_s > 0, err
        # what came before the fault; a step already on the device when the drain began
        # may still finish within the grace period, and its token is kept
        assert len(r.tokens) in (5, 6) and list(r.tokens) == golden[5][:len(r.tokens)]
        drive(ex, lambda: ex.lifecycle_state == "Ready" and ex.generation == 2)
        seq.close()
        assert_freed(ex)
        assert generate(ex, PROMPT, GREEDY).tokens == tuple(golden[5])   # and it serves



def test_sequence_closed_during_a_recovery_is_not_lost_in_the_next():
    held = HeldReset(make_sim("threaded"))
    with make_executor("threaded", driver=held) as ex:
        try:
            seq = ex.open_sequence()
            h = seq.prefill([1, 2, 3])
            drive(ex, h.done)
            open_again(ex, seq)
            held.gate.clear()
            assert ex.recover("forced")
            assert held.resetting.wait(5)
            seq.close()
            held.gate.set()
            drive(ex, lambda: ex.lifecycle_state == "Ready" and ex.generation == 2)
            with ex.open_sequence() as again:
                assert again.seq_id == 0
                h = again.prefill([4, 5])
                drive(ex, h.done)
                assert h.result(0).token_count == 2
        finally:
            held.gate.set()


def test_two_faults_within_max_resumes_both_resume(mode, golden):
    plan = FaultPlan.of(*(FaultRule("infer", "code", seq_id=0, nth=n, code=UNAVAILABLE)
                          for n in (6, 12)))       # 12: after the replay prefill (7)
    with make_executor(mode, faults=plan) as ex:
        r = generate(ex, PROMPT, GREEDY)
        assert r.finish_reason == FinishReason.LENGTH, r.error
        assert list(r.tokens) == golden[5] and r.resumes == 2


# ---- the bounded wait queue ---------------------------------------------------------

def test_bounded_wait_queue_refuses_a_burst_at_once_with_429(mode):
    """``max_waiting=4`` with the device held: four of a burst of ten are accepted, six
    are refused in the call (the device never moves, so none of them could have
    waited); once the device is let go the four complete."""
    with gated_executor(mode, max_waiting=4) as (ex, gated):
        gated.gate.clear()
        blocker = ex.enqueue_nowait(Request.prefill(100, [1, 2, 3]))
        drive(ex, lambda: bool(ex.on_device()))
        accepted, refused = [], []
        for seq in range(10):
            try:
                accepted.append(ex.enqueue_nowait(Request.prefill(seq, [seq + 1] * 3)))
            except ResourceExhausted as e:
                refused.append(e)
        assert len(accepted) == 4 and len(refused) == 6
        for e in refused:
            assert e.http_status == 429 and e.retryable and e.grpc_code == \
                "RESOURCE_EXHAUSTED", e
            assert e.retry_after_s is not None and e.retry_after_s > 0, e
            assert "max_waiting 4" in e.message
        # a stream refused by the full queue ends at once, with the same 429
        s = ex.generate(PROMPT, GREEDY)
        assert s.done()
        assert isinstance(s.result(0).error, ResourceExhausted)
        assert s.result(0).finish_reason == FinishReason.ERROR
        gated.gate.set()
        drive(ex, lambda: all(h.done() for h in [blocker, *accepted]) and ex.idle())
        for h in [blocker, *accepted]:
            assert h.result(0).token_count == 3
        for seq in [100, *range(4)]:
            ex.reset_sequence(seq)
        assert_freed(ex)
        assert ex.stats().succeeded == 5


# ---- sequences ----------------------------------------------------------------------

def test_second_job_on_a_busy_sequence_is_refused(mode):
    with gated_executor(mode) as (ex, gated):
        seq = ex.open_sequence()
        gated.gate.clear()
        h = seq.prefill([1, 2, 3])
        drive(ex, lambda: bool(ex.on_device()))
        assert seq.state == SequenceState.BUSY
        with pytest.raises(FailedPrecondition, match="sequence 0 is Busy: one job at a"
                                                     " time") as e:
            seq.decode(4)
        assert e.value.seq_id == 0 and not e.value.retryable
        r = seq.generate([4, 5], GREEDY).result(0)        # a stream is refused too
        assert r.finish_reason == FinishReason.ERROR
        assert isinstance(r.error, FailedPrecondition) and r.tokens == ()
        gated.gate.set()
        drive(ex, h.done)
        open_again(ex, seq)
        assert h.result(0).token_count == 3 and seq.position == 3
        seq.close()
        assert ex.epoch.kv.sequence_length(0) == 0
        assert_freed(ex)


def test_close_waits_for_a_job_cancelled_after_submit_then_releases_the_kv():
    """The last job is on the device and cancelled; ``close()`` in another thread cannot
    return before the device lets it go (the gate is closed), then releases the KV."""
    gated = GatedDriver(make_sim("threaded"))
    with make_executor("threaded", driver=gated) as ex:
        try:
            seq = ex.open_sequence()
            gated.gate.clear()
            h = seq.prefill([1, 2, 3])
            assert gated.submitted.wait(5) and gated.waiting.wait(5)
            assert h.cancel()
            closer = threading.Thread(target=seq.close)
            closer.start()
            drive(ex, lambda: seq.state == SequenceState.CLOSING)
            assert closer.is_alive() and not h.done()
            releases = len(calls(ex.driver, "kv_release"))
            gated.gate.set()
            closer.join(10)
            assert not closer.is_alive()
            assert seq.state == SequenceState.RELEASED and h.done()
            assert ex.epoch.kv.sequence_length(0) == 0
            assert [c["seq"] for c in calls(ex.driver, "kv_release")[releases:]] == [0]
            assert_freed(ex)
            assert_id_reused(ex, 0)
        finally:
            gated.gate.set()


def test_close_that_times_out_never_hands_out_an_id_with_kv():
    gated = GatedDriver(make_sim("threaded"))
    with make_executor("threaded", driver=gated) as ex:
        try:
            seq = ex.open_sequence()
            gated.gate.clear()
            h = seq.prefill([1, 2, 3])
            assert gated.submitted.wait(5)
            h.cancel()
            try:
                seq.close(timeout=0.05)     # the gate is closed: the job cannot end
            except CalfsmError:
                pass                        # refusing to close is an honest answer
            gated.gate.set()
            drive(ex, lambda: h.done() and ex.idle())
            with ex.open_sequence() as again:
                assert ex.epoch.kv.sequence_length(again.seq_id) == 0
                assert again.prefill([4, 5]).result(5).token_count == 2
        finally:
            gated.gate.set()


def _inside(thread: threading.Thread, *names: str) -> bool:
    """Whether ``thread`` is currently inside a function of one of ``names``."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code.co_name in names:
            return True
        frame = frame.f_back
    return False


def test_close_notices_deferred_work_ending():
    """Deferred work (a stream's sequence release) still queued when ``close()`` starts
    must not make it wait out ``shutdown_timeout_s``: here one deferred call runs (held
    on an Event) with a second queued behind it; once close waits for them and the first
    is let go, close returns at once (2 s allowed, against a 5 s timeout)."""
    ex = make_executor("threaded", shutdown_timeout_s=5)
    running, go = threading.Event(), threading.Event()
    step_port(ex).defer(lambda: (running.set(), go.wait(10)))
    step_port(ex).defer(lambda: None)
    assert running.wait(5)
    closer = threading.Thread(target=ex.close)
    try:
        closer.start()
        if not eventually(lambda: _inside(closer, "drain", "stop"), 5):
            pytest.fail("close() never reached its drain")   # not the defect: a failure
        go.set()
        closer.join(2)
        assert not closer.is_alive(), "close() waited out its shutdown timeout"
    finally:
        go.set()
        closer.join(10)


def test_close_releases_the_kv_and_the_id_is_reused(mode):
    with make_executor(mode) as ex:
        seq, other = ex.open_sequence(), ex.open_sequence()
        assert (seq.seq_id, other.seq_id) == (0, 1)                 # lowest free first
        h = seq.prefill(PROMPT)
        drive(ex, h.done)
        open_again(ex, seq)
        h2 = seq.decode(h.result(0).greedy())
        drive(ex, h2.done)
        open_again(ex, seq)
        assert seq.position == len(PROMPT) + 1
        assert ex.epoch.kv.sequence_length(0) == len(PROMPT) + 1
        seq.close()
        seq.close()                                     # idempotent
        assert seq.state == SequenceState.RELEASED
        assert ex.epoch.kv.sequence_length(0) == 0
        with pytest.raises(FailedPrecondition, match="sequence 0 is Released"):
            seq.decode(1)
        assert_id_reused(ex, 0)
        other.close()
        assert_freed(ex)


def test_open_sequence_beyond_max_sequences_is_a_429(mode):
    with make_executor(mode, max_sequences=2) as ex:
        a, b = ex.open_sequence(), ex.open_sequence()
        for call in (ex.open_sequence, lambda: ex.generate(PROMPT, GREEDY)):
            with pytest.raises(ResourceExhausted, match="all 2 sequence ids are open") as e:
                call()
            assert e.value.http_status == 429 and e.value.retryable
            assert e.value.retry_after_s is not None and e.value.retry_after_s > 0
        b.close()
        assert generate(ex, PROMPT, SamplingParams(max_tokens=2)).finish_reason == \
            FinishReason.LENGTH
        a.close()
        assert_freed(ex)


def test_two_streams_on_one_sequence_continue_its_kv(mode, golden):
    """The first stream's last token is sampled, not decoded: a second stream whose
    prompt is that token continues exactly where the reference goes on."""
    with make_executor(mode) as ex:
        with ex.open_sequence() as seq:
            first = seq.generate(PROMPT, SamplingParams(max_tokens=4))
            drive(ex, lambda: first.done() and seq.state == SequenceState.OPEN)
            assert list(first.result(0).tokens) == golden[5][:4]
            assert seq.position == len(PROMPT) + 3
            second = seq.generate([golden[5][3]], SamplingParams(max_tokens=8))
            drive(ex, lambda: second.done() and seq.state == SequenceState.OPEN)
            assert list(second.result(0).tokens) == golden[5][4:12]
            assert second.result(0).usage.prompt_tokens == 1
        assert ex.epoch.kv.sequence_length(0) == 0
        assert_freed(ex)


def test_a_sequence_takes_its_next_job_as_soon_as_result_returned(monkeypatch):
    """``result()`` may return before the handle's done-callbacks ran (the latch is
    released first); the sequence's own bookkeeping must not make the caller's next job
    look like a second job on a busy sequence."""
    from calfsm.generate.sequence import Sequence as Seq

    late: list = []
    monkeypatch.setattr(Seq, "_job_done", lambda self, h: late.append((self, h)))
    with make_executor("step") as ex:
        seq = ex.open_sequence()
        h = seq.prefill([1, 2, 3])
        StepScheduler(ex, 0).run_until(h.done)
        tok = h.result(0).greedy()
        assert late, "the callback was held back"
        h2 = seq.decode(tok)                 # not refused: the finished job is booked now
        StepScheduler(ex, 0).run_until(h2.done)
        assert h2.result(0).token_count == 1 and seq.position == 3


# ---- one-shot ids, resume budget (issue 20, item 8) --------------------------------

def test_one_shot_generate_gives_its_id_back_before_its_result(mode):
    """With one sequence id, fifty one-shot streams in a row: each next ``generate``,
    asked for the moment the last result is in, gets the id (no spurious 429)."""
    with make_executor(mode, max_sequences=1) as ex:
        for i in range(50):
            s = ex.generate([i + 1, 2, 3], SamplingParams(max_tokens=2))
            drive(ex, s.done)
            assert s.result(10).finish_reason == FinishReason.LENGTH


def test_max_resumes_is_settable_per_one_shot_stream_and_checked(mode):
    with make_executor(mode) as ex:
        for bad in (-1, 1.5, True, "2"):
            with pytest.raises(InvalidArgument, match="max_resumes"):
                ex.generate(PROMPT, GREEDY, max_resumes=bad)
        assert ex.live_streams.live() == []
        assert ex.open_sequence().seq_id == 0      # the refused streams gave their ids back


def test_max_resumes_zero_ends_a_faulted_stream_with_a_retryable_503():
    plan = FaultPlan.of(FaultRule("infer", "ccu_exception", seq_id=0, nth=6))
    with make_executor("step", faults=plan) as ex:
        r = generate(ex, PROMPT, GREEDY, max_resumes=0)
        assert r.finish_reason == FinishReason.ERROR and r.resumes == 0
        assert r.error.retryable and r.error.http_status == 503
        drive(ex, lambda: ex.lifecycle_state == "Ready")
        r = generate(ex, PROMPT, GREEDY, max_resumes=1)      # the fault happened once
        assert r.finish_reason == FinishReason.LENGTH


# ---- stop sequences (several tokens) ------------------------------------------------

def test_a_stop_sequence_ends_the_stream_stop_and_is_never_delivered(mode, golden):
    """The reference tokens t0..t15 with a stop sequence (t5, t6, t7): the stream ends
    ``stop`` with t0..t4, and its consumer never sees t5, although t5 and t6 were
    generated (held back) before t7 completed the sequence."""
    want = golden[5]
    params = SamplingParams(max_tokens=N_TOKENS, stop_sequences=[want[5:8]])
    with make_executor(mode) as ex:
        s = ex.generate(PROMPT, params)
        drive(ex, s.done)
        seen = [e.token for e in s]
        r = s.result(10)
        assert r.finish_reason == FinishReason.STOP
        assert list(r.tokens) == seen == want[:5]
        assert r.usage.completion_tokens == 5 and len(r.inter_token_s) == 4


def test_a_stop_sequence_prefix_that_does_not_complete_is_delivered(mode, golden):
    """(t3, t4, x) with x never coming: t3 and t4 are held while they may begin it and
    delivered once t5 shows they did not; a prefix left at max_tokens is delivered."""
    want = golden[5]
    other = next(t for t in range(VOCAB) if t not in want)
    params = SamplingParams(max_tokens=N_TOKENS,
                            stop_sequences=[(want[3], want[4], other), (want[15], other)])
    with make_executor(mode) as ex:
        s = ex.generate(PROMPT, params)
        drive(ex, s.done)
        events = list(s)
        r = s.result(10)
        assert r.finish_reason == FinishReason.LENGTH
        assert list(r.tokens) == [e.token for e in events] == want
        assert [e.index for e in events] == list(range(N_TOKENS))


def test_stop_sequences_are_checked():
    for bad, match in (([[]], r"stop_sequences\[0\] must hold"), ("ab", "stop_sequences"),
                       ([[1, -2]], r"stop_sequences\[0\]\[1\]"),
                       ([[1]] * 17, "at most 16")):
        with pytest.raises(InvalidArgument, match=match):
            SamplingParams(stop_sequences=bad)
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        SamplingParams(stop_sequences=[[1, VOCAB]]).sampler_for(VOCAB)
    one = SamplingParams(stop_sequences=[[7]])
    assert one.is_stop(7) and not one.holds_back


# ---- idle and close (from the issue #12 defects) ----------------------------------

def test_defect_wait_until_idle_wakes_when_the_last_stream_ends():
    """Found by the soak: ``wait_until(executor.idle, t)`` could sleep until its timeout
    after the last job ended, because a one-shot stream's deferred release (and a job
    failed before submit) left the books without telling the waiters."""
    import time

    from calfsm.generate.sampling import SamplingParams

    # Woken or timed out is told apart by the timeout, not by how soon a busy machine
    # schedules the waiter: a wait that missed its wake-up sleeps the whole timeout
    timeout = 30.0
    with make_executor("threaded") as ex:
        for i in range(60):
            s = ex.generate([1, 2, i % 50], SamplingParams(max_tokens=2 + i % 5))
            if i % 3 == 0:
                s.cancel()
            s.result(10)
            t0 = time.monotonic()
            assert ex.wait_until(ex.idle, timeout)
            slept = time.monotonic() - t0
            assert slept < timeout / 2, \
                f"wait_until(idle) slept {slept:.3f} s after the work ended (stream {i})"


def test_defect_close_racing_a_job_being_started_waits_for_that_job(caplog, monkeypatch):
    """Found while breaking reference cycles: ``Sequence.close()`` landing between a
    job's start (the sequence Busy) and its handle being recorded waited for the job
    before it, released the KV under the new one and gave the id back while it ran."""
    with make_executor("threaded") as ex:
        seq = ex.open_sequence()
        assert finish(ex, seq.prefill([1, 2, 3])).greedy() is not None
        real = Front.enqueue_nowait         # where a sequence's job is enqueued
        closer = threading.Thread(target=seq.close, name="test-closer")
        seen: dict[str, bool] = {}

        def enqueue_while_closing(front, request, **kw):
            closer.start()
            closer.join(0.2)                 # close() must wait for this job's handle
            seen["waited"] = closer.is_alive()
            return real(front, request, **kw)

        monkeypatch.setattr(Front, "enqueue_nowait", enqueue_while_closing)
        try:
            handle = seq.decode(7)
        finally:
            monkeypatch.undo()
        closer.join(10)
        assert seen["waited"], "close() went on before the job being started was known"
        assert not closer.is_alive()
        assert handle.exception(5) is None
        assert seq.state == "Released"
        assert ex.wait_until(ex.idle, 5) and ex.epoch.kv.stats().open == 0
    assert not [r for r in caplog.records if "releasing the KV" in r.getMessage()]
