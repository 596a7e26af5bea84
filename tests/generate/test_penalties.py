"""Penalties and length controls (issue 37, item 3): ``repetition_penalty``,
``frequency_penalty``, ``presence_penalty``, ``min_tokens`` and ``ignore_eos``.

The penalties equal a straightforward numpy reference written here (whole-vocabulary
masks and counts, vLLM's definitions) on golden prompts, greedy and seeded, on the
numpy and the native draw alike; they compose with ``n > 1``, logprobs (of the penalized
row), stop strings and a resume after a device reset (the replayed tokens counted once);
they touch only the distinct ids seen; bad values are InvalidArgument naming the field.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Sequence

import numpy as np
import pytest

from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.drivers.sim import SimDriver
from calfsm.errors import InvalidArgument
from calfsm.generate.sampling import SamplingParams, native_sampling_available
from calfsm.generate.stream import FinishReason
from calfsm.generate.tokenizer import ByteTokenizer
from calfsm.machines.sequence import SequenceState
from calfsm.manifest import TaskKind
from calfsm.tools.direct import DirectRunner, golden_prompts
from tests.helpers.executor import TINY, drive, log_softmax, make_executor

pytestmark = pytest.mark.timeout(120)

CONTRACT = TINY.submodel(TaskKind.DECODE)
VOCAB = CONTRACT.vocab
#: golden prompts short enough to keep the reference quick, long enough to repeat ids
PROMPTS = [p for p in golden_prompts(40) if 2 <= len(p) <= 300][:6]
N = 24

PENALTIES = {
    "repetition": {"repetition_penalty": 1.3},
    "repetition<1": {"repetition_penalty": 0.7},
    "frequency": {"frequency_penalty": 1.5},
    "presence": {"presence_penalty": -0.8},
    "all": {"repetition_penalty": 1.2, "frequency_penalty": 0.6, "presence_penalty": 0.9},
}
CHOOSERS = {
    "greedy": {},
    "seeded": {"temperature": 0.9, "top_k": 50, "top_p": 0.95, "seed": 11},
}


# ---- the reference ------------------------------------------------------------------------

def penalize(row: np.ndarray, prompt: Sequence[int], output: Sequence[int],
             params: SamplingParams, stops: Sequence[int] = ()) -> np.ndarray:
    """vLLM's ``apply_penalties`` over the whole vocabulary, in float32: a new row."""
    x = row.astype(np.float32).copy()
    v = x.shape[0]
    prompt_mask = np.bincount(np.asarray(prompt, np.int64), minlength=v) > 0
    counts = np.bincount(np.asarray(output, np.int64), minlength=v)
    seen = prompt_mask | (counts > 0)
    r = np.float32(params.repetition_penalty)
    x = np.where(seen, np.where(x > 0, x / r, x * r), x).astype(np.float32)
    x = x - np.float32(params.frequency_penalty) * counts.astype(np.float32)
    x = x - np.float32(params.presence_penalty) * (counts > 0).astype(np.float32)
    if len(output) < params.min_tokens:
        x[list(stops)] = -np.inf
    return x


def reference(prompt: list[int], params: SamplingParams, *, stops: Sequence[int] = (),
              native: bool | None = False) -> list[tuple[int, np.ndarray]]:
    """The tokens a stream of ``params`` must give on TINY, each with the penalized row:
    the direct path's rows, penalized by :func:`penalize`, then chosen by a sampler of
    the same draw without penalties (greedy, or the same seed)."""
    plain = SamplingParams(temperature=params.temperature, top_k=params.top_k,
                           top_p=params.top_p, seed=params.seed)
    chooser = plain.sampler_for(VOCAB, native=native)
    out: list[tuple[int, np.ndarray]] = []
    with SimDriver(TINY, trace=False) as d:
        runner = DirectRunner(d, TINY)
        row, pos = runner.prefill(0, prompt), len(prompt)
        try:
            while True:
                seen = penalize(row, prompt, [t for t, _ in out], params, stops)
                tok = chooser.sample(seen.copy())
                if tok in stops and len(out) >= params.min_tokens:
                    return out
                out.append((tok, seen))
                if len(out) >= params.max_tokens:
                    return out
                row = runner.decode(0, tok, pos)
                pos += 1
        finally:
            runner.release(0)


