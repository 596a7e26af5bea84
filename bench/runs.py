"""What every benchmark shares: its ``--smoke`` option, and what it prints (each run's
figures as it ends, then each figure's median and range over the runs)."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable


def repeat(n: int, one_run: Callable[[int], dict[str, float]]) -> list[dict[str, float]]:
    """``one_run(i)`` for i in 0..n-1, each run's figures printed as it ends."""
    runs = []
    for i in range(n):
        r = one_run(i)
        runs.append(r)
        print(f"run {i + 1}: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items()),
              flush=True)
    return runs


def print_summary(runs: list[dict[str, float]], *, width: int = 28) -> None:
    """One line per figure of ``runs`` (each run a dict of the same keys)."""
    for k in runs[0]:
        vals = [r[k] for r in runs]
        print(f"  {k:{width}} median {statistics.median(vals):9.3f}   range "
              f"{min(vals):.3f}-{max(vals):.3f}")


def add_smoke_option(ap: argparse.ArgumentParser, what: str) -> None:
    """``--smoke``: ``what`` (seconds, the smallest run through every path), which
    tests/test_bench_smoke.py runs for every script; its figures mean nothing."""
    ap.add_argument("--smoke", action="store_true",
                    help=f"{what}: checks it still runs (the test suite's), its figures "
                         "mean nothing")
