"""The load clients users trust run as-is (issue 38, item 1) and the penalties and length
controls over HTTP (issue 37, item 3), against a real uvicorn on 127.0.0.1.

The bodies are those ``vllm bench serve`` (0.32), guidellm (0.8) and inference-perf (0.7)
send, streaming and not: ``ignore_eos``, ``repetition_penalty: 1.0``, ``logprobs: null``,
``stream_options.continuous_usage_stats`` (usage on every chunk), ``max_completion_tokens``
on completions, ``stop: null``; and ``min_tokens``, ``store``, ``stream_options`` with
``stream: false``, ``content: null``. Each answers 200 with exactly the tokens asked for.
The penalties give the library's tokens (``tests/generate/test_penalties.py`` holds the
library to a numpy reference); a bad value of each field is a 400 naming it as ``param``.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from calfsm.generate.sampling import SamplingParams
from tests.helpers.serve import (
    MODEL,
    PROMPT_IDS,
    PROMPT_TEXT,
    TOK,
    live_fixtures,
    reference,
    sse_events,
)

pytestmark = pytest.mark.timeout(60)

N = 10

# ---- what the clients send ------------------------------------------------------------------

#: vllm bench serve, ``openai`` (completions) backend, random dataset
VLLM_COMPLETIONS = {"model": MODEL, "prompt": PROMPT_TEXT, "temperature": 0.0,
                    "repetition_penalty": 1.0, "max_tokens": N, "logprobs": None,
                    "stream": True, "stream_options": {"include_usage": True},
                    "ignore_eos": True}
#: vllm bench serve, ``openai-chat`` backend
VLLM_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": [
                 {"type": "text", "text": PROMPT_TEXT}]}],
             "temperature": 0.0, "max_completion_tokens": N, "stream": True,
             "stream_options": {"include_usage": True}, "ignore_eos": True}
#: guidellm, text completions with a fixed output length
GUIDELLM_COMPLETIONS = {"model": MODEL, "stream": True,
                        "stream_options": {"include_usage": True,
                                           "continuous_usage_stats": True},
                        "max_tokens": N, "stop": None, "ignore_eos": True,
                        "prompt": PROMPT_TEXT}
#: guidellm, chat completions with a fixed output length
GUIDELLM_CHAT = {"model": MODEL, "stream": True,
                 "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                 "max_completion_tokens": N, "max_tokens": N, "stop": None,
                 "ignore_eos": True,
                 "messages": [{"role": "user", "content": [{"type": "text",
                                                            "text": PROMPT_TEXT}]}]}
#: inference-perf, completions (``stream_options`` only when streaming)
INFERENCE_PERF_COMPLETIONS = {"model": MODEL, "prompt": PROMPT_TEXT, "max_tokens": N,
                              "ignore_eos": True, "stream": False}
#: inference-perf, chat: an assistant turn of no text is ``content: null`` in others'
INFERENCE_PERF_CHAT = {"model": MODEL, "max_tokens": N, "ignore_eos": True,
                       "stream": True, "stream_options": {"include_usage": True},
                       "messages": [{"role": "system", "content": ""},
                                    {"role": "user", "content": PROMPT_TEXT}]}

CLIENT_BODIES = {
    "vllm-bench-completions": ("/v1/completions", VLLM_COMPLETIONS),
    "vllm-bench-chat": ("/v1/chat/completions", VLLM_CHAT),
    "guidellm-completions": ("/v1/completions", GUIDELLM_COMPLETIONS),
    "guidellm-chat": ("/v1/chat/completions", GUIDELLM_CHAT),
    "inference-perf-completions": ("/v1/completions", INFERENCE_PERF_COMPLETIONS),
    "inference-perf-completions-stream": (
        "/v1/completions", INFERENCE_PERF_COMPLETIONS | {
            "stream": True, "stream_options": {"include_usage": True}}),
    "inference-perf-chat": ("/v1/chat/completions", INFERENCE_PERF_CHAT),
    "inference-perf-chat-unary": ("/v1/chat/completions", INFERENCE_PERF_CHAT | {
        "stream": False}),
}


# as ``calfsm serve`` builds it: the byte-level tokenizer (stop strings on the text)
executor, live, client = live_fixtures(max_sequences=64)


def text_of(answer: dict[str, Any] | list[Any], chat: bool) -> str:
    """The first choice's text of an answer, or of the chunks of a stream."""
    if isinstance(answer, dict):
        c = answer["choices"][0]
        return c["message"]["content"] if chat else c["text"]
    out = []
    for e in answer:
        if isinstance(e, dict) and e["choices"]:
            c = e["choices"][0]
            out.append(c["delta"].get("content", "") if chat else c["text"])
    return "".join(out)


def post(client: httpx.Client, path: str, body: dict[str, Any]) -> Any:
    """The answer (a dict), or the events of a streamed one."""
    if not body.get("stream"):
        r = client.post(path, json=body)
        assert r.status_code == 200, r.text
        return r.json()
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    return events[:-1]


