"""Sampling: parameter validation, greedy, the seeded draw and its distribution, the
native kernel against the numpy fallback, memory, and user samplers.

Most tests run twice, on the native kernel and on the numpy fallback (the ``native``
fixture); the tests near the end compare the two directly, at every instruction-set
level this CPU runs.
"""

from __future__ import annotations

import math
import pickle
import tracemalloc
from collections import Counter

import numpy as np
import pytest

from calfsm.errors import (
    CalfsmError,
    ErrorCategory,
    Incompatible,
    Internal,
    InvalidArgument,
)
from calfsm.generate import sampling as sampling_module
from calfsm.generate.sampling import MAX_VOCAB, Sampler, SamplingParams, native_sampling_available


@pytest.fixture(params=["native", "numpy"])
def native(request) -> bool:
    """Which path a test's draws take."""
    if request.param == "native":
        if not native_sampling_available():
            pytest.skip("the bundled library has no sampling kernel")
        return True
    return False


def kernel():
    k = sampling_module._default_kernel()
    if k is None:
        pytest.skip("the bundled library has no sampling kernel")
    return k


def rows(seed: int, count: int, vocab: int, scale: float = 3.0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(vocab) * scale).astype(np.float32) for _ in range(count)]


def draw(params: SamplingParams, row: np.ndarray, n: int, native: bool) -> list[int]:
    """n tokens of one sampler from fresh copies of the same row (the numpy path, slower,
    draws a fifth of them: its tokens are the kernel's, as the agreement tests check)."""
    if not native:
        n = max(1, n // 5) if n >= 1000 else n
    s = params.sampler_for(row.shape[0], native=native)
    return [s.sample(row.copy()) for _ in range(n)]


# ---- SamplingParams ---------------------------------------------------------------------

@pytest.mark.parametrize(("field", "value"), [
    ("temperature", math.nan), ("temperature", math.inf), ("temperature", -0.5),
    ("temperature", "1"), ("temperature", True), ("temperature", None),
    ("temperature", 10**400), ("top_p", -10**400),
    ("top_k", -1), ("top_k", 1.5), ("top_k", True), ("top_k", "3"), ("top_k", None),
    ("top_p", 0.0), ("top_p", -0.1), ("top_p", 1.01), ("top_p", math.nan),
    ("top_p", math.inf), ("top_p", True), ("top_p", "0.9"),
    ("seed", -1), ("seed", 1.0), ("seed", True), ("seed", "7"),
    ("stop_token_ids", "ab"), ("stop_token_ids", 5), ("stop_token_ids", [1, -1]),
    ("stop_token_ids", [1, 2.0]), ("stop_token_ids", (True,)), ("stop_token_ids", None),
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 2.0), ("max_tokens", False),
    ("max_tokens", None),
    ("sampler", 5), ("sampler", "argmax"),
])
def test_every_field_is_validated_naming_it(field: str, value) -> None:
    with pytest.raises(InvalidArgument) as e:
        SamplingParams(**{field: value})
    assert field in e.value.message
    assert e.value.stage == "request" and e.value.category is ErrorCategory.REQUEST
    assert not e.value.retryable


@pytest.mark.parametrize(("kw", "field"), [
    ({"temperature": -0.5}, "temperature"), ({"top_k": -1}, "top_k"),
    ({"stop_token_ids": [1, -1]}, "stop_token_ids"), ({"stop": [""]}, "stop"),
    ({"stop_sequences": [()]}, "stop_sequences"), ({"presence_penalty": 3}, "presence_penalty"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"sampler": lambda row: 0, "seed": 3}, "sampler"),
])
def test_the_error_carries_the_field_it_refuses(kw: dict, field: str) -> None:
    """A server answers with ``field`` as ``param``: it never reads it off the message
    (whose first word is ``stop[0]`` or ``a`` for some of these)."""
    with pytest.raises(InvalidArgument) as e:
        SamplingParams(**kw)
    assert e.value.field == field
    assert pickle.loads(pickle.dumps(e.value)).field == field


