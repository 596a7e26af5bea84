"""Generation streams against the direct synchronous loop, on SimDriver in real time.

Run from the repository root::

    python bench/bench_streams.py             # ~75 s
    python bench/bench_streams.py --quick     # ~20 s
    python bench/bench_streams.py --runs 3    # three runs, ranges reported
    python bench/bench_streams.py --smoke   # seconds; its figures mean nothing

Every path drives its own ``SimDriver(clock=RealClock(), latency=LatencyModel.fixed(
decode_s=...))`` of the same manifest (prefill takes no device time); as in
``bench_executor.py``, whose direct and per-job paths this reuses, the paths run
interleaved in ABC/CBA blocks so drift hits all alike, and each figure is the median
over the blocks.

(a) one stream, greedy, at 10 ms and 2 ms of device time per decode: the time per output
    token as the consumer sees it — the gap between two token events arriving at a thread
    iterating the stream (``open_sequence()`` + ``seq.generate(...)``) — against the
    direct path's time per token (``DirectRunner.decode`` into a float32 row + argmax,
    in a loop) and, for context, the per-job executor path (``enqueue`` + ``result`` +
    greedy per step). P50 and P99, each as a ratio to the direct path's and to the device
    time per decode (the physical limit); "µs over device" is P50 minus the device time,
    the host's share of each token on the critical path (on the direct path that is the
    sim's wake-up from ``wait`` plus one decode's host work). Before measuring, the
    stream's tokens are checked equal to the direct path's.
(b) four streams at once on one executor (``max_inflight`` 1): the fraction of the wall
    time the device is busy, from the sim's trace: each accepted decode ``infer``
    occupies the device for exactly ``decode_s`` from its submit (one engine, jobs one at
    a time; prefills take none), over the window from the block's first ``infer`` to its
    last decode's end. The wall time over the device time is its inverse, the ratio to
    the physical limit; a stream's time per output token is also shown against four
    decodes' device time (four streams share the device). The direct path, one sequence
    at a time, is beside it: its device time over its decode loop's wall time.

The targets (issue 13) are printed PASS or MISS at the end; with ``--runs N`` a target
passes only if every run meets it, and each figure is shown as its range over the runs.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_executor import PROMPT, DirectPath, ExecutorPath, _pct, _sim, interleaved_blocks
from cpuload import add_load_option, cpu_load
from runs import add_smoke_option

from calfsm.executor import DeviceExecutor, ExecutorConfig
from calfsm.generate.sampling import SamplingParams
from calfsm.generate.stream import FinishReason, Stream
from calfsm.manifest import TaskKind, builtin_manifest

TIMEOUT_S = 120.0


def _check(stream: Stream, steps: int) -> None:
    result = stream.result(TIMEOUT_S)
    if result.finish_reason != FinishReason.LENGTH or len(result.tokens) != steps + 1:
        raise RuntimeError(f"stream ended {result.finish_reason.value} after "
                           f"{len(result.tokens)} of {steps + 1} tokens: {result.error}")


# ---- (a) one stream -------------------------------------------------------------------

class StreamPath:
    """One stream per block: the prefill's token, then ``steps`` decodes."""

    def __init__(self, manifest, decode_s: float, *, trace: bool = False) -> None:
        self.ex = DeviceExecutor(_sim(manifest, decode_s, trace=trace), manifest,
                                 ExecutorConfig(max_inflight=1))

    def tokens(self, steps: int) -> tuple[int, ...]:
        with self.ex.open_sequence() as seq:
            stream = seq.generate(PROMPT, SamplingParams(max_tokens=steps + 1))
            _check(stream, steps)
        return stream.result().tokens

    def block(self, steps: int) -> list[float]:
        clock = time.perf_counter
        with self.ex.open_sequence() as seq:
            stream = seq.generate(PROMPT, SamplingParams(max_tokens=steps + 1))
            stamps = [clock() for _ in stream]      # as each token event arrives
            _check(stream, steps)
        return [b - a for a, b in itertools.pairwise(stamps)]

    def close(self) -> None:
        self.ex.close()


def bench_one_stream(manifest, decode_s: float, steps: int, blocks: int) -> dict:
    paths = {"direct": DirectPath(manifest, decode_s),
             "jobs": ExecutorPath(manifest, decode_s),
             "streams": StreamPath(manifest, decode_s)}
    try:
        want = paths["direct"].runner.generate(0, PROMPT, 21)
        got = paths["streams"].tokens(20)
        if list(got) != want:
            raise RuntimeError(f"the stream's tokens {got} are not the direct path's {want}")
    except BaseException:
        for path in paths.values():
            path.close()
        raise
    per = interleaved_blocks(paths, steps, blocks)
    return {name: {"p50": statistics.median(_pct(r, 50) for r in runs),
                   "p99": statistics.median(_pct(r, 99) for r in runs)}
            for name, runs in per.items()}


# ---- (b) four streams at once -----------------------------------------------------------

