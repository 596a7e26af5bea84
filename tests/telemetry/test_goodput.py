"""The goodput arithmetic (calfsm/telemetry/goodput.py) against cases computed by hand:
vLLM's ``--goodput`` semantics (a request is good when every bounded figure is at most
its bound; TPOT is (e2e - TTFT) / (tokens - 1), 0 for one token), errors as misses,
numpy's linear percentiles."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from calfsm.errors import InvalidArgument
from calfsm.telemetry.goodput import (
    RequestRecord,
    format_slos,
    meets,
    parse_slos,
    summarize,
)

SLOS = {"ttft": 100.0, "tpot": 20.0, "e2el": 500.0}


def _records() -> list[RequestRecord]:
    def rec(ttft: float, gaps: tuple[float, ...]) -> RequestRecord:
        return RequestRecord(ok=True, ttft_s=ttft, e2e_s=ttft + sum(gaps), itl_s=gaps,
                             output_tokens=len(gaps) + 1)
    return [
        rec(0.050, (0.010, 0.020, 0.010, 0.020)),  # e2e 110 ms, tpot 15: good
        rec(0.150, (0.010, 0.010)),                # ttft 150 > 100: misses ttft only
        rec(0.020, (0.050, 0.050)),                # tpot 50 > 20: misses tpot only
        RequestRecord(ok=False),                   # an error: misses every SLO
        rec(0.080, ()),                            # one token: tpot 0, e2e 80: good
    ]


def test_goodput_attainment_and_rates_by_hand() -> None:
    r = summarize(_records(), 2.0, SLOS)
    assert (r.requests, r.errors, r.good) == (5, 1, 2)
    assert r.goodput_rps == pytest.approx(1.0)          # 2 good / 2 s
    assert r.throughput_rps == pytest.approx(2.0)       # 4 answered / 2 s
    assert r.attainment == pytest.approx({"ttft": 3 / 5, "tpot": 3 / 5, "e2el": 4 / 5,
                                          "all": 2 / 5})
    assert r.output_tokens == 5 + 3 + 3 + 1
    assert r.token_throughput == pytest.approx(6.0)


def test_percentiles_by_hand() -> None:
    p = summarize(_records(), 2.0, SLOS).percentiles
    # ttft of the answered: 20, 50, 80, 150 ms; linear: p50 between 50 and 80,
    # p90 at index 2.7 (80 + 0.7 * 70), p99 at 2.97
    assert p["ttft"] == pytest.approx({50: 65.0, 90: 129.0, 99: 147.9})
    # tpot: 0, 10, 15, 50 ms
    assert p["tpot"] == pytest.approx({50: 12.5, 90: 39.5, 99: 48.95})
    # itl pooled: 10 x4, 20 x2, 50 x2
    assert p["itl"] == pytest.approx({50: 15.0, 90: 50.0, 99: 50.0})
    # e2el: 80, 110, 120, 170
    assert p["e2el"] == pytest.approx({50: 115.0, 90: 155.0, 99: 168.5})


def test_a_bound_is_inclusive_and_a_failure_is_never_good() -> None:
    exact = RequestRecord(ok=True, ttft_s=0.125, e2e_s=0.25, itl_s=(0.125,),
                          output_tokens=2)
    assert meets(exact, {"ttft": 125.0, "tpot": 125.0, "e2el": 250.0})
    assert not meets(exact, {"ttft": 124.9})
    failed = RequestRecord(ok=False, ttft_s=0.001, e2e_s=0.002, output_tokens=2)
    assert not meets(failed, {})
    r = summarize([exact, failed], 1.0)             # no SLO: goodput is the answered
    assert (r.good, r.goodput_rps, r.attainment) == (1, 1.0, {"all": 0.5})


def test_no_requests_and_no_duration() -> None:
    r = summarize([], 0.0, SLOS)
    assert (r.requests, r.goodput_rps, r.throughput_rps) == (0, 0.0, 0.0)
    assert r.attainment["all"] == 0.0
    assert r.percentiles["ttft"] == {50: None, 90: None, 99: None}
    assert "n/a" in "\n".join(r.markdown())


def test_from_result_measures_from_arrival() -> None:
    result = SimpleNamespace(error=None, ttft_s=0.030, inter_token_s=(0.010, 0.020),
                             tokens=(1, 2, 3))
    rec = RequestRecord.from_result(result, waited_s=0.005)
    assert rec.ok and rec.ttft_s == pytest.approx(0.035)
    assert rec.e2e_s == pytest.approx(0.065) and rec.tpot_s == pytest.approx(0.015)
    failed = SimpleNamespace(error=RuntimeError("x"), ttft_s=0.01, inter_token_s=(),
                             tokens=(1,))
    assert not RequestRecord.from_result(failed).ok
    none = SimpleNamespace(error=None, ttft_s=None, inter_token_s=(), tokens=())
    assert not RequestRecord.from_result(none).ok


def test_parse_slos_reads_vllms_form() -> None:
    assert parse_slos("ttft:200 tpot:50 e2el:5000") == {"ttft": 200.0, "tpot": 50.0,
                                                        "e2el": 5000.0}
    assert parse_slos(["ttft:200", "tpot:50.5"]) == {"ttft": 200.0, "tpot": 50.5}
    assert parse_slos("") == {}
    assert format_slos(parse_slos("ttft:200 e2el:5000")) == "ttft:200 e2el:5000"


@pytest.mark.parametrize("spec", ["ttft", "itl:5", "ttft:0", "ttft:-1", "ttft:x",
                                  "ttft:inf", "ttft:1 ttft:2", "latency:3"])
def test_parse_slos_refuses(spec: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        parse_slos(spec)
    assert e.value.field == "goodput"


def test_a_bounded_tally_counts_exactly_and_samples_its_percentiles() -> None:
    """The soak's form: attainment and goodput exact whatever ``keep``; the percentiles
    of a uniform sample, close to the exact ones."""
    import random

    from calfsm.telemetry.goodput import GoodputTally

    rng = random.Random(7)
    records = []
    for i in range(5000):
        if i % 50 == 0:
            records.append(RequestRecord(ok=False))
            continue
        gaps = tuple(rng.uniform(0.005, 0.040) for _ in range(rng.randint(0, 6)))
        ttft = rng.uniform(0.01, 0.3)
        records.append(RequestRecord(ok=True, ttft_s=ttft, e2e_s=ttft + sum(gaps),
                                     itl_s=gaps, output_tokens=len(gaps) + 1))
    exact = summarize(records, 10.0, SLOS)
    small = GoodputTally(SLOS, keep=1000, seed=1)
    for r in records:
        small.add(r)
    got = small.report(10.0)
    assert (got.requests, got.errors, got.good, got.output_tokens) == (
        exact.requests, exact.errors, exact.good, exact.output_tokens)
    assert got.attainment == exact.attainment and got.goodput_rps == exact.goodput_rps
    for m in ("ttft", "tpot", "itl", "e2el"):
        assert got.percentiles[m][50] == pytest.approx(exact.percentiles[m][50], rel=0.1)
