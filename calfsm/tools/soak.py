"""``calfsm soak``: a seeded, fault-injected workload held for a duration, judged by the
stability gates of spec 13.2.

Theory of operation
-------------------
``--clients`` threads each loop until the duration is up (``--duration`` of wall time, or
``--device-duration`` of the driver's clock: device time), drawing their next request from
their own seeded RNG: a stream on a sequence of its own (``executor.open_sequence()``,
``sequence.generate(...)``, sometimes a second turn on the same sequence), a one-shot
``executor.generate(...)``, either of them cancelled after a few tokens, or a bad request
(a token outside the vocabulary, an empty or too long prompt, a bad deadline or
parameters). The driver runs a fault plan: ``swarm`` draws one from the seed (swarm
testing: a random subset of :data:`SOAK_KINDS`, each firing on about ``--fault-rate`` of
the calls at its point, aimed at the clients' sequences), or a plan file.

Two ledgers account for everything: every request is issued once and must be answered
once (a refusal at the call, or a stream's result), every job the executor accepts must
end once (:class:`SoakExecutor` observes the jobs accepted and ended, as ``calfsm
run`` counts them). A sampler thread records a :class:`~calfsm.tools.soak_gates.Sample` every
``--sample-every`` seconds: RSS, leased and quarantined buffers, generation, lifecycle,
recoveries, faults fired, open requests and jobs, the latency percentiles of the
window, and the device time covered so far. When the time is up the clients finish what
they hold, the workload drains, the executor closes, and
:func:`calfsm.tools.soak_gates.evaluate` judges the records. The report (``report.md``,
``report.json``, ``samples.csv``) and the plots (:mod:`calfsm.tools.soak_plots`) go to
``--out``.

Exit status: 0 every gate passed; 1 a gate failed; 2 bad usage or input; 3 the executor
did not start.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import random
import re
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from calfsm.drivers import Driver, driver_names, load_driver
from calfsm.drivers.faults import SWARM_KINDS, FaultPlan
from calfsm.engine.observe import JobAccepted, JobEnded, Observer
from calfsm.errors import (
    CalfsmError,
    ErrorCategory,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from calfsm.executor import DeviceExecutor, ExecutorConfig
from calfsm.generate.sampling import SamplingParams
from calfsm.generate.stream import FinishReason, GenerationResult, Stream
from calfsm.manifest import (
    Manifest,
    TaskKind,
    builtin_manifest_names,
    manifest_from_option,
)
from calfsm.telemetry.goodput import (
    GoodputReport,
    GoodputTally,
    RequestRecord,
    format_slos,
    parse_slos,
)
from calfsm.telemetry.steps import DecodeSteps
from calfsm.tools.capabilities_cli import EVIDENCE_DIR_HELP
from calfsm.tools.soak_gates import (
    DEVICE_CATEGORIES,
    RSS_FLOOR_MIB,
    RSS_SLOPE_MIB_PER_H,
    Gate,
    GateLimits,
    RssTrend,
    Sample,
    Tally,
    evaluate,
    explain,
    rss_trend,
)

__all__ = ["DEFAULT_SLOS", "EXCLUDED_KINDS", "EXIT_FAILED_GATE", "GOODPUT_KINDS", "REQUEST_KINDS",
           "SOAK_KINDS",
           "SoakConfig", "SoakExecutor", "SoakResult", "add_parser", "main", "parse_duration",
           "rss_bytes", "run_soak", "soak_plan", "write_report"]

EXIT_OK = 0
EXIT_FAILED_GATE = 1
EXIT_USAGE = 2
EXIT_START_FAILED = 3

#: swarm kinds a soak leaves out unless ``--kinds`` names them, and why
EXCLUDED_KINDS = {
    "reset_fails": "a failed reset ends the executor Failed by design (a supervisor "
                   "restarts the process): the soak would end at the first one",
}
#: the fault kinds ``--faults swarm`` draws from by default
SOAK_KINDS = tuple(k for k in SWARM_KINDS if k not in EXCLUDED_KINDS)
#: what a client sends, and how often (weights)
REQUEST_KINDS = {"stream": 0.4, "generate": 0.3, "cancel": 0.15, "bad": 0.15}
_BAD_KINDS = ("vocab", "empty", "negative", "deadline", "too_long", "params")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h)?\s*$")
_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}
_WINDOW_CAP = 50_000        # latency values kept per sample window
#: the SLOs the soak's goodput is judged against unless ``--goodput`` says otherwise
#: (ms on the driver's clock; vLLM's ``--goodput`` form)
DEFAULT_SLOS = "ttft:500 tpot:100 e2el:5000"
#: the request kinds counted in the goodput: what a user asked to be answered (a cancel
#: is the client's own end, a bad request's 400 its expected answer)
GOODPUT_KINDS = ("stream", "generate")
_GOODPUT_KEEP = 20_000      # values per figure kept for the whole soak's percentiles

log = logging.getLogger("calfsm.soak")


def parse_duration(text: str) -> float:
    """Seconds in ``text``: ``90s``, ``10m``, ``1h``, ``250ms`` or a plain number of
    seconds; more than zero."""
    m = _DURATION.match(str(text))
    if m is None or not float(m.group(1)) > 0:
        raise InvalidArgument(f"not a duration > 0 (write e.g. 90s, 10m, 1h): {text!r}",
                              stage="soak")
    return float(m.group(1)) * _UNITS[m.group(2)]


def rss_bytes() -> int:
    """This process's resident set size now (Linux: /proc/self/statm; elsewhere the
    peak, which still grows with a leak)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def soak_kinds(manifest: Manifest) -> tuple[str, ...]:
    """The default swarm kinds for ``manifest``: :data:`SOAK_KINDS`, and on a batch
    calbin (a batched decode graph) the fault of one row of a batch job too."""
    batched = manifest.submodel(TaskKind.DECODE).batched
    return (*SOAK_KINDS, "row_ccu_exception") if batched else SOAK_KINDS


