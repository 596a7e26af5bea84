"""The reference server's front door (issue 20, items 5 and 7): API keys, per-client fair
use, bounded JSON, bounded echoes of client input, the max_tokens rules, and what the
log says about clients (4xx at DEBUG, a client that leaves at INFO, never a traceback).
Against a real uvicorn on 127.0.0.1, configured as ``calfsm serve`` configures it."""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from calfsm.errors import InvalidArgument
from calfsm.executor import DeviceExecutor, ExecutorConfig
from calfsm.serve import ServerConfig, create_app, realtime_sim
from calfsm.serve.app import client_usage
from calfsm.serve.auth import ApiKeys, fingerprint
from calfsm.serve.bodies import json_depth
from calfsm.serve.fairuse import ClientUsage
from calfsm.serve.httperrors import MAX_MESSAGE, clip
from tests.helpers.serve import MAX_SEQ, MODEL, TINY, TOK, LiveServer, params_of, poll, reference
from tests.helpers.serve_logs import Records

pytestmark = pytest.mark.timeout(60)
GREEDY = {"temperature": 0, "max_tokens": 5}
KEYS = ("key-alice", "key-bob")

@pytest.fixture
def logs() -> Iterator[Records]:
    with Records.capture() as records:
        yield records



class Served:
    """An executor on the real-time simulated device and the app over it, served."""

    def __init__(self, *, max_sequences: int = 64, decode_ms: float = 0.2,
                 prefill_token_us: float = 1, **config: Any) -> None:
        self.ex = DeviceExecutor(realtime_sim(TINY, decode_ms=decode_ms,
                                              prefill_token_us=prefill_token_us),
                                 TINY, ExecutorConfig(max_sequences=max_sequences))
        self.app = create_app(self.ex, ServerConfig(**config))
        self.live = LiveServer(self.app)
        self.url = self.live.url

    def usage(self) -> dict[str, Any]:
        return client_usage(self.app)

    def settled(self) -> bool:
        return not self.usage() and self.ex.idle()

    def close(self) -> None:
        self.live.stop()
        self.ex.close()


@pytest.fixture
def served(request: pytest.FixtureRequest) -> Iterator[Served]:
    srv = Served(**getattr(request, "param", {}))
    yield srv
    srv.close()


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def complete(url: str, body: dict[str, Any], timeout: float = 20,
             **kw: Any) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": MODEL} | body,
                      timeout=timeout, **kw)


# ---- API keys --------------------------------------------------------------------------

