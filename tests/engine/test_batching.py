"""Continuous batching on a batch calbin (issue 22, "Must show"): several streams' next
steps in one device job, every row's promises kept, in step mode (seeded interleavings
on the virtual clock) and threaded mode (real time, a short modelled decode so batches
form while one runs).

- Every row of every batch equals the reference model: the 100 golden prompts, eight
  streams at a time, all lengths.
- Eight sequences of 1000 tokens each, batched together the whole way: no cross-talk.
- Streams joining and leaving mid-batch (different lengths, starts and ends).
- A cancel, a deadline and a stop token in one row each leave the other rows untouched.
- A job-level fault (the whole batch job ends DONE_CCU_EXCEPTION) resumes every row's
  stream with the fault-free tokens; a row-level fault (its row_status, or its
  sequence's KV) fails only its row: no drain, and no other stream spends a resume.
- Batching only on evidence: none, or failing, keeps one row per job with the reason in
  ``health().notes``; proven evidence turns it on; ``max_batch`` caps it.
"""

from __future__ import annotations

from typing import Any

import pytest

from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.drivers.sim import SimDriver
from calfsm.errors import Unavailable
from calfsm.executor import DeviceExecutor, ExecutorConfig
from calfsm.generate.sampling import SamplingParams
from calfsm.generate.streams import FinishReason, Stream
from calfsm.manifest import builtin_manifest
from calfsm.tools.direct import DirectRunner, golden_prompts
from tests.helpers.batching import B8, batch_sizes, make_batched
from tests.helpers.executor import batching, drive, write_batch_evidence
from tests.helpers.streams import assert_freed, direct_runner, reference_fixtures, run_streams

TINY = builtin_manifest("tiny")
PROMPTS = golden_prompts()
N_TOKENS = 16
GREEDY = SamplingParams(max_tokens=N_TOKENS)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def runner() -> DirectRunner:
    return direct_runner()


golden, device = reference_fixtures(PROMPTS, N_TOKENS)


def run_all(ex: DeviceExecutor, streams: list[Stream], seed: int = 0) -> None:
    drive(ex, lambda: all(s.done() for s in streams), seed=seed, timeout=60)


# ---- every row equals the reference ----------------------------------------------

def test_the_100_golden_prompts_eight_at_a_time(mode, golden, tmp_path, device):
    with make_batched(mode, tmp_path, device=device) as ex:
        assert ex.max_batch == 8 and ex.health().notes == ()
        got = run_streams(ex, PROMPTS, GREEDY, lanes=8)
        for i, prompt in enumerate(PROMPTS):
            r, events = got[i]
            assert list(r.tokens) == golden[i], f"prompt {i} (len {len(prompt)})"
            assert [e.token for e in events] == golden[i]
        assert_freed(ex)
        sizes = batch_sizes(ex)
        assert sum(n * k for n, k in sizes.items()) == len(PROMPTS) * (N_TOKENS - 1)
        assert max(sizes) > 1, sizes
        if mode == "step":
            assert max(sizes) == 8, sizes


def test_eight_sequences_of_a_thousand_tokens_keep_apart(mode, runner, tmp_path, device):
    prompts = [PROMPTS[i] for i in (0, 3, 7, 11, 20, 40, 60, 90)]
    want = [runner.generate(0, p, 1000) for p in prompts]
    with make_batched(mode, tmp_path, device=device) as ex:
        streams = [ex.generate(p, SamplingParams(max_tokens=1000)) for p in prompts]
        run_all(ex, streams)
        for i, s in enumerate(streams):
            assert list(s.result(0).tokens) == want[i], f"stream {i}"
        assert_freed(ex)
        sizes = batch_sizes(ex)
        assert sum(n * k for n, k in sizes.items()) == 8 * 999
        assert sizes[8] >= 900, sizes      # batched together nearly the whole way


def test_streams_join_and_leave_mid_batch(mode, runner, tmp_path, device):
    """Streams of different lengths start at different times and end at different
    times; the rows of one batch sit at different positions."""
    plan = [(PROMPTS[2], 40), (PROMPTS[9], 5), (PROMPTS[33], 25), (PROMPTS[1], 60)]
    late = [(PROMPTS[15], 30), (PROMPTS[70], 12), (PROMPTS[4], 50)]
    with make_batched(mode, tmp_path, device=device) as ex:
        first = [ex.generate(p, SamplingParams(max_tokens=n)) for p, n in plan]
        drive(ex, lambda: first[1].done() and first[0].sequence.position
              >= len(plan[0][0]) + 10)
        second = [ex.generate(p, SamplingParams(max_tokens=n)) for p, n in late]
        run_all(ex, first + second)
        for s, (p, n) in zip(first + second, plan + late, strict=True):
            assert list(s.result(0).tokens) == runner.generate(0, p, n)
        assert_freed(ex)
        assert max(batch_sizes(ex)) > 1


