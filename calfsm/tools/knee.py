"""The knee: the highest request rate at which enough requests still meet every SLO,
found in a few runs, as users find it with guidellm's sweep.

Two parts:

- :func:`find_knee`: a search over the rate for any ``measure(rate) -> attainment``
  (the fraction of the requests offered at that rate that met every SLO; errors are
  misses). A rate *passes* when its attainment is at least the target (DistServe's
  "SLO attainment goal", e.g. 90%). Bracket: from ``start``, double while it passes,
  halve while it fails, until one passing and one failing rate enclose the knee; then
  bisect until the bracket is narrower than ``tolerance`` of its low end or the run
  budget is spent. The answer is the highest passing rate seen below the lowest failing
  one. From a start within 2x of the knee that is 2 runs of bracket and 5 of bisection
  (1/32 < 4%): 7 runs. :func:`sweep_knee` is the slow reference: every rate of a fine
  grid, upwards, to the first that fails.
- :class:`PoissonLoad`: one run of open-loop Poisson arrivals at a rate against a
  step-mode executor on the simulated device's virtual clock: deterministic (a seed is
  a run) and much faster than real time. Arrivals are drawn once per seed as unit
  exponential gaps scaled by ``1/rate`` (common random numbers: two rates see the same
  requests in the same order, so attainment falls with the rate without sampling noise
  between runs). A request is measured from its scheduled arrival: when the device step
  in flight ends past it, the request reaches the executor then (it would have waited
  for that step anyway on a device that runs one job at a time).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import attrs

from calfsm.errors import CalfsmError, InvalidArgument
from calfsm.executor import DeviceExecutor
from calfsm.generate.sampling import SamplingParams
from calfsm.generate.stream import Stream
from calfsm.manifest import TaskKind
from calfsm.runtime.stepper import StepScheduler
from calfsm.telemetry.goodput import GoodputReport, RequestRecord, summarize

__all__ = ["KneeResult", "PoissonLoad", "Probe", "find_knee", "sweep_knee"]


@attrs.frozen
class Probe:
    """One run: its offered rate, attainment, and whether it met the target."""

    rate: float
    attainment: float
    passed: bool


@attrs.frozen
class KneeResult:
    """The highest passing rate found (None: even the lowest rate tried failed), the
    bracket it ends in (``high`` None: no rate tried failed) and every run in order."""

    rate: float | None
    high: float | None
    probes: tuple[Probe, ...]

    @property
    def runs(self) -> int:
        return len(self.probes)


def _probe(measure: Callable[[float], float], rate: float, target: float,
           probes: list[Probe]) -> bool:
    att = float(measure(rate))
    probes.append(Probe(rate, att, att >= target))
    return att >= target


def find_knee(measure: Callable[[float], float], *, start: float, target: float = 0.9,
              max_runs: int = 8, tolerance: float = 0.04, factor: float = 2.0,
              min_rate: float = 1e-6, max_rate: float = 1e9) -> KneeResult:
    """Bracket, then bisect, the highest rate whose ``measure`` (attainment in [0, 1]) is
    at least ``target``, in at most ``max_runs`` calls of ``measure``."""
    if not (0 < start < math.inf and 0 < target <= 1 and max_runs >= 1
            and tolerance > 0 and factor > 1):
        raise InvalidArgument("find_knee: start > 0, 0 < target <= 1, max_runs >= 1, "
                              "tolerance > 0 and factor > 1", stage="knee")
    probes: list[Probe] = []
    lo: float | None = None
    hi: float | None = None
    rate = start
    while len(probes) < max_runs and (lo is None or hi is None):
        if _probe(measure, rate, target, probes):
            lo = rate
            if hi is None:
                if rate >= max_rate:
                    break
                rate = min(max_rate, rate * factor)
        else:
            hi = rate
            if lo is None:
                if rate <= min_rate:
                    break
                rate = max(min_rate, rate / factor)
    while len(probes) < max_runs and lo is not None and hi is not None \
            and (hi - lo) > tolerance * lo:
        mid = (lo + hi) / 2
        if _probe(measure, mid, target, probes):
            lo = mid
        else:
            hi = mid
    return KneeResult(lo, hi, tuple(probes))


def sweep_knee(measure: Callable[[float], float], rates: list[float], *,
               target: float = 0.9) -> KneeResult:
    """The fine sweep: ``rates`` in increasing order until the first that fails; the
    knee is the last that passed before it."""
    probes: list[Probe] = []
    lo = hi = None
    for rate in sorted(rates):
        if _probe(measure, rate, target, probes):
            lo = rate
        else:
            hi = rate
            break
    return KneeResult(lo, hi, tuple(probes))


@attrs.frozen
class PoissonLoad:
    """Open-loop Poisson traffic for a step-mode executor: ``requests`` requests, each a
    prompt of ``prompt_tokens`` (low, high) random ids and ``output_tokens`` (low, high)
    generated tokens (fixed: ``ignore_eos`` is the default of a token-id stream),
    drawn from ``seed``."""

    requests: int = 200
    prompt_tokens: tuple[int, int] = (8, 64)
    output_tokens: tuple[int, int] = (8, 24)
    seed: int = 0

    def workload(self, vocab: int) -> list[tuple[float, list[int], int]]:
        """(unit exponential gap, prompt, output tokens) per request: the same for every
        rate (scaled by ``1 / rate`` when run)."""
        rng = random.Random(self.seed)
        out = []
        for _ in range(self.requests):
            gap = rng.expovariate(1.0)
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(*self.prompt_tokens))]
            out.append((gap, prompt, rng.randint(*self.output_tokens)))
        return out

    def run(self, executor: DeviceExecutor, rate: float,
            slos: dict[str, float]) -> GoodputReport:
        """Offer the workload at ``rate`` requests per second of the executor's (virtual)
        clock; every request answered, the report over first arrival to last answer."""
        if executor.config.threaded or not executor.clock.virtual:
            raise InvalidArgument("PoissonLoad runs a step-mode executor on a virtual "
                                  "clock (ExecutorConfig(threaded=False))", stage="knee")
        clock, steps = executor.clock, executor.steps
        sched = StepScheduler(executor, self.seed)
        vocab = executor.epoch.contract(TaskKind.DECODE).vocab
        t = clock.now()
        arrivals = []
        for gap, prompt, n in self.workload(vocab):
            t += gap / rate
            arrivals.append((t, prompt, n))
        t_first = arrivals[0][0] if arrivals else t
        records: list[RequestRecord] = []
        live: list[tuple[float, float, Stream]] = []   # (arrival, created, stream)
        i = 0
        while i < len(arrivals) or live:
            now = clock.now()
            while i < len(arrivals) and arrivals[i][0] <= now:
                at, prompt, n = arrivals[i]
                i += 1
                try:
                    stream = executor.generate(prompt, SamplingParams(max_tokens=n))
                except CalfsmError:
                    records.append(RequestRecord(ok=False))
                    continue
                live.append((at, now, stream))
            if not sched.enabled():
                nxt = min(steps.next_timer(), arrivals[i][0] if i < len(arrivals)
                          else math.inf)
                if math.isinf(nxt):
                    raise RuntimeError("the load is stuck: nothing can move")
                clock.advance_to(max(nxt, clock.now()))
            else:
                sched.step()
            if any(s.done() for _, _, s in live):
                still = []
                for at, created, s in live:
                    if s.done():
                        records.append(RequestRecord.from_result(
                            s.result(0), waited_s=created - at))
                    else:
                        still.append((at, created, s))
                live = still
        return summarize(records, clock.now() - t_first, slos)
