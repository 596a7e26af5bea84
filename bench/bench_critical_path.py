"""The host's share of a stream's token on the critical path: from the moment the
driver's ``wait`` returns for step N to the moment ``infer`` is called for step N+1,
for one stream on the executor and for the direct synchronous loop, on SimDriver in
real time (10 ms a decode). This is the time the device idles between two tokens.

Run from the repository root::

    python bench/bench_critical_path.py            # 3 runs of 150 tokens, ~15 s
    python bench/bench_critical_path.py --load 2   # the same beside two busy processes
    python bench/bench_critical_path.py --hops     # and the stream's path hop by hop
    python bench/bench_critical_path.py --smoke   # seconds; its figures mean nothing

Each run prints the P50 and P90 of that gap for both paths, side by side. On the 2-core
VM of 2026-12-02 (quiet, three runs) the stream's gap was 168-241 us at P50 against the
direct loop's 24-101 us (the machine was noisy: the same direct loop moved 4x between
runs), and 158-179 us against 22-24 us beside two busy processes. ``--hops`` split the
stream's (quiet; loaded in brackets) into reading and checking the output: the device
lock, status, output size, undoing the input slices and BF16 -> FP32 into the row, 45
(58) us; sampling, 7 (7) us; the stream's decision and the core running the prepared
step: recording the token, booking the step on the sequence, checking and writing its
token, its chained KV reservation (two device calls) and queueing it, 58 (66) us; and
the OS waking the submitter thread, 26 (77) us, which only the submitter may cross (spec
6.4).

Each run also prints the process's CPU time per token on both paths (every thread's;
the simulated device's polling at the end of each ``wait`` is in both). It moves far
less with the machine's load than the gaps do. On the same VM: stream 781-889 us
against direct 250-292 us quiet, 448-687 us against 202-208 us loaded. Most of the
stream's extra CPU is off the critical path (preparing the next step ahead, waking the
consumer, the job's callbacks), but it is what bounds how many streams two cores serve.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from runs import add_smoke_option

from calfsm.clock import RealClock
from calfsm.drivers.sim import LatencyModel, SimDriver
from calfsm.executor import DeviceExecutor, ExecutorConfig
from calfsm.generate.sampling import SamplingParams
from calfsm.manifest import builtin_manifest
from calfsm.tools.direct import DirectRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpuload import add_load_option, cpu_load

MANIFEST = builtin_manifest("tiny")
PROMPT = [1, 2, 3]


class GapProbe:
    """Proxy driver that stamps each ``wait`` return and each ``infer`` call."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.events: list[tuple[str, float]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def wait(self, out: Any, timeout_s: float) -> int:
        rc = self._inner.wait(out, timeout_s)
        self.events.append(("wait", time.perf_counter()))
        return rc

    def infer(self, *a: Any, **kw: Any) -> int:
        self.events.append(("infer", time.perf_counter()))
        return self._inner.infer(*a, **kw)

    def infer_fixed(self, *a: Any, **kw: Any) -> int:
        self.events.append(("infer", time.perf_counter()))
        return self._inner.infer_fixed(*a, **kw)

    def gaps_us(self, skip: int = 5) -> list[float]:
        """wait-return -> next infer, per token (the first ``skip`` left out: warm-up)."""
        gaps = [(b[1] - a[1]) * 1e6 for a, b in zip(self.events, self.events[1:])
                if a[0] == "wait" and b[0] == "infer"]
        return gaps[skip:]


class Hops:
    """Stamps the points of the stream's token path between ``wait`` and the next
    ``infer`` into a probe's events (``--hops``): the output checked (BF16 -> FP32 row),
    the token sampled, the next step queued for the submitter. Installed by wrapping
    the three functions, in this benchmark only."""

    POINTS = ("wait", "checked", "sampled", "queued", "infer")

    def __init__(self, probe: GapProbe) -> None:
        import calfsm.engine.completion as completion
        from calfsm.engine.submission import Submission
        from calfsm.generate.sampling import Sampler

        self._undo: list[tuple[Any, str, Any]] = []
        for owner, name, label in ((completion, "check_output", "checked"),
                                   (Sampler, "sample", "sampled"),
                                   (Submission, "queue", "queued")):
            self._wrap(owner, name, label, probe.events)

    def _wrap(self, owner: Any, name: str, label: str, events: list) -> None:
        real = getattr(owner, name)
        before = label == "queued"          # queue hands off: stamp on the way in

        def stamped(*a: Any, **kw: Any) -> Any:
            if before:
                events.append((label, time.perf_counter()))
                return real(*a, **kw)
            out = real(*a, **kw)
            events.append((label, time.perf_counter()))
            return out

        setattr(owner, name, stamped)
        self._undo.append((owner, name, real))

    def remove(self) -> None:
        for owner, name, real in reversed(self._undo):
            setattr(owner, name, real)

    @staticmethod
    def split_us(events: list[tuple[str, float]], skip: int = 5) -> dict[str, float]:
        """Median microseconds of each hop, over the tokens whose whole path was seen
        in order (wait, checked, sampled, queued, infer)."""
        hops: dict[str, list[float]] = {}
        seen: dict[str, float] = {}
        n = 0
        for label, t in events:
            if label == "wait":
                seen = {"wait": t}
            elif seen and label not in seen:
                seen[label] = t
                if label == "infer":
                    if all(p in seen for p in Hops.POINTS):
                        n += 1
                        if n > skip:
                            for a, b in zip(Hops.POINTS, Hops.POINTS[1:]):
                                hops.setdefault(f"{a} -> {b}", []).append(
                                    (seen[b] - seen[a]) * 1e6)
                    seen = {}
        return {k: statistics.median(v) for k, v in hops.items()}


