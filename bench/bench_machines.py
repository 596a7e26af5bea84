"""What the declared job machine costs per job, next to doing without it.

Run from the repository root::

    python bench/bench_machines.py            # defaults: --reps 21 --jobs 2000

It measures, in one run and interleaved (FSM batch, plain batch, FSM batch, ...), so that
CPU frequency and cache drift hit both sides alike:

* one full job lifecycle — the six triggers admit, prepare, enqueue, submit, complete,
  succeed from Created to Succeeded — fired through the shared ``JOB_MACHINE`` with
  :meth:`DeclaredMachine.fire` (guard ``deliverable`` included), on a fresh model;
* the same six states written by plain attribute assignment on the same kind of model,
  i.e. the floor: no checking, no guards, no listeners;

and prints the median of each in µs per lifecycle and their ratio. For context it also
prints what ``transitions.Machine.add_model`` costs per model (the per-job alternative
calfsm avoids), at two population sizes, because its ``mod not in self.models`` list
scan makes it grow with the number of live models. GC is paused inside timed batches,
as ``timeit`` does.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

try:
    import calfsm  # noqa: F401
except ImportError:  # run as a script from a checkout: make the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transitions import Machine

from calfsm.machines import JOB_MACHINE
from calfsm.machines.job import JobState

LIFECYCLE = ("admit", "prepare", "enqueue", "submit", "complete", "succeed")
STATES = ("Admitted", "Preparing", "Queued", "Submitted", "Completing", "Succeeded")


def fsm_batch(jobs: int) -> float:
    """Seconds for ``jobs`` lifecycles through the shared job machine."""
    fire = JOB_MACHINE.fire
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
    args = parser.parse_args(argv)

    fsm_batch(200)  # warm-up: import-time caches, first-call costs
    plain_batch(200)
    fsm_us: list[float] = []
    plain_us: list[float] = []
    for _ in range(args.reps):
        fsm_us.append(fsm_batch(args.jobs) / args.jobs * 1e6)
        plain_us.append(plain_batch(args.jobs) / args.jobs * 1e6)
    fsm, plain = statistics.median(fsm_us), statistics.median(plain_us)

    print(f"python {sys.version.split()[0]}, {args.reps} interleaved reps x "
          f"{args.jobs} job lifecycles (6 transitions each), medians:")
    print(f"  JOB_MACHINE.fire        {fsm:8.2f} us/lifecycle  "
          f"({fsm / len(LIFECYCLE):.2f} us/trigger)")
    print(f"  plain assignment        {plain:8.2f} us/lifecycle")
    print(f"  ratio fire/plain        {fsm / plain:8.1f}x   "
          f"(overhead {fsm - plain:.2f} us per job)")
    print("context, transitions.Machine.add_model (one model per job, not used by calfsm):")
    for population in (100, 2000):
        per = statistics.median(add_model_per_model(population) for _ in range(3))
        print(f"  add_model, {population:5d} models  {per * 1e6:8.2f} us/model")
    return 0


if __name__ == "__main__":
    sys.exit(main())
