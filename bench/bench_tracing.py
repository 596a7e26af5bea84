"""What OpenTelemetry tracing costs: tokens per CPU-second of generation streams with
tracing off, disabled and at 100% sampling, side by side.

Run from the repository root (needs ``pip install -e ".[tracing]"``)::

    python bench/bench_tracing.py            # three runs, ~1 min
    python bench/bench_tracing.py --smoke    # seconds; its figures mean nothing

Step-mode executors (no threads, zero device latency, the virtual clock) on SimDriver,
so every token costs only the executor's CPU: the worst case for an observer, whose
cost a real device's milliseconds a step would hide. Each executor has the server's
:class:`~calfsm.telemetry.metrics.ExecutorMetrics` attached (``calfsm serve`` always
has), and one of:

``off``        no tracer (the default; the baseline)
``off-b``      the same again: the noise floor of the comparison
``disabled``   a tracer whose sampler records nothing (``OTEL_TRACES_SAMPLER=always_off``):
               the observer runs and drops each request at its start
``sampled``    every request traced (100%), its spans through the SDK's
               ``BatchSpanProcessor`` to an exporter that drops them (the export
               thread's CPU counts: process CPU time)

They run interleaved in ABCD/DCBA blocks, each block ``--streams`` greedy streams of
``--tokens`` tokens, four at a time; a run's figure for a variant is the median over the
blocks of its tokens per CPU-second against ``off``'s in the same block (a change in %),
and the share of its CPU spent in the tracer (its observer events, spans included, timed
with the thread's CPU clock, plus every other thread's CPU: the span processor's): the
cost measured directly, which a loaded machine's noise (``off-b``) does not blur.
Three runs, each printed, then the median and range.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runs import add_smoke_option, print_summary, repeat

from calfsm.drivers.sim import LatencyModel, SimDriver
from calfsm.executor import DeviceExecutor, ExecutorConfig
from calfsm.generate.sampling import SamplingParams
from calfsm.manifest import builtin_manifest
from calfsm.runtime.stepper import StepScheduler
from calfsm.telemetry.metrics import ExecutorMetrics
from calfsm.telemetry.tracing import RequestTracer

try:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON
except ImportError:
    sys.exit("bench_tracing needs the tracing extra: pip install -e '.[tracing]'")

PROMPT = [11, 22, 33, 44, 55, 66, 77, 88]
VARIANTS = ("off", "off-b", "disabled", "sampled")
TIMER_NS = 0.0          # set by main: one timed event's own cost


class Dropped(SpanExporter):
    """An exporter that takes every batch and keeps nothing (counts the spans)."""

    def __init__(self) -> None:
        self.spans = 0

    def export(self, spans) -> SpanExportResult:
        self.spans += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


class TimedTracer(RequestTracer):
    """The tracer, with the CPU time spent in its events (every span it starts and
    ends included) added up: the cost it adds to the executor's threads, measured
    directly (the executor is single-threaded in step mode)."""

    cpu_ns = 0
    events = 0

    def _timed(name: str):          # a decorator factory, used in the class body
        base = getattr(RequestTracer, name)

        def event(self, *args):
            t0 = time.thread_time_ns()
            try:
                base(self, *args)
            finally:
                self.cpu_ns += time.thread_time_ns() - t0
                self.events += 1
        event.__name__ = name
        return event

    stream_started = _timed("stream_started")
    _job_ended = _timed("_job_ended")
    stream_resumed = _timed("stream_resumed")
    stream_ended = _timed("stream_ended")
    request_rejected = _timed("request_rejected")
    _device_step = _timed("_device_step")
    del _timed


def _timer_ns(n: int = 20000) -> float:
    """What timing one event costs by itself (two clock reads, the call): subtracted."""
    class Idle:
        cpu_ns = events = 0

        def nothing(self) -> None:
            t0 = time.thread_time_ns()
            try:
                pass
            finally:
                self.cpu_ns += time.thread_time_ns() - t0
                self.events += 1
    idle = Idle()
    for _ in range(n):
        idle.nothing()
    return idle.cpu_ns / n


def make(manifest, variant: str, *, timed: bool = False
         ) -> tuple[DeviceExecutor, TracerProvider | None]:
    """An executor as served (metrics attached), with ``variant``'s tracer: given to the
    executor (``DeviceExecutor(tracer=)``), or ``timed``, a :class:`TimedTracer`
    attached as an embedder attaches one."""
    provider = tracer = None
    if variant in ("disabled", "sampled"):
        provider = TracerProvider(sampler=ALWAYS_ON if variant == "sampled" else ALWAYS_OFF)
        provider.add_span_processor(BatchSpanProcessor(Dropped()))
        tracer = provider.get_tracer("bench")
    ex = DeviceExecutor(SimDriver(manifest, trace=False, latency=LatencyModel.zero()),
                        manifest, ExecutorConfig(threaded=False, max_sequences=8),
                        tracer=None if timed else tracer)
    ExecutorMetrics(ex)
    if timed:
        ex.traced = TimedTracer(ex, tracer)
    return ex, provider


def tokens_per_cpu_s(ex: DeviceExecutor, streams: int, tokens: int
                     ) -> tuple[float, float]:
    """Tokens per process CPU-second of ``streams`` greedy streams, four at a time; and
    the share of that CPU that was the tracer's (its events, and any thread but this
    one: the span processor's)."""
    sched = StepScheduler(ex)
    made = 0
    traced = getattr(ex, "traced", None)
    ns0, ev0 = (traced.cpu_ns, traced.events) if traced is not None else (0, 0)
    t0, own0 = time.process_time(), time.thread_time()
    for _ in range(0, streams, 4):
        group = [ex.generate(PROMPT, SamplingParams(max_tokens=tokens)) for _ in range(4)]
        sched.run_until(lambda g=group: all(s.done() for s in g) and ex.idle())
        made += sum(len(s.result(0).tokens) for s in group)
    cpu = time.process_time() - t0
    others = max(0.0, cpu - (time.thread_time() - own0))
    tracer = 0.0
    if traced is not None:      # less what the timing itself cost
        tracer = max(0.0, traced.cpu_ns - ns0 - (traced.events - ev0) * TIMER_NS) * 1e-9
    return made / cpu, (tracer + others) / cpu