# ---- one row's end leaves the others alone -----------------------------------------

def test_cancel_deadline_and_stop_in_one_row_each(mode, golden, tmp_path, device):
    stop_token = golden[6][4]
    with make_batched(mode, tmp_path, device=device) as ex:
        others = [ex.generate(PROMPTS[i], GREEDY) for i in (10, 11, 12, 13, 14)]
        stopped = ex.generate(PROMPTS[6], SamplingParams(max_tokens=N_TOKENS,
                                                         stop_token_ids=[stop_token]))
        cancelled = ex.generate(PROMPTS[7], SamplingParams(max_tokens=1000))
        late = ex.generate(PROMPTS[8], SamplingParams(max_tokens=4000), deadline_s=0.08)
        drive(ex, lambda: cancelled.sequence.position >= len(PROMPTS[7]) + 3)
        cancelled.cancel()
        run_all(ex, [*others, stopped, cancelled, late])
        for i, s in zip((10, 11, 12, 13, 14), others, strict=True):
            r = s.result(0)
            assert list(r.tokens) == golden[i] and r.finish_reason == FinishReason.LENGTH
        r = stopped.result(0)
        assert r.finish_reason == FinishReason.STOP
        assert list(r.tokens) == golden[6][:golden[6].index(stop_token)]
        r = cancelled.result(0)
        assert r.finish_reason == FinishReason.CANCELLED
        r = late.result(0)
        assert r.finish_reason == FinishReason.DEADLINE, r
        assert_freed(ex)


# ---- faults ------------------------------------------------------------------------

def test_a_job_level_fault_resumes_every_row_with_the_fault_free_tokens(mode, golden,
                                                                        tmp_path, device):
    """The tenth decode job (a batch) ends DONE_CCU_EXCEPTION: every row of it fails,
    the device recovers, every stream replays and gives the tokens of a fault-free run."""
    plan = FaultPlan((FaultRule("infer", "ccu_exception", nth=18),))
    with make_batched(mode, tmp_path, faults=plan, device=device) as ex:
        streams = [ex.generate(PROMPTS[i], GREEDY) for i in range(20, 28)]
        run_all(ex, streams)
        for i, s in enumerate(streams):
            r = s.result(0)
            assert r.error is None and list(r.tokens) == golden[20 + i], f"stream {i}"
        assert sum(s.result(0).resumes for s in streams) >= 2
        assert ex.stats().quarantined >= 2       # a batch of rows failed together
        assert_freed(ex)


class Resumed:
    """The sequences whose streams resumed (an observer of ``stream_resumed``)."""

    def __init__(self) -> None:
        self.seqs: list[int] = []

    def stream_resumed(self, stream: Stream) -> None:
        self.seqs.append(stream.sequence.seq_id)


def assert_no_recovery(ex: DeviceExecutor) -> None:
    """The generation served the whole run: no drain, no recovery, still generation 1."""
    states = [state for _t, state, _why in ex.lifecycle.history]
    assert states == ["Ready"], ex.lifecycle.history
    assert ex.generation == 1 and ex.stats().recoveries == 0, ex.stats()


def sixteen_streams(ex: DeviceExecutor, *, resume_of: Any = lambda seq: True
                    ) -> tuple[list[Any], list[Stream]]:
    """Sixteen greedy streams on sequences of their own (prompts 30..45), run to
    their ends: more than one batch's rows, so batches form and re-form."""
    seqs = [ex.open_sequence() for _ in range(16)]
    streams = [sq.generate(PROMPTS[30 + i], GREEDY, resume=resume_of(sq.seq_id))
               for i, sq in enumerate(seqs)]
    run_all(ex, streams)
    return seqs, streams


def assert_the_others_untouched(streams: list[Stream], seqs: list[Any], golden: Any,
                                faulted: int, resumed: Resumed) -> None:
    """Every stream but the faulted sequence's: the reference tokens, no resume spent,
    no resume seen by the observers."""
    assert set(resumed.seqs) <= {faulted}, resumed.seqs
    for i, s in enumerate(streams):
        if seqs[i].seq_id == faulted:
            continue
        r = s.result(0)
        assert r.error is None and list(r.tokens) == golden[30 + i], f"stream {i}"
        assert r.resumes == 0, f"stream {i} paid a resume for another row's fault"