def soak_plan(spec: str, seed: int, sequences: int, *, rate: float = 0.005,
              kinds: tuple[str, ...] = SOAK_KINDS) -> FaultPlan:
    """``none``, ``swarm`` (a seeded plan of some of ``kinds``, never empty, aimed at
    sequences ``0 .. sequences-1``) or a plan file, used as written."""
    if spec == "none":
        return FaultPlan.none()
    if spec == "swarm":
        return FaultPlan.swarm(seed, kinds=kinds, rate=rate, p_none=0.0) \
            .targeting(range(sequences), seed)
    return FaultPlan.load(spec)


@attrs.frozen
class SoakConfig:
    """One soak: how long, what traffic, where the gates draw their lines.

    How long is either ``duration_s`` of wall time or ``device_duration_s`` of the
    driver's clock (device time: on a virtual clock far more than the wall time it
    takes), exactly one of them."""

    duration_s: float | None
    seed: int = 0
    clients: int = 4
    max_tokens: int = 32
    max_prompt: int = 64
    warmup_s: float | None = None       # None: 20% of the wall time, at most 60 s
    sample_s: float | None = None       # None: duration / 240 within [0.1, 5] s, or 1 s
    stuck_s: float = 30.0
    drain_s: float = 30.0
    rss_slope_mib_per_h: float = RSS_SLOPE_MIB_PER_H
    rss_floor_mib: float = RSS_FLOOR_MIB
    executor: ExecutorConfig = attrs.field(factory=lambda: ExecutorConfig(
        execution_timeout_s=1.0))
    device_duration_s: float | None = None
    #: the SLOs of the report's goodput (parse_slos' form: ``{"ttft": 500.0, ...}``, ms)
    slos: dict[str, float] = attrs.field(factory=lambda: parse_slos(DEFAULT_SLOS))

    def __attrs_post_init__(self) -> None:
        if (self.duration_s is None) == (self.device_duration_s is None):
            raise InvalidArgument("a soak runs for a wall-clock duration or a device-time "
                                  "duration: give exactly one", stage="soak")

    def warmup_for(self, wall_s: float) -> float:
        """The warm-up of a soak that took ``wall_s`` seconds (its duration if known)."""
        if self.warmup_s is not None:
            return self.warmup_s
        return min(60.0, 0.2 * (self.duration_s if self.duration_s is not None else wall_s))

    @property
    def sample_every(self) -> float:
        if self.sample_s is not None:
            return self.sample_s
        if self.duration_s is None:     # the wall time is not known before the end
            return 1.0
        return min(5.0, max(0.1, self.duration_s / 240))

    def limits_for(self, wall_s: float) -> GateLimits:
        return GateLimits(self.warmup_for(wall_s), self.stuck_s, self.rss_slope_mib_per_h,
                          self.rss_floor_mib)


@attrs.frozen
class SoakResult:
    samples: tuple[Sample, ...]
    tally: Tally
    gates: tuple[Gate, ...]
    trend: RssTrend
    wall_s: float
    clock: str                  # what the latencies are measured in
    device_s: float             # how far the driver's clock moved: the device time covered
    warmup_s: float             # the warm-up the gates used
    #: latency percentiles, SLO attainment and goodput of the requests of
    #: :data:`GOODPUT_KINDS`, per second of device time (None: not measured)
    goodput: GoodputReport | None = None

    @property
    def passed(self) -> bool:
        return all(g.passed for g in self.gates)


class SoakExecutor(DeviceExecutor, Observer):
    """A :class:`DeviceExecutor` whose every accepted job is booked in a ledger and must
    end exactly once; a device-side job error is explained against the fault plan. It
    observes itself: ``job_accepted`` books a job (one ``enqueue`` or ``enqueue_nowait``
    accepted, or a stream's step prepared ahead once it is released), ``job_ended``
    answers it; a step prepared ahead that never ran (``announced`` False) is no job
    here."""

    def __init__(self, driver: Driver, manifest: Manifest, config: ExecutorConfig, *,
                 tally: Tally, lock: threading.Lock) -> None:
        self._tally = tally
        self._ledger_lock = lock
        self._open_jobs: dict[int, None] = {}
        self._rules = tuple(getattr(driver, "faults", FaultPlan.none()).rules)
        super().__init__(driver, manifest, config)
        self.add_observer(self)

    @property
    def open_jobs(self) -> int:
        with self._ledger_lock:
            return len(self._open_jobs)

    def job_accepted(self, event: JobAccepted) -> None:
        with self._ledger_lock:
            self._tally.jobs += 1
            self._open_jobs[event.job_id] = None

    def job_ended(self, event: JobEnded) -> None:
        if not event.announced:
            return
        err = event.error
        why = None if err is None else explain(err, self._rules, self.generation)
        t = self._tally
        with self._ledger_lock:
            if self._open_jobs.pop(event.job_id, False) is False:
                t.double_answers += 1
                return
            t.jobs_answered += 1
            timings = event.timings
            if timings.submitted and timings.completed >= timings.submitted:
                t.device_busy_s += timings.completed - timings.submitted
            if err is None or why in ("other", "refusal"):
                return
            if err.category in DEVICE_CATEGORIES:
                t.device_errors += 1
            elif err.category is ErrorCategory.PROGRAMMING:
                t.programming_errors += 1
            if why is None:
                t.unexplained_count += 1
                if len(t.unexplained) < 20:
                    t.unexplained.append(str(err))
            elif why.startswith("point:"):
                t.attributed[why[6:]] += 1


