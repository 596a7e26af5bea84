"""The native tail (calfsm/engine/tail.py, native/calfsm_tail.c) equals the numpy
reference bit for bit: the same tokens for the same seeds, the same rows left behind.

- Unit: the 100 golden prompts as one batch per step (two native threads), greedy and
  three seeded samplings with penalties and ``min_tokens``, at the tiny vocabulary and
  at Qwen3's (V = 151,936, fewer prompts): each row's token and the float32 row the
  call leaves equal the numpy path's (``Sampler(native=False)`` on a numpy conversion).
- The executor: the 100 golden prompts on tiny-b8, eight rows a step, step and threaded,
  with the tail and without it (the reference): the same tokens, and the same logprobs
  where asked.
- What it must not judge: a non-finite row is left to the checked path with nothing
  drawn; a row whose every token is banned raises what the sampler raises.
"""

from __future__ import annotations

import numpy as np
import pytest

from calfsm.drivers import refmodel
from calfsm.engine import tail as T
from calfsm.engine.logits import convert_bf16_range
from calfsm.errors import InvalidArgument
from calfsm.generate.processors import TokenHistory
from calfsm.generate.sampling import Sampler, SamplingParams
from calfsm.tools.direct import golden_prompts
from tests.helpers.batching import make_batched
from tests.helpers.streams import run_streams

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not T.native_tail_available(),
                                 reason="the bundled library has no native tail")]

#: greedy, and three seeded samplings with penalties (Qwen3's recommended settings among
#: them), and Qwen3's without
PARAMS = {
    "greedy": dict(repetition_penalty=1.1),
    "qwen3": dict(temperature=0.7, top_p=0.8, top_k=20, seed=7, presence_penalty=1.5),
    "topk": dict(temperature=1.0, top_k=50, seed=11, frequency_penalty=0.5,
                 min_tokens=4, stop_token_ids=(3, 5, 9)),
    "topp": dict(temperature=0.8, top_p=0.9, seed=13, repetition_penalty=1.3,
                 frequency_penalty=-0.4),
    "qwen3-plain": dict(temperature=0.7, top_p=0.8, top_k=20, seed=17),
}