def run(ex, prompt, params, **kw):
    s = ex.generate(prompt, params, **kw)
    streams = s if isinstance(s, list) else [s]
    drive(ex, lambda: all(x.done() and x.sequence.state == SequenceState.RELEASED
                          for x in streams))
    return [(x.result(0), list(x)) for x in streams]


# ---- equal to the reference ---------------------------------------------------------------

@pytest.mark.parametrize("choose", sorted(CHOOSERS))
@pytest.mark.parametrize("penalty", sorted(PENALTIES))
def test_penalties_equal_the_numpy_reference_on_golden_prompts(penalty, choose):
    params = SamplingParams(max_tokens=N, **PENALTIES[penalty], **CHOOSERS[choose])
    with make_executor("step") as ex:
        for prompt in PROMPTS:
            want = [t for t, _ in reference(prompt, params)]
            [(r, _)] = run(ex, prompt, params)
            assert r.finish_reason == FinishReason.LENGTH, r.error
            assert list(r.tokens) == want, (penalty, choose, len(prompt))
        # and they do change the tokens (greedy on a golden prompt)
        [(plain, _)] = run(ex, PROMPTS[0], SamplingParams(max_tokens=N, **CHOOSERS[choose]))
        assert list(plain.tokens) != want or penalty == "presence"


@pytest.mark.skipif(not native_sampling_available(), reason="no native sampling kernel")
@pytest.mark.parametrize("vocab", [VOCAB, 151936])
def test_the_native_and_numpy_draws_give_the_same_penalized_tokens(vocab):
    """The penalties change the row before the draw, on either path: the same seed gives
    the same tokens and leaves the same weights, token after token."""
    rng = np.random.default_rng(5)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3, **PENALTIES["all"])
    prompt = list(rng.integers(0, vocab, 50))
    samplers = [params.sampler_for(vocab, native=nat, prompt_len=len(prompt))
                for nat in (True, False)]
    plain = SamplingParams(temperature=0.8, top_p=0.9, seed=3).sampler_for(vocab,
                                                                            native=False)
    out: list[int] = []
    for _ in range(30):
        base = (rng.standard_normal(vocab) * 3).astype(np.float32)
        base[prompt[:5]] += 8        # make the seen tokens likely
        rows = [base.copy(), base.copy()]
        toks = [s.sample(r, (*prompt, *out)) for s, r in zip(samplers, rows)]
        assert toks[0] == toks[1]
        assert rows[0].tobytes() == rows[1].tobytes()
        assert toks[0] == plain.sample(penalize(base, prompt, out, params))
        out.append(toks[0])
    assert len(set(out)) > 1


def test_only_the_seen_ids_are_touched_no_vocabulary_sized_temporary():
    """At V=151936 with a 2000-token prompt and 500 output tokens, a penalized step
    allocates far below one float32 row (600 KB)."""
    v = 151936
    rng = np.random.default_rng(2)
    prompt = list(rng.integers(0, v, 2000))
    params = SamplingParams(**PENALTIES["all"], min_tokens=3, stop_token_ids=(1, 2))
    s = params.sampler_for(v, prompt_len=len(prompt))
    row = rng.standard_normal(v).astype(np.float32)
    hist = prompt + list(rng.integers(0, v, 500))
    s.sample(row.copy(), hist[:-1])
    tracemalloc.start()
    tracemalloc.reset_peak()
    s.sample(row, hist)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 100_000, peak


# ---- composition ---------------------------------------------------------------------------

def test_n_streams_each_count_their_own_output():
    params = SamplingParams(max_tokens=N, temperature=0.9, seed=4, **PENALTIES["all"])
    prompt = PROMPTS[1]
    with make_executor("step") as ex:
        got = run(ex, prompt, params, n=2)
    for i, (r, _) in enumerate(got):
        want = reference(prompt, SamplingParams(max_tokens=N, temperature=0.9, seed=4 + i,
                                                **PENALTIES["all"]))
        assert list(r.tokens) == [t for t, _ in want]
    assert got[0][0].tokens != got[1][0].tokens


