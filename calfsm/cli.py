"""``calfsm run``: the main job — a seeded workload through the executor, with a summary.

It runs N seeded prompts, each a prefill followed by greedy decode, on several sequences
at once (one request thread per sequence), through a threaded :class:`DeviceExecutor` on
the chosen driver (the simulated device by default). It shows a progress bar and ends
with a table: jobs, tokens/s, P50/P99 time per token, errors by category, leased buffers
at exit.

Exit status: 0 the workload ran (individual jobs may have failed under injected faults);
2 bad usage or bad input files; 3 the executor ended ``Failed`` — the device could not be
recovered in-process, so a supervisor should restart the process.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from calfsm.errors import CalfsmError, Unavailable
from calfsm.executor import DeviceExecutor, ExecutorConfig
from calfsm.job import Request
from calfsm.machines.lifecycle import LifecycleState
from calfsm.manifest import Manifest, TaskKind, builtin_manifest

__all__ = ["EXIT_DEVICE_FAILED", "main", "run_workload"]

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_DEVICE_FAILED = 3

log = logging.getLogger("calfsm.cli")


def _manifest(spec: str) -> Manifest:
    path = Path(spec)
    if path.suffix in (".json", ".toml") or path.exists():
        return Manifest.load(path)
    return builtin_manifest(spec)


def _faults(spec: str, seed: int, sequences: int):
    """``swarm`` draws a seeded plan aimed at the workload's sequences (the executor's own
    warm-up golden is a health check, not workload); a file is used exactly as written."""
    from calfsm.drivers.faults import FaultPlan
    if spec == "none":
        return FaultPlan.none()
    if spec == "swarm":
        return FaultPlan.swarm(seed).targeting(range(sequences), seed)
    return FaultPlan.load(spec)


def _latency(spec: str):
    """``virtual`` (default), ``real`` or ``real:decode_ms=10,prefill_token_us=50``."""
    from calfsm.drivers.sim import LatencyModel
    if spec == "virtual":
        return None, False
    kind, _, args = spec.partition(":")
    if kind != "real":
        raise ValueError(f"--latency must be 'virtual' or 'real[:k=v,...]', got {spec!r}")
    kw: dict[str, float] = {}
    for part in filter(None, args.split(",")):
        k, _, v = part.partition("=")
        kw[k.strip()] = float(v)
    decode_s = kw.pop("decode_ms", 10.0) / 1e3
    prefill_s = kw.pop("prefill_token_us", 50.0) / 1e6
    if kw:
        raise ValueError(f"unknown latency parameters {sorted(kw)}")
    return LatencyModel.fixed(decode_s=decode_s, prefill_per_token_s=prefill_s), True


def build_driver(name: str, manifest: Manifest, *, faults: Any, seed: int,
                 latency: str) -> Any:
    from calfsm.clock import RealClock
    model, real = _latency(latency)
    if name == "sim":
        from calfsm.drivers.sim import SimDriver
        kw: dict[str, Any] = {"seed": seed, "faults": faults, "trace": False}
        if model is not None:
            kw["latency"] = model
        if real:
            kw["clock"] = RealClock()
        return SimDriver(manifest, **kw)
    if name == "calrt":
        from calfsm.drivers.calrt import CalrtDriver
        return CalrtDriver(manifest, faults=faults)
    raise ValueError(f"unknown driver {name!r} (sim or calrt)")


def run_workload(ex: DeviceExecutor, *, prompts: int, sequences: int, tokens: int,
                 seed: int, max_prompt: int, progress: Any = None) -> dict[str, Any]:
    """Run the workload; return the numbers of the summary table."""
    vocab = ex.epoch.model.submodel(TaskKind.DECODE).vocab
    rng = random.Random(seed)
    work = [[rng.randrange(vocab) for _ in range(rng.randint(1, max_prompt))]
            for _ in range(prompts)]
    per_token_s: list[float] = []
    errors: Counter[str] = Counter()
    generated = [0]
    lock = threading.Lock()
    queue = list(enumerate(work))

    def next_prompt():
        with lock:
            return queue.pop(0) if queue else None

    def sequence_worker(seq: int) -> None:
        while (item := next_prompt()) is not None:
            _, prompt = item
            _one_prompt(ex, seq, prompt, tokens, per_token_s, errors, generated, lock,
                        progress)

    threads = [threading.Thread(target=sequence_worker, args=(s,), name=f"seq-{s}")
               for s in range(sequences)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ptt = np.array(per_token_s) * 1e3 if per_token_s else np.zeros(1)
    return {"jobs": ex.stats().accepted, "tokens": generated[0], "wall_s": wall,
            "tokens_per_s": generated[0] / wall if wall > 0 else 0.0,
            "p50_ms": float(np.percentile(ptt, 50)), "p99_ms": float(np.percentile(ptt, 99)),
            "errors": dict(errors)}


def _one_prompt(ex: DeviceExecutor, seq: int, prompt: list[int], n_tokens: int,
                per_token_s: list[float], errors: Counter, generated: list[int],
                lock: threading.Lock, progress: Any) -> None:
    try:
        r = ex.enqueue(Request.prefill(seq, prompt)).result()
        token, pos = r.greedy(), len(prompt)
        for _ in range(n_tokens):
            r = ex.enqueue(Request.decode(seq, token, pos)).result()
            with lock:
                per_token_s.append(r.timings.total_ms / 1e3)
                generated[0] += 1
            token, pos = r.greedy(), pos + 1
    except CalfsmError as e:
        with lock:
            errors[e.category.value] += 1
        if isinstance(e, Unavailable) and ex.lifecycle_state != LifecycleState.FAILED:
            # back off as the error asks before this sequence takes its next prompt
            time.sleep(min(e.retry_after_s or 0.01, 0.05))
    finally:
        try:
            if ex.lifecycle_state == LifecycleState.READY:
                ex.reset_sequence(seq)
        except CalfsmError as e:   # the sequence may be busy in a recovery race
            log.debug("reset_sequence(%s): %s", seq, e)
        if progress is not None:
            progress()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="calfsm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the seeded workload through the executor")
    run.add_argument("--driver", default="sim", choices=("sim", "calrt"))
    run.add_argument("--manifest", default="qwen3-b1",
                     help="built-in name (qwen3-b1, tiny) or a .json/.toml path")
    run.add_argument("--faults", default="none",
                     help="none, swarm (seeded by --seed) or a fault plan JSON file")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--latency", default="virtual",
                     help="virtual, or real[:decode_ms=10,prefill_token_us=50]")
    run.add_argument("--prompts", type=int, default=16)
    run.add_argument("--sequences", type=int, default=4)
    run.add_argument("--tokens", type=int, default=16, help="greedy tokens per prompt")
    run.add_argument("--max-prompt", type=int, default=64)
    run.add_argument("--max-inflight", type=int, default=1)
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    try:
        manifest = _manifest(args.manifest)
        faults = _faults(args.faults, args.seed, args.sequences)
        driver = build_driver(args.driver, manifest, faults=faults, seed=args.seed,
                              latency=args.latency)
        for name in ("prompts", "sequences", "tokens", "max_prompt"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    except (CalfsmError, ValueError, OSError) as e:
        print(f"calfsm: {e}", file=sys.stderr)
        return EXIT_USAGE
    return _run(args, driver, manifest)


def _run(args: argparse.Namespace, driver: Any, manifest: Manifest) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    console = Console(stderr=False)
    config = ExecutorConfig(max_inflight=args.max_inflight)
    try:
        ex = DeviceExecutor(driver, manifest, config)
    except CalfsmError as e:
        console.print(f"[red]start-up failed:[/red] {e}")
        return EXIT_DEVICE_FAILED
    leased_at_exit = None
    shutdown_error = None
    with Progress(console=console, disable=args.quiet, transient=True) as bar:
        task = bar.add_task("prompts", total=args.prompts)
        try:
            summary = run_workload(ex, prompts=args.prompts, sequences=args.sequences,
                                   tokens=args.tokens, seed=args.seed,
                                   max_prompt=args.max_prompt,
                                   progress=lambda: bar.advance(task))
        finally:
            final_state, reason = ex.lifecycle_state, ex.failure_reason
            try:
                ex.close()
            except CalfsmError as e:
                shutdown_error = e
            leased_at_exit = ex.stats().leased
    stats = ex.stats()
    table = Table(title=f"calfsm run — {args.driver} driver, {manifest.name or 'manifest'}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("jobs", str(summary["jobs"]))
    table.add_row("succeeded / failed / cancelled / quarantined",
                  f"{stats.succeeded} / {stats.failed} / {stats.cancelled} / "
                  f"{stats.quarantined}")
    table.add_row("tokens generated", str(summary["tokens"]))
    clock = "virtual device time" if driver.clock.virtual else "wall time"
    table.add_row("tokens/s (wall time)", f"{summary['tokens_per_s']:.1f}")
    table.add_row(f"P50 time per token ({clock})", f"{summary['p50_ms']:.3f} ms")
    table.add_row(f"P99 time per token ({clock})", f"{summary['p99_ms']:.3f} ms")
    errs = ", ".join(f"{k}: {v}" for k, v in sorted(stats.errors_by_category.items()))
    table.add_row("errors by category", errs or "none")
    table.add_row("recoveries / stale completions",
                  f"{stats.recoveries} / {stats.stale_completions}")
    table.add_row("generation", str(stats.generation))
    table.add_row("leased buffers at exit", str(leased_at_exit))
    table.add_row("lifecycle at end of workload", final_state)
    console.print(table)
    if shutdown_error is not None:
        console.print(f"[red]shutdown:[/red] {shutdown_error}")
    if final_state == LifecycleState.FAILED:
        console.print(f"[red]executor failed:[/red] {reason}")
        return EXIT_DEVICE_FAILED
    if shutdown_error is not None:      # the device kept a job (and its buffers): wedged
        return EXIT_DEVICE_FAILED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