def _generate(prompts: list[tuple[int, ...]], vocab: int, params: SamplingParams,
              n_tokens: int, *, native: bool, keep: bool = True
              ) -> tuple[list[list[int]], list[np.ndarray]]:
    """Every prompt's tokens, the rows of each step in one call (native) or one by one
    (the reference), on the reference model's logits; and the last step's rows."""
    samplers = [params.sampler_for(vocab, native=None if native else False,
                                   prompt_len=len(p), eos_token_id=2) for p in prompts]
    hashes = [refmodel.chain(p)[-1] for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    src = np.empty((len(prompts), vocab), np.uint16)
    dst = [np.empty(vocab, np.float32) for _ in prompts]
    for step in range(n_tokens):
        for i, h in enumerate(hashes):
            refmodel.logits_bf16(h, vocab, src[i])
        if native:
            rows = []
            ptr = T.output_pointer(src.reshape(-1))
            for i, s in enumerate(samplers):
                row = s.tail_row(TokenHistory(prompts[i], out[i]))
                assert row is not None
                row.bind(ptr + i * vocab, dst[i] if keep else None)
                rows.append(row)
            assert T.run_tail(rows, 2) == 0
            tokens = [s.tail_token(r) for s, r in zip(samplers, rows, strict=True)]
        else:
            tokens = []
            for i, s in enumerate(samplers):
                convert_bf16_range(src[i], 0, vocab, dst[i])
                tokens.append(s.sample(dst[i], TokenHistory(prompts[i], out[i])))
        for i, t in enumerate(tokens):
            out[i].append(t)
            hashes[i] = refmodel.step(hashes[i], t, len(prompts[i]) + step)
    return out, dst


@pytest.mark.parametrize("name", PARAMS)
@pytest.mark.parametrize(("vocab", "n_prompts", "n_tokens"),
                         [(1024, 100, 12), (151_936, 8, 4)], ids=["tiny", "qwen3"])
@pytest.mark.parametrize("keep", [True, False], ids=["into-target", "scratch"])
def test_the_tail_equals_the_numpy_reference_bit_for_bit(name, vocab, n_prompts, n_tokens,
                                                         keep):
    """``keep``: the row is converted into its target (then the row left behind is the
    reference's too), or worked on in the library's scratch (a stream step's way)."""
    params = SamplingParams(max_tokens=n_tokens, **PARAMS[name])
    prompts = [tuple(p) for p in golden_prompts(n_prompts, vocab=vocab, max_len=64)]
    want, want_rows = _generate(prompts, vocab, params, n_tokens, native=False)
    got, got_rows = _generate(prompts, vocab, params, n_tokens, native=True, keep=keep)
    assert got == want
    for w, g in zip(want_rows, got_rows, strict=True):
        assert not keep or np.array_equal(w.view(np.uint32), g.view(np.uint32))
    if name != "greedy":                # the seeds were used: the draws differ by prompt
        assert len({tuple(t) for t in got}) > 1


def test_a_non_finite_row_is_left_to_the_checked_path_with_nothing_drawn():
    vocab = 1024
    params = SamplingParams(temperature=0.9, seed=3)
    s = params.sampler_for(vocab)
    ref = params.sampler_for(vocab, native=False)
    src = refmodel.logits_bf16(12345, vocab).copy()
    src[17] = 0x7FC0                    # a NaN
    row = s.tail_row()
    dst = np.empty(vocab, np.float32)
    row.bind(T.output_pointer(src), dst)
    assert T.run_tail([row]) == 1
    assert row.status == T.NONFINITE and row.bad == 17
    assert s.tail_token(row) is None
    # nothing was drawn: the next token is the reference's first
    good = refmodel.logits_bf16(999, vocab)
    row = s.tail_row()
    row.bind(T.output_pointer(good), dst)
    T.run_tail([row])
    x = np.empty(vocab, np.float32)
    convert_bf16_range(good, 0, vocab, x)
    assert s.tail_token(row) == ref.sample(x)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_row_with_every_token_banned_raises_what_the_sampler_raises(temperature):
    """``min_tokens`` bans every stop token, here the whole vocabulary: nothing drawn."""
    vocab = 64
    params = SamplingParams(temperature=temperature, seed=1, min_tokens=2,
                            stop_token_ids=tuple(range(1, vocab)))
    s = params.sampler_for(vocab, eos_token_id=0, prompt_len=1)
    ref = params.sampler_for(vocab, native=False, eos_token_id=0, prompt_len=1)
    src = refmodel.logits_bf16(7, vocab)
    row = s.tail_row((5,))
    row.bind(T.output_pointer(src), None)      # a stream step's way: no target
    assert T.run_tail([row]) == 1
    assert row.status == T.UNUSABLE
    x = np.empty(vocab, np.float32)
    convert_bf16_range(src, 0, vocab, x)
    with pytest.raises(InvalidArgument) as want:
        ref.sample(x, (5,))
    with pytest.raises(InvalidArgument) as got:
        s.tail_token(row)
    assert str(got.value) == str(want.value)


EXEC_PARAMS = [
    SamplingParams(max_tokens=10),
    SamplingParams(max_tokens=10, temperature=0.7, top_p=0.8, top_k=20, seed=5,
                   presence_penalty=1.0),
    SamplingParams(max_tokens=10, temperature=1.0, top_k=40, seed=6, logprobs=3),
    SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=9,
                   repetition_penalty=1.2, min_tokens=3),
]


@pytest.fixture
def reference_tail():
    """Runs the test's body twice: with the native tail, and without (the reference)."""
    yield
    T.use_native_tail(None)


@pytest.mark.parametrize("params", EXEC_PARAMS, ids=["greedy", "qwen3", "logprobs", "topp"])
def test_streams_on_a_batch_graph_give_the_reference_tokens(mode, params, tmp_path,
                                                            reference_tail, monkeypatch):
    prompts = golden_prompts()
    chosen = []                         # tokens the tail chose

    def counting(self, row):
        token = tail_token(self, row)
        chosen.append(token)
        return token

    tail_token = Sampler.tail_token
    monkeypatch.setattr(Sampler, "tail_token", counting)
    got = {}
    for native in (False, True):
        T.use_native_tail(native)
        (tmp_path / str(native)).mkdir()
        with make_batched(mode, tmp_path / str(native)) as ex:
            res = run_streams(ex, prompts, params, lanes=8)
        got[native] = [(list(r.tokens), [(e.logprob, e.top_logprobs) for e in events])
                       for _, (r, events) in sorted(res.items())]
    assert got[True] == got[False]
    assert len(got[True]) == len(prompts)
    # the tail chose every token but a logprobs stream's (converted only, sampled after)
    assert (None not in chosen and len(chosen) > len(prompts) * 5) == (params.logprobs is None)
