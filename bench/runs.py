"""The summary every benchmark prints: each figure's median and range over the runs."""

from __future__ import annotations

import statistics


def print_summary(runs: list[dict[str, float]], *, width: int = 28) -> None:
    """One line per figure of ``runs`` (each run a dict of the same keys)."""
    for k in runs[0]:
        vals = [r[k] for r in runs]
        print(f"  {k:{width}} median {statistics.median(vals):9.3f}   range "
              f"{min(vals):.3f}-{max(vals):.3f}")
