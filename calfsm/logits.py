"""BF16 logits -> the caller's FP32 target: exactly the needed range, bounds-checked.

Theory of operation
-------------------
The device writes the output tensor as raw BF16 bits (``uint16`` host array). The old
adapter converted the *whole* tensor into a temporary ``std::vector<float>`` and then
copied one row out (defect S10). Here only the ``dict_len`` values of the wanted row are
converted, straight into the caller-provided ``float32`` array: no temporary of the
vocabulary, no allocation proportional to it.

The conversion is ``np.copyto(dst, src.view(ml_dtypes.bfloat16), casting="unsafe")``:
BF16 -> FP32 is exact (a 16-bit left shift of the bits), and numpy's buffered cast runs
in fixed-size chunks, so it allocates nothing per call that grows with the vocabulary.
Measured on this machine kind at V=151936 (``bench/bench_components.py``) it runs at the
speed of a plain float32 copy of the same output; the uint16->uint32 shift trick
(``dst.view(np.uint32)[:] = src; dst <<= 16``) was ~1.6-2x slower, so it is not used.

The bound check is written exactly as the spec (section 10.1) asks,
``base <= size and dict_len <= size - base``, so it cannot overflow even where the
indices are fixed-width.

The finite check after conversion is one BLAS pass, ``dst.dot(dst)``: a sum of squares is
finite only if every value is (NaN and Inf propagate, squares cannot cancel), it
allocates nothing and costs less than the copy. Only when it is not finite (a NaN/Inf,
or a finite value above ~1.8e19 overflowing the square) does :func:`find_nonfinite`
run the exact ``isfinite`` scan that names the first offending index.
"""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np

from calfsm.errors import (
    CalrtCode,
    ErrorCategory,
    Internal,
    InvalidArgument,
    from_calrt,
)
from calfsm.manifest import SubmodelContract, TaskKind

__all__ = [
    "convert_bf16_range",
    "extract_logits",
    "find_nonfinite",
    "logits_row",
]

_BF16 = np.dtype(ml_dtypes.bfloat16)
_U16 = np.dtype(np.uint16)
_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)
_STAGE = "output"


def _flat(a: np.ndarray, what: str, **context: Any) -> np.ndarray:
    """A 1-D *view* of ``a`` (never a copy: a copy would be a vocabulary-size temporary)."""
    if a.ndim == 1:
        return a
    if not a.flags.c_contiguous:
        raise InvalidArgument(f"{what} must be C-contiguous to be read as flat memory "
                              f"(shape {a.shape})", stage=_STAGE, **context)
    return a.reshape(-1)


def convert_bf16_range(src_u16: np.ndarray, base: int, dict_len: int,
                       dst_f32: np.ndarray) -> None:
    """Convert ``src_u16[base:base+dict_len]`` (BF16 bits) into ``dst_f32[:dict_len]``.

    ``src_u16`` is read as flat memory (a C-contiguous array of any shape, e.g. the
    physical ``[1, tile_d0, V]`` tile); it may also be an ``ml_dtypes.bfloat16`` view of
    those bits (a buffer slot keeps one, so the per-job path creates no view). Nothing
    outside ``dst_f32[:dict_len]`` is written.
    Raises :class:`InvalidArgument` (before touching ``dst_f32``) for a wrong dtype, a
    negative index, a range outside the source or a target shorter than ``dict_len``.
    """
    if src_u16.dtype != _U16 and src_u16.dtype != _BF16:
        raise InvalidArgument(f"BF16 source must be uint16 bits, got {src_u16.dtype}",
                              stage=_STAGE)
    if dst_f32.dtype != _F32:
        raise InvalidArgument(f"target must be float32, got {dst_f32.dtype}", stage=_STAGE)
    if base < 0 or dict_len < 0:
        raise InvalidArgument(f"negative range: base={base} dict_len={dict_len}",
                              stage=_STAGE)
    src = _flat(src_u16, "BF16 source")
    dst = _flat(dst_f32, "float32 target")
    size = src.shape[0]
    if not (base <= size and dict_len <= size - base):
        raise InvalidArgument(f"BF16 range [{base}, {base}+{dict_len}) outside a source of "
                              f"{size} values", stage=_STAGE)
    if dict_len > dst.shape[0]:
        raise InvalidArgument(f"target holds {dst.shape[0]} values, {dict_len} needed",
                              stage=_STAGE)
    _convert(src, base, dict_len, dst)


def _convert(src: np.ndarray, base: int, dict_len: int, dst: np.ndarray) -> np.ndarray:
    """The conversion itself, on flat arrays whose range the caller checked; returns
    ``dst[:dict_len]``. Whole arrays are used as they are: every slice or view is one
    more trip through numpy's indexing code on the per-token path."""
    if base or dict_len != src.shape[0]:
        src = src[base:base + dict_len]
    if src.dtype != _BF16:
        src = src.view(_BF16)
    if dict_len != dst.shape[0]:
        dst = dst[:dict_len]
    np.copyto(dst, src, casting="unsafe")
    return dst


