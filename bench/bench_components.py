"""Micro-benchmarks of the hot-path components: logits conversion and buffer leases.

Run from the repository root::

    python bench/bench_components.py            # or: python bench/bench_components.py --quick

What it measures, all in one run so the ratios compare like with like:

1. BF16 -> FP32 of one vocabulary row (V = 151936, the Qwen3 calbin) out of the
   physical prefill tile ``[1, 16, V]``, into a preallocated float32 target:
   ``convert_bf16_range`` (ml_dtypes + ``np.copyto``), the uint16->uint32 shift trick
   for comparison, ``extract_logits`` (size check + conversion + finite check), and a
   plain ``np.copyto`` of a float32 row of the same size as the baseline.
   Target: ``convert_bf16_range`` <= 1.5x the plain copy.
2. tracemalloc peak over repeated calls of ``convert_bf16_range`` and ``extract_logits``:
   must stay far below the vocabulary size (no per-call temporary of V values).
3. ``BufferPool.acquire`` + ``BufferPool.release`` on a pool built over the simulated
   device, in microseconds. Target: < 20 us.
4. For information: one KV transaction (``try_reserve`` + ``mark_submitted`` + ``commit``)
   and ``try_reserve`` + ``rollback`` on the simulated device.

Times are the best of several repeats (the least disturbed by the machine), with the
median beside it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import timeit
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from calfsm.buffers import BufferPool
from calfsm.clock import VirtualClock
from calfsm.drivers.sim import SimDriver
from calfsm.kv import KvCoordinator
from calfsm.logits import convert_bf16_range, extract_logits
from calfsm.manifest import TaskKind, builtin_manifest


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    args = ap.parse_args(argv)
    repeat = 5 if args.quick else 15

    manifest = builtin_manifest("qwen3-b1")
    prefill = manifest.submodel(TaskKind.PREFILL_IDS)
    vocab = prefill.vocab
    rng = np.random.default_rng(0)
    tile = rng.integers(0, 0x3F80, size=prefill.logits.shape, dtype=np.uint16)  # finite
    dst = np.empty(vocab, np.float32)
    src_f32 = rng.standard_normal(vocab).astype(np.float32)
    n_tokens = 40959
    row = (n_tokens - 1) % prefill.rows
    base = row * vocab
    flat = tile.reshape(-1)

    def shift_trick() -> None:
        d = dst.view(np.uint32)
        d[:] = flat[base:base + vocab]
        d <<= 16

    rows = {
        "plain float32 copy (baseline)": lambda: np.copyto(dst, src_f32),
        "convert_bf16_range (ml_dtypes)": lambda: convert_bf16_range(tile, base, vocab, dst),
        "uint16->uint32 shift trick": shift_trick,
        "extract_logits (check+convert+finite)": lambda: extract_logits(
            tile, prefill.logits.byte_size, prefill, n_tokens, dst),
    }
    print(f"logits: V={vocab}, tile {list(prefill.logits.shape)}, row {row}, "
          f"best/median of {repeat} x 200 calls")
    results = {name: measure(fn, 200, repeat) for name, fn in rows.items()}
    baseline = results["plain float32 copy (baseline)"][0]
    for name, (best, med) in results.items():
        print(f"  {name:40s} {best * 1e6:8.1f} us  (median {med * 1e6:8.1f})  "
              f"{best / baseline:5.2f}x copy")
    ratio = results["convert_bf16_range (ml_dtypes)"][0] / baseline
    print(f"  convert / copy ratio: {ratio:.2f}x (target <= 1.5x): "
          f"{'OK' if ratio <= 1.5 else 'OVER'}")

    for name in ("convert_bf16_range (ml_dtypes)", "extract_logits (check+convert+finite)"):
        peak = peak_bytes(rows[name])
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
    pool = BufferPool.build(driver, 0, models, slots_per_engine=2)

    def lease_cycle() -> None:
        pool.release(pool.acquire(TaskKind.DECODE))

    def lease_move_cycle() -> None:
        lease = pool.acquire(TaskKind.DECODE).bind(job_id=1, seq_id=1)
        pool.release(lease.move())

    best, med = measure(lease_cycle, 20000, repeat)
    print(f"lease: acquire + release {best * 1e6:.2f} us (median {med * 1e6:.2f}) "
          f"(target < 20 us): {'OK' if best < 20e-6 else 'OVER'}")
    best, med = measure(lease_move_cycle, 20000, repeat)
    print(f"lease: acquire + bind + move + release {best * 1e6:.2f} us "
          f"(median {med * 1e6:.2f})")

    kv = KvCoordinator(driver, max_seq=40960, token_budget=1 << 20, clock=VirtualClock())
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
        best, med = measure(fn, 2000, repeat)
        print(f"kv: {name:38s} {best * 1e6:7.1f} us (median {med * 1e6:7.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
