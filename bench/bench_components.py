"""Micro-benchmarks of the hot-path components: the logits step and buffer leases.

Run from the repository root::

    python bench/bench_components.py            # or: python bench/bench_components.py --quick
    python bench/bench_components.py --smoke   # seconds; its figures mean nothing

What it measures, side by side in one run so the ratios compare like with like:

1. The logits step of one vocabulary row out of the physical prefill tile ``[1, 16, V]``
   into a preallocated float32 target, for V = 151936 (the Qwen3 calbin) and V = 1024
   (the tiny manifest): ``extract_logits`` (bounds check + BF16 -> FP32 + finite check)
   on the native one-pass kernel and on the numpy path, the kernel alone through cffi,
   ``convert_bf16_range`` (numpy, conversion only) and the uint16->uint32 shift trick,
   each against a plain ``np.copyto`` of a float32 row of the same size. Each of
   ``--runs`` runs measures every row (best of several repeats), in a rotated order; the
   report gives each row's best time and the range of its ratio to the copy over the
   runs (and their median). Target: ``extract_logits`` on the kernel <= 1.0x the copy at
   V = 151936, by the median of the runs; at V = 1024 the fixed cost of a call dominates
   and the ratio is for information.
2. tracemalloc peak over repeated calls of ``convert_bf16_range`` and ``extract_logits``:
   must stay far below the vocabulary size (no per-call temporary of V values).
3. ``BufferPool.acquire`` + ``BufferPool.release`` on a pool built over the simulated
   device, in microseconds. Target: < 20 us.
4. For information: one KV transaction (``try_reserve`` + ``mark_submitted`` + ``commit``)
   and ``try_reserve`` + ``rollback`` on the simulated device.

Times are the best of several repeats (the least disturbed by the machine), with the
median beside it where one run is reported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import timeit
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
from runs import add_smoke_option

from calfsm import _native
from calfsm.drivers.sim import SimDriver
from calfsm.engine.buffers import BufferPool
from calfsm.engine.kv import KvCoordinator
from calfsm.engine.logits import (
    convert_bf16_range,
    extract_logits,
    native_kernel_in_use,
    use_native_kernel,
)
from calfsm.manifest import TaskKind, builtin_manifest
from calfsm.runtime.sync import THREADS


def measure(fn, number: int, repeat: int) -> tuple[float, float]:
    """(best, median) seconds per call."""
    fn()
    times = [t / number for t in timeit.repeat(fn, number=number, repeat=repeat)]
    return min(times), statistics.median(times)


def peak_bytes(fn, calls: int = 5) -> int:
    fn()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        for _ in range(calls):
            fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


COPY = "float32 copy of the row (baseline)"
STEP = "extract_logits, native kernel"


def logits_rows(contract, native_ok: bool) -> tuple[dict, int]:
    """The logits rows of one contract: name -> (callable, use the native kernel)."""
    vocab = contract.vocab
    rng = np.random.default_rng(0)
    tile = rng.integers(0, 0x3F80, size=contract.logits.shape, dtype=np.uint16)  # finite
    dst = np.empty(vocab, np.float32)
    src_f32 = rng.standard_normal(vocab).astype(np.float32)
    n_tokens = 40959
    base = (n_tokens - 1) % contract.rows * vocab
    flat = tile.reshape(-1)
    size = contract.logits.byte_size

    def shift_trick() -> None:
        d = dst.view(np.uint32)
        d[:] = flat[base:base + vocab]
        d <<= 16

    rows = {
        COPY: (lambda: np.copyto(dst, src_f32), False),
        "extract_logits, numpy path": (
            lambda: extract_logits(tile, size, contract, n_tokens, dst), False),
        "convert_bf16_range (numpy, convert only)": (
            lambda: convert_bf16_range(tile, base, vocab, dst), False),
        "uint16->uint32 shift trick": (shift_trick, False),
    }
    if native_ok:
        ffi, lib = _native.load_kernels()
        src_p = ffi.from_buffer("uint16_t[]", tile) + base
        dst_p = ffi.from_buffer("float[]", dst, require_writable=True)
        kernel = lib.calfsm_bf16_to_f32_finite
        rows[STEP] = (lambda: extract_logits(tile, size, contract, n_tokens, dst), True)
        rows["kernel alone (cffi, bound pointers)"] = (
            lambda: kernel(src_p, dst_p, vocab), True)
    return rows, base // vocab


def bench_logits(name: str, runs: int, repeat: int, native_ok: bool, gated: bool,
                 scale: int = 1) -> None:
    contract = builtin_manifest(name).submodel(TaskKind.PREFILL_IDS)
    vocab = contract.vocab
    rows, row = logits_rows(contract, native_ok)
    number = max(100, 2_000_000 // vocab) // scale  # a timing of ~1-2 ms
    best: dict[str, float] = {}
    ratios: dict[str, list[float]] = {k: [] for k in rows}
    names = list(rows)
    for r in range(runs):
        order = names[r % len(names):] + names[:r % len(names)]
        got = {}
        for k in order:
            fn, native = rows[k]
            use_native_kernel(native)
            got[k] = measure(fn, number, repeat)[0]
            best[k] = min(best.get(k, got[k]), got[k])
        for k in names:
            ratios[k].append(got[k] / got[COPY])
    use_native_kernel(None)
    print(f"logits: V={vocab} ({name}), tile {list(contract.logits.shape)}, row {row}; "
          f"{runs} runs, each row best of {repeat} x {number} calls")
    for k in names:
        lo, hi = min(ratios[k]), max(ratios[k])
        med = statistics.median(ratios[k])
        print(f"  {k:42s} {best[k] * 1e6:8.2f} us   {med:5.2f}x copy "
              f"(runs {lo:.2f}-{hi:.2f}x)")
    if STEP in ratios:
        lo, hi = min(ratios[STEP]), max(ratios[STEP])
        med = statistics.median(ratios[STEP])
        verdict = ("OK" if med <= 1.0 else "OVER") if gated else \
            "for information: the fixed cost of a call dominates at this size"
        print(f"  logits step on the kernel / copy: median {med:.3f}x, runs {lo:.3f}-"
              f"{hi:.3f}x (target <= 1.0x at V=151936, by the median): {verdict}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats and runs")
    ap.add_argument("--runs", type=int, default=None,
                    help="runs of the logits rows (default 5, --quick 2)")
    add_smoke_option(ap, "a second or two, every row once with few calls")
    args = ap.parse_args(argv)
    repeat = 1 if args.smoke else 5 if args.quick else 15
    runs = 1 if args.smoke else args.runs or (2 if args.quick else 5)
    scale = 20 if args.smoke else 1          # fewer calls per timing

    native_ok = native_kernel_in_use()
    print(f"native logits kernel: {'loaded' if native_ok else 'NOT available (numpy only)'}"
          f"; OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')}")
    for name, gated in (("qwen3-b1", True), ("tiny", False)):
        bench_logits(name, runs, repeat, native_ok, gated, scale)

    manifest = builtin_manifest("qwen3-b1")
    prefill = manifest.submodel(TaskKind.PREFILL_IDS)
    vocab = prefill.vocab
    tile = np.random.default_rng(0).integers(0, 0x3F80, size=prefill.logits.shape,
                                             dtype=np.uint16)
    dst = np.empty(vocab, np.float32)
    peaks = {
        "convert_bf16_range": lambda: convert_bf16_range(tile, 14 * vocab, vocab, dst),
        "extract_logits": lambda: extract_logits(tile, prefill.logits.byte_size, prefill,
                                                 40959, dst),
    }
    for name, fn in peaks.items():
        peak = peak_bytes(fn)
        print(f"  tracemalloc peak over 5 calls of {name}: {peak} B "
              f"(vocabulary row is {vocab * 4} B as float32, {vocab * 2} B as BF16): "
              f"{'OK' if peak < vocab else 'ALLOCATES'}")

    driver = SimDriver(manifest, trace=False)
    assert driver.configure(driver.calbin) == 0
    models = {}
    for kind in (TaskKind.PREFILL_IDS, TaskKind.DECODE):
        contract = manifest.submodel(kind)
        code, handle = driver.model(contract.exact_name)
        assert code == 0, code
        models[kind] = (handle, contract)
    pool = BufferPool.build(driver, 0, models, slots_per_engine=2, sync=THREADS)

    def lease_cycle() -> None:
        pool.release(pool.acquire(TaskKind.DECODE))

    def lease_move_cycle() -> None:
        lease = pool.acquire(TaskKind.DECODE).bind(job_id=1, seq_id=1)
        pool.release(lease.move())

    best, med = measure(lease_cycle, 20000 // scale, repeat)
    print(f"lease: acquire + release {best * 1e6:.2f} us (median {med * 1e6:.2f}) "
          f"(target < 20 us): {'OK' if best < 20e-6 else 'OVER'}")
    best, med = measure(lease_move_cycle, 20000 // scale, repeat)
    print(f"lease: acquire + bind + move + release {best * 1e6:.2f} us "
          f"(median {med * 1e6:.2f})")

    kv = KvCoordinator(driver, max_seq=40960, token_budget=1 << 20, sync=THREADS)
    state = {"len": 0}

    def kv_commit() -> None:
        r = kv.try_reserve(1, state["len"], 1)
        kv.mark_submitted(r)
        kv.commit(r)
        state["len"] += 1
        if state["len"] >= 40960:
            kv.reset_sequence(1)
            state["len"] = 0

    def kv_rollback() -> None:
        kv.rollback(kv.try_reserve(2, 0, 16))

    for name, fn in (("try_reserve + mark_submitted + commit", kv_commit),
                     ("try_reserve + rollback", kv_rollback)):
        best, med = measure(fn, 2000 // scale, repeat)
        print(f"kv: {name:38s} {best * 1e6:7.1f} us (median {med * 1e6:7.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
