"""The server renders chats with the model's own chat template (issue 37, item 4):
messages with ``role: tool`` and an assistant's ``tool_calls`` go through it (the
template of data/chat_templates/qwen3, checked against ``transformers`` in
tests/generate/test_chat_template.py), a template that refuses the messages is a 400
naming ``messages`` (never a 500), and without a template the built-in one renders them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("jinja2")

from calfsm.executor import DeviceExecutor
from calfsm.generate.chattemplate import ChatTemplate, load_chat_template
from calfsm.serve.tokenizer import chat_prompt
from tests.helpers.serve import MODEL, TOK, LiveServer, Serving, poll, serve, serve_executor

DATA = Path(__file__).parents[1] / "generate" / "data" / "chat_templates"
QWEN3 = json.loads((DATA / "qwen3" / "cases.json").read_text("utf-8"))["cases"]

pytestmark = pytest.mark.timeout(60)

ROUND_TRIP = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
    {"role": "tool", "tool_call_id": "call_0", "content": "rain"},
]


@pytest.fixture(scope="module")
def executor() -> Iterator[DeviceExecutor]:
    ex = serve_executor(max_sequences=8)
    yield ex
    ex.close()


def _client(live: LiveServer) -> httpx.Client:
    return httpx.Client(base_url=live.url, timeout=30)


@pytest.fixture(scope="module")
def templated(executor: DeviceExecutor) -> Iterator[httpx.Client]:
    live = serve(executor, chat_template=load_chat_template(DATA / "qwen3"))
    with _client(live) as c:
        yield c
    live.stop()


@pytest.fixture(scope="module")
def builtin(executor: DeviceExecutor) -> Iterator[httpx.Client]:
    live = serve(executor)
    with _client(live) as c:
        yield c
    live.stop()


def _prompt_tokens(client: httpx.Client, messages: list, **extra) -> int:
    r = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": messages, "max_tokens": 1, "temperature": 0} | extra)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def test_the_model_template_renders_the_chat(templated):
    case = next(c for c in QWEN3 if c["name"] == "simple")
    assert _prompt_tokens(templated, case["messages"]) == len(TOK.encode(case["expected"]))


def test_tool_calls_and_tool_results_go_through_the_template(templated):
    # the arguments arrive as OpenAI's JSON string and reach the template as an object
    want = load_chat_template(DATA / "qwen3").render(
        [ROUND_TRIP[0], {"role": "assistant", "tool_calls": [
            {"id": "call_0", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
         ROUND_TRIP[2]])
    assert "<tool_response>\nrain\n</tool_response>" in want
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in want
    assert _prompt_tokens(templated, ROUND_TRIP) == len(TOK.encode(want))


def test_the_builtin_template_renders_tool_calls(builtin):
    want = chat_prompt([ROUND_TRIP[0], {"role": "assistant", "content": None,
                                        "tool_calls": [{"function": {
                                            "name": "get_weather",
                                            "arguments": {"city": "Oslo"}}}]},
                        ROUND_TRIP[2]])
    assert want == ("<|user|>\nWeather in Oslo?\n<|assistant|>\n\n<tool_call>\n"
                    '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
                    "</tool_call>\n<|tool|>\nrain\n<|assistant|>\n")
    assert _prompt_tokens(builtin, ROUND_TRIP) == len(TOK.encode(want))
    # what it rendered before tool calls, it renders the same
    assert _prompt_tokens(builtin, [{"role": "user", "content": "hi"}]) \
        == len(TOK.encode(chat_prompt([("user", "hi")])))


def test_a_template_error_is_a_400_naming_messages(executor):
    refuses = ChatTemplate("{% if messages[-1].role == 'tool' %}"
                           "{{ raise_exception('no tools here') }}{% endif %}x")
    broken = ChatTemplate("{{ messages[0].content.nope.deeper }}")
    for template, words in ((refuses, "no tools here"), (broken, "refused")):
        live = serve(executor, chat_template=template)
        try:
            with _client(live) as c:
                r = c.post("/v1/chat/completions",
                           json={"model": MODEL, "messages": ROUND_TRIP, "max_tokens": 1})
        finally:
            live.stop()
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "messages" and words in error["message"]


@pytest.mark.parametrize("bad", [
    [{"role": "user", "content": None}],
    [{"role": "user", "content": "x", "tool_calls": []}],
    [{"role": "assistant", "tool_calls": [{"type": "function", "function": {}}]}],
    [{"role": "assistant", "tool_calls": "call"}],
    [{"role": "tool", "content": "x", "tool_call_id": 3}],
])
def test_malformed_tool_messages_are_400(builtin, bad):
    r = builtin.post("/v1/chat/completions", json={"model": MODEL, "messages": bad})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages"


def test_calfsm_serve_chat_template_option(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
                    "{% if add_generation_prompt %}[assistant]{% endif %}", "utf-8")
    serving = Serving("--chat-template", str(path))
    try:
        with httpx.Client(base_url=serving.url, timeout=30) as c:
            poll(lambda: c.get("/ready").status_code == 200, 30,
                 "calfsm serve never became ready", every=0.05)
            r = c.post("/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 1})
    finally:
        serving.stop()
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len("[user]hi[assistant]")


@pytest.mark.parametrize(("option", "content", "words"), [
    ("--chat-template", "{% for %}", "does not compile"),
    ("--chat-template", None, "cannot read"),
    ("--tokenizer", None, "no tokenizer.json"),
])
def test_a_bad_template_or_tokenizer_option_is_exit_2(tmp_path, capsys, option, content,
                                                      words):
    from calfsm.tools import cli
    path = tmp_path / "given"
    if content is not None:
        path.write_text(content, "utf-8")
    assert cli.main(["serve", "--manifest", "tiny", "--port", "0", option, str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"calfsm: error: {option} "), err
    assert words in err