def _device_busy(lines: list[str], decode_s: float) -> tuple[float, float]:
    """(device busy seconds, window seconds) of the trace ``lines``: each accepted decode
    ``infer`` busy for ``decode_s`` from its submit, the window from the first accepted
    ``infer`` to the last decode's end."""
    infers = [json.loads(line) for line in lines]
    infers = [e for e in infers if e["call"] in ("infer", "infer_fixed") and e["rc"] == 0]
    decodes = sorted(e["t"] / 1e9 for e in infers if e["model"].endswith("_decode"))
    if not decodes:
        return 0.0, 0.0
    start = min(e["t"] / 1e9 for e in infers)
    busy, end = 0.0, start
    for s in decodes:                         # union of [s, s + decode_s]
        lo, hi = max(s, end), s + decode_s
        if hi > lo:
            busy += hi - lo
            end = hi
    return busy, end - start


def bench_four_streams(manifest, decode_s: float, steps: int, rounds: int) -> dict:
    """``rounds`` blocks, alternating: four streams on one executor, then the direct path
    with one sequence; medians over the blocks."""
    streams = StreamPath(manifest, decode_s, trace=True)
    direct = DirectPath(manifest, decode_s)
    driver = streams.ex.driver
    busy, wall_over_device, itl50, itl99, direct_busy = [], [], [], [], []
    try:
        direct.block(10)
        streams.block(10)
        for _ in range(rounds):
            gc.collect()
            seen = len(driver.trace_lines())
            seqs = [streams.ex.open_sequence() for _ in range(4)]
            runs = [seq.generate(PROMPT, SamplingParams(max_tokens=steps + 1))
                    for seq in seqs]
            gaps: list[float] = []
            lock = threading.Lock()

            def consume(stream: Stream, gaps=gaps, lock=lock) -> None:
                stamps = [time.perf_counter() for _ in stream]
                with lock:
                    gaps.extend(b - a for a, b in itertools.pairwise(stamps))

            threads = [threading.Thread(target=consume, args=(s,)) for s in runs]
            for t in threads:
                t.start()
            for t in threads:
                t.join(TIMEOUT_S)
            for stream in runs:
                _check(stream, steps)
            for seq in seqs:
                seq.close()
            device, window = _device_busy(driver.trace_lines()[seen:], decode_s)
            busy.append(device / window)
            wall_over_device.append(window / device)
            itl50.append(_pct(gaps, 50))
            itl99.append(_pct(gaps, 99))
            gc.collect()
            d = direct.block(steps)
            direct_busy.append(steps * decode_s / sum(d))
    finally:
        streams.close()
        direct.close()
    med = statistics.median
    return {"busy": med(busy), "busy_min": min(busy), "wall_over_device": med(wall_over_device),
            "itl50": med(itl50), "itl99": med(itl99), "direct_busy": med(direct_busy)}


# ---- one run --------------------------------------------------------------------------------

