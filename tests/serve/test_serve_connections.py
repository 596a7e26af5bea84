"""Slow, idle and hostile connections against ``calfsm serve``'s uvicorn configuration
(issue 20, item 5): a slowloris client, a connection that never sends a byte, an
oversized header, a lying Content-Length, the keep-alive and the connection limit.

Each server has small limits (half a second) and each test asserts with generous
margins: a connection is closed within its limit plus several seconds, and not before
half its limit (uvloop's timers count from the loop's cached time, so a timer may fire a
little before its delay measured from outside; half the limit rules out a close that
has nothing to do with the timer)."""

from __future__ import annotations

import json
import logging
import select
import socket
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from calfsm.errors import InvalidArgument
from calfsm.executor import DeviceExecutor
from calfsm.serve import ServerConfig, create_app, realtime_sim
from calfsm.serve.connections import ConnectionLimits, uvicorn_config
from tests.helpers.serve import MODEL, TINY, LiveServer, poll
from tests.helpers.serve_logs import Records

pytestmark = pytest.mark.timeout(60)
LIMIT = 0.5                 # every timeout of the test server, seconds
MARGIN = 8.0                # how much later than its limit a close may come on a busy machine
EARLIEST = LIMIT / 2        # the soonest a close may come (see the module docstring)
LIMITS = ConnectionLimits(header_timeout_s=LIMIT, body_timeout_s=LIMIT, keep_alive_s=LIMIT,
                          max_header_bytes=4096, max_connections=50)
HEAD = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"

@pytest.fixture
def logs() -> Iterator[Records]:
    with Records.capture() as records:
        yield records



@pytest.fixture(scope="module")
def executor() -> Iterator[DeviceExecutor]:
    ex = DeviceExecutor(realtime_sim(TINY, decode_ms=5, prefill_token_us=1), TINY)
    yield ex
    ex.close()


@pytest.fixture(scope="module")
def live(executor: DeviceExecutor) -> Iterator[LiveServer]:
    srv = LiveServer(create_app(executor, ServerConfig()), LIMITS)
    yield srv
    srv.stop()


def connect(live: LiveServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", live.port), timeout=MARGIN)


def until_closed(s: socket.socket, within: float) -> bytes:
    """What the server sends until it closes the connection (bounded by ``within``)."""
    got = b""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        s.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return got
        except TimeoutError:
            continue                    # the deadline: the loop ends and says so
        if not chunk:
            return got
        got += chunk
    raise AssertionError(f"the server kept the connection open {within} s: {got[:80]!r}")


def test_a_connection_that_never_sends_a_byte_is_closed_after_the_header_timeout(live):
    t0 = time.monotonic()
    with connect(live) as s:
        assert until_closed(s, LIMIT + MARGIN) == b""     # nothing to answer
    assert time.monotonic() - t0 >= EARLIEST


def test_headers_sent_a_byte_at_a_time_are_cut_at_the_header_timeout(live):
    """Slowloris: each byte comes well within any per-byte timeout, the headers never
    end. One deadline from the start of the connection cuts it: 408, then close."""
    t0 = time.monotonic()
    with connect(live) as s:
        trickle = HEAD + b"x-pad: " + b"a" * 10_000
        got = b""
        for byte in trickle:
            try:
                s.sendall(bytes((byte,)))
            except (BrokenPipeError, ConnectionResetError):
                break
            if select.select([s], [], [], 0.02)[0]:
                got = until_closed(s, MARGIN)
                break
            assert time.monotonic() - t0 < LIMIT + MARGIN, "never cut"
        else:
            raise AssertionError("the whole trickle was accepted")
    took = time.monotonic() - t0
    assert EARLIEST <= took < LIMIT + MARGIN, took
    assert got.startswith(b"HTTP/1.1 408 "), got[:80]
    assert b'"code": "request_timeout"' in got


def test_the_header_timeout_applies_again_to_the_next_request_on_a_connection(live):
    with connect(live) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        first = s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 "), first
        t0 = time.monotonic()
        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-slow: ")   # never finished
        got = until_closed(s, LIMIT + MARGIN)
    assert time.monotonic() - t0 >= EARLIEST
    assert got.startswith(b"HTTP/1.1 408 "), got[:80]


def test_headers_over_the_limit_are_a_431(live):
    with connect(live) as s:
        s.sendall(HEAD + b"x-big: " + b"a" * 8192 + b"\r\n\r\n")
        got = until_closed(s, MARGIN)
    assert got.startswith(b"HTTP/1.1 431 "), got[:80]
    assert b"request_header_fields_too_large" in got


def test_a_pipelined_request_with_headers_over_the_limit_is_a_431(live):
    """The second request arrives with the first: h11 holds it already when the first
    answer is done, so its head is checked there, not when bytes come."""
    with connect(live) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
                  + HEAD + b"x-big: " + b"a" * 8192 + b"\r\n\r\n")
        got = until_closed(s, MARGIN)
    first, _, second = got.partition(b"HTTP/1.1 431 ")
    assert first.startswith(b"HTTP/1.1 200 ") and second, got[:200]


