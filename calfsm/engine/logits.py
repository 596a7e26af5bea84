"""BF16 logits -> the caller's FP32 target: exactly the needed range, bounds-checked.

Theory of operation
-------------------
The device writes the output tensor as raw BF16 bits (``uint16`` host array). The old
adapter converted the *whole* tensor into a temporary ``std::vector<float>`` and then
copied one row out (defect S10). Here only the ``dict_len`` values of the wanted row are
converted, straight into the caller-provided ``float32`` array: no temporary of the
vocabulary, no allocation proportional to it. BF16 -> FP32 is exact: the 16 bits become
the high half of the float's (NaN payloads included).

The bound check is written exactly as the spec (section 10.1) asks,
``base <= size and dict_len <= size - base``, so it cannot overflow even where the
indices are fixed-width.

:func:`extract_logits` (once per job) has two paths to one result:

- The kernel path: ``calfsm_bf16_to_f32_finite`` (``native/calfsm_kernels.c``, compiled
  into the bundled library, loaded with cffi in ABI mode) converts the row and finds the
  first NaN/Inf in one vectorised pass, reading the BF16 row once and writing the float32
  row once — less memory traffic than a float32 copy of the row, which reads twice as
  many bytes. It is taken when every check passes plainly (the contract's numbers are
  read once into a :class:`_Plan`, the output array's ``ffi.from_buffer`` view is kept
  for the next job) and the row is finite; anything else — an error, a non-finite
  value, a non-contiguous or overlapping array — goes to the checked path, which
  decides again. So the kernel path never raises, and both paths raise the same errors.
- The checked path (numpy; the only path where the library is absent or lacks the
  kernels): every check in the documented order, then
  ``np.copyto(dst, src.view(ml_dtypes.bfloat16), casting="unsafe")`` (numpy's buffered
  cast runs in fixed-size chunks: no allocation that grows with the vocabulary), then
  the finite check as one BLAS pass, ``dst.dot(dst)``: a sum of squares is finite only
  if every value is (NaN and Inf propagate, squares cannot cancel). Only when it is not
  finite (a NaN/Inf, or a finite value above ~1.8e19 overflowing the square) does
  :func:`find_nonfinite` run the exact ``isfinite`` scan that names the first offending
  index.

The caches here (the kernel chosen, a plan per contract, the kernel's buffer views) are
process-wide memos that any thread may fill: they take no lock (the engine names no
thread primitive), only single dict operations, each atomic, so a race costs at most a
plan or a view made twice, and the first kernel decision stored is the one every thread
reads (``dict.setdefault``).

:func:`use_native_kernel` chooses a path explicitly (tests, benchmarks). Measured side by
side in one run (``bench/bench_components.py``, 2-core VM): at V=151936 the kernel alone
takes ~0.7-0.8x a float32 ``np.copyto`` of the row and the whole step on the kernel path
~0.97-1.0x (the ~1 us of Python checks around it runs on caches the row just swept),
the checked path ~2.7x; at V=1024 the fixed cost of a call dominates (~1 us on the
kernel path, of which ~0.2 us is the cffi call itself, against 0.25 us for the copy).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np

from calfsm import _native
from calfsm.errors import (
    CalrtCode,
    Incompatible,
    InvalidArgument,
    from_calrt,
    output_fault,
)
from calfsm.manifest import SubmodelContract, TaskKind
from calfsm.util.lazy import bf16_dtype

__all__ = [
    "convert_bf16_range",
    "extract_logits",
    "find_nonfinite",
    "logits_row",
    "native_kernel_in_use",
    "use_native_kernel",
]

log = logging.getLogger("calfsm.logits")

#: numpy's bfloat16 dtype (ml_dtypes: ~0.6 s to import, so not with calfsm), bound by
#: _bind_bf16 before any read: when a contract's plan is made (extract_logits makes or
#: finds one first, so the per-job path reads this name) and by the public helpers that
#: take BF16 input
_BF16: Any = None
_U16 = np.dtype(np.uint16)
_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)
_STAGE = "output"


# ---- the native kernel ------------------------------------------------------------------

class _Kernel:
    """The kernel's cffi function, ``ffi.from_buffer`` and the two array types, bound
    once, and the views of the last few output arrays.

    ``views`` maps ``id(array)`` to its ``ffi.from_buffer`` view: a view keeps its array
    alive and unresizable (so the id and the address stay the array's), and making one
    costs more than the kernel at a small vocabulary. Output arrays are the buffer
    slots' and live as long as their pool, so a few entries hit every time; at most
    :data:`_VIEWS_MAX` are kept (the oldest dropped), which bounds what they pin."""

    __slots__ = ("convert", "f32_array", "from_buffer", "u16_array", "views")

    def __init__(self) -> None:
        ffi, lib = _native.load_kernels()
        self.convert = lib.calfsm_bf16_to_f32_finite
        self.from_buffer = ffi.from_buffer
        self.u16_array = ffi.typeof("uint16_t[]")
        self.f32_array = ffi.typeof("float[]")
        self.views: dict[int, Any] = {}

    def view(self, out_u16: np.ndarray) -> Any:
        """A new view of an output array, remembered (ValueError: not contiguous)."""
        p = self.from_buffer(self.u16_array, out_u16)
        views = self.views
        if len(views) >= _VIEWS_MAX:
            try:
                del views[next(iter(views))]
            except (KeyError, RuntimeError, StopIteration):
                pass                    # another thread changed it first: still bounded
        views[id(out_u16)] = p
        return p


class _Plan:
    """What :func:`extract_logits` reads of a contract, read once (at a small vocabulary
    the attribute and property reads cost more than the conversion), and the kernel in
    use when it was made (None: numpy; :func:`use_native_kernel` drops every plan)."""

    __slots__ = ("byte_size", "contract", "decode", "kernel", "rows", "vocab")

    def __init__(self, contract: SubmodelContract, kernel: _Kernel | None) -> None:
        self.contract = contract  # kept alive, so its id() is not reused
        self.kernel = kernel
        self.vocab = contract.vocab
        self.rows = contract.rows
        self.decode = contract.kind is TaskKind.DECODE
        self.byte_size = contract.logits.byte_size


_AUTO: Any = object()
_PLANS_MAX = 64
_VIEWS_MAX = 8
_KERNEL = "kernel"
#: what extract_logits uses, under _KERNEL: a _Kernel or None (numpy); absent: decided at
#: first use (setdefault: the first decision stored wins, every thread reads that one)
_choice: dict[str, Any] = {}
#: id(contract) -> its _Plan (which keeps the contract alive, so the id is not reused)
_plans: dict[int, _Plan] = {}


def _decided() -> _Kernel | None:
    """The kernel in use, loading the default one at the first call."""
    kernel = _choice.get(_KERNEL, _AUTO)
    if kernel is not _AUTO:
        return kernel
    try:
        kernel = _Kernel()
    except _native.BuildError as e:
        log.info("BF16 logits are converted with numpy: the native kernel is not "
                 "available (%s)", e)
        kernel = None
    return _choice.setdefault(_KERNEL, kernel)


def _bind_bf16() -> np.dtype:
    """Bind :data:`_BF16` (importing ml_dtypes at the first call) and return it."""
    global _BF16
    _BF16 = bf16_dtype()
    return _BF16


def _plan(contract: SubmodelContract) -> _Plan:
    """The contract's plan, made with the kernel in use at its first extraction."""
    _bind_bf16()
    key = id(contract)
    while True:
        plan = _plans.get(key)
        kernel = _decided()
        if plan is None:
            if len(_plans) >= _PLANS_MAX:
                _plans.clear()
            plan = _plans.setdefault(key, _Plan(contract, kernel))
        if plan.kernel is _decided():
            return plan
        _plans.pop(key, None)           # made before a use_native_kernel: make it again


def use_native_kernel(enable: bool | None = None) -> bool:
    """Choose how :func:`extract_logits` converts: the native one-pass kernel (True), the
    numpy path (False), or the kernel when the bundled library has it (None, the
    default). Returns whether the kernel is now used.

    Raises :class:`~calfsm.errors.Incompatible` naming the reason when ``True`` is asked
    and the kernel cannot be loaded."""
    k: Any = _AUTO if enable is None else None
    if enable:
        try:
            k = _Kernel()
        except _native.BuildError as e:
            raise Incompatible(f"the native logits kernel is not available: {e}",
                               stage=_STAGE) from None
    if k is _AUTO:
        _choice.pop(_KERNEL, None)
    else:
        _choice[_KERNEL] = k
    _plans.clear()                      # after the choice: no plan outlives it (_plan)
    return _decided() is not None


def native_kernel_in_use() -> bool:
    """Whether :func:`extract_logits` converts with the native kernel (loading the
    default one now if it was not yet)."""
    return _decided() is not None


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
    bf16 = _bind_bf16()    # _convert reads it
    if src_u16.dtype != _U16 and src_u16.dtype != bf16:
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
        values = values.view(_bind_bf16())
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

    - ``dst_f32`` shorter than the vocabulary, not float32 or read-only, or ``n_tokens``
      wrong for the graph (decode takes exactly one) -> :class:`InvalidArgument`; nothing
      written.
    - ``produced_bytes`` (the driver's ``output_bytes``) not covering the row, or beyond
      the tensor's byte size -> :func:`~calfsm.errors.output_fault` (``Internal`` of
      category UNKNOWN, ``calrt_code`` SHAPE_MISMATCH) at stage ``output``; nothing
      written (FI09). A host array too small for the row -> ``from_calrt(SHAPE_MISMATCH,
      "output")`` (request).
    - a NaN/Inf in the row -> :func:`~calfsm.errors.output_fault` at stage ``output``
      naming the index (FI10); the target then holds the converted row.
    """
    # The all-is-well case in one kernel call; anything not plainly right (or a
    # non-finite value) goes to _extract_checked, which decides again and raises the
    # precise error.
    plan = _plans.get(id(contract)) or _plan(contract)
    if plan.kernel is not None:
        vocab = plan.vocab
        held = dst_f32.size
        if (dst_f32.dtype is _F32 and (out_u16.dtype is _U16 or out_u16.dtype is _BF16)
                and held >= vocab and type(n_tokens) is int and n_tokens >= 1
                and (n_tokens == 1 or not plan.decode)
                and 0 <= produced_bytes <= plan.byte_size):
            base = (n_tokens - 1) % plan.rows * vocab
            if base + vocab <= produced_bytes // 2 and base + vocab <= out_u16.size:
                k = plan.kernel
                try:
                    src = k.views.get(id(out_u16)) or k.view(out_u16)
                    if k.convert(src + base if base else src,
                                 k.from_buffer(k.f32_array, dst_f32, True), vocab) == -1:
                        return dst_f32 if held == vocab and dst_f32.ndim == 1 \
                            else dst_f32.reshape(-1)[:vocab]
                except ValueError:  # not contiguous, or a read-only target
                    pass
    return _extract_checked(out_u16, produced_bytes, contract, n_tokens, dst_f32,
                            {"job_id": job_id, "seq_id": seq_id, "generation": generation})


def _extract_checked(out_u16: np.ndarray, produced_bytes: int, contract: SubmodelContract,
                     n_tokens: int, dst_f32: np.ndarray, ctx: dict[str, Any]) -> np.ndarray:
    """:func:`extract_logits` on the numpy path, with every check in the documented order
    (the kernel path is only ever a faster way to the same result)."""
    vocab = contract.vocab
    if dst_f32.dtype != _F32:
        raise InvalidArgument(f"logits target must be float32, got {dst_f32.dtype}",
                              stage=_STAGE, **ctx)
    if dst_f32.size < vocab:
        raise InvalidArgument(f"logits target holds {dst_f32.size} values, the vocabulary "
                              f"is {vocab}", stage=_STAGE, **ctx)
    if not dst_f32.flags.writeable:
        raise InvalidArgument("logits target is read-only", stage=_STAGE, **ctx)
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
    # What the device says it wrote breaking the contract is an output fault of the
    # device (like a NaN); a host array too small for the row is the caller's.
    if produced_bytes < 0 or produced_bytes > byte_size:
        raise output_fault(f"device reports {produced_bytes} output bytes for "
                           f"{contract.logits.name!r}, its byte size is {byte_size}",
                           calrt_code=CalrtCode.SHAPE_MISMATCH, stage=_STAGE, **ctx)
    base = row * vocab
    written = produced_bytes // _U16.itemsize
    if not (base <= written and vocab <= written - base):
        raise output_fault(f"short output: {contract.logits.name!r} holds {written} BF16 "
                           f"values ({produced_bytes} bytes), row {row} needs "
                           f"[{base}, {base + vocab})",
                           calrt_code=CalrtCode.SHAPE_MISMATCH, stage=_STAGE, **ctx)
    size = min(written, src.shape[0])   # and the host array can hold
    if not (base <= size and vocab <= size - base):
        raise from_calrt(CalrtCode.SHAPE_MISMATCH, _STAGE,
                         message=f"output host array holds {src.shape[0]} BF16 values, "
                                 f"row {row} needs [{base}, {base + vocab})", **ctx)
    # every check convert_bf16_range makes is made above (the bounds against what the
    # device wrote, not just the array): convert without repeating them
    row_f32 = _convert(src, base, vocab, _flat(dst_f32, "logits target", **ctx))
    bad = find_nonfinite(row_f32)
    if bad is not None:
        value = float(row_f32[bad])
        raise output_fault(f"non-finite logit {value} at vocabulary index {bad} (row "
                           f"{row}, output element {base + bad})", stage=_STAGE, **ctx)
    return row_f32