@pytest.mark.parametrize("choose", sorted(CHOOSERS))
def test_logprobs_are_those_of_the_penalized_row(choose):
    params = SamplingParams(max_tokens=N, logprobs=3, **PENALTIES["all"], **CHOOSERS[choose])
    prompt = PROMPTS[2]
    want = reference(prompt, params)
    with make_executor("step") as ex:
        [(_, events)] = run(ex, prompt, params)
    assert [e.token for e in events] == [t for t, _ in want]
    for e, (tok, seen) in zip(events, want):
        z = log_softmax(seen)
        assert abs(e.logprob - z[tok]) <= 1e-5
        assert [t for t, _ in e.top_logprobs] == list(np.argsort(-z, kind="stable")[:3])


@pytest.mark.parametrize("choose", sorted(CHOOSERS))
@pytest.mark.parametrize("mode", ["step", "threaded"])
def test_a_resumed_stream_counts_the_replayed_tokens_once(mode, choose):
    """A CCU exception on the eighth step: the stream resumes and replays its tokens;
    the penalties after it are those of the fault-free run (greedy checks the replay
    against the penalized row of the tokens before it)."""
    params = SamplingParams(max_tokens=N, logprobs=1, **PENALTIES["all"],
                            **CHOOSERS[choose])
    prompt = PROMPTS[3]
    want = reference(prompt, params)
    plan = FaultPlan.of(FaultRule("infer", "ccu_exception", seq_id=0, nth=8))
    with make_executor(mode, faults=plan) as ex:
        [(r, events)] = run(ex, prompt, params)
    assert r.finish_reason == FinishReason.LENGTH, r.error
    assert r.resumes == 1
    assert [e.index for e in events] == list(range(N))
    assert list(r.tokens) == [t for t, _ in want]
    # the logprobs read every count: a token counted twice would move them
    for e, (tok, seen) in zip(events, want):
        assert abs(e.logprob - log_softmax(seen)[tok]) <= 1e-5, e.index


def test_a_sampler_given_a_shorter_history_counts_each_token_once():
    """What a replay gives the sampler (the history without its last token), and a
    history that shrinks further, then grows again: each row is the reference's."""
    rng = np.random.default_rng(9)
    params = SamplingParams(**PENALTIES["all"])
    prompt = [3, 5, 3, 9]
    out = [5, 7, 5, 5, 11, 7]
    s = params.sampler_for(VOCAB, prompt_len=len(prompt))
    for n in (0, 1, 2, 3, 3, 4, 6, 2, 5, 6, 6):
        row = rng.standard_normal(VOCAB).astype(np.float32)
        want = penalize(row, prompt, out[:n], params)
        s.sample(row, (*prompt, *out[:n]))      # greedy: the row is only changed in place
        assert row.tobytes() == want.tobytes(), n


# ---- min_tokens and ignore_eos ---------------------------------------------------------------

class EosTokenizer(ByteTokenizer):
    """The byte tokenizer with an end-of-sequence token."""

    def __init__(self, vocab: int, eos: int) -> None:
        super().__init__(vocab)
        self.eos_token_id = eos


def first_token(prompt: list[int]) -> int:
    return reference(prompt, SamplingParams(max_tokens=1))[0][0]


