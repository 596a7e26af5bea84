"""The reference server against a real uvicorn on 127.0.0.1 (issue 15, "Must show"):
with httpx and with the official ``openai`` client, completions and chat, streaming and
not, the text decodes to the reference model's greedy tokens and to seeded sampling of
its logits; stop sequences, ``n`` and batches of prompts; every client mistake is a 4xx
with an OpenAI error body (never a 5xx); and the byte-level tokenizer is reversible.

Faults, overload and disconnects are in ``tests/serve/test_serve_faults.py``. The harness
(:class:`LiveServer`, :func:`reference`) is in ``tests/helpers/serve.py``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from calfsm.errors import InvalidArgument
from calfsm.executor import DeviceExecutor
from calfsm.generate.sampling import SamplingParams
from calfsm.serve import ByteTokenizer, ServerConfig, create_app, realtime_sim
from calfsm.serve.tokenizer import IncrementalDecoder, chat_prompt, token_bytes, token_label
from tests.helpers.executor import log_softmax, reference_seen, top_logprobs
from tests.helpers.serve import (
    GREEDY,
    MAX_SEQ,
    MODEL,
    PROMPT_IDS,
    PROMPT_TEXT,
    TINY,
    TOK,
    VOCAB,
    LiveServer,
    live_fixtures,
    params_of,
    poll,
    reference,
    sse_events,
)
from tests.helpers.streams import direct_runner

pytestmark = pytest.mark.timeout(60)


# ---- harness ----------------------------------------------------------------------------

# with the byte-level tokenizer, as ``calfsm serve`` builds it: stop strings are matched on
# the streams' text (tests/serve/test_serve_metrics.py serves an executor without one: stop
# strings as token-id sequences)
executor, live, client = live_fixtures(max_sequences=64)


@pytest.fixture(scope="module")
def oai(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0,
                         timeout=30)


SEEDED = {"temperature": 0.8, "top_p": 0.9, "seed": 11, "max_tokens": 12}
SEEDED_K = SEEDED | {"top_k": 50}


# ---- httpx --------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt", [PROMPT_TEXT, PROMPT_IDS], ids=["text", "ids"])
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED_K], ids=["greedy", "seeded"])
def test_completion_equals_the_reference(client, prompt, sampling):
    body = {"model": MODEL, "prompt": prompt} | sampling
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    ids = prompt if isinstance(prompt, list) else TOK.encode(prompt)
    want = reference(ids, params_of(sampling))
    assert out["object"] == "text_completion" and out["model"] == MODEL
    [choice] = out["choices"]
    assert TOK.encode(choice["text"]) == want
    assert choice["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(want),
                            "total_tokens": len(ids) + len(want)}


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_streamed_completion_equals_the_reference(client, sampling):
    body = {"model": MODEL, "prompt": PROMPT_TEXT, "stream": True,
            "stream_options": {"include_usage": True}} | sampling
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    *chunks, usage = events[:-1]
    want = reference(TOK.encode(PROMPT_TEXT), params_of(sampling))
    assert TOK.encode("".join(c["choices"][0]["text"] for c in chunks)) == want
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["usage"] is None for c in chunks)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(want)


def test_chat_equals_the_reference_through_the_template(client):
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hello "},
                                             {"type": "text", "text": "there"}]}]
    prompt = TOK.encode(chat_prompt([("system", "be brief"), ("user", "hello there")]))
    body = {"model": MODEL, "messages": messages} | SEEDED
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion"
    msg = out["choices"][0]["message"]
    assert msg["role"] == "assistant"
    assert TOK.encode(msg["content"]) == reference(prompt, params_of(SEEDED))
    assert out["usage"]["prompt_tokens"] == len(prompt)


def test_n_and_a_batch_of_prompts_draw_seed_plus_index(client):
    prompts = [[1, 2, 3], "four"]
    body = {"model": MODEL, "prompt": prompts, "n": 2} | SEEDED
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    ids = [[1, 2, 3], [1, 2, 3], TOK.encode("four"), TOK.encode("four")]
    for i, (c, p) in enumerate(zip(choices, ids)):
        assert TOK.encode(c["text"]) == reference(p, params_of(SEEDED, i)), i
    assert r.json()["usage"]["prompt_tokens"] == 3 + 4


def test_stop_sequences_end_the_choice_and_are_not_returned(client):
    full = reference(PROMPT_IDS, params_of(GREEDY | {"max_tokens": 12}))
    # a stop of two tokens from the middle of the greedy output, as text
    stop_text = TOK.decode(full[4:6])
    single = TOK.decode(full[8:9])
    for stream in (False, True):
        body = {"model": MODEL, "prompt": PROMPT_IDS, "stop": [stop_text],
                "stream": stream} | GREEDY
        if stream:
            with client.stream("POST", "/v1/completions", json=body) as r:
                chunks = sse_events(r.iter_lines())[:-1]
            text = "".join(c["choices"][0]["text"] for c in chunks)
            reason = chunks[-1]["choices"][0]["finish_reason"]
        else:
            choice = client.post("/v1/completions", json=body).json()["choices"][0]
            text, reason = choice["text"], choice["finish_reason"]
        assert TOK.encode(text) == full[:4] and reason == "stop", stream
    if TOK.encode(single) == full[8:9] and full[8] not in full[:8]:
        body = {"model": MODEL, "prompt": PROMPT_IDS, "stop": single} | GREEDY
        choice = client.post("/v1/completions", json=body).json()["choices"][0]
        assert TOK.encode(choice["text"]) == full[:8]
        assert choice["finish_reason"] == "stop"


def test_models_lists_the_served_model(client):
    out = client.get("/v1/models").json()
    assert [m["id"] for m in out["data"]] == [MODEL]
    assert out["data"][0]["max_model_len"] == MAX_SEQ


# ---- the official openai client ---------------------------------------------------------------

@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_openai_client_completions(oai, sampling):
    want = reference(PROMPT_IDS, params_of(sampling))
    out = oai.completions.create(model=MODEL, prompt=PROMPT_IDS, **sampling)
    assert TOK.encode(out.choices[0].text) == want
    assert out.usage.completion_tokens == len(want)
    stream = oai.completions.create(model=MODEL, prompt=PROMPT_IDS, stream=True,
                                    stream_options={"include_usage": True}, **sampling)
    chunks = list(stream)
    assert TOK.encode("".join(c.choices[0].text for c in chunks if c.choices)) == want
    assert chunks[-1].usage.completion_tokens == len(want)


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED_K], ids=["greedy", "seeded"])
def test_openai_client_chat(oai, sampling):
    messages = [{"role": "user", "content": "hi"}]
    prompt = TOK.encode(chat_prompt([("user", "hi")]))
    extra = {"top_k": sampling["top_k"]} if "top_k" in sampling else {}
    kw = {k: v for k, v in sampling.items() if k != "top_k"}
    want = reference(prompt, params_of(sampling))
    out = oai.chat.completions.create(model=MODEL, messages=messages, extra_body=extra,
                                      **kw)
    assert TOK.encode(out.choices[0].message.content) == want
    assert out.choices[0].finish_reason == "length"
    stream = oai.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                         extra_body=extra, **kw)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert TOK.encode(text) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_openai_client_sees_openai_errors(oai):
    with pytest.raises(openai.NotFoundError) as e:
        oai.completions.create(model="gpt-4", prompt="x")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL, prompt="x", temperature=-1)
    assert e.value.body["param"] == "temperature"


# ---- logprobs ---------------------------------------------------------------------------------

def scored(prompt: list[int], params: SamplingParams) -> list[tuple[int, Any]]:
    """Each token a choice must give, with the reference row its sampler saw."""
    return reference_seen(direct_runner(), prompt, params)


def offsets(tokens: list[int]) -> list[int]:
    """``text_offset``: the characters of the choice's text before each token."""
    dec, out, n = IncrementalDecoder(), [], 0
    for t in tokens:
        out.append(n)
        n += len(dec.push(t))
    return out


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_openai_client_completion_logprobs(oai, sampling, stream):
    """Legacy format: each token's label, logprob, top-k and text offset, equal to the
    log-softmax of the reference rows (the seeded choice holds a byte that starts a
    character: streamed, its chunk has no text yet but its own logprobs)."""
    want = scored(PROMPT_IDS, params_of(sampling))
    out = oai.completions.create(model=MODEL, prompt=PROMPT_IDS, logprobs=4,
                                 stream=stream, **sampling)
    if stream:
        chunks = [c.choices[0] for c in out if c.choices]
        text = "".join(c.text for c in chunks)
        parts = [c.logprobs for c in chunks if c.logprobs is not None]
        tokens = [t for p in parts for t in p.tokens]
        lps = [x for p in parts for x in p.token_logprobs]
        tops = [x for p in parts for x in p.top_logprobs]
        offs = [x for p in parts for x in p.text_offset]
        assert all(len(p.tokens) == 1 for p in parts)
    else:
        choice = out.choices[0]
        text, lp = choice.text, choice.logprobs
        tokens, lps, tops, offs = lp.tokens, lp.token_logprobs, lp.top_logprobs, \
            lp.text_offset
    ids = [t for t, _ in want]
    assert TOK.encode(text) == ids
    assert tokens == [token_label(t) for t in ids]
    assert any(t.startswith("bytes:\\x") for t in tokens)
    assert offs == offsets(ids)
    for (tok, row), got, top in zip(want, lps, tops):
        ref = top_logprobs(row, 4)
        assert close(got, log_softmax(row)[tok])
        assert list(top) == [token_label(t) for t, _ in ref]
        assert all(close(top[token_label(t)], v) for t, v in ref)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("k", [0, 3])