def test_valid_values_are_kept_in_one_type() -> None:
    p = SamplingParams(temperature=1, top_k=np.int64(5), top_p=1, seed=np.uint32(9),
                       stop_token_ids=[3, np.int16(4)], max_tokens=np.int8(2))
    assert (p.temperature, p.top_k, p.top_p, p.seed, p.stop_token_ids, p.max_tokens) == (
        1.0, 5, 1.0, 9, (3, 4), 2)
    assert type(p.temperature) is float and type(p.top_k) is int and type(p.seed) is int
    assert all(type(t) is int for t in p.stop_token_ids)
    assert SamplingParams() == SamplingParams(0.0, 0, 1.0, None, (), 16, None)
    assert SamplingParams().greedy and not SamplingParams(temperature=0.5).greedy
    # greedy ignores the other knobs (a client's defaults), so they are allowed
    assert SamplingParams(top_k=40, top_p=0.9, seed=1).greedy


def test_a_user_sampler_excludes_the_built_in_knobs() -> None:
    assert not SamplingParams(sampler=lambda row: 0).greedy
    for kw in ({"temperature": 0.7}, {"top_k": 5}, {"top_p": 0.5}, {"seed": 3}):
        with pytest.raises(InvalidArgument) as e:
            SamplingParams(sampler=lambda row: 0, **kw)
        assert next(iter(kw)) in e.value.message


def test_is_stop() -> None:
    p = SamplingParams(stop_token_ids=(7, 2))
    assert p.is_stop(7) and p.is_stop(2)
    assert not p.is_stop(3) and not SamplingParams().is_stop(0)


def test_sampler_checks_its_vocabulary_and_the_stop_ids_against_it() -> None:
    p = SamplingParams()
    for vocab in (0, -1, MAX_VOCAB + 1, True, 2.0, "10"):
        with pytest.raises(InvalidArgument, match="vocab"):
            Sampler(p, vocab)
    with pytest.raises(InvalidArgument, match="params"):
        Sampler({"temperature": 1.0}, 10)
    with pytest.raises(InvalidArgument, match=r"stop_token_ids\[1\] = 10 is outside"):
        SamplingParams(stop_token_ids=(3, 10)).sampler_for(10)
    assert SamplingParams(stop_token_ids=(9,)).sampler_for(10).vocab == 10


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0)])
def test_a_row_of_the_wrong_kind_is_refused(params: SamplingParams) -> None:
    s = params.sampler_for(8)
    for row in (np.zeros(8, np.float64), np.zeros((2, 8), np.float32),
                np.zeros(7, np.float32), [0.0] * 8, None):
        with pytest.raises(InvalidArgument, match="1-D float32") as e:
            s.sample(row)
        assert e.value.stage == "sample"


def test_a_drawn_row_must_be_writeable_a_greedy_one_need_not() -> None:
    row = np.arange(8, dtype=np.float32)
    row.flags.writeable = False
    assert SamplingParams().sampler_for(8).sample(row) == 7
    with pytest.raises(InvalidArgument, match="writeable") as e:
        SamplingParams(temperature=1.0).sampler_for(8).sample(row)
    assert e.value.stage == "sample"
    strided = np.zeros(16, np.float32)[::2]
    with pytest.raises(InvalidArgument, match="contiguous"):
        SamplingParams(temperature=1.0).sampler_for(8).sample(strided)


# ---- greedy -----------------------------------------------------------------------------

def test_greedy_is_argmax_with_ties_to_the_lowest_index_and_reads_only() -> None:
    s = SamplingParams().sampler_for(1000)
    for row in rows(1, 50, 1000):
        before = row.copy()
        assert s.sample(row) == int(np.argmax(row))
        np.testing.assert_array_equal(row, before)
    tied = np.zeros(1000, np.float32)
    tied[[17, 400, 999]] = 5.0
    assert s.sample(tied) == 17
    longer = np.zeros(1010, np.float32)  # only the first vocab values count
    longer[3], longer[1005] = 1.0, 9.0
    assert s.sample(longer) == 3


# ---- the seeded draw --------------------------------------------------------------------

def test_the_same_seed_gives_the_same_tokens_and_seeds_differ(native: bool) -> None:
    row = rows(2, 1, 2000, scale=1.0)[0]
    params = [SamplingParams(temperature=1.0, seed=seed) for seed in range(10)]
    runs = [tuple(draw(p, row, 50, native)) for p in params]
    assert runs == [tuple(draw(p, row, 50, native)) for p in params]   # a second run
    assert len(set(runs)) == 10                                        # every seed differs
    other = tuple(draw(params[0], row, 50, not native)) if native_sampling_available() \
        else runs[0]
    assert other == runs[0]                                            # and either path


