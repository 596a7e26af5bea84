"""The stability gates of a soak (spec 13.2), as pure functions over what a soak recorded.

Theory of operation
-------------------
A soak (:mod:`calfsm.tools.soak`) records a time series of :class:`Sample`\\ s and a
:class:`Tally` of every request and job it sent. The gates judge those records only, so
each one is unit-tested on synthetic data and a broken gate is caught without a soak:

- **rss** — no monotonic RSS growth after warm-up, judged as a rate against absolute
  bounds, whatever the process's size. The statistic is the Theil–Sen slope (the median
  of the slopes between every pair of post-warm-up samples: one allocation step or a
  noisy sample cannot move it, a steady leak does); the growth it explains is that
  slope times the length of the post-warm-up window. It passes when the slope is at
  most ``rss_slope_mib_per_h`` or the growth at most ``rss_floor_mib`` (the gate's
  resolution: the allocator's own swings, up to 25 MiB in clean soaks, look like a
  slope over a short window), i.e. when the slope is at most ``max(rss_slope_mib_per_h,
  rss_floor_mib / window)``. At least :data:`MIN_TREND_SAMPLES` post-warm-up samples
  are needed to judge; past :data:`MAX_TREND_SAMPLES` an evenly spaced subset is used
  (the pairs grow with the square of the samples).
- **leased** — no buffer lease outlives the soak: 0 leased once the workload drained,
  and 0 after ``close()``.
- **device** — no unexplained device exception: every job error of a device-side
  category (device, unknown, artifact, compatibility) is explained by a rule of the
  fault plan that injects it (:func:`explain`), or is collateral of a recovery (its
  generation was retired when it was answered); a programming error (a bug) is never
  explained (one only the executor's counters saw, its caller already answered, is
  reported as a warning); on a driver that counts its faults, no point explains more
  errors than it fired; the executor did not end Failed unless the plan fails resets.
- **stuck** — no stuck job or stream: nothing open when the workload drained, the
  executor idle then, no request open longer than ``stuck_s`` at any sample,
  ``close()`` drained the device, and a soak held for an amount of device time covered
  it (unless the executor ended Failed: the device gate judges that).
- **once** — every request answered exactly once: issued == answered, no second answer
  (request or job), a stream's events are its result's tokens, and a bad request never
  got a result (it is refused, or ends with an error).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import numpy as np

from calfsm.errors import CalfsmError, ErrorCategory, Unavailable

__all__ = ["DEVICE_CATEGORIES", "MAX_TREND_SAMPLES", "MIN_TREND_SAMPLES",
           "RSS_FLOOR_MIB", "RSS_SLOPE_MIB_PER_H", "Gate", "GateLimits", "RssTrend", "Sample",
           "Tally", "evaluate", "explain", "rss_trend"]

#: post-warm-up samples the RSS trend needs before it judges anything
MIN_TREND_SAMPLES = 8
#: at most this many post-warm-up samples (evenly spaced) enter the Theil–Sen slope
MAX_TREND_SAMPLES = 2000
#: the default bound on the RSS slope after warm-up: 64 MiB an hour (1.5 GiB a day).
#: Clean soaks measured below it once their window passes half an hour (docs/soak.md).
RSS_SLOPE_MIB_PER_H = 64.0
#: the default resolution of the RSS gate: growth the trend explains up to 32 MiB is
#: not judged. Clean soaks on qwen3-b1 explained up to 16 MiB (allocator swings of
#: 12-25 MiB between samples), on tiny up to 2 MiB; a 1 MiB/s leak explains 48 MiB over
#: the 48 s judged of a 60 s soak.
RSS_FLOOR_MIB = 32.0
#: job error categories that say the device (or the executor's view of it) went wrong
DEVICE_CATEGORIES = frozenset({ErrorCategory.DEVICE, ErrorCategory.UNKNOWN,
                               ErrorCategory.ARTIFACT, ErrorCategory.COMPATIBILITY})
_MIB = 1 << 20

#: error stage -> the (point, effect) rules that inject an error there
STAGE_RULES: dict[str, frozenset[tuple[str, str]]] = {
    "csr": frozenset({("set_csr", "code")}),
    "kv_seq": frozenset({("set_kv_seq", "code")}),
    "submit": frozenset({("infer", "code")}),
    "wait": frozenset({("wait", "code"), ("infer", "hang")}),
    "status": frozenset({("infer", "ccu_exception")}),
    "row": frozenset({("infer", "row_ccu_exception")}),
    "output": frozenset({("infer", "short_output"), ("infer", "nan"), ("infer", "inf"),
                         ("output_bytes", "code")}),
    "slice": frozenset({("slice_tensor", "code"), ("undo_slice", "code")}),
    "lease": frozenset({("map_buffer", "code"), ("undo_slice", "code")}),
    "kv_apply": frozenset({("kv_apply", "refuse")}),
    "kv_reset": frozenset({("kv_release", "code")}),
    "destroy_buffers": frozenset({("destroy_buffers", "code")}),
}


#: stages where the executor judges what the device returned: an error there is the
#: device's even without a CalRT code (a CCU exception, bad logits)
OBSERVED_STAGES = frozenset({"status", "output", "wait", "row"})


@attrs.frozen
class Sample:
    """The soak's state at one moment (``t``: wall seconds since the soak began;
    ``device_t``: seconds the driver's clock moved since then, which on a virtual clock
    is the device time the soak covered). Latencies are percentiles over the requests
    answered since the sample before, in milliseconds on the driver's clock (None
    without any)."""

    t: float
    rss: int
    leased: int
    quarantined: int
    generation: int
    lifecycle: str
    recoveries: int
    faults: int | None          # faults the driver fired so far (None: it cannot say)
    answered: int
    open_requests: int
    oldest_open_s: float        # age of the oldest open request (0: none open)
    open_jobs: int
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    tpot_p50_ms: float | None = None
    tpot_p99_ms: float | None = None
    device_t: float = 0.0


@attrs.define
class Tally:
    """Everything a soak counted (filled by the workload, judged by the gates)."""

    issued: Counter[str] = attrs.Factory(Counter)      # request kind -> issued
    outcomes: Counter[str] = attrs.Factory(Counter)    # outcome -> requests
    open_requests: int = 0          # issued and not answered when the workload drained
    open_at_end: int = 0            # ... and still not answered after close()
    double_answers: int = 0         # a request or job answered a second time
    token_mismatches: int = 0       # a stream whose events are not its result's tokens
    misanswered_bad: int = 0        # a bad request that got a result, or a device error
    jobs: int = 0                   # jobs enqueued
    jobs_answered: int = 0
    device_busy_s: float = 0.0      # summed submit-to-end time of the jobs that were submitted
    open_jobs: int = 0              # enqueued and unanswered when the workload drained
    open_jobs_at_end: int = 0       # ... and still unanswered after close()
    device_errors: int = 0          # job errors of a DEVICE_CATEGORIES category
    unexplained: list[str] = attrs.Factory(list)       # the first few, one line each
    unexplained_count: int = 0
    attributed: Counter[str] = attrs.Factory(Counter)  # fault point -> errors it explains
    fired: dict[str, int] | None = None                # fault point -> times fired
    #: the most rows one device job carried (continuous batching): a fault of a job
    #: fails each of its rows, so it explains up to that many errors
    rows_per_job: int = 1
    #: decode steps the device ran, by graph, and the rows they carried (a batching
    #: soak shows it batched: rows / steps above 1)
    decode_steps: Counter[str] = attrs.Factory(Counter)
    decode_rows: Counter[str] = attrs.Factory(Counter)
    leased_drained: int = 0         # leased once the workload drained
    leased_closed: int = 0          # leased after close()
    close_error: str | None = None  # close() could not drain the device
    idle_after_drain: bool = True   # the executor had no job left in any queue
    programming_errors: int = 0     # job errors of category programming (bugs) delivered
    executor_bugs: int = 0          # programming errors the executor's counters hold
    final_state: str = "Ready"
    failure_reason: str | None = None
    plan_fails_resets: bool = False
    short_of_goal: str | None = None  # a device-time soak ended before it covered its goal

    def to_dict(self) -> dict[str, Any]:
        return {k: dict(v) if isinstance(v, Counter) else v
                for k, v in attrs.asdict(self, recurse=False).items()}


@attrs.frozen
class GateLimits:
    """Where each gate draws its line."""

    warmup_s: float
    stuck_s: float = 30.0
    rss_slope_mib_per_h: float = RSS_SLOPE_MIB_PER_H
    rss_floor_mib: float = RSS_FLOOR_MIB


@attrs.frozen
class Gate:
    name: str
    passed: bool
    detail: str


@attrs.frozen
class RssTrend:
    """The post-warm-up RSS trend: the Theil–Sen slope (bytes per second) over the
    samples after warm-up, the growth it explains over their window, and the bounds it
    is judged against (:attr:`bound_bps`: the larger of the slope bound and the floor
    spread over the window)."""

    samples: int
    slope_bps: float
    window_s: float
    growth: float
    median: float
    start_t: float
    slope_bound_bps: float
    floor: float

    @property
    def bound_bps(self) -> float:
        """The slope the gate allows over this window."""
        spread = self.floor / self.window_s if self.window_s > 0 else math.inf
        return max(self.slope_bound_bps, spread)

    @property
    def passed(self) -> bool:
        return self.samples >= MIN_TREND_SAMPLES and self.slope_bps <= self.bound_bps

    @property
    def slope_mib_per_h(self) -> float:
        return self.slope_bps * 3600 / _MIB


def rss_trend(samples: Sequence[Sample], warmup_s: float, *,
              slope_mib_per_h: float = RSS_SLOPE_MIB_PER_H,
              floor_mib: float = RSS_FLOOR_MIB) -> RssTrend:
    """The RSS trend over the samples taken at or after ``warmup_s``."""
    post = [s for s in samples if s.t >= warmup_s]
    bound, floor = slope_mib_per_h * _MIB / 3600, floor_mib * _MIB
    if len(post) < 2:
        return RssTrend(len(post), 0.0, 0.0, 0.0, 0.0, warmup_s, bound, floor)
    t = np.array([s.t for s in post], dtype=np.float64)
    rss = np.array([s.rss for s in post], dtype=np.float64)
    window = float(t[-1] - t[0])
    median = float(np.median(rss))
    if len(post) > MAX_TREND_SAMPLES:
        keep = np.unique(np.linspace(0, len(post) - 1, MAX_TREND_SAMPLES).round().astype(int))
        t, rss = t[keep], rss[keep]
    i, j = np.triu_indices(len(t), k=1)
    dt = t[j] - t[i]
    ok = dt > 0
    slope = float(np.median((rss[j] - rss[i])[ok] / dt[ok])) if ok.any() else 0.0
    return RssTrend(len(post), slope, window, slope * window, median, float(t[0]), bound,
                    floor)


def explain(err: CalfsmError, rules: Iterable[Any], generation: int) -> str | None:
    """Why a job met ``err``, or None: unexplained.

    ``"refusal"``: the executor's own 503 while it recovers (no device call failed and
    nothing the device returned was judged bad); ``"point:<name>"``: a rule of the plan
    injects it there; ``"collateral"``: its generation was retired by a recovery, or the
    executor answered it retry-later because a reset overtook it; ``"other"``: not a
    device-side error. A programming error (a bug) is never explained."""
    if err.category is ErrorCategory.PROGRAMMING:
        return None
    if err.category not in DEVICE_CATEGORIES:
        return "other"
    if isinstance(err, Unavailable) and err.calrt_code is None \
            and err.stage not in OBSERVED_STAGES:
        return "refusal"
    if err.generation is not None and err.generation < generation:
        return "collateral"
    rules = list(rules)
    wanted = STAGE_RULES.get(err.stage or "", frozenset())
    for r in rules:
        if (r.point, r.effect) in wanted:
            return f"point:{r.point}"
    for r in rules:
        if err.calrt_code is not None and r.effect == "code" \
                and r.effective_code == err.calrt_code:
            return f"point:{r.point}"
    if isinstance(err, Unavailable) and err.retry_after_s is not None \
            and err.stage not in OBSERVED_STAGES:
        # the executor's own verdict: a reset overtook the job while it was prepared
        # (the generation moves on only once the reset is done)
        return "collateral"
    return None


def _fmt_mib(n: float) -> str:
    return f"{n / _MIB:.1f} MiB"


def _rss_gate(samples: Sequence[Sample], limits: GateLimits) -> Gate:
    trend = rss_trend(samples, limits.warmup_s, slope_mib_per_h=limits.rss_slope_mib_per_h,
                      floor_mib=limits.rss_floor_mib)
    if trend.samples < MIN_TREND_SAMPLES:
        return Gate("rss", False, f"only {trend.samples} samples after the "
                    f"{limits.warmup_s:g} s warm-up (need {MIN_TREND_SAMPLES}): run longer")
    return Gate("rss", trend.passed,
                f"Theil-Sen slope {trend.slope_mib_per_h:+.1f} MiB/h over "
                f"{trend.window_s:.0f} s = {_fmt_mib(trend.growth)} growth (bound "
                f"{limits.rss_slope_mib_per_h:g} MiB/h, or {limits.rss_floor_mib:g} MiB "
                f"over the window: {trend.bound_bps * 3600 / _MIB:.0f} MiB/h here; median "
                f"{_fmt_mib(trend.median)})")


def _leased_gate(tally: Tally) -> Gate:
    ok = tally.leased_drained == 0 and tally.leased_closed == 0
    return Gate("leased", ok, f"leased {tally.leased_drained} when drained, "
                f"{tally.leased_closed} after close")


def _device_gate(tally: Tally) -> Gate:
    problems = []
    if tally.unexplained_count:
        problems.append(f"{tally.unexplained_count} unexplained: "
                        + "; ".join(tally.unexplained[:3]))
    if tally.fired is not None:
        rows = max(1, tally.rows_per_job)
        over = {p: n for p, n in tally.attributed.items()
                if n > rows * tally.fired.get(p, 0)}
        if over:
            each = f" x {rows} rows per job" if rows > 1 else ""
            problems.append("more errors than faults fired at " + ", ".join(
                f"{p} ({n} > {tally.fired.get(p, 0)}{each})"
                for p, n in sorted(over.items())))
    if tally.final_state == "Failed" and not tally.plan_fails_resets:
        problems.append(f"executor Failed without an injected reset failure: "
                        f"{tally.failure_reason}")
    if tally.executor_bugs > tally.programming_errors:
        # a bug only the executor's counters saw: the caller had its answer already
        problems.append(f"the executor counted "
                        f"{tally.executor_bugs - tally.programming_errors} programming "
                        "error(s) no job delivered")
    detail = "; ".join(problems) or (
        f"{tally.device_errors} device-side job errors, all explained "
        f"(by point: {dict(sorted(tally.attributed.items())) or 'none'})")
    return Gate("device", not problems, detail)


def _stuck_gate(samples: Sequence[Sample], tally: Tally, limits: GateLimits) -> Gate:
    oldest = max((s.oldest_open_s for s in samples), default=0.0)
    problems = []
    if tally.open_requests:
        problems.append(f"{tally.open_requests} request(s) still open after the drain")
    if tally.open_jobs:
        problems.append(f"{tally.open_jobs} job(s) still open after the drain")
    if oldest > limits.stuck_s:
        problems.append(f"a request stayed open {oldest:.1f} s (limit {limits.stuck_s:g} s)")
    if not tally.idle_after_drain:
        problems.append("the executor was not idle after the drain")
    if tally.close_error:
        problems.append(f"close: {tally.close_error}")
    if tally.short_of_goal and tally.final_state != "Failed":
        # an executor that ended Failed is the device gate's to judge
        problems.append(tally.short_of_goal)
    return Gate("stuck", not problems, "; ".join(problems) or
                f"nothing open at the end; oldest open request {oldest:.2f} s")


def _once_gate(tally: Tally) -> Gate:
    issued = sum(tally.issued.values())
    answered = sum(tally.outcomes.values())
    problems = []
    if answered + tally.open_at_end != issued:
        problems.append(f"{issued} issued, {answered} answered, {tally.open_at_end} open")
    if tally.jobs_answered + tally.open_jobs_at_end != tally.jobs:
        problems.append(f"{tally.jobs} jobs, {tally.jobs_answered} answered, "
                        f"{tally.open_jobs_at_end} open")
    for what, n in (("second answers", tally.double_answers),
                    ("streams whose events differ from their result", tally.token_mismatches),
                    ("bad requests not refused", tally.misanswered_bad)):
        if n:
            problems.append(f"{n} {what}")
    return Gate("once", not problems and issued > 0, "; ".join(problems) or
                f"{issued} requests and {tally.jobs} jobs, each answered once")


def evaluate(samples: Sequence[Sample], tally: Tally, limits: GateLimits) -> list[Gate]:
    """Every gate, in the order of spec 13.2."""
    return [_rss_gate(samples, limits), _leased_gate(tally), _device_gate(tally),
            _stuck_gate(samples, tally, limits), _once_gate(tally)]