def test_openai_client_chat_logprobs(oai, k, stream):
    """Chat format: ``content`` entries with token, logprob, bytes and top_logprobs."""
    messages = [{"role": "user", "content": "hi"}]
    want = scored(TOK.encode(chat_prompt([("user", "hi")])), params_of(GREEDY))
    kw = {"top_logprobs": k} if k else {}
    out = oai.chat.completions.create(model=MODEL, messages=messages, logprobs=True,
                                      stream=stream, **kw, **GREEDY)
    if stream:
        chunks = [c.choices[0] for c in out if c.choices]
        text = "".join(c.delta.content or "" for c in chunks)
        content = [e for c in chunks if c.logprobs is not None for e in c.logprobs.content]
    else:
        text, content = out.choices[0].message.content, out.choices[0].logprobs.content
    assert TOK.encode(text) == [t for t, _ in want]
    assert len(content) == len(want)
    for (tok, row), entry in zip(want, content):
        assert entry.token == token_label(tok) and entry.bytes == list(token_bytes(tok))
        assert close(entry.logprob, log_softmax(row)[tok])
        ref = top_logprobs(row, k)
        assert [(e.token, e.bytes) for e in entry.top_logprobs] == [
            (token_label(t), list(token_bytes(t))) for t, _ in ref]
        assert all(close(e.logprob, v) for e, (_, v) in zip(entry.top_logprobs, ref))


