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

__all__ = ["METRICS", "PERCENTILES", "SLO_METRICS", "GoodputReport", "RequestRecord",
           "format_slos", "meets", "parse_slos", "summarize"]

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
        ok = result.error is None and result.ttft_s is not None
        if result.ttft_s is None:
            return cls(ok=False, output_tokens=len(result.tokens))
        ttft = waited_s + result.ttft_s
        gaps = tuple(result.inter_token_s)
        return cls(ok=ok, ttft_s=ttft, e2e_s=ttft + math.fsum(gaps), itl_s=gaps,
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


def _percentiles(values: Iterable[float]) -> dict[int, float | None]:
    arr = np.fromiter(values, dtype=float)
    if arr.size == 0:
        return {p: None for p in PERCENTILES}
    return dict(zip(PERCENTILES, (float(v) for v in np.percentile(arr, PERCENTILES))))


def summarize(records: Sequence[RequestRecord], duration_s: float,
              slos: dict[str, float] | None = None) -> GoodputReport:
    """Percentiles (of the requests that succeeded), attainment and goodput of
    ``records`` over ``duration_s`` seconds (the run's span: first arrival to last
    answer, as vLLM's benchmark duration)."""
    slos = dict(slos or {})
    for key in slos:
        if key not in SLO_METRICS:
            raise InvalidArgument(f"no SLO on {key!r} (have {', '.join(SLO_METRICS)})",
                                  field="goodput")
    ok = [r for r in records if r.ok]
    ms = {"ttft": [r.value_ms("ttft") for r in ok], "tpot": [r.value_ms("tpot") for r in ok],
          "e2el": [r.value_ms("e2el") for r in ok],
          "itl": [g * 1e3 for r in ok for g in r.itl_s]}
    pcts = {m: _percentiles(v for v in ms[m] if v is not None) for m in METRICS}
    n = len(records)
    attainment = {k: (sum(1 for r in ok if (v := r.value_ms(k)) is not None and v <= b) / n
                      if n else 0.0) for k, b in slos.items()}
    good = sum(1 for r in records if meets(r, slos))
    attainment["all"] = good / n if n else 0.0
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    return GoodputReport(requests=n, errors=n - len(ok), duration_s=duration_s, slos=slos,
                         percentiles=pcts, attainment=attainment, good=good,
                         goodput_rps=good * per_s, throughput_rps=len(ok) * per_s,
                         output_tokens=sum(r.output_tokens for r in ok))
