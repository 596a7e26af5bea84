"""Admission under a queue of 1000 jobs: wake only the head vs wake every waiter.

Run from the repository root::

    python bench/bench_admission.py             # 3 runs of each column, ~3 minutes
    python bench/bench_admission.py --runs 1    # ~1 minute
    python bench/bench_admission.py --before REV --jobs 500 --device-ms 1.0

``--jobs`` threads (1000) each block in admission the way the executor's callers do
(``KvCoordinator.reserve``, then ``BufferPool.acquire_wait``, then ``load``) and hand the
job to one device thread, which drives a ``SimDriver`` in real time with a fixed device
time per job (``--device-ms``, 0.8 ms: 0.8 s of device time for 1000 jobs). The device
thread keeps one job queued behind the running one, and after each ``wait`` completes
the job as the executor does (undo slices, KV commit, return the lease), which admits
the next waiter. Two scenarios, each behind a small capacity (``--capacity``, 2 jobs):

- ``kv``: the KV token budget admits ``capacity`` jobs; the pool has room for more.
- ``buffers``: KV admits everyone at once; the pool has ``capacity`` slots.

The clock starts when all jobs are asleep in the queue (the capacity was held until
then) and stops when the device thread finished the last one; each run starts after a
garbage collection and one second of settling. Figures per run:

- ``wall/device``: wall time over the device time (jobs x device time); target <= 1.5x.
- ``wake/job``: waiter wake-ups (KV + pool) per job, i.e. per grant of the contended
  resource; target <= ~3.
- ``CPU/job``: process CPU time per job (includes the sim's real-time wait, which spins
  its last 0.5 ms in both columns alike).

Columns, interleaved run by run so drift hits both alike: ``before`` is ``calfsm/kv.py``
and ``calfsm/buffers.py`` of ``--before`` (default: the last commit that woke every
waiter) loaded from git into private modules, ``after`` is the working tree. The before
code has no wake-up counter: its one shared condition is replaced by a counting
subclass (in this benchmark only); the after code is counted by its public
``stats().wakeups``. Each figure is the median over the runs, with the range.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from calfsm import buffers as after_buffers  # noqa: E402
from calfsm import kv as after_kv  # noqa: E402
from calfsm.clock import RealClock  # noqa: E402
from calfsm.drivers.sim import LatencyModel, SimDriver  # noqa: E402
from calfsm.errors import check  # noqa: E402
from calfsm.manifest import TaskKind, builtin_manifest  # noqa: E402

#: the last commit whose admission woke every waiter (notify_all in kv.py, buffers.py)
HERD_REV = "a93951f"
KIND = TaskKind.PREFILL_IDS
DEADLINE_S = 600.0


class CountingCondition(threading.Condition):
    """A Condition that counts returns from ``wait`` (the before column only)."""

    def __init__(self, lock: Any) -> None:
        super().__init__(lock)
        self.wakeups = 0

    def wait(self, timeout: float | None = None) -> bool:
        woke = super().wait(timeout)
        self.wakeups += 1        # the lock is held again here
        return woke


def load_before(rev: str) -> tuple[ModuleType, ModuleType]:
    """kv.py and buffers.py of ``rev`` as private modules (they import the rest of
    calfsm from the working tree, as they did then)."""
    mods = []
    with tempfile.TemporaryDirectory(prefix="bench_admission_") as tmp:
        for name in ("kv", "buffers"):
            src = subprocess.run(["git", "-C", str(ROOT), "show",
                                  f"{rev}:calfsm/{name}.py"],
                                 check=True, capture_output=True, text=True).stdout
            path = Path(tmp) / f"before_{name}.py"
            path.write_text(src)
            spec = importlib.util.spec_from_file_location(f"_before_{name}", path)
            assert spec is not None and spec.loader is not None
            mod = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = mod
            spec.loader.exec_module(mod)
            mods.append(mod)
    return mods[0], mods[1]


class Column:
    """One implementation of admission: its modules and how to read its counters."""

    def __init__(self, name: str, kv_mod: ModuleType, buf_mod: ModuleType,
                 counted: bool) -> None:
        self.name, self.kv_mod, self.buf_mod, self.counted = name, kv_mod, buf_mod, counted

    def make(self, driver: SimDriver, models: dict[TaskKind, Any], *, kv_budget: int,
             slots: int) -> tuple[Any, Any]:
        kv = self.kv_mod.KvCoordinator(driver, max_seq=64, token_budget=kv_budget,
                                       clock=RealClock())
        pool = self.buf_mod.BufferPool.build(driver, 0, models, slots_per_engine=slots)
        if not self.counted:
            kv._cond = CountingCondition(kv._lock)
            pool._cond = CountingCondition(pool._lock)
        return kv, pool

    def wakeups(self, kv: Any, pool: Any) -> int:
        if self.counted:
            return kv.stats().wakeups + pool.stats().wakeups
        return kv._cond.wakeups + pool._cond.wakeups

    def waiting(self, kv: Any, pool: Any) -> int:
        if self.counted:
            return kv.stats().waiting + pool.stats().waiting
        return kv.stats().waiting + sum(map(len, pool._waiting.values()))


def make_driver(manifest: Any, device_s: float) -> tuple[SimDriver, dict[TaskKind, Any]]:
    """A real-time SimDriver, configured, whose 1-token prefill takes ``device_s``."""
    driver = SimDriver(manifest, clock=RealClock(), trace=False, kv_capacity=1 << 20,
                       latency=LatencyModel.fixed(decode_s=0.0, prefill_per_token_s=device_s))
    check(driver.configure(driver.calbin), "configure")
    contract = manifest.submodel(KIND)
    code, model = driver.model(contract.exact_name)
    check(code, "model")
    return driver, {KIND: (model, contract)}


def run_once(col: Column, scenario: str, manifest: Any, jobs: int, capacity: int,
             device_s: float) -> dict[str, float]:
    # the previous run's threads and frames are not on this run's bill: collect them
    # and let the kernel tear their stacks down first
    gc.collect()
    time.sleep(1.0)
    driver, models = make_driver(manifest, device_s)
    model = models[KIND][0]
    if scenario == "kv":
        kv, pool = col.make(driver, models, kv_budget=capacity, slots=2 * capacity)
    else:
        kv, pool = col.make(driver, models, kv_budget=jobs + capacity, slots=capacity)
    # hold the capacity until every job is asleep in the queue
    if scenario == "kv":
        held_kv = [kv.try_reserve(jobs + i, 0, 1) for i in range(capacity)]
        held_slots = []
    else:
        held_kv = []
        held_slots = [pool.acquire(KIND) for _ in range(capacity)]
    ready: queue.SimpleQueue = queue.SimpleQueue()
    errors: list[BaseException] = []

    def job(seq: int) -> None:
        try:
            deadline = time.monotonic() + DEADLINE_S
            r = kv.reserve(seq, 0, 1, deadline, job_id=seq)
            lease = pool.acquire_wait(KIND, deadline).bind(job_id=seq, seq_id=seq)
            lease.load(seq, [1 + seq % 1000], [0])
            ready.put((r, lease))
        except BaseException as e:  # reported after the run
            errors.append(e)
            ready.put(None)

    def start(item: tuple[Any, Any]) -> None:
        r, lease = item
        check(driver.infer(model, lease.slot.inp, lease.slot.out), "infer")
        lease.mark_on_device()
        kv.mark_submitted(r)

    def complete(item: tuple[Any, Any]) -> None:
        r, lease = item
        lease.mark_off_device()
        lease.undo_slices()
        kv.commit(r)
        pool.release(lease)

    threads = [threading.Thread(target=job, args=(i,), daemon=True) for i in range(jobs)]
    for t in threads:
        t.start()
    limit = time.monotonic() + 120
    while col.waiting(kv, pool) < jobs:
        if errors or time.monotonic() > limit:
            raise RuntimeError(f"jobs never queued: {errors[:1]}")
        time.sleep(0.005)
    wake0 = col.wakeups(kv, pool)
    cpu0, t0 = time.process_time(), time.perf_counter()
    for r in held_kv:
        kv.rollback(r)
    for lease in held_slots:
        pool.release(lease)
    running = None
    for _ in range(jobs):
        if running is None:
            running = ready.get()
            if running is None:
                break
            start(running)
        check(driver.wait(running[1].slot.out, 10.0), "wait")
        finished, running = running, None
        try:
            running = ready.get_nowait()   # keep the device busy: next job first
        except queue.Empty:
            pass
        if running is not None:
            start(running)
        complete(finished)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    for t in threads:
        t.join(10)
    if errors:
        raise RuntimeError(f"{len(errors)} job(s) failed, first: {errors[0]}")
    s = kv.stats()
    assert s.committed == jobs and s.open == 0 and pool.stats().leased == 0, (s, pool)
    return {"ratio": wall / (jobs * device_s), "wake": (col.wakeups(kv, pool) - wake0) / jobs,
            "cpu_ms": cpu / jobs * 1e3, "wall": wall}


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
    ap.add_argument("--before", default=HERD_REV, help="git revision of the before column")
    ap.add_argument("--manifest", default="tiny")
    args = ap.parse_args(argv)
    if args.jobs < 1 or args.capacity < 1 or args.runs < 1 or not args.device_ms > 0:
        ap.error("--jobs, --capacity, --runs and --device-ms must be positive")
    manifest = builtin_manifest(args.manifest)
    device_s = args.device_ms / 1e3
    before_kv, before_buf = load_before(args.before)
    columns = [Column(f"before ({args.before})", before_kv, before_buf, counted=False),
               Column("after (working tree)", after_kv, after_buffers, counted=True)]
    print(f"{args.jobs} jobs x {args.device_ms} ms device time "
          f"({args.jobs * device_s:.2f} s), capacity {args.capacity} jobs, "
          f"{args.runs} run(s) per column; median (range); "
          f"load average {os.getloadavg()[0]:.1f} at the start")
    ok = True
    for scenario in ("kv", "buffers"):
        results: dict[str, list[dict[str, float]]] = {c.name: [] for c in columns}
        for i in range(args.runs):
            order = columns if i % 2 == 0 else columns[::-1]
            for col in order:
                results[col.name].append(run_once(col, scenario, manifest, args.jobs,
                                                  args.capacity, device_s))
        print(f"\nscenario {scenario!r} (jobs wait in "
              f"{'KvCoordinator.reserve' if scenario == 'kv' else 'BufferPool.acquire_wait'})")
        print(f"  {'':24s} {'wall/device':>22s} {'wake/job':>24s} {'CPU/job':>26s}")
        for col in columns:
            rs = results[col.name]
            print(f"  {col.name:24s} {_fmt([r['ratio'] for r in rs], 'x', 2):>22s} "
                  f"{_fmt([r['wake'] for r in rs], '', 1):>24s} "
                  f"{_fmt([r['cpu_ms'] for r in rs], ' ms', 2):>26s}")
        after = results[columns[1].name]
        ratio = max(r["ratio"] for r in after)
        wake = max(r["wake"] for r in after)
        met = ratio <= 1.5 and wake <= 3.0
        ok = ok and met
        print(f"  after, worst run: {ratio:.2f}x device time (target <= 1.5x), "
              f"{wake:.2f} wake-ups per job (target <= ~3): {'met' if met else 'NOT MET'}")
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end (other work on the machine "
          "shows in the wall ratio)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
