"""``calfsm run``: the main job — a seeded workload through the executor, with a summary.

It runs N seeded prompts, each a prefill followed by decodes (greedy, or sampled with a
seed per prompt), on several sequences at once, through a :class:`DeviceExecutor` on the
chosen driver (the simulated device by default). On a virtual clock (the default) the
executor runs in step mode and the sequences take turns on one thread, interleaved by a
:class:`~calfsm.runtime.stepper.StepScheduler` seeded from ``--seed``: a seed is a run, the
same table every time, faults included. In real time (``--latency real``, a vendor
device) the executor is threaded and each sequence has a request thread of its own.
On the ``streams`` path (the default) each prompt is a
:class:`~calfsm.generate.stream.Stream` on a sequence of its own: the library samples each token
and enqueues the next step; the ``jobs`` path is the hand-written loop of one enqueue and
result per step, sampled and stopped alike, to compare with. It shows a progress bar
(stderr) and ends with a table (stdout): every prompt and job it tried with its outcome —
refusals at enqueue included — jobs in flight asked and run (and why not, when fewer),
tokens/s, P50/P99 time to first token, time per output token (between a prompt's tokens)
and decode job time, each on the driver's clock, leased buffers at exit.

Errors go to stderr, one line each; a non-zero exit always prints one. Exit status: 0
the workload ran (individual jobs may have failed under injected faults); 2 bad usage or
bad input (an option, a manifest, a fault plan); 3 the executor ended ``Failed`` or
shutdown could not drain the device — a supervisor should restart the process.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import random
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Generator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
import numpy as np

from calfsm.drivers import Driver, driver_names, load_driver
from calfsm.engine.job import Request
from calfsm.engine.observe import DeviceStep, JobAccepted, Observer
from calfsm.errors import CalfsmError, InvalidArgument, Unavailable
from calfsm.executor import DeviceExecutor, ExecutorConfig
from calfsm.generate.sampling import SamplingParams
from calfsm.machines.lifecycle import LifecycleState
from calfsm.manifest import (
    Manifest,
    SubmodelContract,
    TaskKind,
    builtin_manifest_names,
    manifest_from_option,
)
from calfsm.runtime.stepper import StepScheduler
from calfsm.serve import cli as serve_cli
from calfsm.tools import capabilities_cli, soak

if TYPE_CHECKING:
    from calfsm.drivers.faults import FaultPlan
    from calfsm.drivers.sim import LatencyModel

__all__ = ["EXIT_DEVICE_FAILED", "EXIT_OK", "EXIT_USAGE", "PATHS", "JobCounts",
           "build_driver", "main", "prompt_params", "run_workload"]

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
#: the workload's paths: a stream per prompt, or the hand-written loop of jobs
PATHS = ("streams", "jobs")
#: options that take a count of at least one
_COUNTS = ("prompts", "sequences", "tokens", "max_prompt", "max_inflight")

log = logging.getLogger("calfsm.cli")
T = TypeVar("T")



def _manifest(spec: str) -> Manifest:
    return manifest_from_option(spec, option=None)


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
    ``real:decode_ms=10,prefill_token_us=50,transfer_share=0.3`` (a fixed model on the
    wall clock; a static calbin's, ``shape_cost=graph``, unless ``shape_cost=rows``)."""
    from calfsm.drivers.sim import LatencyModel
    if spec == "virtual":
        return None
    kind, _, args = spec.partition(":")
    if kind != "real":
        raise InvalidArgument("must be 'virtual' or 'real[:decode_ms=N,prefill_token_us=N,"
                              "transfer_share=F,batch_row_share=F,context_token_ns=N,"
                              "shape_cost=graph|rows]'", stage="cli")
    return LatencyModel.fixed(decode_s=0.010, prefill_per_token_s=50e-6,
                              shape_cost="graph").with_params(args, stage="cli")


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


