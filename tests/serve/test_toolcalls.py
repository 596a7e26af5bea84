"""Tool calling's parts on their own (issue 37, item 2): the request's ``tools``,
``tool_choice`` and ``parallel_tool_calls`` checked into 400s naming the field; the Hermes
parser on crafted texts, whole and streamed at every split (the same calls either way,
the id and name first, then argument fragments that join to the arguments); and the
grammar that enforces ``required`` and a named function, run by llguidance over a
byte-level vocabulary with random tokens (the simulated device's noise): every output
parses into calls whose arguments are valid against the function's schema."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from calfsm.errors import InvalidArgument
from calfsm.serve.httperrors import ApiError
from calfsm.serve.tokenizer import chat_prompt
from calfsm.serve.toolcalls import (
    TOOL_PARSERS,
    TaggedJsonParser,
    collect_tool_calls,
    parse_tools,
    register_tool_parser,
    tool_grammar,
    tool_parser,
)

HERMES = tool_parser("hermes")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["C", "F"]}},
        "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "precise": {"type": "boolean"}}, "required": ["zone", "precise"],
        "additionalProperties": False}}}
NOTHING = {"type": "function", "function": {"name": "ping"}}


def read(text: str | list[str], *, parallel: bool = True, parser: Any = HERMES
         ) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]], Any]:
    """``text`` (or its pieces) through a fresh stream: (content, calls, deltas, stream)."""
    stream = parser.stream(parallel=parallel)
    content, deltas = [], []
    for piece in [text] if isinstance(text, str) else text:
        out = stream.feed(piece)
        content.append(out.content)
        deltas.extend(out.calls)
    out = stream.finish()
    content.append(out.content)
    deltas.extend(out.calls)
    return "".join(content), collect_tool_calls(deltas), deltas, stream


def call_text(name: str, arguments: Any) -> str:
    """A call as the built-in template writes an assistant's (Hermes' format)."""
    return chat_prompt([{"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": name, "arguments": arguments}}]}]).split("\n", 1)[1] \
        .removesuffix("<|assistant|>\n").lstrip("\n")


def args_of(call: dict[str, Any]) -> Any:
    return json.loads(call["function"]["arguments"])


# ---- the parser on crafted texts ------------------------------------------------------

def test_text_without_calls_is_content() -> None:
    for text in ("Hello, world.", "  spaced  ", "a <tool almost", "<tool_call", "x}\n"):
        content, calls, _, stream = read(text)
        assert (content, calls, stream.calls) == (text, [], 0)


def test_one_call_after_some_text() -> None:
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris", "days": 3}}\n</tool_call>')
    content, calls, deltas, stream = read(text)
    assert content == "Let me look."
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert calls[0]["function"]["arguments"] == '{"city": "Paris", "days": 3}'
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    assert deltas[0]["function"]["name"] == "get_weather" and "id" in deltas[0]
    assert (stream.calls, stream.unfinished) == (1, False)


def test_parallel_calls_and_their_limit() -> None:
    text = (call_text("get_weather", {"city": "Lima"}) + call_text("get_time", {"zone": "UTC"})
            + "\n")
    content, calls, _, _ = read(text)
    assert content == ""
    assert [(c["function"]["name"], args_of(c)) for c in calls] == [
        ("get_weather", {"city": "Lima"}), ("get_time", {"zone": "UTC"})]
    assert len({c["id"] for c in calls}) == 2
    content, calls, _, stream = read(text, parallel=False)
    assert content == "" and [c["function"]["name"] for c in calls] == ["get_weather"]
    assert stream.calls == 1


def test_text_after_a_call_is_content_without_the_blank() -> None:
    content, calls, _, _ = read(call_text("ping", {}) + "\n\nDone, it answered.\n")
    assert content == "Done, it answered.\n" and len(calls) == 1
    assert calls[0]["function"]["arguments"] == "{}"


def test_arguments_first_and_string_arguments() -> None:
    text = '<tool_call>{"arguments": {"a": [1, 2]}, "name": "f"}</tool_call>'
    _, calls, _, _ = read(text)
    assert calls[0]["function"] == {"name": "f", "arguments": '{"a": [1, 2]}'}
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    _, calls, _, _ = read(text)
    assert calls[0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    text = '<tool_call>{"name": "f", "parameters": {"b": "}}"}}</tool_call>'
    _, calls, _, _ = read(text)
    assert calls[0]["function"] == {"name": "f", "arguments": '{"b": "}}"}'}


def test_a_body_that_is_no_call_stays_text() -> None:
    for body in ("not json", '{"no": "name"}', "[1, 2]"):
        text = f"Before <tool_call>{body}</tool_call> after"
        content, calls, _, stream = read(text)
        assert (content, calls, stream.calls) == (text, [], 0)


def test_a_call_cut_short() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    content, calls, _, stream = read(text)
    assert content == "" and stream.unfinished
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Pa'}
    content, calls, _, stream = read('Hm <tool_call>\n{"na')      # no name yet: text
    assert (content, calls, stream.unfinished) == ('Hm <tool_call>\n{"na', [], False)


CRAFTED = [
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
    '"days": 3}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": '
    '"CET", "precise": true, "nested": {"x": [1, {"y": "}</tool_call"}]}}}\n</tool_call>',
    '<tool_call>{"arguments": {"k": "v"}, "name": "odd"}</tool_call> and then text',
    'plain text with < and </ and <tool and } and {"name": "x"}',
    '<tool_call>\n{"name": "cut", "arguments": {"deep": {"deeper": [1, 2',
]


@pytest.mark.parametrize("text", CRAFTED)
def test_streamed_at_every_split_as_whole(text: str) -> None:
    """Any two cuts of the text: the same content, names and arguments as the whole;
    each call's deltas open with its id and name, then fragments."""
    whole = read(text)
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 7):
            content, calls, deltas, _ = read([text[:i], text[i:j], text[j:]])
            assert content == whole[0]
            assert [c["function"] for c in calls] == [c["function"] for c in whole[1]]
            opened: set[int] = set()
            for d in deltas:
                if d["index"] not in opened:
                    assert d["id"] and d["function"]["name"] and d["type"] == "function"
                    opened.add(d["index"])
                else:
                    assert set(d) == {"index", "function"} and d["function"]["arguments"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.from_regex(r"[A-Za-z0-9_-]{1,64}", fullmatch=True),
                          st.dictionaries(st.text(max_size=8), st.recursive(
                              st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                              lambda kids: st.lists(kids, max_size=3)
                              | st.dictionaries(st.text(max_size=5), kids, max_size=3),
                              max_leaves=8), max_size=4)), min_size=1, max_size=3),
       st.text(max_size=20), st.integers(1, 9))
