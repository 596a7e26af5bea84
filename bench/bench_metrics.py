"""What observing costs the per-token path: CPU per job with and without observers.

Run from the repository root::

    python bench/bench_metrics.py            # ~10 s
    python bench/bench_metrics.py --quick    # ~3 s
    python bench/bench_metrics.py --smoke   # seconds; its figures mean nothing

Step-mode executors (no threads, zero device latency, the virtual clock) on SimDriver,
so the figure is the executor's own CPU per job, without thread hand-offs or device
time. Four executors run side by side, interleaved in ABCD/DCBA blocks, each figure the
median over the blocks of process CPU time per job:

``none``      no observer (the default): what the observer plumbing costs when unused
``no-op``     an observer whose ``job_ended`` does nothing: the JobEnded record + call
``metrics``   :class:`calfsm.telemetry.metrics.ExecutorMetrics` attached
``+dump``     metrics and a dump sink that selects nothing the run produces

(a) per-job path: one decode job per step (``enqueue`` + drive + greedy), the path of
    ``bench_executor.py``; (b) streams: 64-token greedy generation streams, CPU per
    token (jobs plus the stream's own sampling and events). The no-observer figure is
    compared across commits with ``bench_executor.py --quick`` run side by side.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runs import add_smoke_option

from calfsm.drivers.sim import LatencyModel, SimDriver
from calfsm.engine.job import Request
from calfsm.engine.observe import JobEnded, Observer
from calfsm.executor import DeviceExecutor, ExecutorConfig
from calfsm.generate.sampling import SamplingParams
from calfsm.manifest import builtin_manifest
from calfsm.runtime.stepper import StepScheduler
from calfsm.telemetry.dump import DumpConfig, DumpSink
from calfsm.telemetry.metrics import ExecutorMetrics

PROMPT = [11, 22, 33, 44, 55, 66, 77, 88]


class NoOp(Observer):
    def job_ended(self, event: JobEnded) -> None:
        pass


def make(manifest, variant: str, dump_dir: str) -> DeviceExecutor:
    ex = DeviceExecutor(SimDriver(manifest, trace=False, latency=LatencyModel.zero()),
                        manifest, ExecutorConfig(threaded=False))
    if variant == "no-op":
        ex.add_observer(NoOp())
    if variant in ("metrics", "+dump"):
        ExecutorMetrics(ex)
    if variant == "+dump":
        ex.add_observer(DumpSink(DumpConfig(directory=Path(dump_dir) / "dumps",
                                            categories={"artifact"})))
    return ex


def per_job(ex: DeviceExecutor, n: int) -> float:
    """CPU seconds per decode job."""
    sched = StepScheduler(ex)
    tok = ex.decode_sync(Request.prefill(0, PROMPT)).greedy()
    pos = len(PROMPT)
    t0 = time.process_time()
    for _ in range(n):
        h = ex.enqueue(Request.decode(0, tok, pos))
        sched.run_until(h.done)
        tok = h.result().greedy()
        pos += 1
    cpu = (time.process_time() - t0) / n
    ex.reset_sequence(0)
    return cpu


def per_token(ex: DeviceExecutor, streams: int) -> float:
    """CPU seconds per delivered token of 64-token streams, one at a time."""
    sched = StepScheduler(ex)
    tokens = 0
    t0 = time.process_time()
    for _ in range(streams):
        s = ex.generate(PROMPT, SamplingParams(max_tokens=64))
        sched.run_until(lambda s=s: s.done() and ex.idle())
        tokens += len(s.result(0).tokens)
    return (time.process_time() - t0) / tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--manifest", default="tiny")
    ap.add_argument("--blocks", type=int, default=8, help="interleaved blocks (even)")
    ap.add_argument("--quick", action="store_true")
    add_smoke_option(ap, "a second or two, 2 blocks of 20 jobs and 1 stream")
    args = ap.parse_args(argv)
    manifest = builtin_manifest(args.manifest)
    jobs, streams = (20, 1) if args.smoke else (300, 4) if args.quick else (1000, 12)
    if args.smoke:
        args.blocks = 2
    variants = ("none", "no-op", "metrics", "+dump")
    with tempfile.TemporaryDirectory() as tmp:
        exs = {v: make(manifest, v, tmp) for v in variants}
        for ex in exs.values():                         # warm
            per_job(ex, 50)
            per_token(ex, 1)
        job_cpu = {v: [] for v in variants}
        tok_cpu = {v: [] for v in variants}
        for b in range(args.blocks):
            order = variants if b % 2 == 0 else variants[::-1]
            for v in order:
                job_cpu[v].append(per_job(exs[v], jobs))
            for v in order:
                tok_cpu[v].append(per_token(exs[v], streams))
        for ex in exs.values():
            ex.close()
    med = statistics.median
    print(f"bench_metrics: {manifest.name}, step mode, zero latency, {args.blocks} "
          f"interleaved blocks, medians (range); python {sys.version.split()[0]}")
    for title, data in (("(a) per-job path: CPU µs per decode job", job_cpu),
                        ("(b) streams: CPU µs per token (64-token streams)", tok_cpu)):
        print(f"\n{title}")
        base = med(data["none"])
        for v in variants:
            xs = data[v]
            print(f"  {v:8} {med(xs) * 1e6:8.1f}  ({min(xs) * 1e6:.1f}-{max(xs) * 1e6:.1f})"
                  f"  x{med(xs) / base:.3f}  +{(med(xs) - base) * 1e6:5.1f} µs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