def test_no_seed_draws_fresh_entropy_per_stream(native: bool) -> None:
    row = rows(3, 1, 2000, scale=1.0)[0]
    p = SamplingParams(temperature=1.0)
    assert len({tuple(draw(p, row, 30, native)) for _ in range(4)}) == 4


def test_top_k_1_and_a_tiny_top_p_are_greedy(native: bool) -> None:
    for row in rows(4, 30, 3000):
        want = int(np.argmax(row))
        for p in (SamplingParams(temperature=1.0, top_k=1, seed=1),
                  SamplingParams(temperature=1.3, top_p=1e-9, seed=2),
                  SamplingParams(temperature=0.7, top_k=20, top_p=1e-9, seed=3)):
            assert draw(p, row, 3, native) == [want] * 3


def test_temperature_towards_zero_draws_only_the_maxima(native: bool) -> None:
    for row in rows(5, 10, 1000):
        want = int(np.argmax(row))
        for t in (1e-3, 1e-30, 5e-324):
            assert draw(SamplingParams(temperature=t, seed=4), row, 5, native) == [want] * 5
    tied = rows(6, 1, 1000)[0]
    tied[[10, 600]] = tied.max() + 1.0
    got = Counter(draw(SamplingParams(temperature=1e-6, seed=5), tied, 200, native))
    assert set(got) == {10, 600} and min(got.values()) > 60


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - x.max())
    return e / e.sum()


def chi_square(counts: Counter, probs: dict[int, float]) -> float:
    n = sum(counts.values())
    return sum((counts.get(t, 0) - n * p) ** 2 / (n * p) for t, p in probs.items())


def test_top_k_3_draws_match_the_softmax_of_the_top_3(native: bool) -> None:
    row = np.array([0.3, 2.0, -1.0, 1.6, 0.9, 1.9, -3.0, 0.2], np.float32)
    top = [1, 5, 3]
    probs = dict(zip(top, softmax(row[top]), strict=True))
    n = 20000
    got = Counter(draw(SamplingParams(temperature=1.0, top_k=3, seed=11), row, n, native))
    assert set(got) == set(top)
    assert chi_square(got, probs) < 13.8          # chi2(df=2) at p = 0.001


def test_temperature_scales_the_distribution(native: bool) -> None:
    row = np.array([1.0, 0.0, -1.0, 2.0], np.float32)
    n = 20000
    for t in (0.5, 2.0):
        probs = dict(enumerate(softmax(row / t)))
        got = Counter(draw(SamplingParams(temperature=t, seed=12), row, n, native))
        assert chi_square(got, probs) < 16.3      # chi2(df=3) at p = 0.001


def test_top_p_keeps_the_smallest_prefix_reaching_p(native: bool) -> None:
    p = np.array([0.05, 0.5, 0.15, 0.3], np.float64)
    row = np.log(p).astype(np.float32)
    n = 20000
    for top_p, nucleus in ((0.45, [1]), (0.75, [1, 3]), (0.9, [1, 3, 2]), (1.0, [0, 1, 2, 3])):
        got = Counter(draw(SamplingParams(temperature=1.0, top_p=top_p, seed=13), row, n,
                           native))
        assert set(got) == set(nucleus), top_p
        if len(nucleus) > 1:
            probs = {t: p[t] / p[nucleus].sum() for t in nucleus}
            assert chi_square(got, probs) < 16.3


def test_top_k_then_top_p() -> None:
    p = np.array([0.4, 0.1, 0.25, 0.2, 0.05], np.float64)
    row = np.log(p).astype(np.float32)
    # top-k 3 leaves {0, 2, 3} renormalised to 0.47/0.29/0.24: top-p 0.7 keeps {0, 2}
    got = set(draw(SamplingParams(temperature=1.0, top_k=3, top_p=0.7, seed=14), row, 2000,
                   native=False))
    assert got == {0, 2}


def test_ties_at_the_top_k_boundary_are_kept(native: bool) -> None:
    row = np.array([5.0, 1.0, 5.0, 5.0, 0.0], np.float32)
    got = set(draw(SamplingParams(temperature=1.0, top_k=2, seed=15), row, 300, native))
    assert got == {0, 2, 3}