class _Ledger:
    """The requests: each issued once, answered once; the latency window."""

    def __init__(self, tally: Tally, lock: threading.Lock,
                 observer: Callable[[str, Any], None] | None,
                 slos: dict[str, float] | None = None) -> None:
        self.tally = tally
        self.lock = lock
        self.observer = observer
        self._next = 0
        self._open: dict[int, float] = {}       # request id -> wall time issued
        self._kind: dict[int, str] = {}         # request id -> kind, while open
        self.goodput = GoodputTally(slos, keep=_GOODPUT_KEEP)
        self._ttft: list[float] = []
        self._tpot: list[float] = []

    def issue(self, kind: str) -> int:
        with self.lock:
            self._next += 1
            self._open[self._next] = time.perf_counter()
            self._kind[self._next] = kind
            self.tally.issued[kind] += 1
            return self._next

    def answer(self, rid: int, answer: GenerationResult | CalfsmError,
               outcome: str) -> None:
        with self.lock:
            if self._open.pop(rid, None) is None:
                self.tally.double_answers += 1
                return
            self.tally.outcomes[outcome] += 1
            if self._kind.pop(rid, None) in GOODPUT_KINDS:
                self.goodput.add(RequestRecord.from_result(answer)
                                 if isinstance(answer, GenerationResult)
                                 else RequestRecord(ok=False))
            if isinstance(answer, GenerationResult) and len(self._tpot) < _WINDOW_CAP:
                if answer.ttft_s is not None:
                    self._ttft.append(answer.ttft_s)
                self._tpot.extend(answer.inter_token_s)
        if self.observer is not None:
            self.observer(outcome, answer)

    def open_now(self) -> tuple[int, float]:
        """(requests open, age in seconds of the oldest)."""
        with self.lock:
            first = next(iter(self._open.values()), None)
            return len(self._open), 0.0 if first is None else time.perf_counter() - first

    def take_window(self) -> tuple[list[float], list[float]]:
        with self.lock:
            window = self._ttft, self._tpot
            self._ttft, self._tpot = [], []
            return window


def _outcome(answer: GenerationResult | CalfsmError) -> str:
    if isinstance(answer, CalfsmError):
        return f"refused:{answer.category.value}"
    if answer.error is not None:
        return f"{answer.finish_reason.value}:{answer.error.category.value}"
    return answer.finish_reason.value