class JobCounts(Observer):
    """Counts every job tried, and the refusals at enqueue by category, so the summary
    accounts for every job: an observer of the executor, not a kind of it. A job
    accepted is a ``job_accepted`` event (``enqueue``, ``enqueue_nowait``, a sequence's
    or a stream's step, and a stream's step prepared ahead once it is released to run; a
    step prepared ahead and discarded never ran, and is not a job here); a refusal is a
    ``job_refused`` event, wherever the job was tried. A job tried is one accepted or
    refused."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.jobs_enqueued = 0
        self.jobs_refused: Counter[str] = Counter()     # category -> jobs refused
        self.decode_steps = self.decode_rows = 0        # batch graph decode jobs, rows

    def job_accepted(self, event: JobAccepted) -> None:
        with self._lock:
            self.jobs_enqueued += 1

    def job_refused(self, error: CalfsmError, request: Any) -> None:
        with self._lock:
            self.jobs_enqueued += 1
            self.jobs_refused[error.category.value] += 1

    def device_step(self, step: DeviceStep) -> None:
        if step.kind is TaskKind.DECODE:
            with self._lock:
                self.decode_steps += 1
                self.decode_rows += step.rows

    def enqueue_counts(self) -> tuple[int, dict[str, int]]:
        """(jobs enqueued, category -> jobs refused at enqueue), a snapshot."""
        with self._lock:
            return self.jobs_enqueued, dict(self.jobs_refused)


class _Tally:
    """What the sequence threads record, under one lock: every prompt's outcome, tokens
    and timings."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.job_s: list[float] = []                # decode jobs: accepted -> completed
        self.ttft_s: list[float] = []               # prompt start -> its first token
        self.itl_s: list[float] = []                # between a prompt's tokens
        self.outputs: dict[int, tuple[int, ...]] = {}
        self.completed = 0                          # prompts that ran all their tokens
        self.failed: Counter[str] = Counter()       # category -> prompts an error ended

    def decode_job(self, seconds: float) -> None:
        with self.lock:
            self.job_s.append(seconds)

    def prompt_ended(self, index: int, tokens: Sequence[int], ttft_s: float | None,
                     itl_s: Sequence[float], error: CalfsmError | None) -> None:
        with self.lock:
            self.outputs[index] = tuple(tokens)
            if ttft_s is not None:
                self.ttft_s.append(ttft_s)
            self.itl_s.extend(itl_s)
            if error is None:
                self.completed += 1
            else:
                self.failed[error.category.value] += 1


def _percentiles_ms(samples: list[float]) -> tuple[float | None, float | None]:
    if not samples:
        return None, None
    ms = np.asarray(samples) * 1e3
    return float(np.percentile(ms, 50)), float(np.percentile(ms, 99))


def prompt_params(sampling: SamplingParams, index: int, tokens: int) -> SamplingParams:
    """Prompt ``index``'s sampling: ``sampling`` with ``tokens + 1`` tokens (the
    prefill's, then one per decode) and, when seeded, the seed ``sampling.seed + index``."""
    seed = sampling.seed + index if sampling.seed is not None else None
    return attrs.evolve(sampling, seed=seed, max_tokens=tokens + 1)


#: what a workload's cooperative step waits for: true once it can go on without blocking
Wait = Callable[[], bool]
#: one sequence's share of the workload (or one prompt), as a cooperative generator: it
#: yields a :data:`Wait` before each call that would block, and returns what it returns
Steps = Generator[Wait, None, T]


