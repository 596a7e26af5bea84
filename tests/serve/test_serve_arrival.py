"""TTFT as clients see it (issue 38, item 2), on a live server: the server's clock for
a request starts at its arrival, before its body is read, and its metrics split that
time into front, queue, prefill and decode; a streaming answer's headers go out once
the executor admitted it, not after the first token (a refusal at the door is still a
429, a failure after the headers an SSE error event); and with a tracer, W3C
``traceparent`` comes in and goes out (issue 38, item 3).
"""

from __future__ import annotations

import contextlib
import json
import socket
import time

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from calfsm.executor import DeviceExecutor, ExecutorConfig
from calfsm.serve import realtime_sim
from calfsm.serve.app import client_usage
from tests.helpers.executor import GatedDriver, make_sim
from tests.helpers.serve import MODEL, TINY, TOK, Serving, poll, samples, serve, sse_events

pytestmark = pytest.mark.timeout(90)

SPLIT = ("front", "queue", "prefill", "decode")


def metric_sums(url: str) -> dict[str, float]:
    got = samples(httpx.get(url + "/metrics").text)
    out = {name: got[(f"calfsm_request_{name}_time_seconds_sum", ())] for name in SPLIT}
    for name in ("time_to_first_token", "e2e_request_latency"):
        out[name] = got[(f"calfsm_{name}_seconds_sum", ())]
    return out


def test_ttft_starts_at_arrival_before_the_body_is_read():
    """A client slow to send its body: the server's TTFT and e2e include that time (a
    client's clock started when it sent its headers), in ``front``; front + queue +
    prefill is the TTFT and + decode the e2e."""
    ex = DeviceExecutor(realtime_sim(TINY, decode_ms=0.5, prefill_token_us=1), TINY,
                        tokenizer=TOK)
    srv = serve(ex)
    body = json.dumps({"model": MODEL, "prompt": [3, 4], "max_tokens": 4,
                       "temperature": 0}).encode()
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                      b"application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
                      + body[:5])
            app = srv.server.config.app     # the arrival was stamped once it waits
            poll(lambda: client_usage(app), 10, "the upload is not waiting")
            seen = time.monotonic()
            time.sleep(0.2)                 # a slow client; a lower bound, not a race
            sending = time.monotonic()      # the server cannot have the body before this
            s.sendall(body[5:])
            answer = s.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200"), answer
        got = metric_sums(srv.url)
    finally:
        srv.stop()
        ex.close()
    assert got["front"] >= sending - seen >= 0.2
    assert got["time_to_first_token"] >= got["front"]
    assert got["front"] + got["queue"] + got["prefill"] == pytest.approx(
        got["time_to_first_token"], abs=1e-6)
    assert got["time_to_first_token"] + got["decode"] == pytest.approx(
        got["e2e_request_latency"], abs=1e-6)


@contextlib.contextmanager
def held(request_timeout_s: float = 30.0):
    """A served executor on a device whose waits the test holds (threaded, real time,
    zero latency), one job on the device at a time, one waiting at most."""
    gated = GatedDriver(make_sim("threaded"))
    ex = DeviceExecutor(gated, TINY, ExecutorConfig(max_waiting=1), tokenizer=TOK)
    srv = serve(ex, request_timeout_s=request_timeout_s)
    try:
        yield ex, gated, srv
    finally:
        gated.gate.set()
        srv.stop()
        ex.close()


