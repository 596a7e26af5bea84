"""``GET /metrics`` of the reference server (issue 15, "Must show"): the body parses with
Prometheus' own text parser, and its histograms and counters count exactly what the test
sent — streams, their tokens, finish reasons, a refusal — and no buffer is leased."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from calfsm.executor import DeviceExecutor, ExecutorConfig
from calfsm.serve import realtime_sim
from tests.helpers.serve import (
    GREEDY,
    MODEL,
    PROMPT_IDS,
    TINY,
    TOK,
    params_of,
    reference,
    samples,
    serve,
    sse_events,
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture()
def live() -> Iterator[tuple[DeviceExecutor, str]]:
    ex = DeviceExecutor(realtime_sim(TINY, decode_ms=0.2), TINY,
                        ExecutorConfig(max_sequences=4))
    srv = serve(ex)
    yield ex, srv.url
    srv.stop()
    ex.close()


def test_metrics_parse_and_count_what_was_sent(live):
    ex, url = live
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10], [11, 12]]
    with httpx.Client(base_url=url, timeout=20) as c:
        before = samples(c.get("/metrics").text)
        assert before[("calfsm_time_to_first_token_seconds_count", ())] == 0
        for p in prompts[:3]:           # 5 tokens each, not streamed
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": p,
                                                "max_tokens": 5, "temperature": 0})
            assert r.status_code == 200
        for p in prompts[3:]:           # 4 tokens each, streamed
            with c.stream("POST", "/v1/completions", json={
                    "model": MODEL, "prompt": p, "max_tokens": 4, "temperature": 0,
                    "stream": True}) as r:
                assert sse_events(r.iter_lines())[-1] == "[DONE]"
        assert c.post("/v1/completions", json={"model": MODEL, "prompt": ""}
                      ).status_code == 400             # never reaches the executor
        r = c.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    got = samples(r.text)
    streams = len(prompts)
    assert got[("calfsm_time_to_first_token_seconds_count", ())] == streams
    assert got[("calfsm_e2e_request_latency_seconds_count", ())] == streams
    assert got[("calfsm_time_per_output_token_seconds_count", ())] == 3 * 4 + 2 * 3
    assert got[("calfsm_requests_finished_total", (("finish_reason", "length"),))] \
        == streams
    assert got[("calfsm_generation_tokens_total", ())] == 3 * 5 + 2 * 4
    assert got[("calfsm_prompt_tokens_total", ())] == sum(map(len, prompts))
    assert got[("calfsm_job_device_time_seconds_count", (("kind", "decode"),))] \
        == 3 * 4 + 2 * 3
    assert got[("calfsm_buffers_leased", ())] == 0
    assert got[("calfsm_time_to_first_token_seconds_bucket", (("le", "+Inf"),))] == streams
    assert ex.stats().leased == 0


def test_a_stop_string_of_several_tokens_ends_the_library_stream_with_stop(live):
    """The stop strings go to the library (``SamplingParams.stop_sequences``): the
    library stream itself ends ``stop`` (it used to be cancelled by the server's own
    matcher, and counted ``cancelled`` while the client saw ``stop``)."""
    ex, url = live
    full = reference(PROMPT_IDS, params_of(GREEDY))
    stop = TOK.decode(full[4:6])                  # two tokens from the middle, as text
    assert len(TOK.encode(stop)) == 2
    assert all(full[i:i + 2] != full[4:6] for i in range(4))     # it first ends at 6
    with httpx.Client(base_url=url, timeout=20) as c:
        body = {"model": MODEL, "prompt": PROMPT_IDS, "stop": stop} | GREEDY
        choice = c.post("/v1/completions", json=body).json()["choices"][0]
        assert TOK.encode(choice["text"]) == full[:4] and choice["finish_reason"] == "stop"
        with c.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
            chunks = sse_events(r.iter_lines())[:-1]
        assert TOK.encode("".join(ch["choices"][0]["text"] for ch in chunks)) == full[:4]
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        got = samples(c.get("/metrics").text)
    finished = "calfsm_requests_finished_total"
    assert got[(finished, (("finish_reason", "stop"),))] == 2
    assert got[(finished, (("finish_reason", "cancelled"),))] == 0
    assert ex.stats().leased == 0