def test_minus_infinity_is_never_drawn_and_a_non_finite_maximum_is_an_error(
        native: bool) -> None:
    row = np.array([-np.inf, 0.0, -np.inf, 0.5], np.float32)
    assert set(draw(SamplingParams(temperature=5.0, seed=16), row, 200, native)) == {1, 3}
    s = SamplingParams(temperature=1.0, seed=0).sampler_for(4, native=native)
    for bad in (np.nan, np.inf):
        with pytest.raises(Internal, match="NaN or \\+inf") as e:
            s.sample(np.array([0.0, bad, 1.0, 2.0], np.float32))
        assert e.value.stage == "sample"


def test_a_one_token_vocabulary(native: bool) -> None:
    assert draw(SamplingParams(temperature=1.0, top_k=1, top_p=0.5, seed=0),
                np.array([3.0], np.float32), 3, native) == [0, 0, 0]


# ---- the kernel and the fallback --------------------------------------------------------

CASES = [(1.0, 0, 1.0), (0.7, 50, 1.0), (1.3, 0, 0.9), (0.5, 10, 0.5), (2.0, 3, 0.99),
         (1e-6, 0, 1.0), (1.0, 1, 1.0), (1.0, 0, 1e-9), (0.9, 2000, 0.95)]


def kernel_at(row: np.ndarray, inv_t: float, top_k: int, p_q: int, u: int,
              level: int) -> int:
    k = kernel()
    return k.lib.calfsm_sample_at(k.from_buffer(k.f32_array, row, True), row.shape[0],
                                  inv_t, top_k, p_q, u, level)


def agree(row: np.ndarray, t: float, top_k: int, top_p: float, u: int) -> None:
    """Every kernel level and the numpy path: the same token and the same consumed row."""
    inv_t, p_q = 1.0 / t, max(1, min(1 << 32, round(top_p * 2.0**32)))
    want = row.copy()
    tok = sampling_module._draw_numpy(want, inv_t, top_k, p_q, u)
    assert 0 <= tok < row.shape[0]
    for level in range(kernel().lib.calfsm_kernels_level() + 1):
        got = row.copy()
        assert kernel_at(got, inv_t, top_k, p_q, u, level) == tok, (level, t, top_k, top_p)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_kernel_and_fallback_agree_on_1000_random_rows() -> None:
    rng = np.random.default_rng(21)
    for i in range(1000):
        vocab = int(rng.integers(1, 5000))
        row = (rng.standard_normal(vocab) * rng.choice([0.1, 1.0, 3.0, 10.0, 100.0])
               ).astype(np.float32)
        if i % 7 == 0:
            row = np.round(row)          # many ties
        t, top_k, top_p = CASES[i % len(CASES)]
        agree(row, t, top_k, top_p, int(rng.integers(0, 2**64, dtype=np.uint64)))


def test_kernel_and_fallback_agree_on_the_kernels_other_paths() -> None:
    # constant rows and few distinct values (the selects' buckets overflow their buffers),
    # -inf, signed zeros, and rows longer than the kernel's block tables (262144 values)
    rng = np.random.default_rng(22)
    special = [np.zeros(3000, np.float32), np.full(5000, -2.5, np.float32),
               np.array([-0.0, 0.0, -0.0], np.float32),
               np.where(rng.random(20000) < 0.5, 1.0, -np.inf).astype(np.float32),
               np.round(rng.standard_normal(300_000)).astype(np.float32),
               (rng.standard_normal(600_000) * 2).astype(np.float32)]
    for row in special:
        for t, top_k, top_p in ((1.0, 0, 1.0), (0.7, 5, 1.0), (1.0, 3000, 0.8),
                                (1.5, 0, 0.5), (0.3, 100, 0.95), (1.0, 1, 1e-9)):
            agree(row, t, top_k, top_p, int(rng.integers(0, 2**64, dtype=np.uint64)))


def test_the_kernel_refuses_bad_arguments() -> None:
    row = np.zeros(4, np.float32)
    for args in ((0, 1.0, 0, 1 << 32), (MAX_VOCAB + 1, 1.0, 0, 1 << 32),
                 (4, 0.0, 0, 1 << 32), (4, math.inf, 0, 1 << 32), (4, math.nan, 0, 1 << 32),
                 (4, 1.0, 0, 0), (4, 1.0, 0, (1 << 32) + 1)):
        k = kernel()
        assert k.lib.calfsm_sample(k.from_buffer(k.f32_array, row, True), *args, 0) == -1