def _driver(decode_s: float) -> GapProbe:
    return GapProbe(SimDriver(MANIFEST, clock=RealClock(),
                              latency=LatencyModel.fixed(decode_s=decode_s)))


class CpuPerToken:
    """The process's CPU time over a generation, per token (``time.process_time``: every
    thread's, the simulated device's polling included on both paths). Unlike the gaps,
    which are wall time, it barely moves with what else runs on the machine."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.us = 0.0

    def __enter__(self) -> CpuPerToken:
        self._t0 = time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.us = (time.process_time() - self._t0) * 1e6 / self.tokens


def stream_gaps(tokens: int, decode_s: float, hops: dict[str, float] | None = None,
                cpu: CpuPerToken | None = None) -> list[float]:
    """The stream's gaps; with ``hops`` (a dict) also the median of each hop, filled in
    (a separate run: the stamps cost a little themselves); with ``cpu``, its CPU time."""
    drv = _driver(decode_s)
    with DeviceExecutor(drv, MANIFEST, ExecutorConfig()) as ex:
        probe = Hops(drv) if hops is not None else None
        try:
            drv.events.clear()
            with cpu or CpuPerToken(tokens):
                list(ex.generate(PROMPT, SamplingParams(max_tokens=tokens)))
        finally:
            if probe is not None:
                probe.remove()
    if hops is not None:
        hops.update(Hops.split_us(drv.events))
        return []
    return drv.gaps_us()


def direct_gaps(tokens: int, decode_s: float, cpu: CpuPerToken | None = None
                ) -> list[float]:
    drv = _driver(decode_s)
    runner = DirectRunner(drv, MANIFEST)
    drv.events.clear()
    with cpu or CpuPerToken(tokens):
        runner.generate(0, PROMPT, tokens)
    return drv.gaps_us()


def _pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=150)
    ap.add_argument("--decode-ms", type=float, default=10.0)
    ap.add_argument("--hops", action="store_true",
                    help="after the runs, one more stream run with the path split hop by "
                         "hop (output check, sampling, queueing, the submitter's wake-up)")
    add_smoke_option(ap, "a second or two, one run of 10 tokens with --hops")
    add_load_option(ap)
    args = ap.parse_args()
    if args.smoke:
        args.runs, args.tokens, args.hops = 1, 10, True
    with cpu_load(args.load):
        return _runs(args)


def _runs(args: argparse.Namespace) -> int:
    print(f"{args.load} CPU-bound process(es) beside the benchmark")
    for r in range(args.runs):
        sc, dc = CpuPerToken(args.tokens), CpuPerToken(args.tokens)
        s = stream_gaps(args.tokens, args.decode_ms * 1e-3, cpu=sc)
        d = direct_gaps(args.tokens, args.decode_ms * 1e-3, cpu=dc)
        print(f"run {r + 1}: wait -> next infer, stream P50 {statistics.median(s):.0f} us "
              f"P90 {_pct(s, 0.9):.0f} us; direct P50 {statistics.median(d):.0f} us "
              f"P90 {_pct(d, 0.9):.0f} us; stream - direct at P50 "
              f"{statistics.median(s) - statistics.median(d):.0f} us; CPU per token, "
              f"stream {sc.us:.0f} us, direct {dc.us:.0f} us")
    if args.hops:
        hops: dict[str, float] = {}
        stream_gaps(args.tokens, args.decode_ms * 1e-3, hops)
        print("stream's path hop by hop, median us (a separate run with stamps): "
              + "; ".join(f"{k} {v:.0f}" for k, v in hops.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