def test_a_malformed_request_is_a_400_and_no_warning(live, logs):
    with connect(live) as s:
        s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        got = until_closed(s, MARGIN)
    assert got.startswith(b"HTTP/1.1 400 "), got[:80]
    assert not [r for r in logs.records if r.levelno >= logging.WARNING], \
        [r.getMessage() for r in logs.records]


def test_an_8_mib_header_is_refused_and_the_server_goes_on(live):
    with connect(live) as s:
        try:
            s.sendall(HEAD + b"x-big: " + b"a" * (8 << 20) + b"\r\n\r\n")
            got = until_closed(s, MARGIN)
        except (BrokenPipeError, ConnectionResetError):
            got = b""               # closed while we were still sending: refused too
    assert got == b"" or got.startswith(b"HTTP/1.1 431 "), got[:80]
    assert httpx.get(live.url + "/health", timeout=10).status_code == 200


def test_a_lying_content_length_is_answered_408_at_the_body_timeout(live, logs):
    t0 = time.monotonic()
    with connect(live) as s:
        s.sendall(HEAD + b"content-length: 100\r\n\r\n" + b'{"model": ')
        got = until_closed(s, LIMIT + MARGIN)
    assert time.monotonic() - t0 >= EARLIEST
    assert got.startswith(b"HTTP/1.1 408 "), got[:80]
    poll(lambda: logs.matching("did not send its body"), 10, "no log of the late body")
    logs.assert_no_traceback()


def test_a_slow_answer_is_not_cut_by_the_timeouts(live):
    """The header and body timeouts are the client's to meet: an answer that takes
    several times longer (100 decodes of 5 ms, one stream) is not cut."""
    r = httpx.post(live.url + "/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": [1], "max_tokens": 200, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 200
    with httpx.stream("POST", live.url + "/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": [1], "max_tokens": 200, "stream": True}) as r:
        assert r.read().rstrip().endswith(b"data: [DONE]")


def test_an_idle_keep_alive_connection_is_closed_after_keep_alive(live):
    with connect(live) as s:
        t0 = time.monotonic()              # before the response: its timer starts after
        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        first = s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 "), first
        assert until_closed(s, LIMIT + MARGIN) == b""
    assert time.monotonic() - t0 >= EARLIEST


def test_the_default_keep_alive_outlasts_the_clients_pool_expiry():
    """A server that closes an idle connection when the client's pool reuses it kills
    that request (13 of 31,125 POSTs at 5 s vs 5 s): the server must outlast the pool."""
    from httpx._config import DEFAULT_LIMITS
    from openai._constants import DEFAULT_CONNECTION_LIMITS
    expiry = max(DEFAULT_LIMITS.keepalive_expiry, DEFAULT_CONNECTION_LIMITS.keepalive_expiry)
    limits = ConnectionLimits()
    assert limits.keep_alive_s >= 2 * expiry
    config = uvicorn_config(lambda *a: None, limits)
    assert config.timeout_keep_alive == limits.keep_alive_s


def test_the_openai_client_reuses_its_connections(live):
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
    for _ in range(3):
        out = client.completions.create(model=MODEL, prompt=[1], max_tokens=2)
        assert out.usage.completion_tokens == 2


def test_connections_past_the_limit_are_closed_at_once(executor):
    srv = LiveServer(create_app(executor, ServerConfig()), ConnectionLimits(
        max_connections=3, header_timeout_s=30))
    held: list[socket.socket] = []
    try:
        for _ in range(3):
            held.append(connect(srv))
        poll(lambda: len(srv.server.server_state.connections) == 3, 10,
             "the server did not see 3 connections")
        with connect(srv) as extra:
            assert until_closed(extra, MARGIN) == b""
        poll(lambda: len(srv.server.server_state.connections) == 3, 10,
             "the refused connection stayed counted")
        held.pop().close()
        poll(lambda: len(srv.server.server_state.connections) == 2, 10,
             "a closed connection stayed counted")
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
    finally:
        for s in held:
            s.close()
        srv.stop()