def test_native_true_without_the_kernel_is_incompatible(monkeypatch) -> None:
    def no_library():
        raise sampling_module._native.BuildError("no library here")
    monkeypatch.setattr(sampling_module, "_kernel", None)
    monkeypatch.setattr(sampling_module._native, "library_path", no_library)
    with pytest.raises(Incompatible, match="no library here"):
        SamplingParams(temperature=1.0).sampler_for(4, native=True)
    s = SamplingParams(temperature=1.0, seed=1).sampler_for(4)     # the default: numpy
    assert not s.uses_native_kernel and 0 <= s.sample(np.zeros(4, np.float32)) < 4


# ---- memory -----------------------------------------------------------------------------

def peak_bytes(sampler: Sampler, row: np.ndarray, src: np.ndarray, calls: int) -> int:
    np.copyto(row, src)
    sampler.sample(row)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        for _ in range(calls):
            np.copyto(row, src)
            sampler.sample(row)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


QWEN_VOCAB = 151936
DRAWS = [SamplingParams(), SamplingParams(temperature=0.8, seed=1),
         SamplingParams(temperature=0.8, top_k=50, seed=1),
         SamplingParams(temperature=0.8, top_p=0.9, seed=1)]


def test_the_kernel_path_allocates_nothing_of_the_vocabulary_size() -> None:
    kernel()
    src = rows(31, 1, QWEN_VOCAB)[0]
    row = np.empty_like(src)
    for p in DRAWS:
        peak = peak_bytes(p.sampler_for(QWEN_VOCAB, native=True), row, src, 5)
        assert peak < 4096, (p, peak)    # a few Python objects; the row is 607744 bytes


def test_the_fallback_allocates_chunks_not_the_vocabulary() -> None:
    for p in DRAWS[1:]:
        peaks = []
        for vocab in (QWEN_VOCAB, 4 * QWEN_VOCAB):
            src = rows(32, 1, vocab)[0]
            peaks.append(peak_bytes(p.sampler_for(vocab, native=False), np.empty_like(src),
                                    src, 1))
        assert peaks[0] < QWEN_VOCAB * 4, (p, peaks)
        assert peaks[1] < 1.25 * peaks[0], (p, peaks)   # does not grow with the vocabulary


# ---- user samplers ----------------------------------------------------------------------

def test_a_user_sampler_sees_the_vocabulary_and_its_choice_is_kept() -> None:
    seen = []

    def last_positive(row: np.ndarray) -> np.int64:
        seen.append(row.shape)
        return np.flatnonzero(row > 0)[-1]
    s = SamplingParams(sampler=last_positive).sampler_for(6)
    assert s.sample(np.array([1, -1, 2, 3, -1, -2, 9, 9], np.float32)) == 3
    assert seen == [(6,)] and not s.uses_native_kernel


def test_a_user_sampler_that_raises_is_a_classified_error() -> None:
    def broken(row):
        raise ZeroDivisionError("boom")
    with pytest.raises(Internal, match="ZeroDivisionError: boom") as e:
        SamplingParams(sampler=broken).sampler_for(4).sample(np.zeros(4, np.float32))
    assert e.value.stage == "sample" and e.value.category is ErrorCategory.PROGRAMMING
    assert isinstance(e.value.__cause__, ZeroDivisionError) and not e.value.retryable

    own = InvalidArgument("the sampler's own complaint", seq_id=3)

    def refusing(row):
        raise own
    with pytest.raises(CalfsmError) as e2:
        SamplingParams(sampler=refusing).sampler_for(4).sample(np.zeros(4, np.float32))
    assert e2.value is own and own.stage == "sample" and own.seq_id == 3


@pytest.mark.parametrize("garbage", [None, "1", 1.0, True, -1, 4, 2**70, [1]])
def test_a_user_sampler_returning_garbage_is_a_classified_error(garbage) -> None:
    s = SamplingParams(sampler=lambda row: garbage).sampler_for(4)
    with pytest.raises(Internal, match="not a token id in \\[0, 4\\)") as e:
        s.sample(np.zeros(4, np.float32))
    assert e.value.stage == "sample" and e.value.category is ErrorCategory.PROGRAMMING
