"""Tool calling through ``calfsm serve``'s app on a real uvicorn (issue 37, item 2): the
official ``openai`` client's round trip (``tools`` -> ``tool_calls`` -> ``role: tool``
-> answer), streaming and not, and LangChain's ``ChatOpenAI(...).bind_tools``.

The simulated model's text is noise, so its replies here are scripted
(:class:`calfsm.testing.ScriptedTokenizer`: the real streams, their text chosen): the
server's parser, deltas, finish reasons and the template's rendering of the calls and
results are what is tested. ``required`` and a named function are enforced by
constrained decoding (then the calls come from the masked noise itself)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from calfsm.errors import InvalidArgument
from calfsm.executor import DeviceExecutor, ExecutorConfig
from calfsm.generate import constraint
from calfsm.generate.chattemplate import load_chat_template
from calfsm.serve import ServerConfig, realtime_sim
from calfsm.serve import cli as serve_cli
from calfsm.serve.tokenizer import chat_prompt
from calfsm.testing import END, ScriptedTokenizer
from tests.helpers.serve import MODEL, TINY, VOCAB, LiveServer, serve, serve_executor

pytestmark = pytest.mark.timeout(120)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city today",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "unit": {"type": "string", "enum": ["C", "F"]}},
        "required": ["city"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}}
TOOLS = [WEATHER, CLOCK]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"unit": "C"}}\n</tool_call>')
ANSWER = "It is 21 C and sunny in Paris."
TEMPLATES = Path(__file__).parents[1] / "generate" / "data" / "chat_templates"


@pytest.fixture(scope="module")
def scripted() -> ScriptedTokenizer:
    return ScriptedTokenizer(VOCAB)


@pytest.fixture(scope="module")
def live(scripted: ScriptedTokenizer) -> Iterator[LiveServer]:
    ex = DeviceExecutor(realtime_sim(TINY, decode_ms=0.2, prefill_token_us=1), TINY,
                        ExecutorConfig(), tokenizer=scripted)
    srv = serve(ex)
    yield srv
    srv.stop()
    ex.close()


@pytest.fixture
def oai(live: LiveServer, scripted: ScriptedTokenizer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0) as c:
        yield c
    assert not scripted.pending, "a scripted reply was not taken"


def prompt_tokens(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> int:
    """The prompt the built-in template makes of ``messages`` (arguments as objects)."""
    rendered = []
    for m in messages:
        calls = [{**c, "function": {**c["function"], "arguments": json.loads(
            c["function"]["arguments"])}} for c in m.get("tool_calls") or ()]
        rendered.append({**m, "tool_calls": calls} if calls else m)
    return len(chat_prompt(rendered, tools=tools).encode())


def test_round_trip_with_the_openai_client(oai: openai.OpenAI,
                                           scripted: ScriptedTokenizer) -> None:
    scripted.script(CALL, ANSWER)
    first = oai.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                        stop=[END], max_tokens=200)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "C"}
    assert first.usage.prompt_tokens == prompt_tokens(QUESTION, TOOLS)

    # the answer's message object sent back as it is (the SDK's own serialisation)
    messages = [*QUESTION, choice.message,
                {"role": "tool", "tool_call_id": call.id, "content": "21 C, sunny"}]
    second = oai.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                         stop=[END], max_tokens=200)
    messages[1] = choice.message.model_dump(exclude_none=True)
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.content == ANSWER
    assert not second.choices[0].message.tool_calls
    # the call and its result went back through the template
    assert second.usage.prompt_tokens == prompt_tokens(messages, TOOLS)


def test_round_trip_streamed(oai: openai.OpenAI, scripted: ScriptedTokenizer) -> None:
    scripted.script(CALL + "\n" + CALL.replace("Let me look.\n", "").replace("Paris", "Lima"),
                    ANSWER)
    content, reasons, deltas = [], [], []
    for chunk in oai.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                             stop=[END], max_tokens=200, stream=True):
        for c in chunk.choices:
            content.append(c.delta.content or "")
            deltas.extend(c.delta.tool_calls or ())
            reasons.append(c.finish_reason)
    assert "".join(content) == "Let me look."
    assert [r for r in reasons if r] == ["tool_calls"]
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        if d.index not in calls:        # its id, type and name first, then fragments
            assert d.id and d.type == "function" and d.function.name
            calls[d.index] = {"id": d.id, "name": d.function.name,
                              "arguments": d.function.arguments or ""}
        else:
            assert d.id is None and d.function.name is None and d.function.arguments
            calls[d.index]["arguments"] += d.function.arguments
    assert sorted(calls) == [0, 1] and len(deltas) > 4      # arguments in several pieces
    assert [json.loads(c["arguments"])["city"] for c in calls.values()] == ["Paris", "Lima"]

    assistant = {"role": "assistant", "content": None, "tool_calls": [
        {"id": c["id"], "type": "function",
         "function": {"name": c["name"], "arguments": c["arguments"]}}
        for c in calls.values()]}
    results = [{"role": "tool", "tool_call_id": c["id"], "content": "sunny"}
               for c in calls.values()]
    messages = [*QUESTION, assistant, *results]
    text, usage = [], None
    for chunk in oai.chat.completions.create(
            model=MODEL, messages=messages, tools=TOOLS, stop=[END], max_tokens=200,
            stream=True, stream_options={"include_usage": True}):
        text.extend(c.delta.content or "" for c in chunk.choices)
        usage = chunk.usage or usage
    assert "".join(text) == ANSWER
    assert usage is not None and usage.prompt_tokens == prompt_tokens(messages, TOOLS)


def test_choices_are_read_apart_and_parallel_false_keeps_one(
        oai: openai.OpenAI, scripted: ScriptedTokenizer) -> None:
    two = CALL + "\n" + CALL.replace("Let me look.\n", "").replace("Paris", "Tokyo")
    scripted.script(two, "No tool needed.")
    answer = oai.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, n=2,
                                         stop=[END], max_tokens=200,
                                         parallel_tool_calls=False)
    by_index = {c.index: c for c in answer.choices}
    assert by_index[0].finish_reason == "tool_calls"
    assert [json.loads(c.function.arguments)["city"] for c in by_index[0].message.tool_calls] \
        == ["Paris"]
    assert by_index[1].finish_reason == "stop" and not by_index[1].message.tool_calls
    assert by_index[1].message.content == "No tool needed."


def test_tool_choice_none_leaves_the_text_as_it_is(oai: openai.OpenAI,
                                                   scripted: ScriptedTokenizer) -> None:
    scripted.script(CALL)
    answer = oai.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                         tool_choice="none", stop=[END], max_tokens=200)
    assert answer.choices[0].message.content == CALL
    assert answer.choices[0].finish_reason == "stop" and not answer.choices[0].message.tool_calls


def test_a_call_cut_by_max_tokens_ends_length(oai: openai.OpenAI,
                                              scripted: ScriptedTokenizer) -> None:
    scripted.script(CALL)
    answer = oai.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                         stop=[END], max_tokens=22)     # 66 characters
    choice = answer.choices[0]
    assert choice.finish_reason == "length" and choice.message.content == "Let me look."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == '{"ci'
    scripted.script(CALL)                   # cut before the name: text it stays
    answer = oai.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                         stop=[END], max_tokens=12)
    choice = answer.choices[0]
    assert choice.finish_reason == "length" and choice.message.content == CALL[:36]
    assert not choice.message.tool_calls


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "other"}}},
     "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": 1}, "parallel_tool_calls"),
])
def test_malformed_tool_fields_are_400_naming_them(live: LiveServer, body: dict[str, Any],
                                                   param: str) -> None:
    r = httpx.post(live.url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": QUESTION, **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_completions_still_refuse_tools(live: LiveServer) -> None:
    r = httpx.post(live.url + "/v1/completions",
                   json={"model": MODEL, "prompt": "x", "tools": TOOLS}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


@pytest.fixture(scope="module")
def noise() -> Iterator[openai.OpenAI]:
    """A server whose text is the simulated device's own (the byte-level tokenizer)."""
    if not constraint.constraints_available():
        pytest.skip("needs constrained decoding (the constraints extra)")
    ex = serve_executor()
    srv = serve(ex)
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0) as c:
        yield c
    srv.stop()
    ex.close()


SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _valid_calls(calls: list[Any], names: set[str]) -> list[str]:
    jsonschema = pytest.importorskip("jsonschema")
    for call in calls:
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return [c.function.name for c in calls]


@pytest.mark.parametrize("seed", range(4))
def test_named_and_required_are_enforced_on_noise(noise: openai.OpenAI, seed: int) -> None:
    """The simulated device's noise, constrained: a named function is always called, with
    arguments valid against its schema; ``required`` calls one of the tools (one call:
    parallel false), streamed the same."""
    named = {"type": "function", "function": {"name": "get_time"}}
    answer = noise.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                           tool_choice=named, max_tokens=200, seed=seed)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert _valid_calls(choice.message.tool_calls, {"get_time"}) == ["get_time"]
    answer = noise.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                           tool_choice="required", parallel_tool_calls=False,
                                           max_tokens=200, seed=seed, n=2)
    for choice in answer.choices:
        assert choice.finish_reason == "tool_calls"
        assert len(_valid_calls(choice.message.tool_calls, set(SCHEMAS))) == 1
    calls: dict[int, dict[str, str]] = {}
    reasons = []
    for chunk in noise.chat.completions.create(
            model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required",
            max_tokens=300, seed=seed, stream=True):
        for c in chunk.choices:
            assert not c.delta.content
            reasons.append(c.finish_reason)
            for d in c.delta.tool_calls or ():
                one = calls.setdefault(d.index, {"name": d.function.name, "arguments": ""})
                one["arguments"] += d.function.arguments or ""
    assert [r for r in reasons if r] == ["tool_calls"] and calls
    jsonschema = pytest.importorskip("jsonschema")
    for one in calls.values():
        jsonschema.validate(json.loads(one["arguments"]), SCHEMAS[one["name"]])


