"""``--load N``: N CPU-bound processes beside a benchmark, started and stopped by it.

A busy machine is where the token path's thread hand-offs cost most (each wake-up waits
for a core), so the stream benchmarks report quiet and loaded runs side by side; this is
the load, the same as ``../shared/tools/under-load`` gives the test suite: plain busy
loops, one process each, killed when the benchmark ends (or is interrupted).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
from collections.abc import Iterator

__all__ = ["add_load_option", "cpu_load"]


def _spin() -> None:  # pragma: no cover - runs in the child
    while True:
        pass


@contextlib.contextmanager
def cpu_load(n: int) -> Iterator[None]:
    """Run ``n`` busy-loop processes for the duration of the block."""
    procs = [mp.get_context("spawn").Process(target=_spin, daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.join(5)


def add_load_option(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--load", type=int, default=0, metavar="N",
                    help="run N CPU-bound processes beside the benchmark (default 0)")
