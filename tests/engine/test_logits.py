"""BF16 -> FP32 logits: exact range, bounds, row choice, output-size and finite checks.

Every test runs twice, with :func:`extract_logits` on the native kernel and on the numpy
path (the module-wide ``path`` fixture); the tests at the end compare the two directly
and check the kernel itself at every instruction-set level this CPU runs.
"""

from __future__ import annotations

import contextlib
import gc
import tracemalloc
import weakref
from collections.abc import Iterator

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from calfsm import _native
from calfsm.engine import logits as logits_module
from calfsm.engine.logits import (
    convert_bf16_range,
    extract_logits,
    find_nonfinite,
    logits_row,
    native_kernel_in_use,
    use_native_kernel,
)
from calfsm.errors import (
    CalrtCode,
    ErrorCategory,
    Incompatible,
    Internal,
    InvalidArgument,
)
from calfsm.manifest import TaskKind, builtin_manifest
from calfsm.runtime.sync import THREADS

TINY = builtin_manifest("tiny")
PREFILL = TINY.submodel(TaskKind.PREFILL_IDS)
DECODE = TINY.submodel(TaskKind.DECODE)
SENTINEL = np.float32(-12345.5)


def bf16_bits(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def reference(bits: np.ndarray) -> np.ndarray:
    return bits.view(ml_dtypes.bfloat16).astype(np.float32)


@pytest.fixture(autouse=True, scope="module", params=["native", "numpy"])
def path(request) -> Iterator[str]:
    """The conversion path extract_logits takes in this module's tests."""
    if request.param == "native":
        try:
            use_native_kernel(True)
        except Incompatible as e:
            pytest.skip(str(e))
    else:
        use_native_kernel(False)
    yield request.param
    use_native_kernel(None)


@contextlib.contextmanager
def on_path(native: bool) -> Iterator[None]:
    """Run a block on one path, then go back to the module's."""
    was = native_kernel_in_use()
    use_native_kernel(native)
    try:
        yield
    finally:
        use_native_kernel(was)


def kernels():
    try:
        return _native.load_kernels()
    except _native.BuildError as e:
        pytest.skip(f"the native kernels are not available: {e}")


def tile(contract, seed=0) -> np.ndarray:
    """A physical output tile of finite BF16 values, distinct per row."""
    rng = np.random.default_rng(seed)
    vals = rng.uniform(-30, 30, size=contract.logits.shape).astype(np.float32)
    return bf16_bits(vals).reshape(contract.logits.shape)


# ---- convert_bf16_range -------------------------------------------------------------

def test_convert_matches_reference_including_special_values():
    src = bf16_bits([0.0, -0.0, 1.0, -2.5, 3.0e38, 1e-38, np.inf, -np.inf, 7.0])
    dst = np.full(9, SENTINEL, np.float32)
    convert_bf16_range(src, 2, 5, dst)
    np.testing.assert_array_equal(dst[:5], reference(src[2:7]))
    assert (dst[5:] == SENTINEL).all()


def test_convert_reads_a_multi_dimensional_tile_as_flat_memory():
    out = tile(PREFILL)
    v = PREFILL.vocab
    dst = np.empty(v, np.float32)
    convert_bf16_range(out, 3 * v, v, dst)
    np.testing.assert_array_equal(dst, reference(out[0, 3]))


@pytest.mark.parametrize(("base", "dict_len"), [(11, 0), (10, 1), (0, 11), (2**63, 1),
                                                (1, 2**64 - 1), (-1, 1), (0, -1)])
def test_convert_rejects_any_range_outside_the_source(base, dict_len):
    src = bf16_bits(np.arange(10))
    dst = np.full(16, SENTINEL, np.float32)
    ok = base >= 0 and dict_len >= 0 and base <= 10 and dict_len <= 10 - base
    if ok:
        convert_bf16_range(src, base, dict_len, dst)
    else:
        with pytest.raises(InvalidArgument):
            convert_bf16_range(src, base, dict_len, dst)
        assert (dst == SENTINEL).all()


def test_convert_rejects_short_target_and_wrong_dtypes_without_writing():
    src = bf16_bits(np.arange(10))
    dst = np.full(4, SENTINEL, np.float32)
    with pytest.raises(InvalidArgument, match="target holds 4"):
        convert_bf16_range(src, 0, 5, dst)
    with pytest.raises(InvalidArgument, match="uint16"):
        convert_bf16_range(src.astype(np.int32), 0, 2, dst)
    with pytest.raises(InvalidArgument, match="float32"):
        convert_bf16_range(src, 0, 2, dst.astype(np.float64))
    assert (dst == SENTINEL).all()


@given(size=st.integers(0, 64), base=st.integers(-2, 80), dict_len=st.integers(-2, 80),
       extra=st.integers(0, 8))
def test_convert_property_writes_exactly_the_range_or_nothing(size, base, dict_len, extra):
    src = bf16_bits(np.arange(size, dtype=np.float32) - 7)
    dst = np.full(max(dict_len, 0) + extra, SENTINEL, np.float32)
    inside = base >= 0 and dict_len >= 0 and base <= size and dict_len <= size - base
    if inside:
        convert_bf16_range(src, base, dict_len, dst)
        np.testing.assert_array_equal(dst[:dict_len], reference(src[base:base + dict_len]))
        assert (dst[dict_len:] == SENTINEL).all()
    else:
        with pytest.raises(InvalidArgument):
            convert_bf16_range(src, base, dict_len, dst)
        assert (dst == SENTINEL).all()


def test_convert_allocates_nothing_of_vocabulary_size():
    qwen = builtin_manifest("qwen3-b1").submodel(TaskKind.PREFILL_IDS)
    v = qwen.vocab
    out = np.zeros(qwen.logits.shape, np.uint16)
    dst = np.empty(v, np.float32)
    extract_logits(out, qwen.logits.byte_size, qwen, 5, dst)  # warm up
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        for _ in range(3):
            extract_logits(out, qwen.logits.byte_size, qwen, 5, dst)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < v, f"peak {peak} B for a vocabulary of {v}"


# ---- find_nonfinite / logits_row ------------------------------------------------------

def test_find_nonfinite_names_the_first_index():
    x = np.zeros(100, np.float32)
    assert find_nonfinite(x) is None
    x[42] = np.nan
    x[77] = np.inf
    assert find_nonfinite(x) == 42
    x[42] = 1.0
    assert find_nonfinite(x) == 77
    x[3] = -np.inf
    assert find_nonfinite(x) == 3
    assert find_nonfinite(bf16_bits([1.0, 2.0, np.nan])) == 2
    assert find_nonfinite(np.zeros(0, np.float32)) is None


@pytest.mark.parametrize(("n", "row"), [(1, 0), (2, 1), (15, 14), (16, 15), (17, 0),
                                        (127, 14), (128, 15), (1024, 15), (4095, 14),
                                        (4096, 15), (40959, 14)])
def test_logits_row_of_prefill_is_the_last_token_in_the_last_tile(n, row):
    assert logits_row(n, 16) == row


def test_logits_row_of_decode_is_zero_and_bad_arguments_raise():
    assert logits_row(1, DECODE.rows) == 0
    with pytest.raises(InvalidArgument):
        logits_row(0, 16)
    with pytest.raises(InvalidArgument):
        logits_row(3, 0)


# ---- extract_logits ------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 128, 8191])
def test_extract_prefill_takes_row_of_last_token(n):
    out = tile(PREFILL, seed=n)
    dst = np.full(PREFILL.vocab + 8, SENTINEL, np.float32)
    extract_logits(out, PREFILL.logits.byte_size, PREFILL, n, dst)
    np.testing.assert_array_equal(dst[:PREFILL.vocab], reference(out[0, (n - 1) % 16]))
    assert (dst[PREFILL.vocab:] == SENTINEL).all()


def test_extract_decode_takes_row_zero_and_only_one_token():
    out = tile(DECODE)
    dst = np.empty(DECODE.vocab, np.float32)
    extract_logits(out, DECODE.logits.byte_size, DECODE, 1, dst)
    np.testing.assert_array_equal(dst, reference(out[0, 0]))
    with pytest.raises(InvalidArgument, match="1 token"):
        extract_logits(out, DECODE.logits.byte_size, DECODE, 2, dst, job_id=9)


@pytest.mark.parametrize("produced", [0, 2, 2046, 2047])
def test_fi09_short_decode_output_detected_nothing_written_past_target(produced):
    out = tile(DECODE)
    dst = np.full(DECODE.vocab * 2, SENTINEL, np.float32)
    with pytest.raises(Internal) as info:
        extract_logits(out, produced, DECODE, 1, dst, job_id=3, seq_id=4, generation=5)
    err = info.value
    assert err.calrt_code == CalrtCode.SHAPE_MISMATCH
    assert err.stage == "output"
    assert (err.job_id, err.seq_id, err.generation) == (3, 4, 5)
    assert (dst == SENTINEL).all()


def test_fi09_short_prefill_output_covers_earlier_rows_but_not_the_needed_one():
    out = tile(PREFILL)
    v = PREFILL.vocab
    dst = np.full(v + 100, SENTINEL, np.float32)
    # 17 tokens -> row 0: covered by one row of output.
    extract_logits(out, v * 2, PREFILL, 17, dst)
    dst[:] = SENTINEL
    # 16 tokens -> row 15: the device produced only 15 rows.
    with pytest.raises(Internal, match="row 15") as info:
        extract_logits(out, 15 * v * 2, PREFILL, 16, dst)
    assert info.value.calrt_code == CalrtCode.SHAPE_MISMATCH
    assert (dst == SENTINEL).all()


def test_extract_rejects_more_bytes_than_the_tensor_and_short_targets():
    out = tile(DECODE)
    with pytest.raises(Internal) as info:
        extract_logits(out, DECODE.logits.byte_size + 2, DECODE, 1,
                       np.empty(DECODE.vocab, np.float32))
    assert info.value.calrt_code == CalrtCode.SHAPE_MISMATCH
    short = np.full(DECODE.vocab - 1, SENTINEL, np.float32)
    with pytest.raises(InvalidArgument, match="vocabulary"):
        extract_logits(out, DECODE.logits.byte_size, DECODE, 1, short, seq_id=2)
    assert (short == SENTINEL).all()


def test_extract_host_array_smaller_than_contract_is_a_shape_mismatch():
    out = tile(DECODE).reshape(-1)[:-1].copy()
    dst = np.full(DECODE.vocab, SENTINEL, np.float32)
    with pytest.raises(Internal) as info:
        extract_logits(out, DECODE.logits.byte_size, DECODE, 1, dst)
    assert info.value.calrt_code == CalrtCode.SHAPE_MISMATCH
    assert (dst == SENTINEL).all()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_fi10_nonfinite_logit_is_an_unknown_internal_error_naming_the_index(bad):
    out = tile(PREFILL)
    out[0, 4, 321] = bf16_bits([bad])[0]
    out[0, 3, 5] = bf16_bits([np.nan])[0]  # another row: not looked at
    dst = np.empty(PREFILL.vocab, np.float32)
    with pytest.raises(Internal) as info:
        extract_logits(out, PREFILL.logits.byte_size, PREFILL, 21, dst, job_id=1)
    err = info.value
    assert type(err) is Internal
    assert err.category is ErrorCategory.UNKNOWN
    assert err.stage == "output" and err.job_id == 1
    assert "index 321" in err.message


# ---- FI09 end to end on the simulated device ------------------------------------------

def test_fi09_short_output_from_the_simulated_device_is_detected():
    from calfsm.drivers.base import JobTag
    from calfsm.drivers.faults import FaultPlan, FaultRule
    from calfsm.drivers.sim import SimDriver
    from calfsm.engine.buffers import BufferPool

    driver = SimDriver(TINY, faults=FaultPlan.of(FaultRule("infer", "short_output",
                                                           n_bytes=100)))
    assert driver.configure(driver.calbin) == 0
    code, handle = driver.model(PREFILL.exact_name)
    assert code == 0
    pool = BufferPool.build(driver, 0, {TaskKind.PREFILL_IDS: (handle, PREFILL)}, sync=THREADS)
    dst = np.full(PREFILL.vocab * 2, SENTINEL, np.float32)
    for job_id, expect_short in ((1, True), (2, False)):
        lease = pool.acquire(TaskKind.PREFILL_IDS).bind(job_id=job_id, seq_id=job_id)
        n = 5
        lease.write_inputs(np.arange(1, n + 1), np.arange(n))
        lease.slice_inputs(n)
        lease.set_csr(PREFILL.csr_cur_seq, n)
        lease.set_csr(PREFILL.csr_total_seq, n)
        lease.set_kv_seq(job_id)
        slot = lease.slot
        assert driver.kv_apply(job_id, n)
        assert driver.infer(slot.model, slot.inp, slot.out, tag=JobTag(job_id, job_id)) == 0
        lease.mark_on_device()
        assert driver.wait(slot.out, 10.0) == 0
        lease.mark_off_device()
        code, produced = driver.output_bytes(slot.out, PREFILL.logits.name)
        assert code == 0
        if expect_short:
            assert produced == 100
            with pytest.raises(Internal) as info:
                extract_logits(slot.logits, produced, PREFILL, n, dst, job_id=job_id)
            assert info.value.calrt_code == CalrtCode.SHAPE_MISMATCH
            assert info.value.job_id == 1
            assert (dst == SENTINEL).all()
        else:
            extract_logits(slot.logits, produced, PREFILL, n, dst, job_id=job_id)
            np.testing.assert_array_equal(dst[:PREFILL.vocab], reference(slot.logits[0, 4]))
            assert (dst[PREFILL.vocab:] == SENTINEL).all()
            assert np.any(dst[:PREFILL.vocab] != 0)
        lease.undo_slices()
        assert pool.release(lease)


def test_find_nonfinite_is_exact_when_huge_finite_values_overflow_the_fast_path():
    x = np.full(1000, 3.0e38, np.float32)  # x.dot(x) overflows, yet all finite
    assert find_nonfinite(x) is None
    x[999] = np.inf
    assert find_nonfinite(x) == 999
    y = np.zeros((4, 5), np.float32)  # not 1-D: the min/max path
    y[2, 3] = np.nan
    assert find_nonfinite(y) == 13
    assert find_nonfinite(np.array([1.0, np.nan])) == 1


# ---- the native kernel against the numpy path ------------------------------------------

def first_nonfinite(bits: np.ndarray) -> int:
    bad = np.flatnonzero((bits & 0x7F80) == 0x7F80)
    return int(bad[0]) if bad.size else -1


def test_kernel_at_every_level_is_the_bit_shift_and_finds_the_first_nonfinite():
    ffi, lib = kernels()
    every = np.random.default_rng(7).permutation(65536).astype(np.uint16)  # all patterns
    finite = every[(every & 0x7F80) != 0x7F80]
    for level in range(lib.calfsm_kernels_level() + 1):
        for src_all in (every, finite):
            for start, n in ((0, 0), (3, 1), (5, 63), (0, 64), (1, 65), (2, 1023), (0, 1024),
                             (9, 1025), (11, 4177), (0, src_all.size)):
                src = src_all[start:start + n]
                dst = np.full(n + 4, SENTINEL, np.float32)
                got = lib.calfsm_bf16_to_f32_finite_at(ffi.from_buffer("uint16_t[]", src),
                                                       ffi.from_buffer("float[]", dst), n,
                                                       level)
                assert got == first_nonfinite(src), (level, start, n)
                np.testing.assert_array_equal(dst[:n].view(np.uint32),
                                              src.astype(np.uint32) << 16)
                assert (dst[n:] == SENTINEL).all()


def test_kernel_refuses_overlapping_arrays_and_writes_nothing():
    ffi, lib = kernels()
    mem = np.arange(64, dtype=np.uint16)
    before = mem.copy()
    p = ffi.from_buffer("uint16_t[]", mem)
    overlap = lib.calfsm_bf16_to_f32_finite(p + 8, ffi.cast("float *", p + 16), 16)
    assert overlap == -2  # CALFSM_OVERLAP
    np.testing.assert_array_equal(mem, before)


SPECIALS = np.array([0x7FC0, 0xFFC0, 0x7F81, 0x7FFF, 0xFF80, 0x7F80,  # NaNs, -Inf, +Inf
                     0x0000, 0x8000, 0x0001, 0x807F, 0x0040, 0x7F7F, 0xFF7F],  # 0s, subnormal
                    dtype=np.uint16)


def outcome(out, contract, n, dst):
    """What extract_logits did: ("ok", bits) or ("error", fields), and the target's bits."""
    try:
        row = extract_logits(out, contract.logits.byte_size, contract, n, dst, job_id=4,
                             seq_id=5, generation=6)
        result = ("ok", row.view(np.uint32).tobytes())
    except Internal as e:
        result = ("error", type(e), str(e), e.category, e.stage, e.calrt_code, e.job_id)
    return result, dst.view(np.uint32).tobytes()


@settings(max_examples=60)
@given(seed=st.integers(0, 2**32 - 1), specials=st.integers(0, 6),
       decode=st.booleans(), n=st.integers(1, 40))
def test_both_paths_are_bit_identical_and_raise_the_same_error(seed, specials, decode, n):
    contract = DECODE if decode else PREFILL
    n = 1 if decode else n
    rng = np.random.default_rng(seed)
    out = rng.integers(0, 0x10000, size=contract.logits.shape, dtype=np.uint16)
    out[(out & 0x7F80) == 0x7F80] &= 0xBFFF  # finite, unless placed below
    row = out.reshape(-1, contract.vocab)[logits_row(n, contract.rows)]
    row[rng.integers(0, contract.vocab, size=specials)] = rng.choice(SPECIALS, specials)
    results = []
    for native in (True, False):
        with on_path(native):
            results.append(outcome(out, contract, n, np.full(contract.vocab, SENTINEL,
                                                             np.float32)))
    assert results[0] == results[1]
    (kind, *_), target = results[0]
    assert target == (row.astype(np.uint32) << 16).tobytes()
    assert kind == ("ok" if first_nonfinite(row) < 0 else "error")
    if kind == "error":
        assert f"index {first_nonfinite(row)} " in results[0][0][2]


def test_the_native_path_converts_without_numpy(monkeypatch):
    kernels()

    def numpy_used(*_args):
        raise AssertionError("the numpy path ran")

    out = tile(DECODE)
    with on_path(True):
        monkeypatch.setattr(logits_module, "_convert", numpy_used)
        monkeypatch.setattr(logits_module, "find_nonfinite", numpy_used)
        dst = np.empty(DECODE.vocab, np.float32)
        assert extract_logits(out, DECODE.logits.byte_size, DECODE, 1, dst) is dst
        np.testing.assert_array_equal(dst, reference(out[0, 0]))


def test_arrays_the_kernel_cannot_take_are_converted_or_refused_as_before():
    out = tile(PREFILL)
    v = PREFILL.vocab
    want = reference(out[0, 6])
    wide = np.full(2 * v, SENTINEL, np.float32)  # a strided target: every other value
    assert np.shares_memory(extract_logits(out, PREFILL.logits.byte_size, PREFILL, 7,
                                           wide[::2]), wide)
    np.testing.assert_array_equal(wide[::2], want)
    assert (wide[1::2] == SENTINEL).all()
    strided = np.zeros(2 * out.size, np.uint16)
    strided[::2] = out.reshape(-1)  # a strided 1-D source
    dst = np.empty(v, np.float32)
    extract_logits(strided[::2], PREFILL.logits.byte_size, PREFILL, 7, dst)
    np.testing.assert_array_equal(dst, want)
    fortran = np.asfortranarray(out.reshape(16, v))  # neither flat nor C-contiguous
    with pytest.raises(InvalidArgument, match="C-contiguous"):
        extract_logits(fortran, PREFILL.logits.byte_size, PREFILL, 7, dst)


def test_a_read_only_target_is_an_invalid_argument_and_not_written():
    out = tile(DECODE)
    dst = np.full(DECODE.vocab, SENTINEL, np.float32)
    dst.flags.writeable = False
    with pytest.raises(InvalidArgument, match="read-only") as info:
        extract_logits(out, DECODE.logits.byte_size, DECODE, 1, dst, seq_id=3)
    assert info.value.seq_id == 3
    assert (dst == SENTINEL).all()


def test_a_target_overlapping_the_output_gets_the_row_as_it_was():
    v = DECODE.vocab
    mem = np.zeros(3 * v, np.uint32)  # the row's bits in the first 2v bytes
    out = mem.view(np.uint16)[:v]
    out[:] = tile(DECODE).reshape(-1)
    want = reference(out.copy())
    dst = mem.view(np.float32)[v // 4:v // 4 + v]  # starts inside the row
    extract_logits(out, DECODE.logits.byte_size, DECODE, 1, dst)
    np.testing.assert_array_equal(dst, want)


def test_output_arrays_are_not_all_kept_alive():
    refs = []
    dst = np.empty(DECODE.vocab, np.float32)
    for seed in range(20):
        out = tile(DECODE, seed=seed)
        extract_logits(out, DECODE.logits.byte_size, DECODE, 1, dst)
        refs.append(weakref.ref(out))
    del out
    gc.collect()
    alive = sum(r() is not None for r in refs)
    assert alive <= 8, f"{alive} of 20 output arrays still alive"
    assert all(r() is None for r in refs[:12])


def test_without_the_kernels_the_numpy_path_is_used_and_asking_for_them_fails(monkeypatch):
    def missing():
        raise _native.BuildError("no library here")

    with on_path(False):
        monkeypatch.setattr(_native, "load_kernels", missing)
        with pytest.raises(Incompatible, match="no library here"):
            use_native_kernel(True)
        assert use_native_kernel(None) is False
        assert native_kernel_in_use() is False
        out = tile(DECODE)
        dst = np.empty(DECODE.vocab, np.float32)
        extract_logits(out, DECODE.logits.byte_size, DECODE, 1, dst)
        np.testing.assert_array_equal(dst, reference(out[0, 0]))
        monkeypatch.undo()


@pytest.mark.parametrize("delta", [-2, 2])
def test_staging_refuses_any_output_size_but_the_tensors(delta):
    """``check_output`` (the one judge of a finished job's output): one BF16 value
    short of the tile, or one past it, is the device's output fault, though row 4 (a
    21-token prefill's) is covered either way; the exact size passes."""
    from calfsm.drivers.base import OutputStatus
    from calfsm.engine.readback import check_output

    out = tile(PREFILL)
    size = PREFILL.logits.byte_size
    dst = np.full(PREFILL.vocab, SENTINEL, np.float32)
    with pytest.raises(Internal) as info:
        check_output((OutputStatus.DONE_OK, 0, size + delta, None), out, PREFILL, 21, dst,
                     {"job_id": 3})
    err = info.value
    assert err.category is ErrorCategory.UNKNOWN and err.calrt_code == CalrtCode.SHAPE_MISMATCH
    assert err.job_id == 3 and f"reports {size + delta} bytes" in err.message
    assert (dst == SENTINEL).all()
    row = check_output((OutputStatus.DONE_OK, 0, size, None), out, PREFILL, 21, dst, {})
    np.testing.assert_array_equal(row, reference(out[0, 4]))