def test_calls_as_the_template_writes_them_read_back(
        calls: list[tuple[str, dict[str, Any]]], before: str, step: int) -> None:
    """What the built-in template writes for an assistant's calls, the parser reads back
    (the round trip of a conversation), in pieces of any size."""
    text = before.replace("<", "") + "".join(call_text(n, a) for n, a in calls)
    content, got, _, stream = read([text[i:i + step] for i in range(0, len(text), step)])
    assert content == before.replace("<", "").rstrip()
    assert [(c["function"]["name"], args_of(c)) for c in got] == calls
    assert not stream.unfinished


FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool_", "</tool", "\n", " ", "{", "}", "[",
             "]", '"', ":", ",", '"name"', '"arguments"', '"parameters"', '"f"', "1", "x",
             "\\", '{"name": "f", "arguments": ', "}}", "<|python_tag|>", ";",
             '{"name": "g", "parameters": ']


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=40).map("".join),
       st.lists(st.integers(0, 400), max_size=6), st.booleans(),
       st.sampled_from(["hermes", "llama3_json"]))
def test_any_text_streams_as_it_reads_whole(text: str, cuts: list[int], parallel: bool,
                                            name: str) -> None:
    """Text made of the tags' and JSON's pieces, cut anywhere, by either parser: no
    error, and the same content and calls as the whole; every call opens with its id and
    name."""
    parser = tool_parser(name)
    whole = read(text, parallel=parallel, parser=parser)
    at = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[i:j] for i, j in zip([0, *at], [*at, len(text)])]
    content, calls, deltas, stream = read(pieces, parallel=parallel, parser=parser)
    assert content == whole[0]
    assert [c["function"] for c in calls] == [c["function"] for c in whole[1]]
    assert stream.unfinished == whole[3].unfinished
    assert all("id" in d for d in deltas if d["index"] not in
               {e["index"] for e in deltas[:deltas.index(d)]})
    if not parallel:
        assert len(calls) <= 1