class _Client:
    """One client thread's loop of seeded requests."""

    def __init__(self, soak: _Soak, index: int) -> None:
        self.soak = soak
        self.ex = soak.ex
        self.ledger = soak.ledger
        self.rng = random.Random(soak.config.seed * 7919 + index)
        contract = self.ex.epoch.contract(TaskKind.DECODE)
        self.vocab = contract.vocab
        self.max_seq = contract.max_seq

    def run(self) -> None:
        kinds, weights = zip(*REQUEST_KINDS.items())
        while not self.soak.stop.is_set() and self.ex.lifecycle_state != "Failed":
            kind = self.rng.choices(kinds, weights)[0]
            try:
                getattr(self, f"_{kind}")()
            except Exception:               # a bug in the soak itself: say so, go on
                log.exception("soak client request %s failed", kind)
                self.soak.crashes += 1

    # ---- requests ------------------------------------------------------------------
    def _prompt(self) -> list[int]:
        return [self.rng.randrange(self.vocab)
                for _ in range(self.rng.randint(1, self.soak.config.max_prompt))]

    def _params(self) -> SamplingParams:
        n = self.rng.randint(1, self.soak.config.max_tokens)
        if self.rng.random() < 0.5:
            return SamplingParams(max_tokens=n)
        return SamplingParams(max_tokens=n, temperature=0.8, top_k=self.rng.choice((0, 40)),
                              seed=self.rng.randrange(1 << 31))

    def _stream(self, cancel_after: int | None = None) -> None:
        rid = self.ledger.issue("stream" if cancel_after is None else "cancel")
        try:
            seq = self.ex.open_sequence()
        except CalfsmError as e:
            self._refused(rid, e)
            return
        with seq:
            turns = 2 if cancel_after is None and self.rng.random() < 0.25 else 1
            for turn in range(turns):
                if turn:
                    rid = self.ledger.issue("stream")
                try:
                    stream = seq.generate(self._prompt(), self._params())
                except CalfsmError as e:
                    self._refused(rid, e)
                    return
                result = self._consume(rid, stream, cancel_after)
                if result.finish_reason is not FinishReason.LENGTH:
                    return

    def _generate(self, cancel_after: int | None = None) -> None:
        rid = self.ledger.issue("generate" if cancel_after is None else "cancel")
        try:
            stream = self.ex.generate(self._prompt(), self._params())
        except CalfsmError as e:
            self._refused(rid, e)
            return
        self._consume(rid, stream, cancel_after)

    def _cancel(self) -> None:
        after = self.rng.randint(0, 4)
        if self.rng.random() < 0.5:
            self._stream(after)
        else:
            self._generate(after)

    def _bad(self) -> None:
        kind = self.rng.choice(_BAD_KINDS)
        rid = self.ledger.issue("bad")
        prompt, params, kw = [1, 2, 3], SamplingParams(max_tokens=4), {}
        if kind == "vocab":
            prompt = [self.vocab + self.rng.randrange(100)]
        elif kind == "empty":
            prompt = []
        elif kind == "negative":
            prompt = [1, -1 - self.rng.randrange(100)]
        elif kind == "deadline":
            kw = {"deadline_s": -1.0}
        elif kind == "too_long":
            prompt = [1] * (self.max_seq + 1)
        else:
            params = "greedy"                                   # type: ignore[assignment]
        try:
            stream = self.ex.generate(prompt, params, **kw)
        except CalfsmError as e:
            self._refused(rid, e, bad=True)
            return
        result = self._consume(rid, stream, None)
        if result.error is None or not _refusal(result.error):
            with self.ledger.lock:
                self.soak.tally.misanswered_bad += 1

    # ---- answers -------------------------------------------------------------------
    def _consume(self, rid: int, stream: Stream, cancel_after: int | None
                 ) -> GenerationResult:
        """Read the stream as a caller does, cancelling after ``cancel_after`` tokens."""
        tokens = []
        if cancel_after == 0:
            stream.cancel()
        for event in stream:
            tokens.append(event.token)
            if cancel_after is not None and len(tokens) == cancel_after:
                stream.cancel()
        result = stream.result()
        if tuple(tokens) != result.tokens or result.usage.completion_tokens != len(tokens):
            with self.ledger.lock:
                self.soak.tally.token_mismatches += 1
        self.ledger.answer(rid, result, _outcome(result))
        if isinstance(result.error, Unavailable):
            self._back_off(result.error)
        return result

    def _refused(self, rid: int, err: CalfsmError, *, bad: bool = False) -> None:
        self.ledger.answer(rid, err, _outcome(err))
        if bad and not _refusal(err):
            with self.ledger.lock:
                self.soak.tally.misanswered_bad += 1
        self._back_off(err)

    def _back_off(self, err: CalfsmError) -> None:
        """Wait as the error asks (at most 50 ms) before the next request."""
        if isinstance(err, Unavailable | ResourceExhausted) and err.retry_after_s:
            self.soak.stop.wait(min(err.retry_after_s, 0.05))


def _refusal(err: CalfsmError) -> bool:
    """What a bad request may be answered with: its own 400, or a retryable refusal that
    came before anyone looked at it."""
    return err.category is ErrorCategory.REQUEST or (isinstance(err, Unavailable) \
        and err.retry_after_s is not None)


class _Soak:
    """The running soak: executor, ledgers, clients, sampler."""

    def __init__(self, config: SoakConfig, ex: SoakExecutor, tally: Tally,
                 lock: threading.Lock, observer: Callable[[str, Any], None] | None) -> None:
        self.config = config
        self.ex = ex
        self.tally = tally
        self.ledger = _Ledger(tally, lock, observer, config.slos)
        self.stop = threading.Event()
        self.crashes = 0
        self.samples: list[Sample] = []
        self.t0 = time.perf_counter()
        self.clock = ex.driver.clock
        self.d0 = self.clock.now()
        fired = getattr(ex.driver, "faults_fired", None)
        self._fired = fired if callable(fired) else None

    def sample(self) -> Sample:
        ex = self.ex
        stats = ex.stats()
        epoch = ex.epoch
        pool = epoch.pool.stats() if epoch is not None else None
        open_requests, oldest = self.ledger.open_now()
        ttft, tpot = self.ledger.take_window()
        s = Sample(
            t=time.perf_counter() - self.t0, rss=rss_bytes(), leased=stats.leased,
            quarantined=pool.quarantined if pool else 0, generation=stats.generation,
            lifecycle=ex.lifecycle_state, recoveries=stats.recoveries,
            faults=sum(self._fired()) if self._fired else None,
            answered=sum(self.tally.outcomes.values()), open_requests=open_requests,
            oldest_open_s=oldest, open_jobs=ex.open_jobs,
            **_percentiles("ttft", ttft), **_percentiles("tpot", tpot),
            device_t=self.device_elapsed())
        self.samples.append(s)
        return s

    def device_elapsed(self) -> float:
        """Seconds the driver's clock moved since the soak began."""
        return self.clock.now() - self.d0

    def fired_by_point(self) -> dict[str, int] | None:
        if self._fired is None:
            return None
        out: dict[str, int] = {}
        for rule, n in zip(self.ex.driver.faults.rules, self._fired()):
            out[rule.point] = out.get(rule.point, 0) + n
        return out