def test_streaming_headers_go_out_at_admission_not_at_the_first_token():
    """The device holds the first prefill: its client already has a 200 and the SSE
    headers (no token can have been made). Its next step waits for the device, so the
    wait queue (max_waiting 1) is full: a second streaming request is refused at once
    with a proper 429 and Retry-After, not a 200 with an error inside. Once the device
    goes on, the first stream gets its tokens."""
    body = {"model": MODEL, "max_tokens": 3, "temperature": 0, "stream": True}
    with held() as (_ex, gated, srv), httpx.Client(base_url=srv.url, timeout=20) as c:
        gated.gate.clear()
        with c.stream("POST", "/v1/completions", json=body | {"prompt": [1, 2]}) as a:
            assert a.status_code == 200
            assert a.headers["content-type"].startswith("text/event-stream")
            poll(gated.waiting.is_set, 10, "the first prefill is not on the device")
            poll(lambda: samples(c.get("/metrics").text)[
                ("calfsm_num_requests_waiting", ())] == 1, 10, "its next step not waiting")
            with c.stream("POST", "/v1/completions", json=body | {"prompt": [5]}) as b:
                assert b.status_code == 429
                err = json.loads(b.read())["error"]
                assert err["code"] == "resource_exhausted" and "max_waiting" in err["message"]
                assert int(b.headers["retry-after"]) >= 1
            gated.gate.set()
            events = sse_events(a.iter_lines())
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_a_failure_after_the_headers_is_an_sse_error_event():
    """The stream's deadline passes while the device holds its prefill: its headers
    were sent (200), so the deadline comes as the last event, then [DONE]."""
    with held(request_timeout_s=0.3) as (ex, gated, srv):
        gated.gate.clear()
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=20, json={
                "model": MODEL, "prompt": [1, 2], "max_tokens": 50, "stream": True}) as r:
            assert r.status_code == 200
            start = ex.clock.now()
            poll(lambda: ex.clock.now() > start + 0.35, 5, "the deadline did not pass")
            gated.gate.set()
            events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "deadline_exceeded", events


def test_traceparent_comes_in_and_goes_out():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    ex = DeviceExecutor(realtime_sim(TINY, decode_ms=0.2, prefill_token_us=1), TINY,
                        tokenizer=TOK, tracer=provider.get_tracer("test"))
    srv = serve(ex)
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    incoming = {"traceparent": f"00-{trace_id}-{parent_id}-01"}
    body = {"model": MODEL, "prompt": [1, 2], "max_tokens": 3, "temperature": 0}
    try:
        plain = httpx.post(srv.url + "/v1/completions", json=body, headers=incoming)
        with httpx.stream("POST", srv.url + "/v1/completions", headers=incoming,
                          json=body | {"stream": True}) as r:
            streamed = r.headers.get("traceparent")
            list(r.iter_lines())
        own = httpx.post(srv.url + "/v1/completions", json=body)     # no traceparent
        poll(lambda: len([s for s in exporter.get_finished_spans()
                          if s.name == "calfsm.request"]) == 3, 10, "three request spans")
    finally:
        srv.stop()
        ex.close()
        provider.shutdown()
    roots = {f"{s.context.span_id:016x}": s for s in exporter.get_finished_spans()
             if s.name == "calfsm.request"}
    for answer in (plain.headers.get("traceparent"), streamed):
        version, tid, sid, _flags = answer.split("-")
        assert (version, tid) == ("00", trace_id)
        assert roots[sid].parent.span_id == int(parent_id, 16)
    _, tid, sid, _ = own.headers["traceparent"].split("-")
    assert tid != trace_id and roots[sid].parent is None     # a trace of its own


def test_no_traceparent_without_a_tracer():
    ex = DeviceExecutor(realtime_sim(TINY, decode_ms=0.2, prefill_token_us=1), TINY,
                        tokenizer=TOK)
    srv = serve(ex)
    try:
        r = httpx.post(srv.url + "/v1/completions", json={
            "model": MODEL, "prompt": [1], "max_tokens": 2},
            headers={"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"})
    finally:
        srv.stop()
        ex.close()
    assert r.status_code == 200 and "traceparent" not in r.headers


def test_calfsm_serve_traces_to_a_dead_collector_without_holding_a_request():
    """``--otlp-traces-endpoint`` at a port nobody listens on: every request is answered
    (with its traceparent), and the server stops cleanly."""
    with socket.socket() as sock:               # a port that was free: nobody listens
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    srv = Serving("--otlp-traces-endpoint", f"http://127.0.0.1:{port}/v1/traces")
    try:        # 'listening on' comes before the warm-up's end: /ready says when
        poll(lambda: httpx.get(srv.url + "/ready").status_code == 200, 60, "not ready")
        answers = [httpx.post(srv.url + "/v1/completions", timeout=20, json={
            "model": MODEL, "prompt": [i + 1], "max_tokens": 3}) for i in range(8)]
    finally:
        srv.stop()
    assert all(r.status_code == 200 and r.headers["traceparent"].startswith("00-")
               for r in answers)