def test_an_enforced_call_round_trips(noise: openai.OpenAI) -> None:
    """A call forced on the noise, its result sent back, and the next turn (``auto``):
    the noise's text as content."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = noise.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                          tool_choice=named, max_tokens=200, seed=7)
    message = first.choices[0].message
    (call,) = message.tool_calls
    messages = [*QUESTION, message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "21 C, sunny"}]
    second = noise.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                           max_tokens=8, seed=7)
    assert second.choices[0].finish_reason in ("stop", "length")
    assert second.usage.prompt_tokens == prompt_tokens(messages, TOOLS)


def test_a_schema_the_matcher_refuses_is_a_400_naming_tools(noise: openai.OpenAI) -> None:
    odd = {"type": "function", "function": {"name": "odd", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "format": "no-such"}},
        "required": ["x"], "not": {"required": ["x"]}}}}
    with pytest.raises(openai.BadRequestError) as e:
        noise.chat.completions.create(model=MODEL, messages=QUESTION, tools=[odd],
                                      tool_choice="required", max_tokens=50)
    assert e.value.body["param"] == "tools"


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_time"}}])
def test_enforced_choices_need_constrained_decoding(oai: openai.OpenAI, choice: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # a server without the constraints extra: what the library answers when llguidance
    # does not import (tests/generate/test_constraint.py checks that in a fresh process)
    monkeypatch.setattr(constraint, "constraints_available", lambda: False)
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                    tool_choice=choice, max_tokens=50)
    assert e.value.body["param"] == "tool_choice"
    assert "constraints extra" in e.value.body["message"]


def test_round_trip_through_the_models_own_template(scripted: ScriptedTokenizer) -> None:
    """Qwen3's chat template (the one transformers renders, tests/generate/data): the
    tools in its system turn, the call as its ``<tool_call>``, the result as its
    ``<tool_response>``; the answer read by the Hermes parser."""
    template = load_chat_template(TEMPLATES / "qwen3")
    ex = DeviceExecutor(realtime_sim(TINY, decode_ms=0.2, prefill_token_us=1), TINY,
                        ExecutorConfig(), tokenizer=scripted)
    srv = serve(ex, chat_template=template)
    try:
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0) as oai:
            scripted.script(CALL, ANSWER)
            first = oai.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                                stop=[END], max_tokens=200)
            message = first.choices[0].message
            assert first.choices[0].finish_reason == "tool_calls"
            messages = [*QUESTION, message.model_dump(exclude_none=True),
                        {"role": "tool", "tool_call_id": message.tool_calls[0].id,
                         "content": "21 C, sunny"}]
            second = oai.chat.completions.create(model=MODEL, messages=messages,
                                                 tools=TOOLS, stop=[END], max_tokens=200)
            assert second.choices[0].message.content == ANSWER
    finally:
        srv.stop()
        ex.close()
    want = template.render([*messages[:1], {**messages[1], "tool_calls": [{
        **messages[1]["tool_calls"][0], "function": {
            "name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}}]},
        messages[2]], tools=TOOLS, add_generation_prompt=True)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": ' \
           '"C"}}\n</tool_call>' in want and "<tool_response>\n21 C, sunny" in want
    assert second.usage.prompt_tokens == len(want.encode())


def test_another_parser_by_name(scripted: ScriptedTokenizer) -> None:
    """``ServerConfig(tool_call_parser="llama3_json")``: Llama 3's bare JSON calls read
    into the same tool_calls, streamed and not."""
    ex = DeviceExecutor(realtime_sim(TINY, decode_ms=0.2, prefill_token_us=1), TINY,
                        ExecutorConfig(), tokenizer=scripted)
    srv = serve(ex, tool_call_parser="llama3_json")
    reply = ('{"name": "get_weather", "parameters": {"city": "Tokyo"}}; '
             '{"name": "get_time", "parameters": {"zone": "UTC"}}')
    try:
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0) as oai:
            scripted.script(reply, reply)
            answer = oai.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                                 stop=[END], max_tokens=200)
            streamed: dict[int, list[str]] = {}
            for chunk in oai.chat.completions.create(model=MODEL, messages=QUESTION,
                                                     tools=TOOLS, stop=[END], max_tokens=200,
                                                     stream=True):
                for c in chunk.choices:
                    for d in c.delta.tool_calls or ():
                        streamed.setdefault(d.index, [d.function.name])
                        streamed[d.index].append(d.function.arguments or "")
    finally:
        srv.stop()
        ex.close()
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    want = [("get_weather", {"city": "Tokyo"}), ("get_time", {"zone": "UTC"})]
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in choice.message.tool_calls] == want
    assert [(v[0], json.loads("".join(v[1:]))) for _, v in sorted(streamed.items())] == want


def test_the_parser_option() -> None:
    parser = argparse.ArgumentParser()
    serve_cli.add_parser(parser.add_subparsers(dest="command"))
    _, config, _ = serve_cli.configs(parser.parse_args(["serve"]))
    assert config.tool_call_parser == "hermes"
    _, config, _ = serve_cli.configs(parser.parse_args(
        ["serve", "--tool-call-parser", "llama3_json"]))
    assert config.tool_call_parser == "llama3_json"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--tool-call-parser", "nope"])
    with pytest.raises(InvalidArgument, match="tool_call_parser: no tool-call parser"):
        ServerConfig(tool_call_parser="nope")


# ---- LangChain ------------------------------------------------------------------------

def test_langchain_bind_tools(live: LiveServer, scripted: ScriptedTokenizer) -> None:
    """``ChatOpenAI(...).bind_tools([...])``: the call as LangChain's ``tool_calls``, and
    its ``ToolMessage`` back for the answer."""
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str, unit: str = "C") -> str:
        """The weather in a city today."""
        return f"21 {unit}, sunny in {city}"

    llm = langchain_openai.ChatOpenAI(model=MODEL, base_url=live.url + "/v1",
                                      api_key="none", max_retries=0, max_tokens=200,
                                      stop_sequences=[END])
    bound = llm.bind_tools([get_weather])
    scripted.script(CALL, ANSWER)
    messages: list[Any] = [HumanMessage("What is the weather in Paris?")]
    reply = bound.invoke(messages)
    assert reply.content == "Let me look."
    (call,) = reply.tool_calls
    assert call["name"] == "get_weather" and call["args"] == {"city": "Paris", "unit": "C"}
    assert reply.response_metadata["finish_reason"] == "tool_calls"
    messages += [reply, ToolMessage(get_weather.invoke(call["args"]),
                                    tool_call_id=call["id"])]
    final = bound.invoke(messages)
    assert final.content == ANSWER and not final.tool_calls
    assert not scripted.pending
