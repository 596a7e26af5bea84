"""BF16 -> FP32 logits: exact range, bounds, row choice, output-size and finite checks."""

from __future__ import annotations

import tracemalloc

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from calfsm.errors import (
    CalrtCode,
    ErrorCategory,
    Internal,
    InvalidArgument,
)
from calfsm.logits import convert_bf16_range, extract_logits, find_nonfinite, logits_row
from calfsm.manifest import TaskKind, builtin_manifest

TINY = builtin_manifest("tiny")
PREFILL = TINY.submodel(TaskKind.PREFILL_IDS)
DECODE = TINY.submodel(TaskKind.DECODE)
SENTINEL = np.float32(-12345.5)


def bf16_bits(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def reference(bits: np.ndarray) -> np.ndarray:
    return bits.view(ml_dtypes.bfloat16).astype(np.float32)


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
    from calfsm.buffers import BufferPool
    from calfsm.drivers.base import JobTag
    from calfsm.drivers.faults import FaultPlan, FaultRule
    from calfsm.drivers.sim import SimDriver

    driver = SimDriver(TINY, faults=FaultPlan.of(FaultRule("infer", "short_output",
                                                           n_bytes=100)))
    assert driver.configure(driver.calbin) == 0
    code, handle = driver.model(PREFILL.exact_name)
    assert code == 0
    pool = BufferPool.build(driver, 0, {TaskKind.PREFILL_IDS: (handle, PREFILL)})
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
