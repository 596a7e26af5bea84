"""Logits processors and logprobs (issue 23, item 3, "Must show"), in step and threaded
mode: processors compose with greedy, seeded draws and a user sampler, and a banned token
never appears; every token event's logprob equals ``log_softmax`` of the reference row
the sampler saw (the reference model's row after the processors) to 1e-5 and its top-k
are that row's; logprobs change no token; a failing processor, a row with every token
banned and bad arguments are classified errors; a replay after a device reset applies
the processors again and delivers each event once; the log-softmax works in chunks
(tracemalloc at V=151936). The server's side is in ``tests/serve/test_serve.py``."""

from __future__ import annotations

import math
import tracemalloc
from collections.abc import Sequence

import numpy as np
import pytest

from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.drivers.sim import SimDriver
from calfsm.errors import ErrorCategory, Internal, InvalidArgument
from calfsm.generate.logprobs import RowLogprobs
from calfsm.generate.processors import BanTokens, TokenHistory, ban_tokens, logit_bias
from calfsm.generate.sampling import Sampler, SamplingParams, native_sampling_available
from calfsm.generate.stream import FinishReason, GenerationResult, TokenEvent
from calfsm.manifest import TaskKind
from calfsm.tools.direct import DirectRunner
from tests.helpers.executor import (
    TINY,
    drive,
    log_softmax,
    make_executor,
    reference_seen,
    top_logprobs,
)
from tests.helpers.streams import settled

pytestmark = pytest.mark.timeout(60)

CONTRACT = TINY.submodel(TaskKind.DECODE)
VOCAB, MAX_SEQ = CONTRACT.vocab, CONTRACT.max_seq
PROMPT = [5, 9, 100, 7, 3, 811, 42, 17]
N = 12


# ---- the reference -----------------------------------------------------------------------

def reference_run(prompt: list[int], params: SamplingParams
                  ) -> list[tuple[int, np.ndarray]]:
    """Each token a stream of ``params`` must give, with the row its sampler saw."""
    with SimDriver(TINY, trace=False) as d:
        return reference_seen(DirectRunner(d, TINY), prompt, params)


def assert_scored(events: Sequence[TokenEvent], want: list[tuple[int, np.ndarray]],
                  k: int) -> None:
    assert [e.token for e in events] == [t for t, _ in want]
    for e, (tok, seen) in zip(events, want):
        z = log_softmax(seen)
        assert e.logprob is not None and abs(e.logprob - z[tok]) <= 1e-5, (e, z[tok])
        ref = top_logprobs(seen, k)
        assert [t for t, _ in e.top_logprobs] == [t for t, _ in ref]
        assert all(abs(a - b) <= 1e-5 for (_, a), (_, b) in zip(e.top_logprobs, ref))


def run(ex, prompt: list[int], params: SamplingParams
        ) -> tuple[GenerationResult, list[TokenEvent]]:
    """A one-shot stream to its end (its sequence released); its result and events."""
    s = ex.generate(prompt, params)
    drive(ex, settled(s))
    return s.result(0), list(s)


# ---- logprobs --------------------------------------------------------------------------

def first_finite(row: np.ndarray) -> int:
    """A user sampler: the lowest token not banned."""
    return int(np.flatnonzero(np.isfinite(row))[0])


CHOOSERS = {
    "greedy": {},
    "temperature": {"temperature": 1.3, "seed": 3},
    "top-k-p": {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "seed": 5},
    "user": {"sampler": first_finite},
}


@pytest.mark.parametrize("k", [0, 5, 20])
@pytest.mark.parametrize("choose", sorted(CHOOSERS))
def test_logprobs_are_the_log_softmax_of_the_reference_rows(mode, choose, k):
    params = SamplingParams(max_tokens=N, logprobs=k, **CHOOSERS[choose])
    want = reference_run(PROMPT, params)
    with make_executor(mode) as ex:
        r, events = run(ex, PROMPT, params)
        assert r.finish_reason == FinishReason.LENGTH, r.error
        assert_scored(events, want, k)
        assert all(len(e.top_logprobs) == k for e in events)
        # asking for logprobs changes no token: the same seed gives the same draws
        plain, _ = run(ex, PROMPT, SamplingParams(max_tokens=N, **CHOOSERS[choose]))
        assert plain.tokens == r.tokens


