"""Continuous batching on ``tiny-b8`` against the batch-1 ``tiny``, on SimDriver in real time.

Run from the repository root::

    python bench/bench_batching.py              # three runs, ~3 minutes
    python bench/bench_batching.py --quick      # one run, fewer tokens
    python bench/bench_batching.py --smoke      # seconds; its figures mean nothing

The device: ``LatencyModel.fixed(decode_s=10 ms, prefill_token_us=200,
batch_row_share=0.05, shape_cost="graph")``. A batch decode step of ``R`` rows takes
``decode_s * (1 + 0.05 * (R - 1))`` (a cost *model*, docs/driver-protocol.md, Batches),
``R`` the graph's whole batch: 13.5 ms for eight rows,
so the model's ideal aggregate rate on ``tiny-b8`` is ``8 / 13.5 ms`` = 593 tokens/s,
against ``1 / 10 ms`` = 100 tokens/s one row at a time.

Evidence first: the batch runner (``examples/vendor/batch_semantics.py``) runs on the
simulated device and writes its evidence into a temporary directory, which the batching
executor reads (``ExecutorConfig.evidence_dir``), as in production; the batch-1 executor
reads the same directory (it has no batch graph). Each run, side by side:

(a) ``--streams`` (64) greedy streams at once, ``--tokens`` each, on ``tiny-b8`` and on
    ``tiny``: the aggregate tokens/s while every stream is running (from the last first
    token to the first last token: no ramp), against the ideal of each, and the ratio
    batched / batch-1 (targets: >= 0.95x ideal; >= 5x). Per-stream time per output
    token P99 over that window against the model's (``streams / 8`` batch steps per
    token when every stream runs; target <= 1.10x).
(b) eight streams on ``tiny-b8`` (one full batch): P99 time per output token against
    one batch step, 13.5 ms (target <= 1.10x).
(c) one stream alone on ``tiny-b8``, on ``tiny-buckets`` and on ``tiny``: time per output
    token P50, the ratios. The device models a static calbin (``shape_cost="graph"``,
    docs/driver-protocol.md, Shape cost): a lone stream on the b8 graph pays the whole
    8-row step (1.35x: what a missing bucket costs, no target); on ``tiny-buckets``, with
    the step-cost runner's evidence, it runs on the b1 graph (target <= 1.02x).

Before measuring, every stream's tokens are checked against the reference model. Each
figure is reported per run and as the median with the range over the runs.
"""

from __future__ import annotations

import argparse
import gc
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from runs import add_smoke_option, print_summary, repeat  # noqa: E402

from calfsm.clock import RealClock  # noqa: E402
from calfsm.drivers.sim import LatencyModel, SimDriver  # noqa: E402
from calfsm.executor import DeviceExecutor, ExecutorConfig  # noqa: E402
from calfsm.generate.sampling import SamplingParams  # noqa: E402
from calfsm.manifest import builtin_manifest  # noqa: E402
from calfsm.tools.direct import DirectRunner  # noqa: E402

DECODE_S = 0.010
SHARE = 0.05
ROWS = 8
LATENCY = LatencyModel.fixed(decode_s=DECODE_S, prefill_per_token_s=2e-4,
                             batch_row_share=SHARE, shape_cost="graph")
STEP_S = DECODE_S * (1 + SHARE * (ROWS - 1))
TIMEOUT_S = 600.0