def _percentiles(name: str, values: list[float]) -> dict[str, float | None]:
    if not values:
        return {f"{name}_p50_ms": None, f"{name}_p99_ms": None}
    p50, p99 = np.percentile(np.asarray(values) * 1e3, [50, 99])
    return {f"{name}_p50_ms": float(p50), f"{name}_p99_ms": float(p99)}


def run_soak(config: SoakConfig, driver: Driver, manifest: Manifest, *,
             progress: Callable[[float, Sample], None] | None = None,
             observer: Callable[[str, Any], None] | None = None) -> SoakResult:
    """Run the soak on ``driver`` and judge it. ``progress(elapsed_s, latest sample)``
    is called after each sample; ``observer(outcome, answer)`` after every answer (a
    seam for tests: whatever it keeps, the soak sees in its RSS)."""
    rules = getattr(driver, "faults", FaultPlan.none()).rules
    tally = Tally(plan_fails_resets=any(r.point == "reset" for r in rules))
    lock = threading.Lock()
    ex = SoakExecutor(driver, manifest, config.executor, tally=tally, lock=lock)
    decode = DecodeSteps()          # did it batch, and on which graphs
    ex.add_observer(decode)
    soak = _Soak(config, ex, tally, lock, observer)
    clients = [threading.Thread(target=_Client(soak, i).run, name=f"soak-client-{i}",
                                daemon=True) for i in range(config.clients)]
    soak.sample()
    for c in clients:
        c.start()
    _hold(soak, clients, progress)
    soak.stop.set()
    drain_end = time.perf_counter() + config.drain_s
    for c in clients:
        c.join(max(0.0, drain_end - time.perf_counter()))
    # in short waits: wait_until can miss the wake-up of the last job (see docs/soak.md)
    while not ex.idle() and time.perf_counter() < drain_end:
        ex.wait_until(ex.idle, 0.1)
    tally.idle_after_drain = ex.idle()
    soak.sample()
    tally.open_requests = soak.ledger.open_now()[0]
    tally.open_jobs = ex.open_jobs
    tally.leased_drained = ex.stats().leased
    tally.fired = soak.fired_by_point()
    tally.rows_per_job = ex.max_batch
    tally.decode_steps, tally.decode_rows = decode.steps, decode.rows
    tally.final_state, tally.failure_reason = ex.lifecycle_state, ex.failure_reason
    tally.executor_bugs = ex.stats().errors_by_category.get(ErrorCategory.PROGRAMMING.value, 0)
    try:
        ex.close(timeout=min(config.drain_s, 10.0))
    except CalfsmError as e:
        tally.close_error = str(e)
    tally.leased_closed = ex.epoch.pool.stats().leased if ex.epoch is not None else 0
    for c in clients:               # a stuck client may answer once close() ended its stream
        c.join(0.5)
    tally.open_at_end = soak.ledger.open_now()[0]
    tally.open_jobs_at_end = ex.open_jobs
    if soak.crashes:
        tally.unexplained_count += soak.crashes
        tally.unexplained.append(f"{soak.crashes} soak client request(s) raised")
    wall = time.perf_counter() - soak.t0
    samples = tuple(soak.samples)
    limits = config.limits_for(wall)
    return SoakResult(samples, tally, tuple(evaluate(samples, tally, limits)),
                      rss_trend(samples, limits.warmup_s,
                                slope_mib_per_h=limits.rss_slope_mib_per_h,
                                floor_mib=limits.rss_floor_mib),
                      wall, "virtual device time" if driver.clock.virtual else "wall time",
                      soak.device_elapsed(), limits.warmup_s,
                      soak.ledger.goodput.report(soak.device_elapsed()))


def _hold(soak: _Soak, clients: list[threading.Thread],
          progress: Callable[[float, Sample], None] | None) -> None:
    """Sample while the clients send traffic: for the wall-clock duration, or until the
    driver's clock covered the device duration. The latter also ends when no client is
    left to move it (the executor ended Failed) or it stood still for ``stuck_s`` (then
    the ``stuck`` gate says so)."""
    config = soak.config
    if config.duration_s is not None:
        end = soak.t0 + config.duration_s
        while (left := end - time.perf_counter()) > 0:
            soak.stop.wait(min(left, config.sample_every))
            latest = soak.sample()
            if progress is not None:
                progress(min(latest.t, config.duration_s), latest)
        return
    goal = config.device_duration_s
    moved_at, last = time.perf_counter(), soak.device_elapsed()
    while (covered := soak.device_elapsed()) < goal:
        if not any(c.is_alive() for c in clients):
            soak.tally.short_of_goal = (f"no client left at {_span(covered)} of the "
                                        f"{_span(goal)} of device time asked")
            return
        now = time.perf_counter()
        if covered > last:
            moved_at, last = now, covered
        elif now - moved_at > config.stuck_s:
            soak.tally.short_of_goal = (f"device time stood still for {config.stuck_s:g} s "
                                        f"at {_span(covered)} of {_span(goal)}")
            return
        soak.stop.wait(config.sample_every)
        latest = soak.sample()
        if progress is not None:
            progress(min(latest.device_t, goal), latest)


def _span(seconds: float) -> str:
    """``seconds`` for a reader: 45.2 s, 12.5 min, 24.03 h."""
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