def test_without_logprobs_events_carry_none(mode):
    with make_executor(mode) as ex:
        _, events = run(ex, PROMPT, SamplingParams(max_tokens=3))
        assert [(e.logprob, e.top_logprobs) for e in events] == [(None, ())] * 3


def test_logprobs_are_before_temperature():
    """The same row at two temperatures: the same logprobs (the row the sampler saw,
    not the distribution it drew from)."""
    row = np.random.default_rng(1).normal(size=VOCAB).astype(np.float32) * 3
    got = [SamplingParams(temperature=t, seed=1, logprobs=4).sampler_for(VOCAB)
           .sample_logprobs(row.copy()) for t in (0.3, 2.0)]
    assert got[0][2] == got[1][2]
    ref = top_logprobs(row, 4)
    assert [t for t, _ in got[0][2]] == [t for t, _ in ref]
    assert all(abs(a - b) < 1e-9 for (_, a), (_, b) in zip(got[0][2], ref))


# ---- processors ------------------------------------------------------------------------

def no_repeat(tokens: Sequence[int], row: np.ndarray) -> None:
    """A processor that reads the history: the last token may not come again."""
    row[tokens[-1]] = -np.inf


BANNED = (0, 1, 2, 3, 4, 5)
PROCESSORS = (logit_bias({7: 4.0, 300: -2.5, 1023: 1.0}), ban_tokens(BANNED), no_repeat)


@pytest.mark.parametrize("choose", sorted(CHOOSERS))
def test_processors_compose_with_every_way_of_choosing(mode, choose):
    params = SamplingParams(max_tokens=N, logprobs=6, logits_processors=PROCESSORS,
                            **CHOOSERS[choose])
    want = reference_run(PROMPT, params)
    with make_executor(mode) as ex:
        r, events = run(ex, PROMPT, params)
        assert r.finish_reason == FinishReason.LENGTH, r.error
        assert_scored(events, want, 6)
    tokens = list(r.tokens)
    assert not set(tokens) & set(BANNED)
    assert all(a != b for a, b in zip([PROMPT[-1], *tokens], tokens))
    # the processors did change the outcome: without them the rows are others
    assert any(not np.array_equal(seen, seen_plain) for (_, seen), (_, seen_plain)
               in zip(want, reference_run(PROMPT, SamplingParams(max_tokens=N))))


def test_the_processors_see_the_prompt_and_the_tokens_so_far(mode):
    seen: list[tuple[int, ...]] = []

    def record(tokens: Sequence[int], row: np.ndarray) -> None:
        assert row.dtype == np.float32 and row.shape == (VOCAB,)
        assert row.flags.writeable and row.flags.c_contiguous
        seen.append(tuple(tokens))

    with make_executor(mode) as ex:
        r, _ = run(ex, PROMPT, SamplingParams(max_tokens=5, logits_processors=[record]))
    assert seen == [(*PROMPT, *r.tokens[:i]) for i in range(5)]


def test_a_bias_and_a_ban_touch_only_their_tokens():
    row = np.arange(8, dtype=np.float32)
    logit_bias({1: 2.5, 6: -1.0})((), row)
    ban_tokens([3, 3, 0])((), row)
    assert row.tolist() == [-math.inf, 3.5, 2.0, -math.inf, 4.0, 5.0, 5.0, 7.0]
    assert ban_tokens([3, 0]) == ban_tokens((0, 3)) and ban_tokens([3]).token_ids == (3,)


@pytest.mark.parametrize("bias", [10**400, 1e39, -1e39, math.inf, math.nan])
def test_a_bias_beyond_float32_is_refused_as_an_argument(bias):
    """Not a raw OverflowError, and not a bias that makes the row's logit infinite."""
    with pytest.raises(InvalidArgument, match=r"logit_bias\[1\] must be a finite number"):
        logit_bias({1: bias})


def test_a_processor_built_directly_is_checked_against_the_vocabulary_unsorted():
    """BanTokens and LogitBias are public: built without their factories their ids need
    not be sorted, and the largest is still refused at request time, not at the draw."""
    with pytest.raises(InvalidArgument, match="names token 9, outside the vocabulary"):
        Sampler(SamplingParams(logits_processors=[BanTokens((9, 1))]), 4)