def test_the_eos_token_ends_a_stream_unless_ignore_eos():
    prompt = PROMPTS[0]
    eos = first_token(prompt)
    with make_executor("step", tokenizer=EosTokenizer(VOCAB, eos)) as ex:
        [(r, _)] = run(ex, prompt, SamplingParams(max_tokens=8))
        assert r.finish_reason == FinishReason.STOP and r.tokens == ()
        [(r, _)] = run(ex, prompt, SamplingParams(max_tokens=8, ignore_eos=True))
        assert r.finish_reason == FinishReason.LENGTH and len(r.tokens) == 8
        assert r.tokens[0] == eos
        # a stop token given is still a stop with ignore_eos (as vLLM's)
        [(r, _)] = run(ex, prompt, SamplingParams(max_tokens=8, ignore_eos=True,
                                                  stop_token_ids=(eos,)))
        assert r.finish_reason == FinishReason.STOP


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_masks_the_stop_tokens_and_the_eos(ignore_eos):
    prompt = PROMPTS[0]
    stop = first_token(prompt)
    eos = (stop + 1) % VOCAB
    params = SamplingParams(max_tokens=10, min_tokens=4, stop_token_ids=(stop,),
                            ignore_eos=ignore_eos)
    want = reference(prompt, params, stops=(stop, eos))
    with make_executor("step", tokenizer=EosTokenizer(VOCAB, eos)) as ex:
        [(r, _)] = run(ex, prompt, params)
    assert list(r.tokens) == [t for t, _ in want]
    assert len(r.tokens) >= 4 and stop not in r.tokens[:4] and eos not in r.tokens[:4]


def test_min_tokens_holds_off_stop_strings_and_stop_sequences():
    """The text of the first ``min_tokens`` tokens is never matched (as vLLM's
    detokenizer); a stop after them still ends the stream."""
    prompt = PROMPTS[0]
    toks = [t for t, _ in reference(prompt, SamplingParams(max_tokens=12))]
    tok = ByteTokenizer(VOCAB)
    text = [tok.decode([t]) for t in toks]
    with make_executor("step", tokenizer=tok) as ex:
        [(r, _)] = run(ex, prompt, SamplingParams(max_tokens=12, stop=[text[1]]))
        assert r.finish_reason == FinishReason.STOP and len(r.tokens) <= 1
        [(r, _)] = run(ex, prompt, SamplingParams(max_tokens=12, stop=[text[1]],
                                                  min_tokens=3))
        assert list(r.tokens[:3]) == toks[:3]
        later = text[1] in "".join(text[3:])
        assert r.finish_reason == (FinishReason.STOP if later else FinishReason.LENGTH)
        seq = (toks[1], toks[2])
        [(r, _)] = run(ex, prompt, SamplingParams(max_tokens=12, stop_sequences=[seq],
                                                  min_tokens=2))
        assert list(r.tokens) == toks        # the sequence straddles min_tokens: no stop
        [(r, _)] = run(ex, prompt, SamplingParams(max_tokens=12, stop_sequences=[seq]))
        assert list(r.tokens) == toks[:1] and r.finish_reason == FinishReason.STOP


# ---- validation --------------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.5), ("presence_penalty", "1"), ("frequency_penalty", -3),
    ("frequency_penalty", float("nan")), ("repetition_penalty", 0), ("repetition_penalty", -1),
    ("repetition_penalty", float("inf")), ("min_tokens", -1), ("min_tokens", 17),
    ("min_tokens", 1.5), ("ignore_eos", 1), ("ignore_eos", "yes")])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(InvalidArgument, match=field):
        SamplingParams(**{field: value})


def test_neutral_values_keep_the_hot_path():
    p = SamplingParams(presence_penalty=0, frequency_penalty=0.0, repetition_penalty=1,
                       min_tokens=0, ignore_eos=False)
    s = p.sampler_for(VOCAB)
    assert s.plain and not s.uses_tokens
    assert not SamplingParams(min_tokens=1).sampler_for(VOCAB).plain


def test_penalties_compose_with_stop_strings():
    """The penalized tokens, cut where their text holds the stop string (never given)."""
    prompt = PROMPTS[0]
    params = SamplingParams(max_tokens=N, **PENALTIES["all"])
    toks = [t for t, _ in reference(prompt, params)]
    tok = ByteTokenizer(VOCAB)
    text = tok.decode(toks)
    stop = text[len(text) // 2:len(text) // 2 + 2]
    with make_executor("step", tokenizer=tok) as ex:
        [(r, _)] = run(ex, prompt, SamplingParams(max_tokens=N, stop=[stop],
                                                  **PENALTIES["all"]))
    assert r.finish_reason == FinishReason.STOP
    assert r.text == text[:text.index(stop)]