def find_nonfinite(values: np.ndarray) -> int | None:
    """Index (flat) of the first NaN or +-Inf in ``values``, or None when all are finite.

    Floats are checked as they are; a ``uint16`` array is read as BF16 bits. The all-finite
    case allocates nothing (two reductions); only a hit pays for locating the index.
    """
    if values.dtype == _U16:
        values = values.view(_BF16)
    if values.size == 0:
        return None
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf is what we look for
        if values.ndim == 1 and (values.dtype == _F32 or values.dtype == _F64):
            # One BLAS pass: a sum of squares is finite only if every value is (a huge
            # finite value may overflow it: then the exact check below decides).
            if math.isfinite(float(values.dot(values))):
                return None
        else:
            lo = values.min()
            hi = values.max()
            if np.isfinite(lo) and np.isfinite(hi):
                return None
    bad = np.flatnonzero(~np.isfinite(values.astype(np.float32, copy=False)))
    return int(bad[0]) if bad.size else None


def logits_row(n_tokens: int, tile_d0: int) -> int:
    """Row of the physical output tile that holds the last token's logits.

    Prefill of ``n`` tokens in tiles of ``tile_d0`` rows: ``(n - 1) % tile_d0``. Decode has
    one row: pass ``tile_d0=1`` (``SubmodelContract.rows``), which gives row 0.
    """
    if n_tokens < 1:
        raise InvalidArgument(f"n_tokens must be >= 1, got {n_tokens}", stage=_STAGE)
    if tile_d0 < 1:
        raise InvalidArgument(f"tile_d0 must be >= 1, got {tile_d0}", stage=_STAGE)
    return (n_tokens - 1) % tile_d0


def extract_logits(out_u16: np.ndarray, produced_bytes: int, contract: SubmodelContract,
                   n_tokens: int, dst_f32: np.ndarray, *, job_id: int | None = None,
                   seq_id: int | None = None, generation: int | None = None) -> np.ndarray:
    """After ``Wait``: check the output covers the last token's row, convert that row into
    ``dst_f32[:vocab]`` and check it is finite; returns that row (``dst_f32`` itself when
    it is exactly ``vocab`` long).

    - ``dst_f32`` shorter than the vocabulary, not float32, or ``n_tokens`` wrong for the
      graph (decode takes exactly one) -> :class:`InvalidArgument`; nothing written.
    - ``produced_bytes`` (the driver's ``output_bytes``) not covering the row, or beyond
      the tensor's byte size -> ``from_calrt(SHAPE_MISMATCH, "output")``; nothing written
      (FI09).
    - a NaN/Inf in the row -> :class:`Internal` of category UNKNOWN at stage ``output``
      naming the index (FI10); the target then holds the converted row.
    """
    ctx = {"job_id": job_id, "seq_id": seq_id, "generation": generation}
    vocab = contract.vocab
    if dst_f32.dtype != _F32:
        raise InvalidArgument(f"logits target must be float32, got {dst_f32.dtype}",
                              stage=_STAGE, **ctx)
    if dst_f32.size < vocab:
        raise InvalidArgument(f"logits target holds {dst_f32.size} values, the vocabulary "
                              f"is {vocab}", stage=_STAGE, **ctx)
    if contract.kind is TaskKind.DECODE and n_tokens != 1:
        raise InvalidArgument(f"a decode job carries 1 token, got {n_tokens}",
                              stage=_STAGE, **ctx)
    try:
        row = logits_row(n_tokens, contract.rows)
    except InvalidArgument as e:
        raise e.with_context(**ctx) from None
    if out_u16.dtype != _U16 and out_u16.dtype != _BF16:
        raise InvalidArgument(f"output host array must be uint16 (BF16 bits), got "
                              f"{out_u16.dtype}", stage=_STAGE, **ctx)
    src = _flat(out_u16, "output host array", **ctx)
    byte_size = contract.logits.byte_size
    if produced_bytes < 0 or produced_bytes > byte_size:
        raise from_calrt(CalrtCode.SHAPE_MISMATCH, _STAGE,
                         message=f"device reports {produced_bytes} output bytes for "
                                 f"{contract.logits.name!r}, its byte size is {byte_size}",
                         **ctx)
    # Values the device actually wrote (and the host array can hold).
    size = min(produced_bytes // _U16.itemsize, src.shape[0])
    base = row * vocab
    if not (base <= size and vocab <= size - base):
        raise from_calrt(CalrtCode.SHAPE_MISMATCH, _STAGE,
                         message=f"output {contract.logits.name!r} holds {size} BF16 values "
                                 f"({produced_bytes} bytes), row {row} needs "
                                 f"[{base}, {base + vocab})", **ctx)
    # every check convert_bf16_range makes is made above (the bounds against what the
    # device wrote, not just the array): convert without repeating them
    row_f32 = _convert(src, base, vocab, _flat(dst_f32, "logits target", **ctx))
    bad = find_nonfinite(row_f32)
    if bad is not None:
        value = float(row_f32[bad])
        raise Internal(f"non-finite logit {value} at vocabulary index {bad} (row {row}, "
                       f"output element {base + bad})", category=ErrorCategory.UNKNOWN,
                       stage=_STAGE, **ctx)
    return row_f32