LLAMA = tool_parser("llama3_json")
LLAMA_TEXTS = [
    '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
    '{"name": "get_time", "parameters": {"zone": "CET", "deep": {"x": "}{\\"", "y": [{}]}}}',
    '<|python_tag|>{"name": "f", "arguments": {}}',
    '  {"parameters": {"k": "v"}, "name": "odd"}',
    'Hello {there}; no call here',
    '{"not": "a call"}',
    '{"name": "f", "parameters": {"a": 1}} and some text after',
    '{"name": "cut", "parameters": {"deep": {"deeper": [1, 2',
    '<|python_ta',
]


def test_llama3_json_reads_bare_objects() -> None:
    content, calls, _, stream = read(LLAMA_TEXTS[0], parser=LLAMA)
    assert content == "" and not stream.unfinished
    assert [(c["function"]["name"], args_of(c)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 3}),
        ("get_time", {"zone": "CET", "deep": {"x": '}{"', "y": [{}]}})]
    assert calls[0]["function"]["arguments"] == '{"city": "Paris", "days": 3}'
    _, calls, _, _ = read(LLAMA_TEXTS[1], parser=LLAMA)
    assert calls[0]["function"] == {"name": "f", "arguments": "{}"}
    _, calls, _, _ = read(LLAMA_TEXTS[2], parser=LLAMA)
    assert calls[0]["function"] == {"name": "odd", "arguments": '{"k": "v"}'}
    for text in LLAMA_TEXTS[3:5] + LLAMA_TEXTS[7:]:
        content, calls, _, _ = read(text, parser=LLAMA)
        assert (content, calls) == (text, [])
    content, calls, _, _ = read(LLAMA_TEXTS[5], parser=LLAMA)
    assert content == "and some text after" and len(calls) == 1
    _, calls, _, stream = read(LLAMA_TEXTS[6], parser=LLAMA)
    assert stream.unfinished and calls[0]["function"]["arguments"] == '{"deep": {"deeper": [1, 2'
    _, calls, _, _ = read(LLAMA_TEXTS[0], parser=LLAMA, parallel=False)
    assert [c["function"]["name"] for c in calls] == ["get_weather"]


@pytest.mark.parametrize("text", LLAMA_TEXTS)
def test_llama3_json_streamed_at_every_split_as_whole(text: str) -> None:
    whole = read(text, parser=LLAMA)
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 5):
            content, calls, _, stream = read([text[:i], text[i:j], text[j:]], parser=LLAMA)
            assert content == whole[0]
            assert [c["function"] for c in calls] == [c["function"] for c in whole[1]]
            assert stream.unfinished == whole[3].unfinished


def test_a_parser_of_another_format_plugs_in() -> None:
    mine = TaggedJsonParser("test-fn", "<function_call>", "</function_call>")
    register_tool_parser(mine)
    try:
        assert tool_parser("test-fn") is mine
        with pytest.raises(InvalidArgument, match="registered already"):
            register_tool_parser(TaggedJsonParser("test-fn", "<a>", "</a>"))
        _, calls, _, _ = read('<function_call>{"name": "f", "arguments": {}}</function_call>',
                              parser=mine)
        assert calls[0]["function"] == {"name": "f", "arguments": "{}"}
    finally:
        del TOOL_PARSERS["test-fn"]
    with pytest.raises(InvalidArgument, match=r"no tool-call parser named 'nope'.*hermes"):
        tool_parser("nope")


