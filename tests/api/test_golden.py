"""The reference model against an independent pure-Python oracle, and the golden.

The golden: the 100 fixed prompts of :func:`calfsm.tools.direct.golden_prompts`, 16 greedy
tokens each through the direct path on SimDriver (the ``tiny`` manifest, V=1024), equal
to the pure-Python model; plus a few prompts on ``qwen3-b1`` (V=151936); plus a fixed
embeddings prompt on both drivers (the emulator and SimDriver).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from calfsm.drivers import refmodel
from calfsm.drivers.base import OutputStatus
from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.drivers.sim import SimDriver
from calfsm.engine.buffers import BufferPool
from calfsm.errors import (
    CalrtCode,
    DeadlineExceeded,
    ErrorCategory,
    Internal,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
    check,
)
from calfsm.manifest import DType, Manifest, TaskKind, builtin_manifest
from calfsm.request import EMBED_DTYPES
from calfsm.runtime.sync import THREADS
from calfsm.tools.direct import DirectRunner, golden_prompts
from tests.helpers import refmodel_pure as pure
from tests.helpers.embeds import EMBEDS_GOLDEN_TOKENS, golden_embeds, tiny_with_embeds_dtype

u32 = st.integers(0, 2**32 - 1)


# ---- numpy model == pure model --------------------------------------------------------

@given(u32)
def test_fmix32(x) -> None:
    assert refmodel.fmix32(x) == pure.fmix32(x)


@given(u32, st.integers(1, 300))
def test_logits(h, vocab) -> None:
    assert refmodel.logits_bf16(h, vocab).tolist() == pure.logits_bf16(h, vocab)


def test_logits_full_vocab_sampled() -> None:
    row = refmodel.logits_bf16(0x2F6C05BA, 151936)
    for v in range(0, 151936, 997):
        assert int(row[v]) == pure.logit_bf16(0x2F6C05BA, v)
    assert refmodel.greedy(row) == 2730


@given(st.lists(st.integers(0, 0xFFFF), min_size=1, max_size=64))
def test_greedy(bits) -> None:
    row = np.array(bits, np.uint16)
    f = (row.astype(np.uint32) << 16).view(np.float32)
    if np.isnan(f).any():
        assert refmodel.greedy(row) == int(np.argmax(f))
    else:
        assert refmodel.greedy(row) == pure.greedy(bits)


def test_greedy_ties_lowest_index() -> None:
    assert refmodel.greedy(np.array([0x3F80, 0x4000, 0x4000], np.uint16)) == 1
    assert refmodel.greedy(np.array([0x8000, 0x0000], np.uint16)) == 0   # -0 == +0


@given(st.lists(st.tuples(st.integers(-2**31, 2**31 - 1), st.integers(0, 40)),
                min_size=1, max_size=30))
@settings(max_examples=60)
def test_chain_into_any_positions(pairs) -> None:
    tokens = np.array([t for t, _ in pairs], np.int32)
    positions = np.array([p for _, p in pairs], np.int32)
    kv = np.zeros(41, np.uint32)
    kv[::3] = 12345                      # pre-existing words
    ref = {i: int(kv[i]) for i in range(41)}
    want = []
    for t, p in pairs:
        prev = pure.H_INIT if p == 0 else ref[p - 1]
        ref[p] = pure.step(prev, t & 0xFFFFFFFF, p)
        want.append(ref[p])
    assert refmodel.chain_into(kv.copy(), tokens, positions, write=False) == want
    got = refmodel.chain_into(kv, tokens, positions)
    assert got == want
    assert kv.tolist() == [ref[i] for i in range(41)]


def test_tile_row() -> None:
    assert [refmodel.tile_row(n, 16) for n in (1, 2, 15, 16, 17, 127, 128, 1024)] == \
        [0, 1, 14, 15, 0, 14, 15, 15]
    with pytest.raises(ValueError):
        refmodel.tile_row(0, 16)


def test_prefill_tile_matches_pure() -> None:
    for n in (1, 5, 16, 17, 40):
        tokens = list(range(3, 3 + n))
        out = np.full((1, 16, 50), 0xFFFF, np.uint16)
        refmodel.prefill_tile(pure.hashes(tokens), 16, out)
        assert out.reshape(16, 50).tolist() == pure.prefill_tile(tokens, 16, 50)


def test_logits_kernel_allocates_nothing() -> None:
    import tracemalloc
    out = np.empty(151936, np.uint16)
    k = refmodel.kernel(151936)
    k.into(1, out)
    tracemalloc.start()
    try:
        base = tracemalloc.take_snapshot()
        for h in range(20):
            k.into(h, out)
        diff = tracemalloc.take_snapshot().compare_to(base, "filename")
        grown = sum(s.size_diff for s in diff if s.size_diff > 0
                    and "tracemalloc" not in s.traceback[0].filename)
    finally:
        tracemalloc.stop()
    assert grown < 4096


# ---- the golden -----------------------------------------------------------------------

def test_golden_prompts_fixed() -> None:
    prompts = golden_prompts()
    assert len(prompts) == 100
    assert prompts == golden_prompts()
    lengths = [len(p) for p in prompts]
    assert min(lengths) == 1 and max(lengths) == 4096
    for n in (1, 2, 15, 16, 17, 127, 128, 1024, 4095, 4096):
        assert n in lengths
    assert len(set(lengths)) > 60
    assert all(0 <= t < 1024 for p in prompts for t in p)


@pytest.mark.parametrize("name", ["tiny", "tiny-b8"])
def test_golden_100_prompts_tiny(name: str) -> None:
    """The batch-8 graph carrying one row computes the batch-1 goldens."""
    m = builtin_manifest(name)
    runner = DirectRunner(SimDriver(m, trace=False), m)
    vocab = runner.vocab
    for i, prompt in enumerate(golden_prompts()):
        got = runner.generate(i, prompt, 16)
        assert got == pure.generate(prompt, 16, vocab), f"prompt {i} (len {len(prompt)})"


def test_golden_qwen3_vocab() -> None:
    m = builtin_manifest("qwen3-b1")
    runner = DirectRunner(SimDriver(m, trace=False), m)
    assert runner.generate(0, [1, 2, 3], 8) == [2730, 142, 62, 2560, 21, 1540, 44, 1445]
    for i, prompt in enumerate(golden_prompts()[2:4]):       # lengths 2 and 15
        assert runner.generate(i, prompt, 3) == pure.generate(prompt, 3, 151936)
    row = runner.prefill(9, [5, 6, 7])
    assert row.dtype == np.float32 and row.shape == (151936,)
    want = pure.logits_bf16(pure.hashes([5, 6, 7])[-1], 16)
    assert (row[:16].view(np.uint32) >> 16).tolist() == want


# ---- the direct path checks every code -------------------------------------------------

def _runner(*rules: FaultRule, **kw) -> DirectRunner:
    m = builtin_manifest("tiny")
    return DirectRunner(SimDriver(m, faults=FaultPlan.of(*rules), **kw), m, timeout_s=1.0)


@pytest.mark.parametrize(("rule", "error", "stage", "code"), [
    (FaultRule("infer", "code"), Unavailable, "infer", CalrtCode.DEVICE_BUSY),
    (FaultRule("infer", "code", code=18), Unavailable, "infer", CalrtCode.DEVICE_UNAVAILABLE),
    (FaultRule("wait", "code"), DeadlineExceeded, "wait", CalrtCode.TIMEOUT),
    (FaultRule("infer", "hang"), DeadlineExceeded, "wait", CalrtCode.TIMEOUT),
    (FaultRule("set_csr", "code", name="total_seq"), Internal, "set_csr", CalrtCode.NOT_FOUND),
    (FaultRule("slice_tensor", "code"), InvalidArgument, "slice_tensor",
     CalrtCode.OUT_OF_RANGE),
    (FaultRule("infer", "ccu_exception"), Unavailable, "status", None),
    (FaultRule("infer", "short_output"), Internal, "output", None),
    (FaultRule("kv_apply", "refuse"), ResourceExhausted, "kv_apply", None),
])
def test_direct_path_raises_classified(rule, error, stage, code) -> None:
    r = _runner(rule)
    with pytest.raises(error) as info:
        r.prefill(3, [1, 2, 3])
    assert info.value.stage == stage
    assert info.value.seq_id == 3
    assert info.value.calrt_code == code
    if stage == "status":
        assert info.value.category is ErrorCategory.DEVICE


def test_direct_path_configure_code() -> None:
    with pytest.raises(Internal) as info:
        _runner(FaultRule("configure", "code"))
    assert info.value.stage == "configure"
    assert info.value.calrt_code == CalrtCode.INVALID_CALBIN


def test_direct_decode_matches_prefill() -> None:
    r = _runner()
    a = r.prefill(0, [4, 5, 6]).copy()
    r.release(0)
    r.prefill(0, [4, 5])
    out = np.empty(r.vocab, np.float32)
    b = r.decode(0, 6, 2, out=out)
    assert b is out
    assert np.array_equal(a, b)


# ---- embeddings ---------------------------------------------------------------------------
#
# A prefill_embeds job steps the hash chain with one word per embedding row, a function of
# the row's exact bytes (docs/reference-model.md, "Embedding rows"). The golden: a fixed
# 17 x 64 BF16 prompt (17 rows: a second output chunk) prefilled through the emulator and
# the simulated device, then greedy decodes, equal to the pure model.

def _drivers():
    from calfsm.drivers.calrt import CalrtDriver
    return [pytest.param(lambda m: SimDriver(m, trace=False), id="sim"),
            pytest.param(lambda m: CalrtDriver.virtual(manifest_or_calbin=m), id="emulator")]


class _EmbedsRunner:
    """The direct path's runner, plus one buffer set of the prefill_embeds graph
    programmed through ``BufferLease.load``."""

    def __init__(self, driver, manifest: Manifest) -> None:
        self.driver = driver
        self.direct = DirectRunner(driver, manifest, timeout_s=10.0)
        self.sub = manifest.submodel(TaskKind.PREFILL_EMBEDS)
        code, self.handle = driver.model(self.sub.exact_name)
        check(code, "model")
        self.pool = BufferPool.build(driver, 0, {self.sub.kind: (self.handle, self.sub)},
                                     sync=THREADS)

    def prefill_bf16(self, seq: int, embeds: np.ndarray, past_len: int = 0) -> np.ndarray:
        d, sub, n = self.driver, self.sub, len(embeds)
        assert d.kv_apply(seq, past_len + n)
        lease = self.pool.acquire(sub.kind)
        lease.bind(seq_id=seq)
        lease.load(seq, embeds, np.arange(past_len, past_len + n))
        slot = lease.slot
        check(d.infer(self.handle, slot.inp, slot.out), "infer")
        lease.mark_on_device()
        check(d.wait(slot.out, 10.0), "wait")
        lease.mark_off_device()
        assert d.status(slot.out) == OutputStatus.DONE_OK
        assert d.output_bytes(slot.out, sub.logits.name) == (0, sub.logits.byte_size)
        row = slot.logits.reshape(sub.rows, sub.vocab)[refmodel.tile_row(n, sub.rows)].copy()
        lease.undo_slices()
        self.pool.release(lease)
        return row

    def generate(self, seq: int, embeds: np.ndarray, n_tokens: int, past_len: int = 0
                 ) -> list[int]:
        out = [refmodel.greedy(self.prefill_bf16(seq, embeds, past_len))]
        pos = past_len + len(embeds)
        while len(out) < n_tokens:
            out.append(refmodel.greedy(self.direct.decode_bf16(seq, out[-1], pos)))
            pos += 1
        return out


def _words(embeds: np.ndarray) -> list[int]:
    return [pure.embed_word(row.tobytes()) for row in embeds]


def test_embed_word_vectors() -> None:
    row = np.array([1.0, -2.0, 0.5, 0.0], ml_dtypes.bfloat16)
    assert row.tobytes().hex() == "803f00c0003f0000"
    assert pure.embed_word(row.tobytes()) == 0x2ADA9C30
    assert refmodel.embed_words(row.reshape(1, 4)).tolist() == [0x2ADA9C30]
    assert pure.generate(_words(golden_embeds()), 4, 1024) == EMBEDS_GOLDEN_TOKENS


@given(st.lists(st.binary(min_size=1, max_size=40), min_size=1, max_size=8)
       .map(lambda rows: [r.ljust(40, b"\0") for r in rows]))
def test_embed_words_match_pure(rows) -> None:
    a = np.frombuffer(b"".join(rows), np.uint8).reshape(len(rows), 40)
    assert refmodel.embed_words(a).tolist() == [pure.embed_word(r) for r in rows]
    assert refmodel.embed_words(a.view(np.uint16)).tolist() == \
        refmodel.embed_words(a).tolist()                 # bytes, whatever the dtype


def test_every_byte_of_a_row_counts() -> None:
    e = golden_embeds(1)
    base = refmodel.embed_words(e)[0]
    raw = e.view(np.uint8)
    for i in range(raw.shape[1]):
        flipped = raw.copy()
        flipped[0, i] ^= 1
        assert refmodel.embed_words(flipped)[0] != base, i


def test_a_row_is_hashed_by_its_bytes_not_its_values() -> None:
    a = np.zeros((1, 64), ml_dtypes.bfloat16)
    b = a.copy()
    b[0, 0] = -0.0                      # equal as numbers, not as bytes
    assert np.array_equal(a, b) and a.tobytes() != b.tobytes()
    assert refmodel.embed_words(a)[0] != refmodel.embed_words(b)[0]


@pytest.mark.parametrize("make", _drivers())
def test_golden_embeddings_prompt(make) -> None:
    m = builtin_manifest("tiny")
    embeds = golden_embeds()
    with make(m) as driver:
        runner = _EmbedsRunner(driver, m)
        assert runner.generate(0, embeds, 4) == EMBEDS_GOLDEN_TOKENS
        row = runner.prefill_bf16(1, embeds)
        assert row.tolist() == pure.logits_bf16(pure.hashes(_words(embeds))[-1], 1024)


@pytest.mark.parametrize("make", _drivers())
@pytest.mark.parametrize("dtype", [DType.F32, DType.F16, DType.BF16])
def test_embeddings_of_each_dtype_after_a_token_prefix(make, dtype) -> None:
    """Embeddings after three token ids continue the same chain; every dtype's bytes."""
    m = tiny_with_embeds_dtype(dtype)
    embeds = golden_embeds(5, dtype=EMBED_DTYPES[dtype])
    with make(m) as driver:
        runner = _EmbedsRunner(driver, m)
        runner.direct.prefill_bf16(2, [1, 2, 3])
        got = runner.generate(2, embeds, 3, past_len=3)
    assert got == pure.generate([1, 2, 3, *_words(embeds)], 3, 1024)