def test_a_row_level_fault_fails_only_its_row(mode, golden, tmp_path, device):
    """One row of a batch job ends DONE_CCU_EXCEPTION (the job DONE_OK): that row's job
    fails, its stream (resume off) ends error; every other row succeeded as it was,
    with no drain, no recovery and no resume of any other stream (once the row's fault
    drained the generation and every stream replayed: same tokens, a resume spent)."""
    seq = 3
    plan = FaultPlan((FaultRule("infer", "row_ccu_exception", seq_id=seq, nth=6),))
    with make_batched(mode, tmp_path, faults=plan, device=device) as ex:
        ex.add_observer(resumed := Resumed())
        seqs, streams = sixteen_streams(ex, resume_of=lambda s: s != seq)
        assert max(batch_sizes(ex)) > 1
        assert_no_recovery(ex)
        assert resumed.seqs == []
        for i, s in enumerate(streams):
            r = s.result(0)
            if seqs[i].seq_id == seq:
                assert r.finish_reason == FinishReason.ERROR
                assert isinstance(r.error, Unavailable) and r.error.retryable
                assert f"the KV of sequence {seq} was lost (row " in str(r.error)
                assert "ended DONE_CCU_EXCEPTION although the job ended DONE_OK" \
                    in str(r.error), r.error
                assert list(r.tokens) == golden[30 + i][:len(r.tokens)]
                assert len(r.tokens) == 5 and r.resumes == 0
        assert_the_others_untouched(streams, seqs, golden, seq, resumed)
        stats = ex.stats()
        assert (stats.failed, stats.quarantined) == (1, 0), stats
        assert stats.errors_by_category == {"device": 1}, stats
        for sq in seqs:
            sq.close()
        drive(ex, ex.idle)
        assert_freed(ex)


def test_a_leading_rows_fault_resumes_only_its_stream(mode, golden, tmp_path, device):
    """The issue's case: the thirtieth job's row 0 (the row whose slot the batch runs)
    ends DONE_CCU_EXCEPTION among 16 greedy streams. Its stream resumes (its sequence
    alone reset and replayed) and ends with the reference tokens, one resume spent;
    the other 15 go on with no resume and the generation stays (once every one of the
    16 resumed after a drain)."""
    plan = FaultPlan((FaultRule("infer", "row_ccu_exception", nth=30, index=1),))
    with make_batched(mode, tmp_path, faults=plan, device=device) as ex:
        ex.add_observer(resumed := Resumed())
        seqs, streams = sixteen_streams(ex)
        assert_no_recovery(ex)
        assert len(resumed.seqs) == 1, resumed.seqs
        (faulted,) = resumed.seqs
        assert_the_others_untouched(streams, seqs, golden, faulted, resumed)
        i = [sq.seq_id for sq in seqs].index(faulted)
        r = streams[i].result(0)
        assert r.error is None and list(r.tokens) == golden[30 + i] and r.resumes == 1
        stats = ex.stats()
        assert (stats.failed, stats.quarantined) == (1, 0), stats
        assert ex.epoch.pool.stats().quarantined == 0      # the leader's slot came back
        for sq in seqs:
            sq.close()
        drive(ex, ex.idle)
        assert_freed(ex)


def test_a_rows_kv_faults_fail_only_its_stream(mode, golden, tmp_path, device):
    """KV faults of one row's sequence among 16 batched streams: another sequence's KV
    grow is refused three times (its row waits for room and goes on), and a row's
    DONE_CCU_EXCEPTION is followed by a refused KV reset of its sequence, so its
    stream cannot resume and ends error as its policy says. Neither drains the
    generation, and no other stream resumes or changes a token."""
    faulted, refused = 5, 9
    plan = FaultPlan((FaultRule("kv_apply", "refuse", seq_id=refused, nth=4, every=1,
                                count=3),
                      FaultRule("infer", "row_ccu_exception", seq_id=faulted, nth=8),
                      FaultRule("kv_release", "code", seq_id=faulted)))
    with make_batched(mode, tmp_path, faults=plan, device=device) as ex:
        ex.add_observer(resumed := Resumed())
        seqs, streams = sixteen_streams(ex)
        assert_no_recovery(ex)
        if device == "sim":
            assert ex.driver.faults_fired() == (3, 1, 1)
        assert_the_others_untouched(streams, seqs, golden, faulted, resumed)
        assert resumed.seqs == []            # its reset failed: no replay began
        i = [sq.seq_id for sq in seqs].index(faulted)
        r = streams[i].result(0)
        assert r.finish_reason == FinishReason.ERROR and r.resumes == 0
        assert r.error.stage == "kv_reset", r.error
        assert list(r.tokens) == golden[30 + i][:len(r.tokens)] and len(r.tokens) == 7
        for sq in seqs:
            sq.close()
        drive(ex, ex.idle)


