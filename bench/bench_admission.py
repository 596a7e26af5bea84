"""The one admission queue under 1000 blocked callers: device use, admission steps and CPU.

Run from the repository root::

    python bench/bench_admission.py             # 3 runs of each scenario, ~1 minute
    python bench/bench_admission.py --runs 1 --jobs 500 --device-ms 1.0
    python bench/bench_admission.py --smoke   # seconds; its figures mean nothing

``--jobs`` threads (1000) each call the threaded ``DeviceExecutor.enqueue`` with a
one-token prefill of its own sequence and then wait for the result, the way a
thread-per-request server does. Behind a small capacity (``--capacity``, 2 jobs) all but
a few must wait: since issue 21 they wait in the executor's one admission queue (the KV
books and the pool grant now or refuse, and never sleep), each caller blocked on its own
job. The device is a real-time ``SimDriver`` with a fixed device time per job
(``--device-ms``, 0.8 ms: 0.8 s of device time for 1000 jobs). Two scenarios:

- ``kv``: the KV token budget admits ``capacity`` jobs at once; the pool has room.
- ``buffers``: KV admits everyone; the pool has ``capacity`` prefill slots.

The device is held (its ``wait`` gated) until every caller is in the queue; the clock
starts when it opens and stops when the last result is in. Each run starts after a
garbage collection and a second of settling. Figures per run:

- ``wall/device``: wall time over the device time (jobs x device time); target <= 1.5x.
- ``steps/job``: admission steps (``Admission.admit_parked`` calls, counted by wrapping
  it in this benchmark only) per admitted job; 1.0 is one try per grant, and a herd
  would be ~jobs; target <= ~3.
- ``CPU/job``: process CPU time per job (includes the sim's real-time wait, which spins
  its last 0.5 ms).

Each figure is the median over the runs, with the range.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from runs import add_smoke_option  # noqa: E402

from calfsm.clock import RealClock  # noqa: E402
from calfsm.drivers.sim import LatencyModel, SimDriver  # noqa: E402
from calfsm.engine.admission import Admission  # noqa: E402
from calfsm.engine.epoch import WARMUP_SEQ  # noqa: E402
from calfsm.executor import DeviceExecutor, ExecutorConfig  # noqa: E402
from calfsm.manifest import builtin_manifest  # noqa: E402
from calfsm.request import Request  # noqa: E402

TIMEOUT_S = 600.0
#: the pause before each run, for the machine to settle (none in --smoke)
SETTLE_S = [1.0]


class HeldDevice:
    """A driver whose ``wait`` blocks until :attr:`gate` opens (only the benchmark's
    jobs: the warm-up runs before the gate closes)."""

    def __init__(self, inner: SimDriver) -> None:
        self._inner = inner
        self.gate = threading.Event()
        self.gate.set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def wait(self, out: Any, timeout_s: float) -> int:
        self.gate.wait(TIMEOUT_S)
        return self._inner.wait(out, timeout_s)


class CountedSteps:
    """Counts ``Admission.admit_parked`` calls while installed."""

    def __init__(self) -> None:
        self.calls = 0
        self._real = Admission.admit_parked

    def __enter__(self) -> CountedSteps:
        real, me = self._real, self

        def counted(admission: Admission) -> bool:
            me.calls += 1
            return real(admission)

        Admission.admit_parked = counted          # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        Admission.admit_parked = self._real       # type: ignore[method-assign]


def run_once(scenario: str, manifest: Any, jobs: int, capacity: int,
             device_s: float) -> dict[str, float]:
    gc.collect()
    time.sleep(SETTLE_S[0])
    sim = SimDriver(manifest, clock=RealClock(), trace=False, kv_capacity=1 << 20,
                    latency=LatencyModel.fixed(decode_s=0.0, prefill_per_token_s=device_s))
    device = HeldDevice(sim)
    cfg = ExecutorConfig(threaded=True, admission_timeout_s=TIMEOUT_S,
                         queue_timeout_s=TIMEOUT_S, default_deadline_s=TIMEOUT_S,
                         admission_estimate=False,
                         token_budget=capacity if scenario == "kv" else 4 * jobs,
                         slots_per_engine=2 * capacity if scenario == "kv" else capacity)
    ex = DeviceExecutor(device, manifest, cfg)
    errors: list[BaseException] = []
    done = threading.Semaphore(0)

    def caller(seq: int) -> None:
        try:
            ex.enqueue(Request.prefill(seq, [1 + seq % 1000])).result(TIMEOUT_S)
        except BaseException as e:      # reported after the run
            errors.append(e)
        done.release()

    try:
        device.gate.clear()
        threads = [threading.Thread(target=caller, args=(i,), daemon=True)
                   for i in range(jobs)]
        base = ex.stats()
        with CountedSteps() as steps:
            for t in threads:
                t.start()
            limit = time.monotonic() + 120
            while ex.stats().accepted < base.accepted + jobs:
                if errors or time.monotonic() > limit:
                    raise RuntimeError(f"callers never queued: {errors[:1]}")
                time.sleep(0.005)
            steps0 = steps.calls
            cpu0, t0 = time.process_time(), time.perf_counter()
            device.gate.set()
            for _ in range(jobs):
                if not done.acquire(timeout=TIMEOUT_S):
                    raise RuntimeError("a caller never finished")
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            n_steps = steps.calls - steps0
        for t in threads:
            t.join(10)
        if errors:
            raise RuntimeError(f"{len(errors)} job(s) failed, first: {errors[0]}")
        s = ex.stats()
        assert s.succeeded == base.succeeded + jobs and s.admitting == 0 \
            and s.leased == 0, s
    finally:
        device.gate.set()
        ex.close()
    return {"ratio": wall / (jobs * device_s), "steps": n_steps / jobs,
            "cpu_ms": cpu / jobs * 1e3}


def _fmt(xs: list[float], unit: str, digits: int) -> str:
    med = statistics.median(xs)
    if len(xs) == 1:
        return f"{med:.{digits}f}{unit}"
    return f"{med:.{digits}f}{unit} ({min(xs):.{digits}f}-{max(xs):.{digits}f})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--device-ms", type=float, default=0.8, help="device time per job")
    ap.add_argument("--capacity", type=int, default=2, help="jobs admitted at once")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--manifest", default="tiny")
    add_smoke_option(ap, "a few seconds, one run of 20 jobs, no target judged")
    args = ap.parse_args(argv)
    if args.smoke:
        args.jobs, args.runs, SETTLE_S[0] = 20, 1, 0.0
    if args.jobs < 1 or args.capacity < 1 or args.runs < 1 or not args.device_ms > 0:
        ap.error("--jobs, --capacity, --runs and --device-ms must be positive")
    manifest = builtin_manifest(args.manifest)
    if args.jobs >= WARMUP_SEQ:
        ap.error(f"--jobs must stay below {WARMUP_SEQ} (the warm-up's sequence id)")
    device_s = args.device_ms / 1e3
    print(f"{args.jobs} blocked callers x {args.device_ms} ms device time "
          f"({args.jobs * device_s:.2f} s), capacity {args.capacity} jobs, "
          f"{args.runs} run(s); median (range); "
          f"load average {os.getloadavg()[0]:.1f} at the start")
    ok = True
    for scenario in ("kv", "buffers"):
        rs = [run_once(scenario, manifest, args.jobs, args.capacity, device_s)
              for _ in range(args.runs)]
        ratio = max(r["ratio"] for r in rs)
        steps = max(r["steps"] for r in rs)
        met = ratio <= 1.5 and steps <= 3.0
        ok = ok and met
        print(f"\nscenario {scenario!r}: wall/device {_fmt([r['ratio'] for r in rs], 'x', 2)}"
              f", steps/job {_fmt([r['steps'] for r in rs], '', 2)}"
              f", CPU/job {_fmt([r['cpu_ms'] for r in rs], ' ms', 2)}")
        print(f"  worst run: {ratio:.2f}x device time (target <= 1.5x), {steps:.2f} "
              f"admission steps per job (target <= ~3): {'met' if met else 'NOT MET'}")
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end (other work on the machine "
          "shows in the wall ratio)")
    return 0 if ok or args.smoke else 1


if __name__ == "__main__":
    raise SystemExit(main())