def one_run(manifest, blocks: int, q: int) -> dict:
    """Both parts once, each with ``1/q`` of the steps; prints the run's tables and returns
    the figures the targets read."""
    figures: dict = {}
    print("\n(a) one stream, time per output token as the consumer sees it; ratios to the "
          "direct path's and to the device time per decode")
    hdr = (f"{'decode':>7} {'steps':>6} | {'direct':>8} {'jobs':>8} {'streams':>8} "
           f"{'jobs/d':>6} {'str/d':>6} {'str/dev':>7} | {'direct':>8} {'jobs':>8} "
           f"{'streams':>8} {'jobs/d':>6} {'str/d':>6} {'str/dev':>7} | {'direct':>6} "
           f"{'jobs':>6} {'streams':>7}")
    print(f"{'':14} | {'P50':^58} | {'P99':^58} | {'P50 µs over device':^21}")
    print(hdr)
    print("-" * len(hdr))
    for decode_s, steps in ((0.010, 200 // q), (0.002, 400 // q)):
        r = bench_one_stream(manifest, decode_s, steps, blocks)
        d, j, s = r["direct"], r["jobs"], r["streams"]
        cells = []
        for k in ("p50", "p99"):
            cells.append(f"{d[k] * 1e3:6.3f}ms {j[k] * 1e3:6.3f}ms {s[k] * 1e3:6.3f}ms "
                         f"{j[k] / d[k]:6.3f} {s[k] / d[k]:6.3f} {s[k] / decode_s:7.3f}")
        over = " ".join(f"{(x['p50'] - decode_s) * 1e6:{w}.0f}"
                        for x, w in ((d, 6), (j, 6), (s, 7)))
        print(f"{decode_s * 1e3:5.0f}ms {steps * blocks:6d} | {cells[0]} | {cells[1]} | "
              f"{over}", flush=True)
        ms = round(decode_s * 1e3)
        for k in ("p50", "p99"):
            figures[f"{k}@{ms}ms"] = s[k] / d[k]
            figures[f"{k}@{ms}ms/device"] = s[k] / decode_s
            figures[f"jobs {k}@{ms}ms"] = j[k] / d[k]
            figures[f"direct {k}@{ms}ms/device"] = d[k] / decode_s
    print("\n(b) four streams at once on one executor (max_inflight 1); direct path one "
          "sequence at a time")
    hdr = (f"{'decode':>7} {'steps':>6} | {'busy':>7} {'(min)':>7} {'wall/dev':>8} "
           f"{'P50/tok':>8} {'P99/tok':>8} {'P50/4dev':>8} | {'direct busy':>11}")
    print(hdr)
    print("-" * len(hdr))
    rounds = max(2, blocks // 2)
    for decode_s, steps in ((0.010, 100 // q), (0.002, 300 // q)):
        r = bench_four_streams(manifest, decode_s, steps, rounds)
        print(f"{decode_s * 1e3:5.0f}ms {4 * steps * rounds:6d} | {r['busy'] * 100:6.2f}% "
              f"{r['busy_min'] * 100:6.2f}% {r['wall_over_device']:8.4f} "
              f"{r['itl50'] * 1e3:6.2f}ms {r['itl99'] * 1e3:6.2f}ms "
              f"{r['itl50'] / (4 * decode_s):8.3f} | {r['direct_busy'] * 100:10.2f}%",
              flush=True)
        ms = round(decode_s * 1e3)
        figures[f"busy@{ms}ms"] = r["busy"]
        figures[f"wall/device@{ms}ms"] = r["wall_over_device"]
    return figures


#: (name, figure, target, True if the figure must be at most the target)
TARGETS = (
    ("one stream @10ms: P50 <= 1.005x direct", "p50@10ms", 1.005, True),
    ("one stream @10ms: P99 <= 1.02x direct", "p99@10ms", 1.02, True),
    ("one stream @2ms: P50 <= 1.03x direct", "p50@2ms", 1.03, True),
    ("four streams @10ms: device busy >= 98%", "busy@10ms", 0.98, False),
)
#: figures shown beside the targets: the physical limit and the per-job path
CONTEXT = (
    ("one stream @10ms P50 / device time", "p50@10ms/device"),
    ("one stream @10ms P99 / device time", "p99@10ms/device"),
    ("one stream @2ms P50 / device time", "p50@2ms/device"),
    ("direct path @10ms P50 / device time", "direct p50@10ms/device"),
    ("direct path @10ms P99 / device time", "direct p99@10ms/device"),
    ("direct path @2ms P50 / device time", "direct p50@2ms/device"),
    ("four streams @10ms wall / device time", "wall/device@10ms"),
    ("per-job path @10ms P50 / direct", "jobs p50@10ms"),
    ("per-job path @10ms P99 / direct", "jobs p99@10ms"),
    ("per-job path @2ms P50 / direct", "jobs p50@2ms"),
)


def _range(values: list[float], percent: bool) -> str:
    fmt = (lambda v: f"{v * 100:.2f}%") if percent else (lambda v: f"{v:.4f}")
    lo, hi = min(values), max(values)
    return fmt(lo) if lo == hi else f"{fmt(lo)}-{fmt(hi)}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--manifest", default="tiny", help="tiny (default) or qwen3-b1")
    ap.add_argument("--blocks", type=int, default=6, help="A/B blocks per latency (even)")
    ap.add_argument("--runs", type=int, default=1, help="whole runs; ranges over them")
    ap.add_argument("--quick", action="store_true", help="a quarter of the steps")
    add_smoke_option(ap, "a few seconds, 2 blocks of a few steps")
    add_load_option(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.blocks, args.runs = 2, 1
    if args.runs < 1 or args.blocks < 1 or args.load < 0:
        ap.error("--runs and --blocks must be >= 1, --load >= 0")
    with cpu_load(args.load):
        return _runs(args)


def _runs(args: argparse.Namespace) -> int:
    manifest = builtin_manifest(args.manifest)
    vocab = manifest.submodel(TaskKind.DECODE).vocab
    print(f"bench_streams: {manifest.name} (V={vocab}), SimDriver real time, "
          f"{args.blocks} interleaved blocks per row, medians over blocks, {args.runs} "
          f"run(s){', smoke' if args.smoke else ', quick' if args.quick else ''}, {args.load} "
          "CPU-bound process(es) "
          f"beside; python {sys.version.split()[0]}")
    runs = []
    for i in range(args.runs):
        if args.runs > 1:
            print(f"\n=== run {i + 1} of {args.runs} ===")
        runs.append(one_run(manifest, args.blocks, 50 if args.smoke else 4 if args.quick else 1))
    print(f"\ntargets{f' (every one of {args.runs} runs must meet it)' if args.runs > 1 else ''}:")
    for name, key, target, at_most in TARGETS:
        values = [r[key] for r in runs]
        met = sum((v <= target) if at_most else (v >= target) for v in values)
        verdict = "PASS" if met == len(values) else "MISS"
        tally = f" ({met}/{len(values)} runs)" if len(values) > 1 else ""
        print(f"  {verdict}  {name}: {_range(values, not at_most)}{tally}")
    print("context:")
    for name, key in CONTEXT:
        print(f"        {name}: {_range([r[key] for r in runs], False)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
