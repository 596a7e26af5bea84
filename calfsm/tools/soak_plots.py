"""PNG plots of a soak: RSS (with leased buffers), latency, recoveries — over time.

matplotlib is an optional extra (``pip install -e ".[soak]"``) and runs on its Agg
backend, so plotting needs no display and never touches the caller's backend choice
beyond this process's first import.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

from calfsm.errors import InvalidArgument
from calfsm.tools.soak_gates import RssTrend, Sample

__all__ = ["PLOTS", "pyplot", "write_plots"]

#: file names of the plots, in the order they are written
PLOTS = ("soak-rss.png", "soak-latency.png", "soak-recoveries.png")
_MIB = 1 << 20


def pyplot():
    """matplotlib's pyplot on the Agg backend, or InvalidArgument naming the extra."""
    try:
        import matplotlib
    except ImportError:
        raise InvalidArgument("plots need matplotlib: pip install 'calfsm[soak]'",
                              stage="soak") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def write_plots(samples: Sequence[Sample], trend: RssTrend, out: Path, *, title: str,
                clock: str) -> list[Path]:
    """Write :data:`PLOTS` into ``out``; returns their paths."""
    plt = pyplot()
    out.mkdir(parents=True, exist_ok=True)
    t = [s.t for s in samples]
    paths = []

    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.plot(t, [s.rss / _MIB for s in samples], label="RSS", color="tab:blue")
    if trend.samples >= 2:
        t0 = trend.start_t
        t1 = t0 + trend.window_s
        mid = trend.median / _MIB
        half = trend.slope_bps * trend.window_s / 2 / _MIB
        ax.plot([t0, t1], [mid - half, mid + half], "--", color="tab:red",
                label=f"Theil-Sen trend: {trend.slope_mib_per_h:+.0f} MiB/h, "
                      f"{trend.growth / _MIB:+.1f} MiB (bound here "
                      f"{trend.bound_bps * 3600 / _MIB:.0f} MiB/h)")
    ax.axvspan(0, trend.start_t, color="0.9", label="warm-up")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("RSS (MiB)")
    ax2 = ax.twinx()
    ax2.step(t, [s.leased for s in samples], where="post", color="tab:green", alpha=0.6,
             label="leased buffers")
    ax2.set_ylabel("leased buffers")
    ax2.set_ylim(bottom=0)
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="lower right", fontsize=8)
    ax.set_title(f"{title}: memory")
    paths.append(_save(fig, out / PLOTS[0], plt))

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for field, label, style in (("ttft_p50_ms", "TTFT P50", "-"),
                                ("ttft_p99_ms", "TTFT P99", ":"),
                                ("tpot_p50_ms", "TPOT P50", "-"),
                                ("tpot_p99_ms", "TPOT P99", ":")):
        pts = [(s.t, getattr(s, field)) for s in samples if getattr(s, field) is not None]
        if pts:
            ax.plot(*zip(*pts), style, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel(f"ms ({clock})")
    ax.legend(fontsize=8)
    ax.set_title(f"{title}: latency per sample window")
    paths.append(_save(fig, out / PLOTS[1], plt))

    fig, ax = plt.subplots(figsize=(9, 4.5))
    if any(s.faults is not None for s in samples):
        ax.step(t, [s.faults or 0 for s in samples], where="post", label="faults injected")
    ax.step(t, [s.recoveries for s in samples], where="post", lw=2.5, label="recoveries")
    ax.step(t, [s.generation for s in samples], where="post", ls="--", color="k", lw=0.8,
            label="generation")
    for s0, s1 in itertools.pairwise(samples):
        if s0.lifecycle != "Ready":
            ax.axvspan(s0.t, s1.t, color="tab:orange", alpha=0.2, lw=0)
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("count (cumulative)")
    ax.legend(fontsize=8, title="shaded: sampled not Ready", title_fontsize=8)
    ax.set_title(f"{title}: faults and recoveries")
    paths.append(_save(fig, out / PLOTS[2], plt))
    return paths


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