@pytest.mark.parametrize("field", ["header_timeout_s", "body_timeout_s", "keep_alive_s",
                                   "max_header_bytes", "max_connections"])
def test_connection_limits_refuse_bad_values(field):
    with pytest.raises(InvalidArgument, match=field):
        ConnectionLimits(**{field: 0})


# ---- HTTP oddities (issue 34, item 6) ---------------------------------------------------

@pytest.fixture(scope="module")
def patient(executor: DeviceExecutor) -> Iterator[LiveServer]:
    """A server whose keep-alive outlasts every wait here, so a connection it closes was
    closed by the rule under test, not by the idle timer."""
    srv = LiveServer(create_app(executor, ServerConfig()),
                     ConnectionLimits(keep_alive_s=60, header_timeout_s=30, body_timeout_s=30))
    yield srv
    srv.stop()


def read_answer(s: socket.socket) -> tuple[bytes, dict[bytes, bytes], bytes, bytes]:
    """One HTTP/1.1 answer framed by its content-length: (status line, headers, body,
    the bytes that came after it)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"closed before an answer: {data[:80]!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status, *lines = head.split(b"\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(b":") for x in lines)}
    size = int(headers[b"content-length"])
    while len(body) < size:
        chunk = s.recv(65536)
        assert chunk, "closed in the middle of an answer"
        body += chunk
    return status, headers, body[:size], body[size:]


def _chunked(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n0\r\n\r\n"


REQUEST = (b'{"model": "' + MODEL.encode() + b'", "prompt": [1], "max_tokens": 1, '
           b'"temperature": 0}')


@pytest.mark.parametrize("order", ["cl-first", "te-first"])
def test_content_length_with_chunked_is_answered_then_the_connection_closed(patient, order):
    """RFC 9112 6.1: a request with both Transfer-Encoding and Content-Length is read by
    its Transfer-Encoding (h11's rule) and its connection closed after the answer, so the
    two ends cannot disagree about where the next request begins (request smuggling).
    The bytes after the chunked body would be a second request to a reader that trusts
    the Content-Length; they are never answered."""
    cl, te = b"content-length: 4\r\n", b"transfer-encoding: chunked\r\n"
    framing = cl + te if order == "cl-first" else te + cl
    smuggled = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
    with connect(patient) as s:
        s.sendall(HEAD + framing + b"\r\n" + _chunked(REQUEST) + smuggled)
        status, headers, body, after = read_answer(s)
        assert status.startswith(b"HTTP/1.1 200 "), (status, body[:200])
        assert json.loads(body)["usage"]["completion_tokens"] == 1   # the chunked body
        rest = after + until_closed(s, MARGIN)
        assert headers.get(b"connection") == b"close", headers
    assert rest == b"", f"the smuggled request was answered: {rest[:80]!r}"


def test_a_plain_chunked_request_keeps_its_connection(patient):
    """Only the ambiguous framing closes: chunked alone is an ordinary request."""
    with connect(patient) as s:
        s.sendall(HEAD + b"transfer-encoding: chunked\r\n\r\n" + _chunked(REQUEST))
        status, headers, _, _ = read_answer(s)
        assert status.startswith(b"HTTP/1.1 200 ") and b"connection" not in headers
        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        status, _, _, _ = read_answer(s)
        assert status.startswith(b"HTTP/1.1 200 "), status


@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/v1/completions/"), ("POST", "/v1/completions/"),
    ("POST", "/v1/chat/completions/"), ("GET", "/v1/models/"), ("GET", "/metrics/"),
    ("GET", "/health/"), ("GET", "/ready/")])
def test_a_trailing_slash_is_an_openai_404_not_a_redirect(patient, method, path):
    """Starlette would redirect (307, empty body) to the path without the slash; a POST
    client that follows it may resend or drop its body, and an OpenAI client expects an
    error object. OpenAI answers such a path 404 too."""
    r = httpx.request(method, patient.url + path, json={"model": MODEL, "prompt": "x"},
                      timeout=10, follow_redirects=False)
    assert r.status_code == 404, (r.status_code, r.headers, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and path in err["message"]
    assert f"did you mean {path.rstrip('/')!r}?" in err["message"]
    assert "location" not in r.headers
