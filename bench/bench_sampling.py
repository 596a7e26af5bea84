"""Micro-benchmark of sampling: one token from a float32 logits row, against a copy of it.

Run from the repository root::

    python bench/bench_sampling.py            # or: python bench/bench_sampling.py --quick
    python bench/bench_sampling.py --smoke   # seconds; its figures mean nothing

What it measures, side by side in one run so the ratios compare like with like:

1. For V = 151936 (the Qwen3 calbin) and V = 1024 (the tiny manifest), on rows of the
   reference model's logits (what both drivers produce: BF16 values spread evenly over
   [-8, 8)) and on rows of normal logits (sigma 3, a few tokens standing out): one
   ``Sampler.sample`` for greedy, temperature 0.8, temperature 0.8 + top-k 50, and
   temperature 0.8 + top-p 0.9, on the native kernel and on the numpy fallback, each
   against ``np.copyto`` of a float32 row of the same size. A draw consumes its row, so
   every call first refreshes the row with that same copy, and the copy's own time
   (measured beside it) is subtracted: the ratio is sampling alone over one copy.
   Each of ``--runs`` runs measures every row (best of several repeats) in a rotated
   order; the report gives each row's best time and the median and range of its ratio
   over the runs. No target: the numbers are what the overlap scheduler has to hide.
2. tracemalloc peak over repeated draws at V = 151936 on each path: the row is
   607744 bytes; a path allocating the vocabulary would show it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import timeit
import tracemalloc
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ml_dtypes
import numpy as np
from runs import add_smoke_option

from calfsm.drivers import refmodel
from calfsm.generate.sampling import SamplingParams, native_sampling_available

MODES = {
    "greedy": SamplingParams(),
    "temperature 0.8": SamplingParams(temperature=0.8, seed=1),
    "top-k 50": SamplingParams(temperature=0.8, top_k=50, seed=1),
    "top-p 0.9": SamplingParams(temperature=0.8, top_p=0.9, seed=1),
}
COPY = "float32 copy of the row (baseline)"


def reference_row(vocab: int) -> np.ndarray:
    bits = refmodel.logits_bf16(0x1234ABCD, vocab)
    return bits.view(ml_dtypes.bfloat16).astype(np.float32)


def normal_row(vocab: int) -> np.ndarray:
    return (np.random.default_rng(0).standard_normal(vocab) * 3.0).astype(np.float32)


def best_time(fn: Callable[[], object], number: int, repeat: int) -> float:
    fn()
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number


def calls_for(fn: Callable[[], object], budget_s: float = 2e-3) -> int:
    """How many calls make one timing of about ``budget_s``."""
    once = best_time(fn, 1, 3)
    return max(3, min(20000, int(budget_s / max(once, 1e-7))))


def rows_of(src: np.ndarray, native_ok: bool) -> dict[str, Callable[[], object]]:
    vocab = src.shape[0]
    row = np.empty_like(src)
    fns: dict[str, Callable[[], object]] = {COPY: lambda: np.copyto(row, src)}
    paths = [("kernel", True)] if native_ok else []
    paths.append(("numpy", False))
    for mode, params in MODES.items():
        for label, native in paths:
            if mode == "greedy" and not native:
                continue                        # greedy is np.argmax on either path
            s = params.sampler_for(vocab, native=native)

            def fn(s=s) -> None:
                np.copyto(row, src)
                s.sample(row)
            fns[mode if mode == "greedy" else f"{mode}, {label}"] = fn
    return fns


def bench(name: str, src: np.ndarray, runs: int, repeat: int, native_ok: bool,
          budget_s: float = 2e-3) -> None:
    fns = rows_of(src, native_ok)
    numbers = {k: calls_for(fn, budget_s) for k, fn in fns.items()}
    names = list(fns)
    best: dict[str, float] = {}
    ratios: dict[str, list[float]] = {k: [] for k in names if k != COPY}
    for r in range(runs):
        order = names[r % len(names):] + names[:r % len(names)]
        got = {}
        for k in order:
            got[k] = best_time(fns[k], numbers[k], repeat)
        copy = got[COPY]
        best[COPY] = min(best.get(COPY, copy), copy)
        for k in ratios:
            alone = max(got[k] - copy, 0.0)
            best[k] = min(best.get(k, alone), alone)
            ratios[k].append(alone / copy)
    print(f"sampling: V={src.shape[0]}, {name}; {runs} runs, each row best of {repeat} "
          f"timings; times are sampling alone (the row's refresh subtracted)")
    print(f"  {COPY:36s} {best[COPY] * 1e6:9.2f} us")
    for k, rs in ratios.items():
        print(f"  {k:36s} {best[k] * 1e6:9.2f} us   {statistics.median(rs):7.2f}x copy "
              f"(runs {min(rs):.2f}-{max(rs):.2f}x)")


def peak_bytes(fn: Callable[[], object], calls: int = 5) -> int:
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
    ap.add_argument("--quick", action="store_true", help="fewer repeats and runs")
    ap.add_argument("--runs", type=int, default=None, help="runs (default 5, --quick 2)")
    add_smoke_option(ap, "a second or two, every row once with a few calls")
    args = ap.parse_args(argv)
    repeat = 1 if args.smoke else 3 if args.quick else 7
    runs = 1 if args.smoke else args.runs or (2 if args.quick else 5)
    budget_s = 1e-5 if args.smoke else 2e-3     # one timing's length: the fewest calls
    native_ok = native_sampling_available()
    print(f"native sampling kernel: {'loaded' if native_ok else 'NOT available (numpy only)'}")
    for vocab in (151936, 1024):
        for name, make in (("reference-model logits", reference_row),
                           ("normal logits (sigma 3)", normal_row)):
            bench(name, make(vocab), runs, repeat, native_ok, budget_s)
    vocab = 151936
    src = reference_row(vocab)
    row = np.empty_like(src)
    for fn_name, fn in rows_of(src, native_ok).items():
        if fn_name == COPY:
            continue
        peak = peak_bytes(fn)
        print(f"  tracemalloc peak over 5 draws, {fn_name:28s}: {peak:7d} B (row {row.nbytes} "
              f"B): {'OK' if peak < row.nbytes else 'ALLOCATES THE VOCABULARY'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
