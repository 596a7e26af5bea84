"""Structured outputs over HTTP (issue 37, item 1): ``response_format`` (``json_object``,
``json_schema`` with ``strict``), vLLM's ``structured_outputs`` and ``guided_*`` extras,
against a real uvicorn on 127.0.0.1; the official ``openai`` client's
``chat.completions.parse(..., response_format=PydanticModel)`` returns a parsed object.
A bad or unsupported constraint is a 400 naming the field.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

import pytest

from tests.helpers.serve import MODEL, live_fixtures, sse_events

pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

pytestmark = pytest.mark.timeout(120)

executor, live, client = live_fixtures(max_sequences=32)


@pytest.fixture(scope="module")
def oai(live: Any) -> Any:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


class Pet(pydantic.BaseModel):
    name: Annotated[str, pydantic.Field(max_length=10)]
    kind: Literal["cat", "dog", "fish"]
    age: Annotated[int, pydantic.Field(ge=0, le=30)]
    vaccinated: bool


class Owner(pydantic.BaseModel):
    owner: Annotated[str, pydantic.Field(max_length=8)]
    pets: Annotated[list[Pet], pydantic.Field(max_length=2)]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Answer."}],
            "max_tokens": 600, "temperature": 0.8, "seed": 1, **fields}


@pytest.mark.parametrize("model", [Pet, Owner])
def test_the_openai_client_parses_a_pydantic_model(oai, model):
    done = oai.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "A pet, please."}],
        response_format=model, max_tokens=600, temperature=0.7, seed=3)
    choice = done.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, model), choice.message.content


def test_json_object_gives_a_json_object(client):
    r = client.post("/v1/chat/completions",
                    json=chat(response_format={"type": "json_object"}, n=2))
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        assert c["finish_reason"] == "stop"
        assert isinstance(json.loads(c["message"]["content"]), dict)


def test_a_streamed_schema_output_parses(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 9},
                                               "w": {"enum": ["a", "b"]}},
              "required": ["n", "w"], "additionalProperties": False}
    body = chat(stream=True, response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": schema, "strict": True}})
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    text = "".join(e["choices"][0]["delta"].get("content") or ""
                   for e in events if isinstance(e, dict) and e.get("choices"))
    assert json.loads(text)["w"] in ("a", "b")


@pytest.mark.parametrize(("fields", "check"), [
    ({"guided_regex": r"[a-z]{3}-\d{2}"}, lambda t: re.fullmatch(r"[a-z]{3}-\d{2}", t)),
    ({"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    ({"guided_json": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
     lambda t: all(isinstance(v, bool) for v in json.loads(t))),
    ({"guided_grammar": 'start: "<" /[0-9]{2}/ ">"'}, lambda t: re.fullmatch(r"<\d\d>", t)),
    ({"guided_grammar": 'root ::= "x" [0-9] [0-9]?'}, lambda t: re.fullmatch(r"x\d\d?", t)),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
    ({"structured_outputs": {"regex": "[A-Z]{4}"}}, lambda t: re.fullmatch("[A-Z]{4}", t)),
    ({"response_format": {"type": "text"}}, lambda t: True),
], ids=["guided_regex", "guided_choice", "guided_json", "lark", "gbnf",
        "structured_choice", "structured_regex", "text"])
def test_vllms_extras(client, fields, check):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 60,
                                             "temperature": 0.9, "seed": 2, **fields})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert check(text), text


@pytest.mark.parametrize(("fields", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "strict": True, "schema": {"type": "string", "format": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern"),
])
def test_a_bad_constraint_is_a_400_naming_the_field(client, fields, param):
    r = client.post("/v1/chat/completions", json=chat(**fields))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(live, method):
    """LangChain's ``ChatOpenAI(...).with_structured_output(Model)`` against the server:
    by a ``json_schema`` response format (its default) and by a named tool call (its
    ``function_calling``, enforced as a named ``tool_choice``), the answer is a parsed
    model either way, on a device whose text is noise."""
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(model=MODEL, base_url=live.url + "/v1",
                                      api_key="unused", max_retries=0, timeout=60,
                                      max_tokens=600, temperature=0.7, seed=3)
    got = llm.with_structured_output(Pet, method=method).invoke("A pet, please.")
    assert isinstance(got, Pet), got