# ---- on evidence only --------------------------------------------------------------

def test_without_evidence_one_row_per_job_with_the_reason(mode, golden, tmp_path, device):
    with make_batched(mode, tmp_path, evidence=False, device=device) as ex:
        assert ex.max_batch == 1
        (note,) = ex.health().notes
        assert "batch graphs (max_batch 8)" in note and "1 row per job" in note
        assert "batch_rows_independent, batch_mixed_rows, batch_kv_no_partial_update " \
            "are claimed" in note and "no evidence" in note, note
        got = run_streams(ex, PROMPTS[:12], GREEDY, lanes=8)
        assert [list(got[i][0].tokens) for i in range(12)] == golden[:12]
        assert set(batch_sizes(ex)) == {1}


def test_failing_evidence_keeps_one_row_per_job(tmp_path):
    drv = SimDriver(B8)
    write_batch_evidence(tmp_path, drv, holds=False)
    with DeviceExecutor(drv, B8, ExecutorConfig(threaded=False,
                                                evidence_dir=str(tmp_path))) as ex:
        assert ex.max_batch == 1
        (note,) = ex.health().notes
        assert "are failed: does not hold" in note, note


def test_max_batch_caps_the_rows_and_one_turns_batching_off(golden, tmp_path):
    for asked, rows in ((3, 3), (1, 1)):
        with make_batched("step", tmp_path, max_batch=asked) as ex:
            assert ex.max_batch == rows and ex.health().notes == ()
            got = run_streams(ex, PROMPTS[:16], GREEDY, lanes=8)
            assert [list(got[i][0].tokens) for i in range(16)] == golden[:16]
            assert max(batch_sizes(ex)) == rows


def test_threaded_on_a_virtual_clock_never_holds_a_batch_for_a_window(golden, tmp_path):
    """The batch window is wall time: on a virtual clock nobody advances it (the soak's
    setting) a partial batch must not wait for it (it once held the streams forever)."""
    drv = SimDriver(B8, seed=0)
    ex = DeviceExecutor(drv, B8, ExecutorConfig(threaded=True, **batching(tmp_path, drv)))
    with ex:
        assert drv.clock.virtual and ex.max_batch == 8
        # streams that end one after another: each step after an end has fewer rows
        streams = [ex.generate(PROMPTS[i], SamplingParams(max_tokens=4 + 3 * i))
                   for i in range(5)]
        for i, s in enumerate(streams):
            assert list(s.result(30).tokens) == golden[i][:4 + 3 * i]


def test_a_row_fault_on_a_lone_row_is_the_rows_as_in_a_batch(mode, golden, tmp_path, device):
    """A job of the batch graph that carries one row (a stream alone) and whose row ends
    DONE_CCU_EXCEPTION while the job ends DONE_OK fails as a row of a batch would (stage
    ``row``), not as a job the device failed: the same fault is the same error whether
    other rows shared the step or not (threaded, that depends on timing)."""
    with make_batched(mode, tmp_path, device=device) as probe:
        seq = probe.open_sequence().seq_id            # the id a first sequence gets
    plan = FaultPlan((FaultRule("infer", "row_ccu_exception", seq_id=seq, nth=3),))
    with make_batched(mode, tmp_path, faults=plan, device=device) as ex:
        sq = ex.open_sequence()
        assert sq.seq_id == seq
        stream = sq.generate(PROMPTS[5], GREEDY, resume=False)
        run_all(ex, [stream])
        r = stream.result(0)
        assert r.finish_reason == FinishReason.ERROR
        assert isinstance(r.error, Unavailable) and r.error.stage in ("row", "stream")
        assert "row 0 of a batch job ended DONE_CCU_EXCEPTION" in str(r.error), r.error
        assert list(r.tokens) == golden[5][:len(r.tokens)] and len(r.tokens) == 2
        assert batch_sizes(ex) and set(batch_sizes(ex)) == {1}
        sq.close()
        drive(ex, ex.idle)
