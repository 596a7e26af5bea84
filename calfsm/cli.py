"""``calfsm run``: the main job — a seeded workload through the executor, with a summary.

It runs N seeded prompts, each a prefill followed by greedy decode, on several sequences
at once (one request thread per sequence), through a threaded :class:`DeviceExecutor` on
the chosen driver (the simulated device by default). It shows a progress bar (stderr) and
ends with a table (stdout): every prompt and job it tried with its outcome — refusals at
enqueue included — tokens/s, P50/P99 time per token, leased buffers at exit.

Errors go to stderr, one line each; a non-zero exit always prints one. Exit status: 0
the workload ran (individual jobs may have failed under injected faults); 2 bad usage or
bad input (an option, a manifest, a fault plan); 3 the executor ended ``Failed`` or
shutdown could not drain the device — a supervisor should restart the process.
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from calfsm.drivers import Driver, driver_names, load_driver
from calfsm.errors import CalfsmError, InvalidArgument, Unavailable
from calfsm.executor import DeviceExecutor, ExecutorConfig
from calfsm.job import InferenceResult, Request
from calfsm.machines.lifecycle import LifecycleState
from calfsm.manifest import Manifest, TaskKind, builtin_manifest, builtin_manifest_names

if TYPE_CHECKING:
    from calfsm.drivers.faults import FaultPlan
    from calfsm.drivers.sim import LatencyModel

__all__ = ["EXIT_DEVICE_FAILED", "EXIT_OK", "EXIT_USAGE", "build_driver", "main",
           "run_workload"]

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_DEVICE_FAILED = 3

EPILOG = """\
exit status:
  0  the workload ran (jobs may fail under injected faults; the table says how)
  2  bad usage or input: an option, a manifest, a fault plan
  3  the executor ended Failed (no in-process recovery possible), or shutdown could
     not drain a job the device never finished (e.g. an injected hang): a supervisor
     should restart the process