# ---- the report ------------------------------------------------------------------------
def write_report(result: SoakResult, out: Path, *, config: SoakConfig, about: dict[str, Any],
                 plots: bool = True) -> list[Path]:
    """``report.json``, ``report.md``, ``samples.csv`` and (``plots``) the PNGs in ``out``."""
    from calfsm.tools.soak_plots import write_plots

    out.mkdir(parents=True, exist_ok=True)
    fields = [f.name for f in attrs.fields(Sample)]
    with (out / "samples.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(fields)
        for s in result.samples:
            w.writerow(attrs.astuple(s))
    data = {"passed": result.passed, "about": about, "wall_s": result.wall_s,
            "device_s": result.device_s, "latency_clock": result.clock,
            "config": {k: v for k, v in attrs.asdict(config, recurse=False).items()
                       if k != "executor"} | {"warmup_s": result.warmup_s,
                                              "sample_s": config.sample_every},
            "gates": [attrs.asdict(g) for g in result.gates],
            "rss_trend": attrs.asdict(result.trend), "tally": result.tally.to_dict(),
            "goodput": None if result.goodput is None else result.goodput.to_dict()}
    (out / "report.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    (out / "report.md").write_text(_markdown(result, config, about))
    paths = [out / "report.md", out / "report.json", out / "samples.csv"]
    if plots:
        paths += write_plots(result.samples, result.trend, out, clock=result.clock,
                             title=f"calfsm soak ({about.get('driver', '?')}, "
                                   f"seed {config.seed}, {_span(result.device_s)} of "
                                   "device time)")
    return paths


def _markdown(result: SoakResult, config: SoakConfig, about: dict[str, Any]) -> str:
    t = result.tally
    last = result.samples[-1]
    lines = [f"# calfsm soak: {'PASS' if result.passed else 'FAIL'}", "",
             *(f"- {k}: {v}" for k, v in about.items()),
             f"- {_asked(config)}; wall time {_span(result.wall_s)}, warm-up "
             f"{result.warmup_s:.1f} s, {len(result.samples)} samples",
             f"- device time covered: {_span(result.device_s)} ({result.clock}"
             + (f", {result.device_s / result.wall_s:.1f} x the wall time"
                if result.wall_s > 0 and result.clock != "wall time" else "")
             + f"); jobs were on the device for {_span(t.device_busy_s)} of it"
             + (", the rest is the waits the executor sat out (timeouts, back-offs, "
                "recoveries)" if t.device_busy_s < 0.99 * result.device_s else ""),
             "", "| gate | result | detail |", "| --- | --- | --- |",
             *(f"| {g.name} | {'pass' if g.passed else 'FAIL'} | {g.detail} |"
               for g in result.gates),
             "", "| count | value |", "| --- | --- |",
             f"| requests issued | {sum(t.issued.values())} ({_kv(t.issued)}) |",
             f"| answers | {_kv(t.outcomes)} |",
             f"| jobs enqueued / answered | {t.jobs} / {t.jobs_answered} |",
             f"| device-side job errors (explained by point) | {t.device_errors} "
             f"({_kv(t.attributed)}) |",
             f"| faults fired by point | {_kv(t.fired) if t.fired is not None else 'n/a'} |",
             f"| decode steps by graph (rows per step) | {_decode_steps(t)} |",
             f"| recoveries / generation at end | {last.recoveries} / {last.generation} |",
             f"| lifecycle at end | {t.final_state} |",
             f"| RSS at start / end | {result.samples[0].rss / 2**20:.1f} / "
             f"{last.rss / 2**20:.1f} MiB |", ""]
    if result.goodput is not None:
        lines += [f"## Latency and goodput ({', '.join(GOODPUT_KINDS)} requests; ms and "
                  f"rates on the {result.clock}, errors and refusals counted as misses)",
                  "", *result.goodput.markdown(rate_unit="s of device time"
                                               if result.clock != "wall time" else "s"), ""]
    return "\n".join(lines)


def _asked(config: SoakConfig) -> str:
    if config.duration_s is not None:
        return f"duration {_span(config.duration_s)} of wall time"
    return f"duration {_span(config.device_duration_s or 0.0)} of device time"


def _kv(counts: dict[str, int] | None) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted((counts or {}).items())) or "none"


def _decode_steps(t: Tally) -> str:
    """Decode steps of batch graphs or shape buckets, each graph's with its mean rows
    ("none": every step ran alone on a one-row graph, which reports none)."""
    graphs = sorted(t.decode_steps, key=lambda g: (len(g), g))     # b2 before b16
    return ", ".join(f"{g}: {t.decode_steps[g]} ({t.decode_rows[g] / t.decode_steps[g]:.2f})"
                     for g in graphs) or "none"


# ---- the command -------------------------------------------------------------------------
_DESCRIPTION = """\
Hold a seeded mixed workload (streams, one-shot generations, cancels, bad requests) on the
executor under a fault plan for a wall-clock duration (--duration) or until the driver's
clock covered an amount of device time (--device-duration); sample RSS, leased buffers,
generation, lifecycle, latency and device time; judge the stability gates of spec 13.2
(RSS slope after warm-up within --rss-slope MiB/h, leased 0 at the end, no unexplained
device exception, nothing stuck, every request answered once); write report.md,
report.json, samples.csv and PNG plots to --out. The report states the device time the
soak covered: on the simulated device's virtual clock far more than the wall time."""
_EPILOG = """\
exit status:
  0  every gate passed
  1  a gate failed (the report says which and why)
  2  bad usage or input: an option, a manifest, a fault plan
  3  the executor did not start
"""


def add_parser(sub: Any, formatter_class: type = argparse.HelpFormatter
               ) -> argparse.ArgumentParser:
    """The ``soak`` subcommand of ``calfsm``."""
    p = sub.add_parser("soak", help="hold a fault-injected workload and judge the stability "
                       "gates", description=_DESCRIPTION, epilog=_EPILOG,
                       formatter_class=formatter_class)
    how_long = p.add_mutually_exclusive_group()
    how_long.add_argument("--duration", default=None, metavar="TIME",
                          help="how long to send traffic, in wall time: 90s, 10m, 1h, or "
                               "seconds (default 60s)")
    how_long.add_argument("--device-duration", default=None, metavar="TIME",
                          help="instead: send traffic until the driver's clock covered this "
                               "much device time (e.g. 24h; on the simulated device's "
                               "virtual clock far more than the wall time it takes)")
    p.add_argument("--faults", default="swarm", metavar="none|swarm|PLAN.json",
                   help="none, swarm (a seeded random mix of --kinds) or a fault plan file")
    p.add_argument("--seed", type=int, default=0, metavar="N",
                   help="seeds the clients, the swarm plan and the driver")
    p.add_argument("--kinds", default=None, metavar="K,K,...",
                   help="swarm kinds to draw from (default: "
                        f"{','.join(SOAK_KINDS)}, and on a batch calbin also "
                        "row_ccu_exception, a fault of one row of a batch job); left out "
                        f"by default: {', '.join(EXCLUDED_KINDS)} (why: docs/soak.md)")
    p.add_argument("--fault-rate", type=float, default=0.005, metavar="R",
                   help="swarm: each drawn kind fires on about this fraction of the calls "
                        "at its point, in (0, 1]")
    p.add_argument("--driver", default="sim", choices=driver_names(),
                   help="sim (simulated, virtual clock) or calrt (the C ABI: the native "
                        "emulator unless CALFSM_CALRT_LIB names a vendor shim)")
    p.add_argument("--manifest", default="qwen3-b1", metavar="NAME|PATH",
                   help=f"a built-in ({', '.join(builtin_manifest_names())}) or a file")
    p.add_argument("--clients", type=int, default=4, metavar="N",
                   help="client threads sending requests at once")
    p.add_argument("--max-tokens", type=int, default=32, metavar="N",
                   help="a request's max_tokens is drawn from 1..N")
    p.add_argument("--max-prompt", type=int, default=64, metavar="N",
                   help="a prompt's length is drawn from 1..N")
    p.add_argument("--warmup", default=None, metavar="TIME",
                   help="samples before this are not judged for RSS growth (default: 20%% "
                        "of the wall time, at most 60s)")
    p.add_argument("--sample-every", default=None, metavar="TIME",
                   help="sampling period in wall time (default: --duration / 240, within "
                        "0.1s..5s; 1s with --device-duration)")
    p.add_argument("--stuck", default="30s", metavar="TIME",
                   help="a request open longer than this is stuck")
    p.add_argument("--rss-slope", type=float, default=RSS_SLOPE_MIB_PER_H, metavar="MIB/H",
                   help="the RSS gate's bound on the Theil-Sen slope of RSS after warm-up, "
                        "in MiB per hour, whatever the process's size")
    p.add_argument("--rss-floor", type=float, default=RSS_FLOOR_MIB, metavar="MIB",
                   help="the RSS gate's resolution: a trend explaining at most this much "
                        "growth over the judged window passes whatever its slope (clean "
                        "soaks swing by up to 25 MiB; docs/soak.md)")
    p.add_argument("--execution-timeout", default="1s", metavar="TIME",
                   help="the executor's execution deadline: how soon a hung job is given "
                        "up and the device reset")
    p.add_argument("--evidence-dir", default=None, metavar="DIR",
                   help=EVIDENCE_DIR_HELP + "; on a batch manifest it decides whether "
                        "the soak's steps carry several rows")
    p.add_argument("--goodput", nargs="+", default=[DEFAULT_SLOS], metavar="KEY:MS",
                   help="the SLOs of the report's goodput, vLLM's form: ttft, tpot, e2el "
                        f"in ms of the driver's clock (default {DEFAULT_SLOS})")
    p.add_argument("--out", default="soak-out", metavar="DIR",
                   help="directory for report.md, report.json, samples.csv, soak-*.png")
    p.add_argument("--shape-cost", default="graph", choices=("graph", "rows"),
                   help="sim: what a step costs: graph, a static calbin's (its graph's "
                        "whole batch, padded rows included; the default), or rows, a "
                        "dynamic-shape device's (the rows it carries); both are models")
    p.add_argument("--no-plots", action="store_true", help="write no PNGs")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p




def _config(args: argparse.Namespace) -> SoakConfig:
    for name in ("clients", "max_tokens", "max_prompt"):
        if getattr(args, name) < 1:
            raise InvalidArgument(f"--{name.replace('_', '-')}: must be >= 1, got "
                                  f"{getattr(args, name)}", stage="soak")
    for name in ("rss_slope", "rss_floor"):
        if not 0 <= getattr(args, name) < float("inf"):
            raise InvalidArgument(f"--{name.replace('_', '-')}: must be a number >= 0",
                                  stage="soak")
    device = None if args.device_duration is None else parse_duration(args.device_duration)
    duration = None if device is not None else parse_duration(args.duration or "60s")
    warmup = None if args.warmup is None else parse_duration(args.warmup)
    if warmup is not None and duration is not None and warmup >= duration:
        raise InvalidArgument("--warmup must be shorter than --duration", stage="soak")
    return SoakConfig(
        duration_s=duration, device_duration_s=device, seed=args.seed, clients=args.clients,
        max_tokens=args.max_tokens, max_prompt=args.max_prompt, warmup_s=warmup,
        sample_s=None if args.sample_every is None else parse_duration(args.sample_every),
        stuck_s=parse_duration(args.stuck), rss_slope_mib_per_h=args.rss_slope,
        rss_floor_mib=args.rss_floor, slos=parse_slos(args.goodput),
        executor=ExecutorConfig(execution_timeout_s=parse_duration(args.execution_timeout),
                                evidence_dir=args.evidence_dir))


def _latency_of(args: argparse.Namespace) -> dict[str, Any]:
    """The simulated device's plausible figures priced as ``--shape-cost`` says (a static
    calbin's by default); other drivers keep their own latency."""
    if args.driver != "sim":
        return {}
    from calfsm.drivers.sim import LatencyModel
    return {"latency": attrs.evolve(LatencyModel.virtual_default(),
                                    shape_cost=args.shape_cost)}


def _kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    if not kinds:
        raise InvalidArgument("--kinds: name at least one kind", stage="soak")
    return kinds


def main(args: argparse.Namespace) -> int:
    """``calfsm soak`` with parsed ``args``; returns the exit status."""
    def error(message: str) -> None:
        print(f"calfsm: {message}", file=sys.stderr)

    try:
        config = _config(args)
        if not 0 < args.fault_rate <= 1:
            raise InvalidArgument(f"--fault-rate must be in (0, 1], got {args.fault_rate}",
                                  stage="soak")
        manifest = manifest_from_option(args.manifest, stage="soak")
        kinds = _kinds(args.kinds) if args.kinds is not None else soak_kinds(manifest)
        plan = soak_plan(args.faults, args.seed, config.clients, rate=args.fault_rate,
                         kinds=kinds)
        driver = load_driver(args.driver, manifest_or_calbin=manifest, seed=args.seed,
                             faults=plan, trace=False, **_latency_of(args))
        if not args.no_plots:
            from calfsm.tools.soak_plots import pyplot
            pyplot()                    # fail now, not after the soak, without matplotlib
    except CalfsmError as e:
        error(f"error: {e.message}")
        return EXIT_USAGE
    except OSError as e:
        error(f"error: {e}")
        return EXIT_USAGE
    about = {"driver": args.driver, "manifest": args.manifest, "seed": args.seed,
             "clients": config.clients, "fault plan": plan.describe(),
             "evidence dir": args.evidence_dir or "(default rule)"}
    result = _run(config, driver, manifest, quiet=args.quiet)
    if result is None:
        return EXIT_START_FAILED
    out = Path(args.out)
    paths = write_report(result, out, config=config, about=about, plots=not args.no_plots)
    _print(result, paths)
    if not result.passed:
        error("soak failed: " + ", ".join(g.name for g in result.gates if not g.passed))
        return EXIT_FAILED_GATE
    return EXIT_OK


def _run(config: SoakConfig, driver: Driver, manifest: Manifest, *, quiet: bool
         ) -> SoakResult | None:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("calfsm").setLevel(logging.CRITICAL)   # thousands of expected faults
    columns = (TextColumn("soak"), BarColumn(), TextColumn("{task.description}"),
               TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), disable=quiet,
                  transient=True) as bar:
        task = bar.add_task("starting", total=config.duration_s or config.device_duration_s)

        def progress(elapsed: float, s: Sample) -> None:
            bar.update(task, completed=elapsed, description=(
                f"{s.answered} answered, {s.recoveries} recoveries, gen {s.generation}, "
                f"RSS {s.rss / 2**20:.0f} MiB, leased {s.leased}, device time "
                f"{_span(s.device_t)}"))
        try:
            return run_soak(config, driver, manifest, progress=progress)
        except CalfsmError as e:
            print(f"calfsm: start-up failed: {e}", file=sys.stderr)
            return None


def _print(result: SoakResult, paths: list[Path]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"calfsm soak — {'PASS' if result.passed else 'FAIL'}")
    table.add_column("gate")
    table.add_column("result")
    table.add_column("detail")
    for g in result.gates:
        table.add_row(g.name, "pass" if g.passed else "[red]FAIL[/red]", g.detail)
    console = Console()
    console.print(table)
    console.print(f"device time covered: {_span(result.device_s)} ({result.clock}) in "
                  f"{_span(result.wall_s)} of wall time")
    if result.goodput is not None:
        g = result.goodput
        unit = "s of device time" if result.clock != "wall time" else "s"
        console.print(f"goodput ({format_slos(g.slos)}): {g.goodput_rps:.2f} req/{unit}, "
                      f"{g.attainment['all']:.1%} of {g.requests} requests met every SLO")
    console.print("wrote " + ", ".join(str(p) for p in paths))
