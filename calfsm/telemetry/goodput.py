"""Latency percentiles, SLO attainment and goodput of a set of requests: the one
computation the soak's report and the benchmarks share.

Goodput is vLLM's (``vllm bench serve --goodput ttft:200 tpot:50 e2el:5000``, after
DistServe): the requests per second that met **every** service-level objective, over
the run's duration. An SLO bounds one per-request figure, in milliseconds:

- ``ttft``: time to first token;
- ``tpot``: time per output token after the first, ``(e2el - ttft) / (tokens - 1)``
  (0 for a one-token answer, as vLLM counts it);
- ``e2el``: end-to-end latency.

A request meets an SLO when its figure is at most the bound. A request that failed (an
error, a refusal: anything but a finished answer) meets none: it counts in the
denominator of every attainment and never in goodput. ITL (every gap between two
tokens, pooled over the requests) is reported with the others but, as in vLLM, bounds
nothing: a TPOT bound is its per-request mean.

Percentiles are numpy's linear interpolation (``np.percentile``), vLLM's too.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import numpy as np

from calfsm.errors import InvalidArgument

__all__ = ["METRICS", "PERCENTILES", "SLO_METRICS", "GoodputReport", "GoodputTally",
           "RequestRecord", "format_slos", "meets", "parse_slos", "summarize"]

#: the figures reported per request (``itl`` pooled over every gap)
METRICS = ("ttft", "tpot", "itl", "e2el")
#: the figures an SLO may bound (vLLM's ``--goodput`` keys)
SLO_METRICS = ("ttft", "tpot", "e2el")
#: the percentiles reported
PERCENTILES = (50, 90, 99)


@attrs.frozen
class RequestRecord:
    """One request as a client saw it. ``ok``: it ended with an answer (a finished
    generation); a refusal or an error is ``ok=False`` and its timings may be None.
    Times in seconds, measured from the request's arrival."""

    ok: bool
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: tuple[float, ...] = ()
    output_tokens: int = 0

    @property
    def tpot_s(self) -> float | None:
        """The mean time per output token after the first (0 for one token, as vLLM)."""
        if self.ttft_s is None or self.e2e_s is None:
            return None
        if self.output_tokens <= 1:
            return 0.0
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def value_ms(self, metric: str) -> float | None:
        """The request's ``ttft``, ``tpot`` or ``e2el`` in milliseconds (None: unknown)."""
        v = {"ttft": self.ttft_s, "tpot": self.tpot_s, "e2el": self.e2e_s}[metric]
        return None if v is None else v * 1e3

    @classmethod
    def from_result(cls, result: Any, *, waited_s: float = 0.0) -> RequestRecord:
        """From a :class:`~calfsm.engine.results.GenerationResult` (duck-typed: its
        ``error``, ``ttft_s``, ``inter_token_s``, ``tokens``); ``waited_s``: the time
        from the request's arrival to its stream's creation, added to TTFT and e2e
        (the stream's clock starts at its creation)."""
        if result.ttft_s is None:
            return cls(ok=False, output_tokens=len(result.tokens))
        ttft = waited_s + result.ttft_s
        gaps = tuple(result.inter_token_s)
        return cls(ok=result.error is None, ttft_s=ttft, e2e_s=ttft + math.fsum(gaps), itl_s=gaps,
                   output_tokens=len(result.tokens))


def parse_slos(spec: str | Sequence[str]) -> dict[str, float]:
    """``"ttft:200 tpot:50 e2el:5000"`` (or its words as a list, as argparse gives
    ``nargs='+'``) -> ``{"ttft": 200.0, ...}`` in ms. Each key at most once, each bound
    a finite number > 0; an empty spec is no SLO. A bad one is an InvalidArgument."""
    words = spec.split() if isinstance(spec, str) else [w for s in spec for w in s.split()]
    out: dict[str, float] = {}
    for word in words:
        key, sep, value = word.partition(":")
        key = key.strip().lower()
        if not sep or key not in SLO_METRICS:
            raise InvalidArgument(f"not an SLO (write KEY:MS with KEY one of "
                                  f"{', '.join(SLO_METRICS)}): {word!r}", field="goodput")
        if key in out:
            raise InvalidArgument(f"SLO {key} given twice", field="goodput")
        try:
            ms = float(value)
        except ValueError:
            ms = math.nan
        if not 0 < ms < math.inf:
            raise InvalidArgument(f"SLO {key}: a bound must be a number of ms > 0, got "
                                  f"{value!r}", field="goodput")
        out[key] = ms
    return out


def format_slos(slos: dict[str, float]) -> str:
    """The spec :func:`parse_slos` reads back: ``ttft:200 tpot:50``."""
    return " ".join(f"{k}:{v:g}" for k, v in slos.items())


def meets(record: RequestRecord, slos: dict[str, float]) -> bool:
    """Whether ``record`` met every SLO (a failed request meets none, even with none
    set: it is no good answer)."""
    if not record.ok:
        return False
    for key, bound in slos.items():
        v = record.value_ms(key)
        if v is None or v > bound:
            return False
    return True