@pytest.mark.parametrize("native", [True, False], ids=["kernel", "numpy"])
def test_a_banned_token_is_never_drawn(native):
    """2000 seeded draws of a hot temperature from a reference row whose 20 most likely
    tokens are banned (and 50 more): none of them ever comes, and the rest do."""
    if native and not native_sampling_available():
        pytest.skip("the native sampling kernel is not built")
    with SimDriver(TINY, trace=False) as d:
        row = DirectRunner(d, TINY).prefill(0, PROMPT)
    hot = [int(t) for t in np.argsort(-row)[:20]]
    banned = set(hot) | set(range(500, 550))
    params = SamplingParams(temperature=3.0, top_p=0.95, seed=9,
                            logits_processors=[ban_tokens(banned)])
    sampler = params.sampler_for(VOCAB, native=native)
    drawn = [sampler.sample(row.copy()) for _ in range(2000)]
    assert not set(drawn) & banned
    assert len(set(drawn)) > 100
    greedy = SamplingParams(logits_processors=[ban_tokens(banned)]).sampler_for(VOCAB)
    assert greedy.sample(row.copy()) == next(int(t) for t in np.argsort(-row, kind="stable")
                                             if int(t) not in banned)


def test_banned_tokens_never_appear_in_seeded_streams(mode):
    banned = set(range(0, VOCAB, 3))
    with make_executor(mode) as ex:
        for seed in range(6):
            params = SamplingParams(temperature=1.5, seed=seed, max_tokens=N,
                                    logits_processors=[ban_tokens(banned)])
            r, _ = run(ex, PROMPT, params)
            assert len(r.tokens) == N and not set(r.tokens) & banned


# ---- errors ------------------------------------------------------------------------------

@pytest.mark.parametrize("choose", ["greedy", "temperature"])
@pytest.mark.parametrize("k", [None, 3])
def test_every_token_banned_is_a_clear_error_not_a_nan(mode, choose, k):
    params = SamplingParams(logprobs=k, logits_processors=[ban_tokens(range(VOCAB))],
                            **CHOOSERS[choose])
    with make_executor(mode) as ex:
        r, events = run(ex, PROMPT, params)
    assert r.finish_reason == FinishReason.ERROR and events == []
    assert isinstance(r.error, InvalidArgument) and r.error.stage == "sample"
    assert "every token" in r.error.message


def raises(tokens: Sequence[int], row: np.ndarray) -> None:
    raise ValueError("no logits today")


def leaves_nan(tokens: Sequence[int], row: np.ndarray) -> None:
    row[11] = np.nan


FAILING = [(raises, "greedy"), (raises, "temperature"), (raises, "user"),
           (raises, "logprobs"), (leaves_nan, "greedy"), (leaves_nan, "temperature"),
           (leaves_nan, "logprobs")]       # a user sampler sees the NaN: its own to judge


@pytest.mark.parametrize(("bad", "choose"), FAILING,
                         ids=[f"{b.__name__}-{c}" for b, c in FAILING])
def test_a_failing_processor_ends_the_stream_with_a_programming_error(mode, bad, choose):
    kw = {"logprobs": 2} if choose == "logprobs" else CHOOSERS[choose]
    params = SamplingParams(logits_processors=[ban_tokens([1]), bad], **kw)
    with make_executor(mode) as ex:
        r, events = run(ex, PROMPT, params)
    assert r.finish_reason == FinishReason.ERROR and events == []
    err = r.error
    assert isinstance(err, Internal) and err.category is ErrorCategory.PROGRAMMING
    assert err.stage == "sample" and not err.retryable
    assert ("ValueError: no logits today" if bad is raises else "nan") in err.message


@pytest.mark.parametrize(("kw", "field"), [
    ({"logits_processors": [1]}, r"logits_processors\[0\]"),
    ({"logits_processors": [ban_tokens([1]), "x"]}, r"logits_processors\[1\]"),
    ({"logits_processors": no_repeat}, "logits_processors"),
    ({"logits_processors": "abc"}, "logits_processors"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"logprobs": 1.5}, "logprobs"),
])
def test_bad_processors_and_logprobs_are_refused_naming_the_field(kw, field):
    with pytest.raises(InvalidArgument, match=field) as e:
        SamplingParams(**kw)
    assert e.value.stage == "request"


