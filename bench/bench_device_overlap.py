"""What two jobs in flight on Ping and Pong can gain on the phased device, driver level.

Run from the repository root::

    python bench/bench_device_overlap.py                  # both drivers, 3 runs each
    python bench/bench_device_overlap.py --share 0.3 --decode-ms 10 --jobs 200 --runs 3
    python bench/bench_device_overlap.py --smoke   # seconds; its figures mean nothing

Two sequences decode on the real-time device (``LatencyModel.fixed(decode_s,
transfer_share)``), side by side in one run:

- ``one in flight``: the jobs of both sequences one after the other (serial mode);
- ``ping/pong``: sequence 0 on PING, sequence 1 on PONG, parallel mode; each sequence
  resubmits as soon as its own job finished, so two are in flight most of the time.

Reports aggregate jobs/s of each, their ratio, the ideal pipeline bound
``1 / max(share, 1 - share)`` (one job per compute or per pair of transfers, whichever is
longer) and the overlap the device timeline shows. This is the device's ceiling for the
executor's ping/pong, not the executor's figure (no host work between jobs here).
"""

from __future__ import annotations

import argparse
import time

from runs import add_smoke_option

from calfsm.clock import RealClock
from calfsm.drivers.base import EngineSlot, JobTag
from calfsm.drivers.calrt import CalrtDriver
from calfsm.drivers.sim import LatencyModel, SimDriver
from calfsm.drivers.timeline import Phase, overlap_s
from calfsm.manifest import TaskKind
from calfsm.testing.conformance.util import prepare, setup, small_calbin

CB = small_calbin(vocab=1024, max_seq=4096)


def _driver(name: str, lat: LatencyModel, jobs: int = 0):
    kw = {"latency": lat, "timeline_jobs": jobs}     # the whole run in the timeline
    return SimDriver(clock=RealClock(), **kw) if name == "sim" else CalrtDriver(**kw)


def one_in_flight(name: str, lat: LatencyModel, jobs: int) -> float:
    with _driver(name, lat) as d:
        d.configure(CB)
        bufs = [setup(d, CB, TaskKind.DECODE) for _ in range(2)]
        t0 = time.monotonic()
        for k in range(jobs):
            seq = k % 2
            b = bufs[seq]
            prepare(d, b, seq, [k % 1000], k // 2)
            assert d.infer(b.model, b.inp, b.out) == 0
            assert d.wait(b.out, 10.0) == 0
        return jobs / (time.monotonic() - t0)


def ping_pong(name: str, lat: LatencyModel, jobs: int) -> tuple[float, float]:
    """(jobs/s, seconds of transfers hidden behind the other engine's compute)."""
    with _driver(name, lat, jobs) as d:
        d.configure(CB)
        assert d.enable_parallel_mode(True) == 0
        engines = (EngineSlot.PING, EngineSlot.PONG)
        bufs = [setup(d, CB, TaskKind.DECODE, engine=e) for e in engines]
        pos = [0, 0]

        def submit(seq: int, k: int) -> None:
            b = bufs[seq]
            prepare(d, b, seq, [k % 1000], pos[seq])
            pos[seq] += 1
            assert d.infer_fixed(b.model, b.inp, b.out, engines[seq], tag=JobTag(k, seq)) == 0

        t0 = time.monotonic()
        submit(0, 0)
        submit(1, 1)
        done = 0
        k = 2
        while done < jobs:
            seq = done % 2              # jobs finish in submission order
            assert d.wait(bufs[seq].out, 10.0) == 0
            done += 1
            if k < jobs:
                submit(seq, k)
                k += 1
        rate = jobs / (time.monotonic() - t0)
        spans = d.timeline() or []      # a job's own transfers never meet its compute
        hidden = overlap_s([s for s in spans if s.phase.on_dma],
                           [s for s in spans if s.phase is Phase.COMPUTE])
        return rate, hidden


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--share", type=float, default=0.3)
    ap.add_argument("--decode-ms", type=float, default=10.0)
    ap.add_argument("--jobs", type=int, default=200)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--driver", choices=("sim", "calrt", "both"), default="both")
    add_smoke_option(ap, "a second or two, one run of 10 jobs at 2 ms on both drivers")
    args = ap.parse_args()
    if args.smoke:
        args.jobs, args.runs, args.decode_ms, args.driver = 10, 1, 2.0, "both"
    lat = LatencyModel.fixed(decode_s=args.decode_ms / 1e3, transfer_share=args.share)
    bound = 1 / max(args.share, 1 - args.share)
    ideal_one = 1e3 / args.decode_ms
    print(f"decode {args.decode_ms} ms, transfer share {args.share}, {args.jobs} jobs; ideal: "
          f"one in flight {ideal_one:.1f} jobs/s, ping/pong {ideal_one * bound:.1f} jobs/s "
          f"(pipeline bound {bound:.3f}x)")
    for name in (("sim", "calrt") if args.driver == "both" else (args.driver,)):
        ratios = []
        for run in range(args.runs):
            one = one_in_flight(name, lat, args.jobs)
            two, hidden = ping_pong(name, lat, args.jobs)
            ratios.append(two / one)
            print(f"  {name} run {run + 1}: one in flight {one:6.1f} jobs/s "
                  f"({one / ideal_one:.1%} of ideal), ping/pong {two:6.1f} jobs/s "
                  f"({two / ideal_one / bound:.1%} of ideal), ratio {two / one:.3f}, "
                  f"transfers hidden behind compute {hidden * 1e3:.0f} ms")
        print(f"  {name}: ratio {min(ratios):.3f}-{max(ratios):.3f} over {args.runs} runs")


if __name__ == "__main__":
    main()