def write_evidence(directory: str) -> None:
    """The real runner, on the simulated device, writing the file the executor reads."""
    cmd = [sys.executable, str(ROOT / "examples/vendor/batch_semantics.py"), "--driver",
           "sim", "--manifest", "tiny-b8", "--out", directory]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"batch runner failed:\n{done.stdout}\n{done.stderr}")
    cmd = [sys.executable, str(ROOT / "examples/vendor/step_costs.py"), "--driver", "sim",
           "--manifest", "tiny-buckets", "--out", directory, "--latency",
           f"virtual:decode_ms={DECODE_S * 1e3:g},prefill_token_us=200,"
           f"batch_row_share={SHARE}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"step-cost runner failed:\n{done.stdout}\n{done.stderr}")


def prompts(n: int) -> list[list[int]]:
    return [[(7 * i + 3) % 1024, (11 * i + 5) % 1024, (13 * i + 1) % 1024]
            for i in range(n)]


def run(name: str, n: int, tokens: int, evidence: str) -> tuple[list, float]:
    """``n`` greedy streams of ``tokens`` on ``name``: each stream's absolute token times
    (driver clock) and the executor's rows per step."""
    m = builtin_manifest(name)
    drv = SimDriver(m, clock=RealClock(), latency=LATENCY)
    with DeviceExecutor(drv, m, ExecutorConfig(evidence_dir=evidence,
                                               admission_estimate=False)) as ex:
        gc.collect()
        gc.disable()
        try:
            streams = [ex.generate(p, SamplingParams(max_tokens=tokens))
                       for p in prompts(n)]
            results = [s.result(TIMEOUT_S) for s in streams]
        finally:
            gc.enable()
        times = []
        for s, r in zip(streams, results, strict=True):
            assert len(r.tokens) == tokens, r
            t = s.started + r.ttft_s + np.concatenate(([0.0], np.cumsum(r.inter_token_s)))
            times.append((t, list(r.tokens)))
        return times, ex.max_batch


def check(name: str, times: list, tokens: int) -> None:
    m = builtin_manifest("tiny")
    ref = DirectRunner(SimDriver(m), m)
    for i, (_, got) in enumerate(times):
        assert got == ref.generate(0, prompts(len(times))[i], tokens), (name, i)


def window(times: list) -> tuple[float, float, np.ndarray]:
    """Aggregate tokens/s while every stream runs, and the gaps inside that window."""
    start = max(t[0] for t, _ in times)
    end = min(t[-1] for t, _ in times)
    inside = sum(int(((t >= start) & (t <= end)).sum()) for t, _ in times)
    gaps = np.concatenate([np.diff(t[(t >= start) & (t <= end)]) for t, _ in times])
    return inside / (end - start), end - start, gaps


def one_run(args: argparse.Namespace, evidence: str) -> dict[str, float]:
    out: dict[str, float] = {}
    b8, rows = run("tiny-b8", args.streams, args.tokens, evidence)
    assert rows == ROWS, rows
    b1, _ = run("tiny", args.streams, args.tokens, evidence)
    if args.check:
        check("tiny-b8", b8, args.tokens)
    rate8, _, gaps8 = window(b8)
    rate1, _, _ = window(b1)
    out["b8 tok/s"] = rate8
    out["b1 tok/s"] = rate1
    out["b8 / ideal"] = rate8 / (ROWS / STEP_S)
    out["b1 / ideal"] = rate1 * DECODE_S
    out["b8 / b1"] = rate8 / rate1
    per_token = args.streams / ROWS * STEP_S
    out["b8 P99 TPOT / model"] = float(np.percentile(gaps8, 99)) / per_token
    full, _ = run("tiny-b8", ROWS, args.tokens * 2, evidence)
    _, _, gaps_full = window(full)
    out["8 streams P99 TPOT / step"] = float(np.percentile(gaps_full, 99)) / STEP_S
    lone8, _ = run("tiny-b8", 1, args.tokens * 2, evidence)
    lone_bk, _ = run("tiny-buckets", 1, args.tokens * 2, evidence)
    lone1, _ = run("tiny", 1, args.tokens * 2, evidence)
    p50_8 = float(np.median(np.diff(lone8[0][0])))
    p50_bk = float(np.median(np.diff(lone_bk[0][0])))
    p50_1 = float(np.median(np.diff(lone1[0][0])))
    out["lone P50 TPOT b8 / b1"] = p50_8 / p50_1
    out["lone P50 TPOT buckets / b1"] = p50_bk / p50_1
    out["lone P50 TPOT b1 ms"] = p50_1 * 1e3
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--tokens", type=int, default=40, help="tokens per stream in (a)")
    p.add_argument("--quick", action="store_true", help="one run, 20 tokens")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="skip the reference check of the batched tokens")
    add_smoke_option(p, "a few seconds, one run of 8 streams x 10 tokens")
    args = p.parse_args(argv)
    if args.quick:
        args.runs, args.tokens = 1, 20
    if args.smoke:
        args.runs, args.streams, args.tokens = 1, ROWS, 10   # a window all 8 share
    with tempfile.TemporaryDirectory(prefix="calfsm-bench-evidence-") as evidence:
        write_evidence(evidence)
        runs = repeat(args.runs, lambda _: one_run(args, evidence))
    print(f"\n{args.streams} streams x {args.tokens} tokens, decode {DECODE_S * 1e3:.0f} ms, "
          f"batch_row_share {SHARE}: step of {ROWS} rows {STEP_S * 1e3:.1f} ms, ideal "
          f"{ROWS / STEP_S:.0f} tok/s batched, {1 / DECODE_S:.0f} tok/s batch-1")
    print_summary(runs, width=28)
    return 0


if __name__ == "__main__":
    sys.exit(main())