"""

#: ``--latency real:`` parameters: name -> (default, unit in seconds)
_LATENCY_PARAMS = {"decode_ms": (10.0, 1e-3), "prefill_token_us": (50.0, 1e-6)}
#: options that take a count of at least one
_COUNTS = ("prompts", "sequences", "tokens", "max_prompt", "max_inflight")

log = logging.getLogger("calfsm.cli")
T = TypeVar("T")


def _manifest(spec: str) -> Manifest:
    """A built-in name always means the built-in manifest; anything else is a file."""
    if spec in builtin_manifest_names():
        return builtin_manifest(spec)
    if not Path(spec).is_file():
        raise InvalidArgument(f"not a built-in manifest ({', '.join(builtin_manifest_names())})"
                              " and not a file", stage="cli")
    return Manifest.load(spec)


def _faults(spec: str, seed: int, sequences: int) -> FaultPlan:
    """``swarm`` draws a seeded plan aimed at the workload's sequences (the executor's own
    warm-up golden is a health check, not workload); a file is used exactly as written."""
    from calfsm.drivers.faults import FaultPlan
    if spec == "none":
        return FaultPlan.none()
    if spec == "swarm":
        return FaultPlan.swarm(seed).targeting(range(sequences), seed)
    return FaultPlan.load(spec)


def _latency(spec: str) -> LatencyModel | None:
    """``virtual`` (None: the driver's own clock), ``real`` or
    ``real:decode_ms=10,prefill_token_us=50`` (a fixed model on the wall clock)."""
    from calfsm.drivers.sim import LatencyModel
    if spec == "virtual":
        return None
    kind, _, args = spec.partition(":")
    if kind != "real":
        raise InvalidArgument("must be 'virtual' or 'real[:decode_ms=N,prefill_token_us=N]'",
                              stage="cli")
    seconds = {k: default * unit for k, (default, unit) in _LATENCY_PARAMS.items()}
    for part in filter(None, args.split(",")):
        key, _, text = (s.strip() for s in part.partition("="))
        if key not in _LATENCY_PARAMS:
            raise InvalidArgument(f"unknown parameter {key!r} (have "
                                  f"{', '.join(_LATENCY_PARAMS)})", stage="cli")
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0:
            raise InvalidArgument(f"{key} must be a finite number >= 0, got {text!r}",
                                  stage="cli")
        seconds[key] = value * _LATENCY_PARAMS[key][1]
    return LatencyModel.fixed(decode_s=seconds["decode_ms"],
                              prefill_per_token_s=seconds["prefill_token_us"])


def build_driver(name: str, manifest: Manifest, *, faults: Any, seed: int,
                 latency: str) -> Driver:
    """The driver registered as ``name``, with the workload's fault plan and seed; a
    ``real`` latency runs it on the wall clock."""
    from calfsm.clock import RealClock
    model = _latency(latency)
    kw: dict[str, Any] = {"seed": seed, "faults": faults, "trace": False}
    if model is not None:
        kw |= {"latency": model, "clock": RealClock()}
    return load_driver(name, manifest_or_calbin=manifest, **kw)


class _Tally:
    """What the sequence threads record, under one lock: every job and prompt tried."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.per_token_s: list[float] = []
        self.jobs = 0                               # enqueue calls
        self.refused: Counter[str] = Counter()      # category -> jobs refused at enqueue
        self.completed = 0                          # prompts that ran all their tokens
        self.failed: Counter[str] = Counter()       # category -> prompts an error ended

    def run(self, ex: DeviceExecutor, request: Request) -> InferenceResult:
        """Enqueue one job and wait for its result; a refusal at enqueue is counted."""
        with self.lock:
            self.jobs += 1
        try:
            handle = ex.enqueue(request)
        except CalfsmError as e:
            with self.lock:
                self.refused[e.category.value] += 1
            raise
        return handle.result()

    def token(self, seconds: float) -> None:
        with self.lock:
            self.per_token_s.append(seconds)

    def prompt_ended(self, error: CalfsmError | None) -> None:
        with self.lock:
            if error is None:
                self.completed += 1
            else:
                self.failed[error.category.value] += 1


def run_workload(ex: DeviceExecutor, *, prompts: int, sequences: int, tokens: int,
                 seed: int, max_prompt: int, progress: Any = None) -> dict[str, Any]:
    """Run the workload; return the numbers of the summary table: ``jobs`` enqueued,
    ``refused`` (category -> jobs refused at enqueue), ``prompts_completed``, ``errors``
    (category -> prompts an error ended), ``tokens``, ``wall_s``, ``tokens_per_s``,
    ``p50_ms`` and ``p99_ms`` per token."""
    vocab = ex.epoch.model.submodel(TaskKind.DECODE).vocab
    rng = random.Random(seed)
    work = [[rng.randrange(vocab) for _ in range(rng.randint(1, max_prompt))]
            for _ in range(prompts)]
    tally = _Tally()
    queue = list(work)

    def next_prompt() -> list[int] | None:
        with tally.lock:
            return queue.pop(0) if queue else None

    def sequence_worker(seq: int) -> None:
        while (prompt := next_prompt()) is not None:
            _one_prompt(ex, seq, prompt, tokens, tally, progress)

    threads = [threading.Thread(target=sequence_worker, args=(s,), name=f"seq-{s}")
               for s in range(sequences)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    generated = len(tally.per_token_s)
    ptt = np.array(tally.per_token_s) * 1e3 if generated else np.zeros(1)
    return {"jobs": tally.jobs, "refused": dict(tally.refused),
            "prompts_completed": tally.completed, "errors": dict(tally.failed),
            "tokens": generated, "wall_s": wall,
            "tokens_per_s": generated / wall if wall > 0 else 0.0,
            "p50_ms": float(np.percentile(ptt, 50)), "p99_ms": float(np.percentile(ptt, 99))}


def _one_prompt(ex: DeviceExecutor, seq: int, prompt: list[int], n_tokens: int,
                tally: _Tally, progress: Any) -> None:
    error: CalfsmError | None = None
    try:
        r = tally.run(ex, Request.prefill(seq, prompt))
        token, pos = r.greedy(), len(prompt)
        for _ in range(n_tokens):
            r = tally.run(ex, Request.decode(seq, token, pos))
            tally.token(r.timings.total_ms / 1e3)
            token, pos = r.greedy(), pos + 1
    except CalfsmError as e:
        error = e
        if isinstance(e, Unavailable) and ex.lifecycle_state != LifecycleState.FAILED:
            # back off as the error asks before this sequence takes its next prompt
            time.sleep(min(e.retry_after_s or 0.01, 0.05))
    finally:
        tally.prompt_ended(error)
        try:
            if ex.lifecycle_state == LifecycleState.READY:
                ex.reset_sequence(seq)
        except CalfsmError as e:   # the sequence may be busy in a recovery race
            log.debug("reset_sequence(%s): %s", seq, e)
        if progress is not None:
            progress()


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The epilog kept as written; an option's default after its help (not for flags)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not any(action.default is v for v in (None, False, argparse.SUPPRESS)):
            text += " (default: %(default)s)"
        return text


_DESCRIPTION = """\
Run seeded prompts (a prefill, then greedy decodes) on several sequences through the
executor; print progress and errors on stderr, the summary table on stdout."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="calfsm", description=_DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the seeded workload through the executor",
                         description=_DESCRIPTION, epilog=EPILOG,
                         formatter_class=_HelpFormatter)
    builtins = ", ".join(builtin_manifest_names())
    run.add_argument("--driver", default="sim", choices=driver_names(),
                     help="a registered device driver: sim (simulated) or calrt (the C "
                          "ABI through cffi: CALFSM_CALRT_LIB names a vendor shim, else "
                          "the native emulator)")
    run.add_argument("--manifest", default="qwen3-b1", metavar="NAME|PATH",
                     help=f"a built-in name ({builtins}) always means the built-in "
                          "manifest; anything else is a .json or .toml file (write "
                          "./tiny for a file named tiny)")
    run.add_argument("--faults", default="none", metavar="none|swarm|PLAN.json",
                     help="none, swarm (a random plan drawn from --seed) or a fault plan "
                          "JSON file")
    run.add_argument("--seed", type=int, default=0, metavar="N",
                     help="seeds the prompts, the swarm fault plan and the driver")
    run.add_argument("--latency", default="virtual",
                     metavar="virtual|real[:decode_ms=N,prefill_token_us=N]",
                     help="virtual: the driver's own clock (the sim's is virtual and "
                          "never sleeps); real: a fixed latency on the wall clock, each "
                          "value a finite number >= 0 (decode_ms=10, "
                          "prefill_token_us=50 unless given)")
    run.add_argument("--prompts", type=int, default=16, metavar="N",
                     help="prompts to run, each a prefill then --tokens greedy decodes")
    run.add_argument("--sequences", type=int, default=4, metavar="N",
                     help="sequences running prompts at once (one request thread each)")
    run.add_argument("--tokens", type=int, default=16, metavar="N",
                     help="greedy tokens decoded per prompt")
    run.add_argument("--max-prompt", type=int, default=64, metavar="N",
                     help="longest prompt in tokens (lengths are drawn from 1..N)")
    run.add_argument("--max-inflight", type=int, default=1, metavar="N",
                     help="jobs the executor may keep on the device at once")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def _check_counts(args: argparse.Namespace) -> None:
    for name in _COUNTS:
        value = getattr(args, name)
        if value < 1:
            raise InvalidArgument(f"--{name.replace('_', '-')}: must be an integer >= 1, "
                                  f"got {value}", stage="cli")


def _option(option: str, value: str, load: Callable[[str], T]) -> T:
    """``load(value)``, its error prefixed with the option and value it came from."""
    try:
        return load(value)
    except CalfsmError as e:
        raise InvalidArgument(f"{option} {value}: {e.message}", stage="cli") from e


def _error(message: str) -> None:
    print(f"calfsm: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """``calfsm run [options]``; returns the exit status (``--help``: 0)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:              # --help, or argparse's own usage error
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    try:
        _check_counts(args)
        _option("--latency", args.latency, _latency)
        manifest = _option("--manifest", args.manifest, _manifest)
        faults = _option("--faults", args.faults,
                         lambda spec: _faults(spec, args.seed, args.sequences))
        driver = build_driver(args.driver, manifest, faults=faults, seed=args.seed,
                              latency=args.latency)
    except CalfsmError as e:
        _error(f"error: {e.message}")
        return EXIT_USAGE
    except OSError as e:
        _error(f"error: {e}")
        return EXIT_USAGE
    return _run(args, driver, manifest)


def _run(args: argparse.Namespace, driver: Any, manifest: Manifest) -> int:
    from rich.console import Console
    from rich.progress import Progress

    try:
        ex = DeviceExecutor(driver, manifest, ExecutorConfig(max_inflight=args.max_inflight))
    except CalfsmError as e:
        _error(f"start-up failed: {e}")
        return EXIT_DEVICE_FAILED
    shutdown_error = None
    with Progress(console=Console(stderr=True), disable=args.quiet, transient=True) as bar:
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
    console = Console()
    console.print(_table(args, driver, manifest, summary, ex, final_state))
    # the verdict ends the summary (stdout) and is the error line (stderr)
    if shutdown_error is not None:
        console.print(f"[red]shutdown:[/red] {shutdown_error}")
        _error(f"shutdown: {shutdown_error}")
    if final_state == LifecycleState.FAILED:
        console.print(f"[red]executor failed:[/red] {reason}")
        _error(f"executor failed: {reason}")
        return EXIT_DEVICE_FAILED
    if shutdown_error is not None:      # the device kept a job (and its buffers): wedged
        return EXIT_DEVICE_FAILED
    return EXIT_OK


def _by_category(counts: dict[str, int]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) or "none"


def _table(args: argparse.Namespace, driver: Any, manifest: Manifest,
           summary: dict[str, Any], ex: DeviceExecutor, final_state: str) -> Any:
    from rich.table import Table

    stats = ex.stats()
    table = Table(title=f"calfsm run — {args.driver} driver, {manifest.name or 'manifest'}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    failed = sum(summary["errors"].values())
    table.add_row("prompts completed / failed", f"{summary['prompts_completed']} / {failed}")
    table.add_row("prompt failures by category", _by_category(summary["errors"]))
    table.add_row("jobs enqueued", str(summary["jobs"]))
    table.add_row("jobs refused at enqueue", _by_category(summary["refused"]))
    table.add_row("succeeded / failed / cancelled / quarantined",
                  f"{stats.succeeded} / {stats.failed} / {stats.cancelled} / "
                  f"{stats.quarantined}")
    table.add_row("errors by category", _by_category(stats.errors_by_category))
    table.add_row("tokens generated", str(summary["tokens"]))
    clock = "virtual device time" if driver.clock.virtual else "wall time"
    table.add_row("tokens/s (wall time)", f"{summary['tokens_per_s']:.1f}")
    table.add_row(f"P50 time per token ({clock})", f"{summary['p50_ms']:.3f} ms")
    table.add_row(f"P99 time per token ({clock})", f"{summary['p99_ms']:.3f} ms")
    table.add_row("recoveries / stale completions",
                  f"{stats.recoveries} / {stats.stale_completions}")
    table.add_row("generation", str(stats.generation))
    table.add_row("leased buffers at exit", str(stats.leased))
    table.add_row("lifecycle at end of workload", final_state)
    return table


if __name__ == "__main__":
    sys.exit(main())
