"""Every benchmark in bench/ still runs: each script's ``--smoke`` mode, as a subprocess.

Nothing else runs the benchmarks, so without this they rot when the code they drive
moves (issue 34: two of them failed on a removed argument and a renamed member). The
scripts are found by glob, so a new one is covered without being listed here: a module
of bench/ with an ``if __name__ == "__main__":`` block is a benchmark and must accept
``--smoke`` (a few seconds, the smallest run through every path, figures meaningless,
no target judged); one without is a helper, which some benchmark must import, so the
benchmarks' runs cover it. A smoke run fails the test when the script exits non-zero,
prints nothing, or outlives its bound.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
#: a smoke run takes seconds (about 1-8 s each on a 2-core VM); the bound is for a
#: hang, with room for a loaded machine
TIMEOUT_S = 180.0


def _is_benchmark(path: Path) -> bool:
    return re.search(r'^if __name__ == "__main__":', path.read_text(), re.M) is not None


MODULES = sorted(BENCH.glob("*.py"))
BENCHMARKS = [p for p in MODULES if _is_benchmark(p)]
HELPERS = [p for p in MODULES if not _is_benchmark(p)]


def test_the_benchmarks_are_found() -> None:
    """The glob is not silently empty (a moved directory would pass every case)."""
    names = {p.name for p in BENCHMARKS}
    assert {"bench_sim.py", "bench_components.py", "bench_server.py"} <= names, names
    assert {p.name for p in HELPERS} >= {"runs.py", "cpuload.py"}


@pytest.mark.parametrize("helper", HELPERS, ids=lambda p: p.name)
def test_every_helper_is_used_by_a_benchmark(helper: Path) -> None:
    """A helper runs when the benchmarks that import it run; one nothing imports would
    rot unseen."""
    pattern = re.compile(rf"^\s*(from|import)\s+{re.escape(helper.stem)}\b", re.M)
    users = [p.name for p in BENCHMARKS if pattern.search(p.read_text())]
    assert users, f"bench/{helper.name} is imported by no benchmark"


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.name)
def test_benchmark_runs_in_smoke_mode(script: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        done = subprocess.run([sys.executable, str(script), "--smoke"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"bench/{script.name} --smoke ran past {TIMEOUT_S:.0f} s:\n"
                    f"{(e.stdout or b'')[-2000:]!r}\n{(e.stderr or b'')[-2000:]!r}")
    assert done.returncode == 0, (
        f"bench/{script.name} --smoke exited {done.returncode} (a benchmark that no longer "
        f"runs; a new one must accept --smoke):\n{done.stdout[-3000:]}\n"
        f"{done.stderr[-3000:]}")
    assert done.stdout.strip(), f"bench/{script.name} --smoke printed nothing"