@pytest.mark.parametrize("served", [{"api_keys": KEYS}], indirect=True)
def test_every_route_but_the_probes_needs_one_of_the_keys(served, logs):
    body = {"prompt": [1, 2]} | GREEDY
    want = reference([1, 2], params_of(GREEDY))
    for headers in ({}, bearer("wrong"), {"authorization": "Bearer"},
                    {"authorization": "Basic a2V5LWFsaWNl"},
                    bearer("key-alice-and-more"), bearer(KEYS[0][:-1])):
        r = complete(served.url, body, headers=headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.json() == {"error": {"message": r.json()["error"]["message"],
                                      "type": "invalid_request_error", "param": None,
                                      "code": "invalid_api_key"}}
        assert r.headers["www-authenticate"].startswith("Bearer")
        assert "key-alice" not in r.text
    for path in ("/v1/models", "/metrics", "/v1/nothing"):
        assert httpx.get(served.url + path).status_code == 401, path
    for key in KEYS:                     # several keys: each one opens the door
        r = complete(served.url, body, headers=bearer(key))
        assert r.status_code == 200, r.text
        assert TOK.encode(r.json()["choices"][0]["text"]) == want
        assert httpx.get(served.url + "/metrics", headers=bearer(key)).status_code == 200
    for probe in ("/health", "/ready"):  # a supervisor's probe carries no key
        assert httpx.get(served.url + probe).status_code == 200, probe
    refusals = [r for r in logs.records if "401" in r.getMessage()]
    assert refusals and all(r.levelno == logging.DEBUG for r in refusals)
    logs.assert_no_traceback()


@pytest.mark.parametrize("served", [{"api_keys": KEYS}], indirect=True)
def test_the_openai_client_with_a_key_and_without(served):
    good = openai.OpenAI(base_url=served.url + "/v1", api_key=KEYS[1], max_retries=0)
    out = good.completions.create(model=MODEL, prompt=[3, 4], **GREEDY)
    assert TOK.encode(out.choices[0].text) == reference([3, 4], params_of(GREEDY))
    bad = openai.OpenAI(base_url=served.url + "/v1", api_key="sk-nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.completions.create(model=MODEL, prompt=[3, 4], **GREEDY)
    assert e.value.body["code"] == "invalid_api_key"


def test_a_key_is_compared_with_every_key_in_constant_time(monkeypatch):
    keys = ApiKeys(["k-one", "k-two", "k-three"])
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    for token, want in (("k-one", fingerprint("k-one")), ("k-three", fingerprint("k-three")),
                        ("k-on", None), ("", None)):
        calls.clear()
        assert keys.match(token) == want
        # every key, whether or not one matched already, and always digests of one length
        assert len(calls) == 3 and {len(a) for a, b in calls} | {len(b) for a, b in calls} \
            == {32}


@pytest.mark.parametrize("keys", ["one-key", ["has space"], [""], ["a,b"], ["é"], [5]])
def test_server_config_refuses_bad_keys(keys):
    with pytest.raises(InvalidArgument, match="api_keys"):
        ServerConfig(api_keys=keys)


def test_server_config_does_not_show_its_keys():
    assert "secret-key" not in repr(ServerConfig(api_keys=["secret-key"]))


# ---- per-client fair use -----------------------------------------------------------------

#: 4000 decodes of 5 ms: 20 s at least. The tests that hold these give them no request
#: timeout, so no deadline: the executor's admission estimate (which prices a step from
#: the warm-up's, however slow on a busy machine: 39 ms once in CI, and 4 x 4000 of them
#: passed a 600 s timeout) never refuses them, and only the per-client limits are tested
LONG = {"temperature": 0, "max_tokens": 4000}


async def _hold(c: httpx.AsyncClient, headers: dict[str, str], n: int,
                stack: Any) -> None:
    """Open ``n`` streams that are never read past their first event."""
    for i in range(n):
        r = await stack.enter_async_context(c.stream(
            "POST", "/v1/completions", headers=headers,
            json={"model": MODEL, "prompt": [i + 1, 9], "stream": True} | LONG))
        assert r.status_code == 200, await r.aread()


@pytest.mark.parametrize("served", [{"api_keys": KEYS, "decode_ms": 5,
                                     "max_sequences": 8, "request_timeout_s": None}],
                         indirect=True)
def test_one_client_at_its_stream_limit_gets_429_while_another_is_served(served):
    """max_sequences 8: each client may hold 4 (half). Alice holds 4 streams she never
    reads; her next request is a 429 with Retry-After, Bob's is served."""
    from contextlib import AsyncExitStack
    alice, bob = bearer(KEYS[0]), bearer(KEYS[1])

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=served.url, timeout=20) as c, \
                AsyncExitStack() as stack:
            await _hold(c, alice, 4, stack)
            assert served.usage() == {fingerprint(KEYS[0]): ClientUsage(streams=4)}
            for body in ({"prompt": [5]} | GREEDY, {"prompt": [5], "n": 2} | GREEDY):
                r = await c.post("/v1/completions", headers=alice, json={"model": MODEL}
                                 | body)
                assert r.status_code == 429, r.text
                assert r.json()["error"]["code"] == "rate_limit_exceeded"
                assert r.json()["error"]["type"] == "rate_limit_error"
                assert int(r.headers["retry-after"]) >= 1
            r = await c.post("/v1/completions", headers=alice,
                             json={"model": MODEL, "prompt": [5], "n": 5} | GREEDY)
            assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
            r = await c.post("/v1/completions", headers=bob,
                             json={"model": MODEL, "prompt": [6, 7]} | GREEDY)
            assert r.status_code == 200, r.text
            assert TOK.encode(r.json()["choices"][0]["text"]) == reference(
                [6, 7], params_of(GREEDY))
            assert served.usage()[fingerprint(KEYS[0])].streams == 4
            assert fingerprint(KEYS[1]) not in served.usage()

    asyncio.run(scenario())
    poll(served.settled, 10, "the books are not empty after the clients left")


@pytest.mark.parametrize("served", [{"decode_ms": 5, "max_sequences": 4,
                                     "request_timeout_s": None}], indirect=True)
def test_without_keys_a_client_is_its_address(served):
    """127.0.0.1 holds its 2 streams (half of 4); 127.0.0.2 is another client."""
    from contextlib import AsyncExitStack
    other = httpx.AsyncHTTPTransport(local_address="127.0.0.2")

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=served.url, timeout=20) as c, \
                httpx.AsyncClient(base_url=served.url, timeout=20, transport=other) as c2, \
                AsyncExitStack() as stack:
            await _hold(c, {}, 2, stack)
            r = await c.post("/v1/completions", json={"model": MODEL, "prompt": [5]}
                             | GREEDY)
            assert r.status_code == 429, r.text
            r = await c2.post("/v1/completions", json={"model": MODEL, "prompt": [5]}
                              | GREEDY)
            assert r.status_code == 200, r.text
            assert set(served.usage()) == {"addr:127.0.0.1"}

    asyncio.run(scenario())
    poll(served.settled, 10, "the books are not empty after the clients left")