@attrs.frozen
class GoodputReport:
    """What :func:`summarize` computed. ``percentiles[metric][p]`` in ms (None without a
    value); ``attainment[key]``: the fraction of all requests meeting that SLO, and
    ``attainment["all"]`` every one; rates per second of ``duration_s``."""

    requests: int
    errors: int
    duration_s: float
    slos: dict[str, float]
    percentiles: dict[str, dict[int, float | None]]
    attainment: dict[str, float]
    good: int
    goodput_rps: float
    throughput_rps: float
    output_tokens: int

    @property
    def token_throughput(self) -> float:
        """Output tokens per second of the duration."""
        return self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (percentile keys as ``p50`` ...)."""
        d = attrs.asdict(self)
        d["percentiles"] = {m: {f"p{p}": v for p, v in ps.items()}
                            for m, ps in self.percentiles.items()}
        d["token_throughput"] = self.token_throughput
        return d

    def markdown(self, *, rate_unit: str = "s") -> list[str]:
        """Lines of Markdown: the percentile table, then attainment and goodput."""
        head = "| metric | " + " | ".join(f"P{p} ms" for p in PERCENTILES) + " | SLO ms | met |"
        lines = [head, "| --- |" + " --- |" * (len(PERCENTILES) + 2)]
        for m in METRICS:
            cells = " | ".join("n/a" if v is None else f"{v:.1f}"
                               for v in self.percentiles[m].values())
            slo = self.slos.get(m)
            met = self.attainment.get(m)
            lines.append(f"| {m} | {cells} | {'-' if slo is None else f'{slo:g}'} | "
                         f"{'-' if met is None else f'{met:.1%}'} |")
        lines += ["", f"- requests: {self.requests} ({self.errors} failed, counted as "
                      f"misses) in {self.duration_s:.2f} s; throughput "
                      f"{self.throughput_rps:.3f} req/{rate_unit}, "
                      f"{self.token_throughput:.1f} output tokens/{rate_unit}",
                  f"- SLOs ({format_slos(self.slos) or 'none'}) all met by {self.good} "
                  f"requests ({self.attainment['all']:.1%}): **goodput "
                  f"{self.goodput_rps:.3f} req/{rate_unit}**"]
        return lines


class GoodputTally:
    """Requests added one at a time, for a run too long to keep them all (the soak):
    attainment and goodput are counted exactly; each figure's percentiles come from a
    uniform sample of at most ``keep`` values (reservoir sampling, seeded; None: every
    value), held in arrays allocated up front, so a long run's memory stays flat."""

    def __init__(self, slos: dict[str, float] | None = None, *, keep: int | None = None,
                 seed: int = 0) -> None:
        self.slos = dict(slos or {})
        for key in self.slos:
            if key not in SLO_METRICS:
                raise InvalidArgument(f"no SLO on {key!r} (have {', '.join(SLO_METRICS)})",
                                      field="goodput")
        self.keep = keep
        self._rng = np.random.default_rng(seed)
        self.requests = self.ok = self.good = self.output_tokens = 0
        self.met = dict.fromkeys(self.slos, 0)
        self._seen = dict.fromkeys(METRICS, 0)
        self._values: dict[str, Any] = {
            m: [] if keep is None else np.full(keep, np.nan) for m in METRICS}

    def add(self, record: RequestRecord) -> None:
        self.requests += 1
        if not record.ok:
            return                              # meets no SLO (:func:`meets`)
        self.ok += 1
        self.output_tokens += record.output_tokens
        values = {m: record.value_ms(m) for m in SLO_METRICS}
        good = True
        for key, bound in self.slos.items():
            v = values[key]
            if v is not None and v <= bound:
                self.met[key] += 1
            else:
                good = False
        self.good += good
        for m, v in values.items():
            if v is not None:
                self._keep(m, v)
        for gap in record.itl_s:
            self._keep("itl", gap * 1e3)

    def _keep(self, metric: str, value: float) -> None:
        n = self._seen[metric]
        self._seen[metric] = n + 1
        if self.keep is None:
            self._values[metric].append(value)
        elif n < self.keep:
            self._values[metric][n] = value
        else:                                   # Algorithm R: keep it with p = keep / (n+1)
            j = int(self._rng.integers(0, n + 1))
            if j < self.keep:
                self._values[metric][j] = value

    def report(self, duration_s: float) -> GoodputReport:
        """The figures so far, rates over ``duration_s`` seconds."""
        n = self.requests
        pcts = {}
        for m in METRICS:
            vals = np.asarray(self._values[m], dtype=float)[:self._seen[m]]
            pcts[m] = _percentiles(vals)
        attainment = {k: (c / n if n else 0.0) for k, c in self.met.items()}
        attainment["all"] = self.good / n if n else 0.0
        per_s = 1.0 / duration_s if duration_s > 0 else 0.0
        return GoodputReport(requests=n, errors=n - self.ok, duration_s=duration_s,
                             slos=dict(self.slos), percentiles=pcts, attainment=attainment,
                             good=self.good, goodput_rps=self.good * per_s,
                             throughput_rps=self.ok * per_s,
                             output_tokens=self.output_tokens)


def _percentiles(values: np.ndarray) -> dict[int, float | None]:
    if values.size == 0:
        return {p: None for p in PERCENTILES}
    return dict(zip(PERCENTILES, (float(v) for v in np.percentile(values, PERCENTILES))))


def summarize(records: Iterable[RequestRecord], duration_s: float,
              slos: dict[str, float] | None = None) -> GoodputReport:
    """Percentiles (of the requests that succeeded), attainment and goodput of
    ``records`` over ``duration_s`` seconds (the run's span: first arrival to last
    answer, as vLLM's benchmark duration)."""
    tally = GoodputTally(slos)
    for r in records:
        tally.add(r)
    return tally.report(duration_s)