@pytest.mark.parametrize(("make", "arg"), [
    (logit_bias, [1]), (logit_bias, {-1: 1.0}), (logit_bias, {1: math.nan}),
    (logit_bias, {1: math.inf}), (logit_bias, {1: "x"}), (logit_bias, {True: 1.0}),
    (ban_tokens, "ab"), (ban_tokens, [-1]), (ban_tokens, [1.0]), (ban_tokens, 3),
])
def test_bad_built_in_processors_are_refused(make, arg):
    with pytest.raises(InvalidArgument, match=make.__name__):
        make(arg)


@pytest.mark.parametrize("proc", [ban_tokens([VOCAB]), logit_bias({2: 1.0, VOCAB + 5: 1.0})])
def test_a_processor_token_outside_the_vocabulary_is_refused_at_the_start(mode, proc):
    with make_executor(mode) as ex:
        with pytest.raises(InvalidArgument, match=rf"logits_processors\[1\].*{VOCAB}"):
            ex.generate(PROMPT, SamplingParams(logits_processors=[no_repeat, proc]))
        assert len(ex.live_streams) == 0
        with ex.open_sequence() as seq:             # the one-shot sequence came back
            assert seq.seq_id == 0


# ---- a replay after a device reset ------------------------------------------------------

@pytest.mark.parametrize("choose", ["greedy", "top-k-p"])
def test_a_replay_applies_the_processors_again_and_delivers_each_event_once(mode, choose):
    """A CCU exception on the sixth step: the stream resumes. Greedy checks the replay
    against the last delivered token with the processors applied to the tokens before
    it (``no_repeat`` reads them); a draw draws nothing. Every event comes once, with
    the logprobs of the fault-free run."""
    params = SamplingParams(max_tokens=N, logprobs=3, logits_processors=PROCESSORS,
                            **CHOOSERS[choose])
    want = reference_run(PROMPT, params)
    plan = FaultPlan.of(FaultRule("infer", "ccu_exception", seq_id=0, nth=6))
    with make_executor(mode, faults=plan) as ex:
        r, events = run(ex, PROMPT, params)
        assert r.finish_reason == FinishReason.LENGTH, r.error
        assert r.resumes == 1
        assert [e.index for e in events] == list(range(N))
        assert_scored(events, want, 3)


# ---- the chunked log-softmax -------------------------------------------------------------

def test_the_log_softmax_works_in_chunks_at_a_large_vocabulary():
    """V=151936 (Qwen's): within 1e-9 of a whole-row float64 log_softmax, the top-20
    the row's, and the peak of what it allocates far below one float64 row (a row of
    float64 is 1.2 MB; the chunks are 32 KB). A draw with logprobs keeps one float32
    row per sampler, allocated once."""
    v = 151936
    rng = np.random.default_rng(7)
    row = (rng.standard_normal(v) * 4).astype(np.float32)
    row[rng.integers(0, v, 1000)] = -np.inf
    row[[150000, 17]] = row.max() + 1                # a tie at the top: by token id
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        lp = RowLogprobs(row)
        top = lp.top(row, 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 300_000, peak          # a float32 row is 600 KB, a float64 one 1.2 MB
    z = log_softmax(row)
    assert abs(lp.of(row[123]) - z[123]) < 1e-9
    assert [t for t, _ in top] == [t for t, _ in top_logprobs(row, 20)]
    assert top[0][0] == 17 and top[1][0] == 150000
    assert max(abs(a - b) for (_, a), (_, b) in zip(top, top_logprobs(row, 20))) < 1e-9

    sampler = SamplingParams(temperature=1.0, seed=1, logprobs=20).sampler_for(v)
    sampler.sample_logprobs(row.copy())               # the kept row is allocated here
    work = row.copy()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        tok, logprob, _ = sampler.sample_logprobs(work)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 300_000, peak
    assert abs(logprob - z[tok]) < 1e-9


def test_token_history_reads_the_prompt_then_the_tokens_in_place():
    generated = [7, 8]
    h = TokenHistory((1, 2, 3), generated)
    assert list(h) == [1, 2, 3, 7, 8] and len(h) == 5 and h[-1] == 8 and h[3] == 7
    assert h[1:4] == (2, 3, 7) and h[::-2] == (8, 3, 1)
    short = TokenHistory((1, 2, 3), generated, 4)
    generated.append(9)
    assert list(short) == [1, 2, 3, 7] and short[-1] == 7
    with pytest.raises(IndexError):
        short[4]
