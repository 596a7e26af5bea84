"""What the declared job machine costs per job: the direct table, transitions' own engine,
and doing without either.

Run from the repository root::

    python bench/bench_machines.py            # defaults: --reps 21 --jobs 2000
    python bench/bench_machines.py --smoke   # seconds; its figures mean nothing

It measures, in one run and interleaved (table batch, engine batch, plain batch, table
batch, ...), so that CPU frequency and cache drift hit all sides alike:

* one full job lifecycle -- the six triggers admit, prepare, enqueue, submit, complete,
  succeed from Created to Succeeded -- fired through the shared ``JOB_MACHINE`` with
  :meth:`DeclaredMachine.fire` (the direct table; guard ``deliverable`` included), on a
  fresh model;
* the same lifecycle through :meth:`DeclaredMachine.fire_via_engine`, i.e. transitions'
  own ``Event.trigger`` (what ``fire`` would cost without the table);
* the same six states written by plain attribute assignment on the same kind of model,
  i.e. the floor: no checking, no guards, no listeners;

and prints the median of each in µs per lifecycle and the engine/table and table/plain
ratios of the medians. For context it also prints what ``transitions.Machine.add_model``
costs per model (the per-job alternative calfsm avoids), at two population sizes, because
its ``mod not in self.models`` list scan makes it grow with the number of live models.
GC is paused inside timed batches, as ``timeit`` does.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

try:
    import calfsm  # noqa: F401
except ImportError:  # run as a script from a checkout: make the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runs import add_smoke_option
from transitions import Machine

from calfsm.machines import JOB_MACHINE
from calfsm.machines.job import JobState

LIFECYCLE = ("admit", "prepare", "enqueue", "submit", "complete", "succeed")
STATES = ("Admitted", "Preparing", "Queued", "Submitted", "Completing", "Succeeded")


def fsm_batch(jobs: int, fire: Callable[[SimpleNamespace, str], bool]) -> float:
    """Seconds for ``jobs`` lifecycles fired through ``fire``."""
    gc.disable()
    try:
        t0 = time.perf_counter()
        for _ in range(jobs):
            job = SimpleNamespace(state="Created", cancel_requested=False)
            for trigger in LIFECYCLE:
                fire(job, trigger)
        elapsed = time.perf_counter() - t0
    finally:
        gc.enable()
    assert job.state == "Succeeded"
    return elapsed


def plain_batch(jobs: int) -> float:
    """Seconds for ``jobs`` lifecycles written as plain attribute assignments."""
    a, b, c, d, e, f = STATES
    gc.disable()
    try:
        t0 = time.perf_counter()
        for _ in range(jobs):
            job = SimpleNamespace(state="Created", cancel_requested=False)
            job.state = a
            job.state = b
            job.state = c
            job.state = d
            job.state = e
            job.state = f
        elapsed = time.perf_counter() - t0
    finally:
        gc.enable()
    assert job.state == "Succeeded"
    return elapsed


def add_model_per_model(population: int) -> float:
    """Seconds per ``add_model`` while growing a fresh job machine to ``population``."""
    machine = Machine(model=None, states=[s.value for s in JobState],
                      transitions=[dict(t) for t in JOB_MACHINE.declaration],
                      initial=JobState.CREATED.value, auto_transitions=False,
                      send_event=True)
    models = [SimpleNamespace() for _ in range(population)]
    gc.disable()
    try:
        t0 = time.perf_counter()
        for model in models:
            machine.add_model(model)
        elapsed = time.perf_counter() - t0
    finally:
        gc.enable()
    return elapsed / population


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=21, help="interleaved repetitions")
    parser.add_argument("--jobs", type=int, default=2000, help="lifecycles per batch")
    add_smoke_option(parser, "a second, 1 rep of 50 lifecycles")
    args = parser.parse_args(argv)
    populations = (10, 50) if args.smoke else (100, 2000)
    if args.smoke:
        args.reps, args.jobs = 1, 50

    sides = {"table": JOB_MACHINE.fire, "engine": JOB_MACHINE.fire_via_engine}
    for fire in sides.values():  # warm-up: import-time caches, first-call costs
        fsm_batch(200, fire)
    plain_batch(200)
    us: dict[str, list[float]] = {name: [] for name in (*sides, "plain")}
    for _ in range(args.reps):
        for name, fire in sides.items():
            us[name].append(fsm_batch(args.jobs, fire) / args.jobs * 1e6)
        us["plain"].append(plain_batch(args.jobs) / args.jobs * 1e6)
    med = {name: statistics.median(v) for name, v in us.items()}

    print(f"python {sys.version.split()[0]}, {args.reps} interleaved reps x "
          f"{args.jobs} job lifecycles (6 transitions each), medians:")
    for name, label in (("table", "JOB_MACHINE.fire (table)"),
                        ("engine", "fire_via_engine (transitions)"), ("plain", "plain assignment")):
        print(f"  {label:30} {med[name]:8.2f} us/lifecycle  "
              f"({med[name] / len(LIFECYCLE):.2f} us/transition)")
    for num, den in (("engine", "table"), ("table", "plain")):
        print(f"  ratio {num}/{den:<24} {med[num] / med[den]:8.1f}x   "
              f"(difference {med[num] - med[den]:.2f} us per job)")
    print("context, transitions.Machine.add_model (one model per job, not used by calfsm):")
    for population in populations:
        per = statistics.median(add_model_per_model(population) for _ in range(3))
        print(f"  add_model, {population:5d} models  {per * 1e6:8.2f} us/model")
    return 0


if __name__ == "__main__":
    sys.exit(main())