def one_run(manifest, blocks: int, streams: int, tokens: int) -> dict[str, float]:
    built = {v: make(manifest, v) for v in VARIANTS}
    timed = {v: make(manifest, v, timed=True) for v in ("disabled", "sampled")}
    try:
        for ex, _ in (*built.values(), *timed.values()):       # warm
            tokens_per_cpu_s(ex, 4, tokens)
        rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for b in range(blocks):
            for v in VARIANTS if b % 2 == 0 else VARIANTS[::-1]:
                rates[v].append(tokens_per_cpu_s(built[v][0], streams, tokens)[0])
        # each block's variants ran next to each other: compare within the block
        ratios = {v: [x / o for x, o in zip(rates[v], rates["off"])] for v in VARIANTS}
        # the tracer's own CPU, timed (the timing's own cost kept out of the above)
        spent = {v: [tokens_per_cpu_s(ex, streams, tokens)[1]
                     for _ in range(max(1, blocks // 2))] for v, (ex, _) in timed.items()}
    finally:
        for ex, provider in (*built.values(), *timed.values()):
            ex.close()
            if provider is not None:
                provider.shutdown()
    out = {"off tokens/cpu-s": statistics.median(rates["off"])}
    for v in VARIANTS[1:]:
        out[f"{v} change %"] = (statistics.median(ratios[v]) - 1) * 100
    for v, shares in spent.items():
        out[f"{v} tracer's CPU %"] = statistics.median(shares) * 100
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--manifest", default="tiny")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--blocks", type=int, default=10, help="interleaved blocks (even)")
    ap.add_argument("--streams", type=int, default=16, help="streams a block (x4)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens a stream")
    add_smoke_option(ap, "a second or two: 1 run, 2 blocks of 4 streams of 8 tokens")
    args = ap.parse_args(argv)
    if args.smoke:
        args.runs, args.blocks, args.streams, args.tokens = 1, 2, 4, 8
    manifest = builtin_manifest(args.manifest)
    global TIMER_NS
    TIMER_NS = _timer_ns()
    print(f"bench_tracing: {manifest.name}, step mode, zero latency, metrics attached, "
          f"{args.streams} streams of {args.tokens} tokens a block, {args.blocks} "
          f"interleaved blocks a run (timing an event costs {TIMER_NS:.0f} ns, "
          f"subtracted); python {sys.version.split()[0]}", flush=True)
    runs = repeat(args.runs, lambda i: one_run(manifest, args.blocks, args.streams,
                                                args.tokens))
    print(f"over {args.runs} runs (a change % is tokens per CPU-second against off; "
          "targets: disabled >= -0.5, sampled >= -2):")
    print_summary(runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