# ---- the request's fields -------------------------------------------------------------

@pytest.mark.parametrize(("body", "param", "words"), [
    ({"tools": {"a": 1}}, "tools", "must be a list"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "tools[0] must be"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "letters"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools", "1 to 64"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
     "tools", "parameters must be a JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]},
     "tools", "strict must be a boolean"),
    ({"tools": [NOTHING, NOTHING]}, "tools", "more than once"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice", "none, auto, required"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice", "none, auto"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice", "not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls", "boolean"),
])
def test_malformed_tool_fields_are_400s_naming_them(body: dict[str, Any], param: str,
                                                     words: str) -> None:
    with pytest.raises(ApiError) as e:
        parse_tools(body)
    assert (e.value.status, e.value.param) == (400, param)
    assert words in e.value.message


def test_tool_fields_read() -> None:
    assert parse_tools({}) is None
    assert parse_tools({"tools": [], "tool_choice": "none"}) is None
    plan = parse_tools({"tools": [WEATHER, NOTHING]})
    assert plan is not None and (plan.choice, plan.parallel, plan.parses) == ("auto", True, True)
    assert plan.tools[1].parameters["type"] == "object"      # no parameters: none
    assert plan.specs == [WEATHER, NOTHING]
    plan = parse_tools({"tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}, "parallel_tool_calls": False})
    assert plan is not None and (plan.choice, plan.function, plan.parallel) == (
        "function", "get_weather", False)
    assert plan.enforced
    plan = parse_tools({"tools": [WEATHER], "tool_choice": "none"})
    assert plan is not None and not plan.parses and not plan.enforced


# ---- the enforcement ------------------------------------------------------------------

def test_nothing_to_enforce_for_none_and_auto() -> None:
    plan = parse_tools({"tools": [WEATHER]})
    assert plan is not None
    for choice in ("none", "auto"):
        assert tool_grammar(plan.tools, choice, True, HERMES) is None


class _Bytes:
    """A byte-level vocabulary for llguidance: ids 0..255 the bytes, 256 the end."""

    def __init__(self) -> None:
        self.eos_token_id, self.bos_token_id = 256, None
        self.tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
        self.special_token_ids = [256]

    def __call__(self, s: Any) -> list[int]:
        return list(s if isinstance(s, bytes) else s.encode())


@pytest.fixture(scope="module")
def vocab() -> Any:
    """llguidance's view of the byte-level vocabulary (skips without llguidance, the
    constraints extra's engine)."""
    llguidance = pytest.importorskip("llguidance")
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))


def matcher(vocab: Any, lark: str) -> Any:
    import llguidance
    m = llguidance.LLMatcher(vocab, llguidance.LLMatcher.grammar_from_lark(lark))
    assert not m.is_error(), m.get_error()
    return m


def accepts(vocab: Any, lark: str, text: str) -> bool:
    m = matcher(vocab, lark)
    ids = list(text.encode())
    return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()


def random_output(vocab: Any, lark: str, seed: int, limit: int = 5000) -> str:
    """Tokens drawn uniformly among those the grammar allows (noise, masked) until it
    ends: the simulated device under the constraint."""
    import numpy as np
    rng = np.random.default_rng(seed)
    m = matcher(vocab, lark)
    out = []
    while not m.is_stopped():
        assert len(out) < limit, bytes(out).decode(errors="replace")
        mask = np.frombuffer(m.compute_bitmask(), dtype=np.uint32)
        allowed = np.flatnonzero((mask[np.arange(257) // 32] >> (np.arange(257) % 32)) & 1)
        assert len(allowed), "a dead end"
        t = int(rng.choice(allowed))
        assert m.consume_token(t), m.get_error()
        if t < 256:
            out.append(t)
    return bytes(out).decode()


def test_required_and_named_grammars_accept_exactly_valid_calls(vocab: Any) -> None:
    plan = parse_tools({"tools": [WEATHER, TIME, NOTHING]})
    assert plan is not None
    required = tool_grammar(plan.tools, "required", False, HERMES)
    named = tool_grammar(plan.tools, "function", False, HERMES, "get_time")
    assert required is not None and named is not None
    weather = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}' \
              '\n</tool_call>'
    clock = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET", "precise": true}}' \
            '\n</tool_call>'
    ping = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    for text in (weather, clock, ping):
        assert accepts(vocab, required, text), text
    assert accepts(vocab, named, clock)
    for text in (weather, ping,                                           # another function
                 clock.replace('"CET"', '"cet"'),                         # the pattern
                 clock.replace(', "precise": true', ""),                  # a required key
                 clock.replace("true", '"yes"'),                          # the type
                 "Sure. " + clock,                                        # text first
                 clock + "\n" + clock):                                   # one call only
        assert not accepts(vocab, named, text), text
    assert not accepts(vocab, required, weather.replace('"days": 2', '"days": 9'))
    assert not accepts(vocab, required, weather + "\n" + clock)           # not parallel
    parallel = tool_grammar(plan.tools, "required", True, HERMES)
    assert parallel is not None and accepts(vocab, parallel, weather + "\n" + clock + "\n" + ping)


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
@pytest.mark.parametrize("choice", ["required", "function"])
def test_noise_under_the_grammar_is_always_a_valid_call(vocab: Any, choice: str,
                                                        parser: str) -> None:
    """Random tokens the grammar allows, 40 times: every output parses (by the same
    parser) into calls of the offered (or named) functions whose arguments are valid
    against their schemas."""
    jsonschema = pytest.importorskip("jsonschema")
    plan = parse_tools({"tools": [WEATHER, TIME, NOTHING]})
    assert plan is not None
    lark = tool_grammar(plan.tools, choice, True, tool_parser(parser), "get_weather")
    assert lark is not None
    schemas = {t.name: t.parameters for t in plan.tools}
    seen = set()
    for seed in range(40):
        text = random_output(vocab, lark, seed)
        content, calls, _, stream = read(text, parser=tool_parser(parser))
        assert content == "" and calls and not stream.unfinished, text
        for call in calls:
            name = call["function"]["name"]
            jsonschema.validate(args_of(call), schemas[name])
            seen.add(name)
    assert seen == ({"get_weather"} if choice == "function" else set(schemas))


def test_strict_unless_the_function_says_not(vocab: Any) -> None:
    """A keyword the matcher does not implement: refused (OpenAI's strict), unless the
    function says ``strict: false`` (then ignored, as ``JsonSchema(strict=False)``)."""
    import llguidance
    odd = {"type": "object", "properties": {"x": {"type": "integer"}}, "not": {}}
    for strict, refused in ((None, True), (True, True), (False, False)):
        function = {"name": "odd", "parameters": odd} | (
            {} if strict is None else {"strict": strict})
        plan = parse_tools({"tools": [{"type": "function", "function": function}]})
        assert plan is not None
        lark = tool_grammar(plan.tools, "required", False, HERMES)
        error, _ = llguidance.LLMatcher.validate_grammar_with_warnings(
            llguidance.LLMatcher.grammar_from_lark(lark), vocab)
        assert error is refused


def test_llama3_json_grammar(vocab: Any) -> None:
    plan = parse_tools({"tools": [WEATHER, TIME]})
    assert plan is not None
    lark = tool_grammar(plan.tools, "required", True, LLAMA)
    one = '{"name": "get_weather", "parameters": {"city": "Lima"}}'
    two = '{"name": "get_time", "parameters": {"zone": "UTC", "precise": false}}'
    assert lark is not None and accepts(vocab, lark, one) and accepts(vocab, lark, f"{one}; {two}")
    assert not accepts(vocab, lark, one.replace("parameters", "arguments"))
    assert not accepts(vocab, lark, "<tool_call>\n" + one + "\n</tool_call>")
    single = tool_grammar(plan.tools, "required", False, LLAMA)
    assert single is not None and not accepts(vocab, single, f"{one}; {two}")