def run_workload(ex: DeviceExecutor, *, prompts: int, sequences: int, tokens: int,
                 seed: int, max_prompt: int, progress: Any = None, path: str = "streams",
                 sampling: SamplingParams | None = None, resume: bool = False,
                 counts: JobCounts | None = None) -> dict[str, Any]:
    """Run the workload on ``path`` (``streams`` or ``jobs``); return the numbers of the
    summary table: ``jobs`` enqueued, ``refused`` (category -> jobs refused at enqueue),
    ``prompts_completed``, ``errors`` (category -> prompts an error ended), ``tokens``
    (decoded: each prompt's first token comes from its prefill), ``wall_s``,
    ``clock_s`` (the same span on the driver's clock) and ``tokens_per_s`` (on the
    driver's clock), ``p50_ms``/``p99_ms`` per decode job, ``ttft_p50_ms``/
    ``ttft_p99_ms`` (time to first token), ``itl_p50_ms``/``itl_p99_ms`` (time per
    output token), each None without samples, and ``outputs`` (prompt index -> its
    tokens). ``resume`` (streams only): a stream whose KV a reset lost replays and
    continues. ``counts``: the :class:`JobCounts` observing ``ex`` (default: one observes
    this run only).

    A threaded executor runs each sequence on a thread of its own. A step-mode executor
    (``threaded=False``: what ``calfsm run`` builds on a virtual clock) runs every
    sequence on this thread, interleaved by a :class:`~calfsm.runtime.stepper.StepScheduler`
    seeded with ``seed``: the same seed then gives the same jobs in the same order, the
    same faults on the same jobs, and the same numbers, every time."""
    if path not in PATHS:
        raise InvalidArgument(f"path must be one of {', '.join(PATHS)}, got {path!r}",
                              stage="cli")
    if resume and path != "streams":
        raise InvalidArgument("resume applies to the streams path only", stage="cli")
    sampling = sampling or SamplingParams()
    contract = ex.epoch.contract(TaskKind.DECODE)
    vocab = contract.vocab
    rng = random.Random(seed)
    work = [[rng.randrange(vocab) for _ in range(rng.randint(1, max_prompt))]
            for _ in range(prompts)]
    tally = _Tally()
    queue = list(enumerate(work))
    own_counts = counts is None
    if counts is None:
        counts = JobCounts()
        ex.add_observer(counts)
    jobs_before, refused_before = counts.enqueue_counts()

    def next_prompt() -> tuple[int, list[int]] | None:
        with tally.lock:
            return queue.pop(0) if queue else None

    def sequence_steps(seq: int) -> Steps[None]:
        while (item := next_prompt()) is not None:
            index, prompt = item
            params = prompt_params(sampling, index, tokens)
            if path == "streams":
                error = yield from _stream_prompt(ex, index, prompt, params, resume, tally)
            else:
                error = yield from _jobs_prompt(ex, seq, index, prompt, params, contract,
                                                tally)
            if isinstance(error, Unavailable) and ex.lifecycle_state != LifecycleState.FAILED:
                yield from _back_off(ex, error)
            if progress is not None:
                progress()

    workers = [sequence_steps(s) for s in range(sequences)]
    t0, c0 = time.perf_counter(), ex.clock.now()
    if ex.config.threaded:
        threads = [threading.Thread(target=_to_the_end, args=(w,), name=f"seq-{s}")
                   for s, w in enumerate(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        _interleave(workers, StepScheduler(ex, seed))
    wall, elapsed = time.perf_counter() - t0, ex.clock.now() - c0
    jobs, refused = counts.enqueue_counts()
    if own_counts:
        ex.remove_observer(counts)
    refused = {k: n - refused_before.get(k, 0) for k, n in refused.items()
               if n > refused_before.get(k, 0)}
    generated = len(tally.itl_s)
    p50, p99 = _percentiles_ms(tally.job_s)
    ttft50, ttft99 = _percentiles_ms(tally.ttft_s)
    itl50, itl99 = _percentiles_ms(tally.itl_s)
    return {"jobs": jobs - jobs_before, "refused": refused,
            "prompts_completed": tally.completed, "errors": dict(tally.failed),
            "tokens": generated, "wall_s": wall, "clock_s": elapsed,
            "tokens_per_s": generated / elapsed if elapsed > 0 else 0.0,
            "p50_ms": p50, "p99_ms": p99, "ttft_p50_ms": ttft50, "ttft_p99_ms": ttft99,
            "itl_p50_ms": itl50, "itl_p99_ms": itl99,
            "outputs": dict(sorted(tally.outputs.items()))}


def _to_the_end(steps: Steps[T]) -> T:
    """Run cooperative ``steps`` on a threaded executor: every call blocks by itself, so
    what a step waits for needs no driving."""
    while True:
        try:
            next(steps)
        except StopIteration as end:
            return end.value


def _interleave(workers: list[Steps[None]], scheduler: StepScheduler) -> None:
    """Run cooperative ``workers`` on one thread over a step-mode executor: the first
    worker (in slot order) whose wait is over goes on until it waits again; when none
    can, ``scheduler`` steps the executor until one can."""
    waits: dict[int, Wait] = {}

    def go_on(slot: int) -> None:
        try:
            waits[slot] = next(workers[slot])
        except StopIteration:
            del waits[slot]

    for slot in range(len(workers)):
        waits[slot] = lambda: True
    while waits:
        slot = next((s for s, ready in waits.items() if ready()), None)
        if slot is None:
            scheduler.run_until(lambda: any(ready() for ready in waits.values()))
        else:
            go_on(slot)


def _back_off(ex: DeviceExecutor, error: Unavailable) -> Steps[None]:
    """Before a sequence takes its next prompt after ``error``: back off as it asks (a
    thread sleeps, at most 50 ms), or in step mode wait until the executor is Ready again
    (or will never be)."""
    if ex.config.threaded:
        time.sleep(min(error.retry_after_s or 0.01, 0.05))
        return
    life = ex.lifecycle
    yield lambda: life.ready or life.closing or life.state == LifecycleState.FAILED


def _stream_prompt(ex: DeviceExecutor, index: int, prompt: list[int],
                   params: SamplingParams, resume: bool, tally: _Tally
                   ) -> Steps[CalfsmError | None]:
    """One prompt as a :class:`~calfsm.generate.stream.Stream` on a sequence of its own; the
    error that ended it, or None."""
    try:
        with ex.open_sequence() as seq:
            stream = seq.generate(prompt, params, resume=resume)
            yield stream.done
            for event in stream:
                if event.index:             # a decode's token (index 0: the prefill's)
                    tally.decode_job(event.timings.total_ms / 1e3)
            result = stream.result()
            # a step prepared ahead may still be on the device: closing waits for it
            yield lambda: seq.last_job is None or seq.last_job.done()
    except CalfsmError as e:                # refused before the stream ran a job
        tally.prompt_ended(index, (), None, (), e)
        return e
    tally.prompt_ended(index, result.tokens, result.ttft_s, result.inter_token_s,
                       result.error)
    return result.error


def _jobs_prompt(ex: DeviceExecutor, seq: int, index: int, prompt: list[int],
                 params: SamplingParams, contract: SubmodelContract, tally: _Tally
                 ) -> Steps[CalfsmError | None]:
    """One prompt by hand on sequence ``seq``: a prefill, then one enqueue and result per
    decode, sampled, stopped and timed as a stream does; the error that ended it, or
    None."""
    clock = ex.clock
    max_seq = contract.max_seq
    sampler = params.sampler_for(contract.vocab)
    error: CalfsmError | None = None
    out: list[int] = []
    times: list[float] = []
    t0 = clock.now()
    try:
        handle = ex.enqueue(Request.prefill(seq, prompt))
        yield handle.done
        r = handle.result()
        pos = len(prompt)
        while True:
            out.append(sampler.sample(r.logits))
            times.append(clock.now())
            if len(out) >= params.max_tokens or pos >= max_seq:
                break
            handle = ex.enqueue(Request.decode(seq, out[-1], pos))
            yield handle.done
            r = handle.result()
            tally.decode_job(r.timings.total_ms / 1e3)
            pos += 1
    except CalfsmError as e:
        error = e
    finally:
        try:
            if ex.lifecycle_state == LifecycleState.READY:
                ex.reset_sequence(seq)
        except CalfsmError as e:   # the sequence may be busy in a recovery race
            log.debug("reset_sequence(%s): %s", seq, e)
    tally.prompt_ended(index, out, times[0] - t0 if times else None,
                       [b - a for a, b in itertools.pairwise(times)], error)
    return error


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The epilog kept as written; an option's default after its help (not for flags)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not any(action.default is v for v in (None, False, argparse.SUPPRESS)):
            text += " (default: %(default)s)"
        return text


_DESCRIPTION = """\
Run seeded prompts (a prefill, then decodes, greedy unless a --temperature is given) on
several sequences through the executor, as generation streams or as a hand-written loop
of jobs; print progress and errors on stderr, the summary table on stdout."""


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
                     help="seeds the prompts, the swarm fault plan, the driver and, on a "
                          "virtual clock, the order the sequences take turns in")
    run.add_argument("--latency", default="virtual",
                     metavar="virtual|real[:decode_ms=N,prefill_token_us=N,"
                             "transfer_share=F,batch_row_share=F,context_token_ns=N,"
                             "shape_cost=graph|rows]",
                     help="virtual: the driver's own clock (the sim's is virtual and "
                          "never sleeps); real: a fixed latency on the wall clock, each "
                          "value a finite number >= 0 (decode_ms=10, "
                          "prefill_token_us=50 unless given; transfer_share, below 1, "
                          "is the part of each job spent in H2D/D2H, 0 unless given; "
                          "batch_row_share, below 1, what each row past the first adds "
                          "to a batch decode step, 0 unless given; context_token_ns, "
                          "what each context token a decode row attends over adds, 0 "
                          "unless given; shape_cost: graph, a static calbin's step costs "
                          "its graph's whole batch and context window (the default), or "
                          "rows, a dynamic-shape device's the rows it carries)")
    run.add_argument("--path", default="streams", choices=PATHS,
                     help="streams: each prompt a generation stream on a sequence of its "
                          "own (open_sequence + generate: the library samples and enqueues "
                          "each next step); jobs: the hand-written loop, one enqueue and "
                          "result per step, to compare with")
    run.add_argument("--prompts", type=int, default=16, metavar="N",
                     help="prompts to run, each a prefill then --tokens decodes")
    run.add_argument("--sequences", type=int, default=4, metavar="N",
                     help="sequences running prompts at once (taking turns on one thread "
                          "on a virtual clock; one request thread each in real time)")
    run.add_argument("--tokens", type=int, default=16, metavar="N",
                     help="tokens decoded per prompt after the one its prefill gives "
                          "(the table's 'tokens generated' counts these)")
    run.add_argument("--max-prompt", type=int, default=64, metavar="N",
                     help="longest prompt in tokens (lengths are drawn from 1..N)")
    run.add_argument("--max-inflight", type=int, default=1, metavar="N",
                     help="jobs the executor may keep on the device at once: more than one "
                          "runs only where the vendor runners' evidence proves two in "
                          "flight (else it runs one and says why on stderr and in the "
                          "table)")
    run.add_argument("--evidence-dir", default=None, metavar="DIR",
                     help=capabilities_cli.EVIDENCE_DIR_HELP)
    run.add_argument("--temperature", type=float, default=0.0, metavar="T",
                     help="sampling temperature, a finite number >= 0; 0 is greedy (then "
                          "--top-k, --top-p and --sampling-seed do not apply)")
    run.add_argument("--top-k", type=int, default=0, metavar="K",
                     help="sample among the K most likely tokens only; 0 is off")
    run.add_argument("--top-p", type=float, default=1.0, metavar="P",
                     help="sample from the smallest set of tokens holding probability P, "
                          "in (0, 1]; 1 is off")
    run.add_argument("--sampling-seed", type=int, default=None, metavar="N",
                     help="seeds the draws: prompt i draws from seed N + i, so a run "
                          "replays exactly on either path (default: --seed)")
    run.add_argument("--resume", action="store_true",
                     help="streams only: a stream whose KV a device reset lost re-prefills "
                          "its prompt and tokens and goes on (without it the prompt fails, "
                          "as on the jobs path)")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    capabilities_cli.add_parser(sub, _HelpFormatter)
    serve_cli.add_parser(sub, formatter_class=_HelpFormatter)
    soak.add_parser(sub, _HelpFormatter)
    return parser


def _sampling(args: argparse.Namespace) -> SamplingParams:
    """The options' :class:`SamplingParams` (the base of every prompt's), each value
    checked on its own so that an error names its option."""
    temperature = _option("--temperature", str(args.temperature),
                          lambda _: SamplingParams(temperature=args.temperature))
    top_k = _option("--top-k", str(args.top_k), lambda _: SamplingParams(top_k=args.top_k))
    top_p = _option("--top-p", str(args.top_p), lambda _: SamplingParams(top_p=args.top_p))
    if temperature.greedy:
        seed = None                     # greedy draws nothing
    else:
        given = args.sampling_seed is not None
        value = args.sampling_seed if given else args.seed
        seed = _option("--sampling-seed" if given else "--seed", str(value),
                       lambda _: SamplingParams(seed=value)).seed
    return SamplingParams(temperature=temperature.temperature, top_k=top_k.top_k,
                          top_p=top_p.top_p, seed=seed)


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
    """``calfsm run [options]`` (or ``calfsm capabilities``); returns the exit status
    (``--help``: 0)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:              # --help, or argparse's own usage error
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    if args.command == "capabilities":
        return capabilities_cli.main(args)
    if args.command == "serve":
        return serve_cli.run(args)
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "soak":
        return soak.main(args)
    try:
        _check_counts(args)
        if args.resume and args.path != "streams":
            raise InvalidArgument("--resume applies to --path streams only", stage="cli")
        args.sampling = _sampling(args)
        _option("--latency", args.latency, _latency)
        manifest = _option("--manifest", args.manifest, _manifest)
        faults = _option("--faults", args.faults,
                         lambda spec: _faults(spec, args.seed, args.sequences))
        driver = build_driver(args.driver, manifest, faults=faults, seed=args.seed,
                              latency=args.latency)
        try:
            _option("--manifest", args.manifest,
                    lambda _: manifest.check_runtime(driver.version()))
        except CalfsmError:
            driver.close()
            raise
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
        # on a virtual clock nothing needs threads: step mode, with a StepScheduler seeded
        # from --seed, makes the run (faults, order, numbers) the same every time
        ex = DeviceExecutor(driver, manifest,
                            ExecutorConfig(max_inflight=args.max_inflight,
                                           threaded=not driver.clock.virtual,
                                           evidence_dir=args.evidence_dir))
    except CalfsmError as e:
        _error(f"start-up failed: {e}")
        return EXIT_DEVICE_FAILED
    counts = JobCounts()
    ex.add_observer(counts)
    for note in ex.health().notes:     # configuration not honoured (e.g. --max-inflight)
        _error(f"note: {note}")
    shutdown_error = None
    with Progress(console=Console(stderr=True), disable=args.quiet, transient=True) as bar:
        task = bar.add_task("prompts", total=args.prompts)
        try:
            summary = run_workload(ex, prompts=args.prompts, sequences=args.sequences,
                                   tokens=args.tokens, seed=args.seed,
                                   max_prompt=args.max_prompt,
                                   progress=lambda: bar.advance(task), path=args.path,
                                   sampling=args.sampling, resume=args.resume,
                                   counts=counts)
        finally:
            final_state, reason = ex.lifecycle_state, ex.failure_reason
            try:
                ex.close()
            except CalfsmError as e:
                shutdown_error = e
    console = Console()
    console.print(_table(args, driver, manifest, summary, ex, counts, final_state))
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


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f} ms"


def _sampling_rows(p: SamplingParams) -> list[tuple[str, str]]:
    if p.greedy:
        return [("sampling: temperature / top-k / top-p", "greedy"),
                ("sampling seed (prompt i: seed + i)", "n/a")]
    return [("sampling: temperature / top-k / top-p",
             f"{p.temperature:g} / {p.top_k or 'off'} / "
             f"{f'{p.top_p:g}' if p.top_p < 1.0 else 'off'}"),
            ("sampling seed (prompt i: seed + i)", str(p.seed))]


def _table(args: argparse.Namespace, driver: Any, manifest: Manifest,
           summary: dict[str, Any], ex: DeviceExecutor, counts: JobCounts,
           final_state: str) -> Any:
    from rich.table import Table

    stats = ex.stats()
    health = ex.health()
    table = Table(title=f"calfsm run — {args.driver} driver, {manifest.name or 'manifest'}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("path", args.path + (", resume" if args.resume else ""))
    table.add_row("jobs in flight: asked / running",
                  f"{args.max_inflight} / {health.max_inflight}")
    if counts.decode_steps:     # a batch graph: how full its decode steps ran
        table.add_row(f"rows per decode step (at most {health.max_batch})",
                      f"{counts.decode_rows / counts.decode_steps:.2f}")
    for note in health.notes:
        table.add_row("note", note)
    for metric, value in _sampling_rows(args.sampling):
        table.add_row(metric, value)
    failed = sum(summary["errors"].values())
    table.add_row("prompts completed / failed", f"{summary['prompts_completed']} / {failed}")
    table.add_row("prompt failures by category", _by_category(summary["errors"]))
    table.add_row("jobs enqueued", str(summary["jobs"]))
    table.add_row("jobs refused at enqueue", _by_category(summary["refused"]))
    table.add_row("succeeded / failed / cancelled / quarantined",
                  f"{stats.succeeded} / {stats.failed} / {stats.cancelled} / "
                  f"{stats.quarantined}")
    table.add_row("steps prepared ahead, not needed (discarded)", str(stats.discarded))
    table.add_row("errors by category", _by_category(stats.errors_by_category))
    table.add_row("tokens generated", str(summary["tokens"]))
    clock = "virtual device time" if driver.clock.virtual else "wall time"
    table.add_row(f"tokens/s ({clock})", f"{summary['tokens_per_s']:.1f}")
    for q in ("P50", "P99"):
        table.add_row(f"{q} time to first token ({clock})",
                      _ms(summary[f"ttft_{q.lower()}_ms"]))
    for q in ("P50", "P99"):
        table.add_row(f"{q} time per output token ({clock})",
                      _ms(summary[f"itl_{q.lower()}_ms"]))
    for q in ("P50", "P99"):
        table.add_row(f"{q} decode job time ({clock})", _ms(summary[f"{q.lower()}_ms"]))
    table.add_row("recoveries / stale completions",
                  f"{stats.recoveries} / {stats.stale_completions}")
    table.add_row("generation", str(stats.generation))
    table.add_row("leased buffers at exit", str(stats.leased))
    table.add_row("lifecycle at end of workload", final_state)
    return table


if __name__ == "__main__":
    sys.exit(main())