def _upload_in_progress(port: int, key: str) -> socket.socket:
    """A request whose body never finishes arriving (20 of 1000 bytes)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\n"
              "content-type: application/json\r\ncontent-length: 1000\r\n\r\n"
              '{"model": "tiny", "p'.encode())
    return s


@pytest.mark.parametrize("served", [{"api_keys": KEYS, "max_client_waiting": 2}],
                         indirect=True)
def test_a_client_at_its_waiting_limit_gets_429_before_its_body_is_read(served, logs):
    uploads = [_upload_in_progress(served.live.port, KEYS[0]) for _ in range(2)]
    try:
        poll(lambda: served.usage().get(fingerprint(KEYS[0])) is not None
             and served.usage()[fingerprint(KEYS[0])].waiting == 2, 10,
             "the two uploads are not waiting")
        r = complete(served.url, {"prompt": [5]} | GREEDY, headers=bearer(KEYS[0]))
        assert r.status_code == 429 and "max_client_waiting" in r.json()["error"]["message"]
        assert int(r.headers["retry-after"]) >= 1
        r = complete(served.url, {"prompt": [5]} | GREEDY, headers=bearer(KEYS[1]))
        assert r.status_code == 200, r.text
    finally:
        for s in uploads:
            s.close()
    poll(served.settled, 10, "the books are not empty after the uploads were dropped")
    # each handler logs as it returns, after its books are closed: wait for both lines
    poll(lambda: len(logs.matching("left during its upload")) == 2, 10, "not two lines")
    left = logs.matching("left during its upload")
    assert all(r.levelno == logging.INFO for r in left)
    logs.assert_no_traceback()


def test_a_client_leaving_mid_upload_is_one_info_line_without_a_traceback(served, logs):
    _upload_in_progress(served.live.port, "none").close()
    poll(lambda: logs.matching("left during its upload"), 10, "no log of the upload")
    poll(served.settled, 10, "the books are not empty after the upload")
    [line] = logs.matching("left during its upload")
    assert line.levelno == logging.INFO and not line.exc_info
    assert "of 1000 body bytes" in line.getMessage()     # 0 or 20 came before the close
    logs.assert_no_traceback()


@pytest.mark.parametrize("served", [{"decode_ms": 1, "prefill_token_us": 100,
                                     "max_sequences": 2, "max_client_streams": 8,
                                     "request_timeout_s": 1.0}], indirect=True)
def test_the_books_are_empty_after_every_way_a_request_ends(served, logs):
    """Success, client errors, a stop sequence's cancel, a deadline, the executor's own
    429 half-way through a request's choices, and clients that leave (mid-stream,
    before the first token, waiting for a whole answer, mid-upload): after each, no
    client holds anything, and nothing logged a traceback."""
    url = served.url
    full = reference([4, 4], params_of({"temperature": 0, "max_tokens": 8}))

    def ends(what: str, action: Any, logged: str | None = None) -> None:
        action()
        poll(served.settled, 10, f"the books are not empty after {what}")
        if logged is not None:          # a handler logs as it returns, after its books
            poll(lambda: logs.matching(logged), 10, f"no log line {logged!r}")

    def stream_and_leave() -> None:
        with httpx.stream("POST", url + "/v1/completions", timeout=20, json={
                "model": MODEL, "prompt": [2], "stream": True} | LONG) as r:
            assert r.status_code == 200
            next(r.iter_lines())

    def leave_before_the_first_token() -> None:
        # a prefill of 6000 tokens takes 0.6 s on this device: the client is gone first
        with pytest.raises(httpx.ReadTimeout):
            complete(url, {"prompt": [1] * 6000, "stream": True, "max_tokens": 100},
                     timeout=0.05)

    def give_up_waiting() -> None:
        with pytest.raises(httpx.ReadTimeout):
            complete(url, {"prompt": [3]} | LONG, timeout=0.2)

    def drop_an_upload() -> None:
        _upload_in_progress(served.live.port, "none").close()

    ends("a completion", lambda: complete(url, {"prompt": [4, 4], "max_tokens": 8,
                                                "temperature": 0}).raise_for_status())
    ends("a stream", lambda: httpx.post(url + "/v1/completions", timeout=20, json={
        "model": MODEL, "prompt": [4, 4], "stream": True} | GREEDY).raise_for_status())
    ends("a 400", lambda: complete(url, {"prompt": [1], "max_tokens": 10 ** 30}))
    ends("bad JSON", lambda: httpx.post(url + "/v1/completions", content=b"{"))
    ends("a stop sequence", lambda: complete(url, {
        "prompt": [4, 4], "stop": TOK.decode(full[3:5]), "temperature": 0,
        "max_tokens": 8}).raise_for_status())
    ends("a deadline", lambda: complete(url, {"prompt": [5]} | LONG))
    # one of the two sequences held elsewhere: the second stream finds none (n = 3 could
    # never be served together, a 400: tests/api/test_refusals_at_once.py)
    held = served.ex.open_sequence()
    r = complete(url, {"prompt": [6], "n": 2} | GREEDY)
    held.close()
    assert r.status_code == 429, r.text
    ends("the executor's 429", lambda: None)
    ends("a client gone mid-stream", stream_and_leave, "left in the middle of the stream")
    ends("a client gone before its first token", leave_before_the_first_token,
         "left before the first token")
    ends("a client that stopped waiting", give_up_waiting, "left while waiting")
    ends("an abandoned upload", drop_an_upload, "left during its upload")
    logs.assert_no_traceback()
    for what in ("left in the middle of the stream", "left before the first token",
                 "left while waiting for the answer", "left during its upload"):
        lines = logs.matching(what)
        assert len(lines) == 1 and lines[0].levelno == logging.INFO, (what, lines)
    client_errors = logs.matching("answering 4")
    assert client_errors and all(r.levelno == logging.DEBUG for r in client_errors)


# ---- bounded JSON ----------------------------------------------------------------------------

def test_json_depth_counts_brackets_outside_strings_only():
    for text, depth in (("1", 0), ("[]", 1), ('{"a": [1, {"b": "[[[["}]}', 3),
                        (r'["\\", [2]]', 2), (r'["\"[", [[3]]]', 3), (r'{"a": "\\\"[["}', 1),
                        ("[" * 5000 + "]" * 5000, 5000), ('"' + "[" * 99 + '"', 0)):
        assert json_depth(text.encode()) == depth, text


def test_deep_or_malformed_json_is_a_400_naming_the_problem_and_no_traceback(served, logs):
    deep_prompt = b'{"model": "tiny", "prompt": ' + b"[" * 100 + b"1" + b"]" * 100 + b"}"
    for body, says in ((b"[" * 980 + b"]" * 980, "nests 980 levels"),
                       (b"[" * 100_000 + b"]" * 100_000, "nests 100000 levels"),
                       (deep_prompt, "nests 101 levels"),
                       (b'{"model": "tiny", "prompt": ' + b"9" * 5000 + b"}", "not JSON"),
                       (b'{"model": "\xff"}', "not UTF-8"),
                       (b'{"model": ', "not JSON")):
        r = httpx.post(served.url + "/v1/completions", content=body,
                       headers={"content-type": "application/json"}, timeout=20)
        assert r.status_code == 400, (says, r.text)
        assert says in r.json()["error"]["message"], r.text
    logs.assert_no_traceback()
    # 64 levels are fine: this one is refused for its prompt, not its depth
    r = complete(served.url, {"prompt": [[[[1]]]]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


# ---- bounded echoes --------------------------------------------------------------------------

def test_error_bodies_quote_at_most_a_bounded_prefix_of_client_input(served):
    big = "x" * 100_000
    cases = [({"model": big, "prompt": "a"}, 404), ({"prompt": "a", big: 1}, 400),
             ({"prompt": "a", "temperature": big}, 400),
             ({"prompt": [1, big]}, 400), ({"prompt": [1, [big[:1000]] * 1000]}, 400),
             ({"prompt": "a", "max_tokens": -10 ** 4000}, 400),
             ({"prompt": "a", **{f"k{i}{big[:50]}": 1 for i in range(100)}}, 400)]
    for body, status in cases:
        r = httpx.post(served.url + "/v1/completions", json={"model": MODEL} | body,
                       timeout=20)
        assert r.status_code == status, r.text[:200]
        err = r.json()["error"]
        assert len(r.content) < MAX_MESSAGE + 200, len(r.content)
        assert "x" * 60 not in err["message"]
        assert err["param"] is None or len(err["param"]) <= 64
    r = httpx.get(served.url + "/" + "p" * 8000)
    assert r.status_code == 404 and len(r.content) < 300


def test_clip_is_bounded_whatever_it_quotes():
    deep: list[Any] = []
    cur = deep
    for _ in range(10_000):
        cur.append([])
        cur = cur[0]
    for value in ("x" * 10 ** 6, list(range(10 ** 5)), deep, {str(i): i for i in range(10 ** 4)},
                  10 ** 4000, b"\x00" * 10 ** 5):
        assert len(clip(value)) <= 48
    assert clip("ok") == "'ok'" and clip([1, 2]) == "[1, 2]"


# ---- max_tokens ------------------------------------------------------------------------------

@pytest.mark.parametrize(("body", "field", "says"), [
    ({"prompt": [1], "max_tokens": 10 ** 30}, "max_tokens", "cap"),
    ({"prompt": [1], "max_tokens": 4097}, "max_tokens", "cap"),
    ({"prompt": [1] * 8000, "max_tokens": 193}, "max_tokens", "context holds 8192"),
    ({"prompt": [[1], [1] * 8100], "max_tokens": 100}, "max_tokens", "context holds"),
])
def test_max_tokens_over_the_cap_or_the_context_is_a_400_naming_it(served, body, field, says):
    r = complete(served.url, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and field in r.json()["error"]["message"]
    assert says in r.json()["error"]["message"]


def test_chat_max_completion_tokens_is_checked_the_same_way(served):
    oai = openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                    max_completion_tokens=10 ** 30)
    assert e.value.body["param"] == "max_completion_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL, prompt="hi", max_tokens=MAX_SEQ)
    assert e.value.body["param"] == "max_tokens"


def test_max_tokens_that_fits_exactly_runs_and_the_default_is_clipped(served):
    r = complete(served.url, {"prompt": [1] * 8000, "max_tokens": 192, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 192
    r = complete(served.url, {"prompt": [1] * (MAX_SEQ - 3), "temperature": 0})
    assert r.status_code == 200, r.text          # the default 16, clipped to the room left
    assert r.json()["usage"]["completion_tokens"] == 3


def test_the_cap_is_configurable_and_bounds_the_default():
    ServerConfig(max_tokens_cap=100, default_max_tokens=100)
    with pytest.raises(InvalidArgument, match="max_tokens_cap"):
        ServerConfig(max_tokens_cap=10, default_max_tokens=16)


@pytest.mark.parametrize("served", [{"max_tokens_cap": 8, "default_max_tokens": 8}],
                         indirect=True)
def test_a_smaller_cap_is_a_400_above_it(served):
    assert complete(served.url, {"prompt": [1], "max_tokens": 8}).status_code == 200
    r = complete(served.url, {"prompt": [1], "max_tokens": 9})
    assert r.status_code == 400 and "<= 8" in r.json()["error"]["message"]