def test_without_logprobs_the_answer_has_none(client):
    body = {"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 3}
    assert client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"] is None
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3, "logprobs": False}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None


@pytest.mark.parametrize(("path", "extra", "param"), [
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"logprobs": "5"}, "logprobs"),
    ("/v1/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 3}, "logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
def test_bad_logprobs_are_400_naming_the_field(client, path, extra, param):
    body = {"model": MODEL, "max_tokens": 2} | extra | (
        {"prompt": "x"} if path == "/v1/completions"
        else {"messages": [{"role": "user", "content": "x"}]})
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


# ---- client mistakes are 4xx ---------------------------------------------------------------

BAD = [
    ({"model": MODEL}, 400, "prompt"),
    ({"prompt": "x"}, 400, "model"),
    ({"model": MODEL, "prompt": ""}, 400, "prompt"),
    ({"model": MODEL, "prompt": [1, VOCAB]}, 400, "prompt"),
    ({"model": MODEL, "prompt": [1, -1]}, 400, "prompt"),
    ({"model": MODEL, "prompt": [0] * MAX_SEQ}, 400, "prompt"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "prompt": "x", "seed": -3}, 400, "seed"),
    ({"model": MODEL, "prompt": "x", "stop": ["a"] * 5}, 400, "stop"),
    ({"model": MODEL, "prompt": "x", "n": 17}, 400, "n"),
    ({"model": MODEL, "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ({"model": MODEL, "prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
    ({"model": MODEL, "prompt": "x", "stream_options": {"include_usage": 1}}, 400,
     "stream_options"),
    ({"model": MODEL, "prompt": "\U000f1000"}, 400, "prompt"),
    ({"model": "other", "prompt": "x"}, 404, "model"),
    ([1, 2], 400, None),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD)
def test_bad_requests_are_4xx_with_an_openai_error(client, body, status, param):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert err["param"] == param


def test_bad_bodies_and_routes(client):
    r = client.post("/v1/chat/completions", content=b"{not json",
                    headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
    r = client.post("/v1/completions", content=b"x" * (9 << 20))
    assert r.status_code == 413
    assert client.get("/v1/nothing").status_code == 404
    assert client.get("/v1/completions").status_code == 405
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [
        {"role": "robot", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2, 2000)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=4),
    max_leaves=12)
FIELDS = ("model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k",
          "seed", "stop", "n", "stream", "stream_options", "logprobs", "stop_token_ids")


@settings(deadline=None, max_examples=60)     # each example is an HTTP round trip
@given(st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=6),
       st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_no_body_gets_a_5xx(client, body, path):
    """Whatever JSON a client sends, the answer is a 2xx or a 4xx: never the server's
    fault. (``max_tokens`` is capped so the examples stay quick.)"""
    if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool):
        body["max_tokens"] = min(body["max_tokens"], 4)
    body.setdefault("model", MODEL)
    body.pop("n", None) if body.get("n") not in (None, 1) else None
    r = client.post(path, json=body)
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        assert r.json()["error"]["message"]
    if body.get("stream") is True and r.status_code == 200:
        assert sse_events(r.text.splitlines())[-1] == "[DONE]"


# ---- tokenizer ------------------------------------------------------------------------------

@given(st.lists(st.integers(0, VOCAB - 1), max_size=40))
def test_tokenizer_ids_survive_text(ids):
    text = TOK.decode(ids)
    assert TOK.encode(text) == ids
    dec = IncrementalDecoder()
    assert "".join(dec.push(t) for t in ids) + dec.flush() == text


@given(st.text())
def test_tokenizer_text_survives_ids(text):
    if any(0xF0000 <= ord(c) < 0xF3000 for c in text) or any(
            0xD800 <= ord(c) < 0xE000 for c in text):
        return
    assert TOK.decode(TOK.encode(text)) == text
    assert TOK.encode(text) == list(text.encode())


def test_tokenizer_refuses_malformed_escapes():
    for bad in ("\U000f1000", "\U000f2000", "\U000f0100", "\U000f1000\U000f2005",
                "\ud800"):
        with pytest.raises(InvalidArgument):
            TOK.encode(bad)
    with pytest.raises(InvalidArgument):
        ByteTokenizer(255)


# ---- an executor the app owns ---------------------------------------------------------------

def test_an_owned_executor_starts_in_the_lifespan_and_closes_on_shutdown():
    built: list[DeviceExecutor] = []

    async def start() -> DeviceExecutor:
        ex = await DeviceExecutor.create(realtime_sim(TINY, decode_ms=0), TINY)
        built.append(ex)
        return ex

    srv = LiveServer(create_app(start))
    try:
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            poll(lambda: c.get("/ready").status_code == 200, 10, "never ready")
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": [1]} | GREEDY)
            assert TOK.encode(r.json()["choices"][0]["text"]) == reference(
                [1], params_of(GREEDY))
    finally:
        srv.stop()
    assert built and built[0].lifecycle.closing


def test_a_server_that_is_starting_answers_503_with_retry_after():
    gate = asyncio.Event()
    loop_box: list[asyncio.AbstractEventLoop] = []

    async def start() -> DeviceExecutor:
        loop_box.append(asyncio.get_running_loop())
        await gate.wait()
        return await DeviceExecutor.create(realtime_sim(TINY, decode_ms=0), TINY)

    srv = LiveServer(create_app(start))
    try:
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            assert c.get("/health").status_code == 503
            r = c.get("/ready")
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
            assert r.status_code == 503 and "starting" in r.json()["error"]["message"]
            assert r.headers["retry-after"] == "1"
            loop_box[0].call_soon_threadsafe(gate.set)
            poll(lambda: c.get("/health").status_code == 200, 10, "never live")
    finally:
        srv.stop()


# ---- the embedding example of docs/serving.md runs as written ------------------------------

def _doc_example() -> dict[str, Any]:
    from pathlib import Path
    text = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    block = text.split("## Embedding the executor", 1)[1].split("```python\n", 1)[1]
    namespace: dict[str, Any] = {}
    exec(compile(block.split("```", 1)[0], "docs/serving.md", "exec"), namespace)
    return namespace


def test_the_embedding_example_in_the_docs_serves_a_request(executor):
    handle = _doc_example()["handle"]
    sent: list[int] = []
    errors: list[tuple[int, Any, str]] = []

    async def send(token: int) -> None:
        sent.append(token)

    async def send_error(status: int, retry_after: Any, message: str) -> None:
        errors.append((status, retry_after, message))

    asyncio.run(handle(executor, [3, 1, 4], send, send_error))
    assert errors == []
    assert sent == reference([3, 1, 4], SamplingParams(max_tokens=64, temperature=0.7,
                                                       seed=1))
    asyncio.run(handle(executor, [3, VOCAB], send, send_error))
    assert [e[0] for e in errors] == [400]


@pytest.mark.parametrize(("field", "value"), [
    ("default_max_tokens", 0), ("default_max_tokens", None), ("max_choices", 1.5),
    ("request_timeout_s", -1), ("max_body_bytes", True),
    ("max_concurrent_requests", 0), ("max_concurrent_requests", 2.5),
    ("shutdown_grace_s", -1), ("shutdown_grace_s", float("inf")),
    ("shutdown_grace_s", None)])
def test_server_config_refuses_bad_values(field, value):
    with pytest.raises(InvalidArgument, match=field):
        ServerConfig(**{field: value})
