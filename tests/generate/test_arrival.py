"""A request's arrival (issue 38, item 2): ``generate(arrival=...)`` is where the
stream's ``ttft_s`` and the metrics' TTFT and e2e start, as a client's clock does; the
metrics split that time into front, queue, prefill and decode. Step mode on the
virtual clock, so the sums are exact."""

from __future__ import annotations

import math

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from calfsm.errors import InvalidArgument
from calfsm.generate.sampling import SamplingParams
from calfsm.runtime.stepper import StepScheduler
from calfsm.telemetry.metrics import ExecutorMetrics
from tests.helpers.executor import make_executor

pytestmark = pytest.mark.timeout(60)

PROMPT = [5, 6, 7, 8]


def sums(m: ExecutorMetrics) -> dict[str, float]:
    return {s.name: s.value
            for f in text_string_to_metric_families(generate_latest(m.registry).decode())
            for s in f.samples if s.name.endswith("_seconds_sum") and not s.labels}


def test_ttft_and_e2e_count_from_the_arrival_and_split_into_their_parts():
    with make_executor("step") as ex:
        m = ExecutorMetrics(ex)
        arrival = ex.clock.now()
        ex.clock.advance(0.25)                  # the request was read and parsed
        s = ex.generate(PROMPT, SamplingParams(max_tokens=5), arrival=arrival)
        assert (s.arrival, s.started) == (arrival, arrival + 0.25)
        StepScheduler(ex).run_until(lambda: s.done() and ex.idle())
        r = s.result(0)
        got = sums(m)
        m.close()
    assert r.ttft_s >= 0.25
    assert got["calfsm_time_to_first_token_seconds_sum"] == pytest.approx(r.ttft_s)
    assert got["calfsm_request_front_time_seconds_sum"] == pytest.approx(0.25)
    assert got["calfsm_request_front_time_seconds_sum"] \
        + got["calfsm_request_queue_time_seconds_sum"] \
        + got["calfsm_request_prefill_time_seconds_sum"] == pytest.approx(r.ttft_s)
    assert r.ttft_s + got["calfsm_request_decode_time_seconds_sum"] == pytest.approx(
        got["calfsm_e2e_request_latency_seconds_sum"])


def test_without_an_arrival_the_stream_starts_its_own_clock():
    with make_executor("step") as ex:
        s = ex.generate(PROMPT, SamplingParams(max_tokens=2))
        assert s.arrival == s.started
        StepScheduler(ex).run_until(lambda: s.done() and ex.idle())


@pytest.mark.parametrize("bad", [math.inf, math.nan, "now", True, 1e9])
def test_an_arrival_not_on_the_clock_is_refused(bad):
    with make_executor("step") as ex:
        with pytest.raises(InvalidArgument, match="arrival"):
            ex.generate(PROMPT, SamplingParams(max_tokens=2), arrival=bad)
        assert ex.idle() and not ex.requests()