# ---- the clients' bodies ---------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(CLIENT_BODIES))
def test_the_bodies_the_load_clients_send_are_served(client, name):
    path, body = CLIENT_BODIES[name]
    chat = "chat" in path
    answer = post(client, path, body)
    if isinstance(answer, dict):
        used = answer["usage"]
    else:
        finals = [e for e in answer if not e["choices"]]
        assert len(finals) == 1, "one usage chunk, last"
        assert answer[-1] is finals[0]
        used = finals[0]["usage"]
    assert used["completion_tokens"] == N           # ignore_eos: the length asked for
    prompt = TOK.encode(PROMPT_TEXT)
    if not chat:
        assert used["prompt_tokens"] == len(prompt)
    if not chat and body.get("temperature") == 0:       # greedy: the reference's text
        want = reference(prompt, SamplingParams(max_tokens=N))
        assert text_of(answer, chat) == TOK.decode(want)


@pytest.mark.parametrize("path,body", [CLIENT_BODIES["guidellm-completions"],
                                       CLIENT_BODIES["guidellm-chat"]])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client, path, body):
    events = post(client, path, body)
    chunks = [e for e in events if e["choices"]]
    assert chunks and all(e["usage"] is not None for e in chunks)
    made = [e["usage"]["completion_tokens"] for e in chunks]
    assert made == sorted(made) and made[-1] == N
    prompt = chunks[0]["usage"]["prompt_tokens"]
    assert all(e["usage"]["total_tokens"] == prompt + e["usage"]["completion_tokens"]
               for e in chunks)
    # without it (include_usage only) the chunks carry usage null, as before
    plain = post(client, path, body | {"stream_options": {"include_usage": True}})
    assert all(e["usage"] is None for e in plain if e["choices"])


def test_harmless_fields_are_accepted(client):
    base = {"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 4}
    # stream_options without stream is ignored; store is ignored
    for extra in ({"stream_options": {"include_usage": True}, "stream": False},
                  {"stream_options": {"include_usage": True,
                                      "continuous_usage_stats": True}},
                  {"store": True}, {"store": False}, {"store": None},
                  {"min_tokens": 2}, {"ignore_eos": False},
                  {"presence_penalty": 0, "frequency_penalty": 0.0,
                   "repetition_penalty": 1}):
        r = client.post("/v1/completions", json=base | extra)
        assert r.status_code == 200, (extra, r.text)
    # max_completion_tokens on completions: it wins over max_tokens
    r = client.post("/v1/completions", json=base | {"max_completion_tokens": 6})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
    # content: null (an assistant turn of no text)
    r = client.post("/v1/chat/completions", json={
        "model": MODEL, "max_tokens": 3, "messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
            {"role": "user", "content": "again"}]})
    assert r.status_code == 200, r.text


# ---- penalties and length controls -----------------------------------------------------------

PENALTY_BODIES = [
    {"repetition_penalty": 1.3},
    {"frequency_penalty": 1.2, "presence_penalty": 0.7},
    {"repetition_penalty": 0.8, "frequency_penalty": -0.5, "temperature": 0.9, "seed": 4},
]


@pytest.mark.parametrize("extra", PENALTY_BODIES)
@pytest.mark.parametrize("stream", [False, True])
def test_penalties_give_the_library_tokens(client, extra, stream):
    body = {"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 16, "temperature": 0,
            "stream": stream, "n": 2, "logprobs": 2} | extra
    answer = post(client, "/v1/completions", body)
    for i in range(2):
        params = SamplingParams(
            max_tokens=16, temperature=body["temperature"],
            seed=None if "seed" not in body else body["seed"] + i,
            **{k: v for k, v in extra.items() if k.endswith("_penalty")})
        want = TOK.decode(reference(PROMPT_IDS, params))
        if isinstance(answer, dict):
            got = answer["choices"][i]["text"]
        else:
            got = "".join(e["choices"][0]["text"] for e in answer
                          if e["choices"] and e["choices"][0]["index"] == i)
        assert got == want, (extra, i)


def test_min_tokens_holds_off_a_stop_string(client):
    want = TOK.decode(reference(PROMPT_IDS, SamplingParams(max_tokens=12)))
    stop = want[1]
    body = {"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 12, "temperature": 0,
            "stop": [stop]}
    early = client.post("/v1/completions", json=body).json()["choices"][0]
    assert early["finish_reason"] == "stop" and len(early["text"]) <= 1
    late = client.post("/v1/completions", json=body | {"min_tokens": 4}).json()
    text = late["choices"][0]["text"]
    assert text.startswith(want[:4]) and late["usage"]["completion_tokens"] >= 4


# ---- every 400 names its param ---------------------------------------------------------------

BAD = [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": "0"}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 1.5}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"ignore_eos": "true"}, "ignore_eos"),
    ({"store": "yes"}, "store"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": "yes"}},
     "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": True, "other": 1}},
     "stream_options"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"prompt": "a\U000f1000"}, "prompt"),
]


@pytest.mark.parametrize("extra,param", BAD)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_values_are_400_naming_the_field(client, path, extra, param):
    body = {"model": MODEL, "max_tokens": 4} | extra
    if path.endswith("chat/completions"):
        prompt = body.pop("prompt", "hello")
        body["messages"] = [{"role": "user", "content": prompt}]
        param = "messages" if param == "prompt" else param
    else:
        body.setdefault("prompt", "hello")
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
