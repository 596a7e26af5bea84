"""Structured outputs: a request's ``response_format`` or vLLM's guided-decoding extras
as the library's constraint (:mod:`calfsm.generate.constraint`).

Accepted, at most one of them per request (two are a 400 naming the second):

- OpenAI's ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}``
  (any JSON object), ``{"type": "json_schema", "json_schema": {"name": ..., "schema":
  {...}, "strict": true}}`` (``strict`` refuses the schema keywords the matcher does not
  implement; not strict, OpenAI's default, they are ignored);
- vLLM's ``structured_outputs`` (one of ``json``, ``regex``, ``choice``, ``grammar``,
  ``json_object``) and its older top-level ``guided_json``, ``guided_regex``,
  ``guided_choice`` and ``guided_grammar`` (Lark, llguidance's dialect; a GBNF grammar,
  told by its ``::=``, is converted).

The constraint is compiled here, with the server's tokenizer and the model's vocabulary
(cached: the streams find it compiled), so a schema the matcher does not support, or a
server without the ``constraints`` extra, is a 400 naming the field before anything runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from calfsm.errors import InvalidArgument
from calfsm.generate.constraint import (
    Choice,
    Constraint,
    Grammar,
    JsonObject,
    JsonSchema,
    Regex,
    compile_constraint,
)
from calfsm.serve.httperrors import clip
from calfsm.serve.httperrors import invalid_argument as _bad

__all__ = ["STRUCTURED_FIELDS", "constraint_of"]

#: the request fields that ask for a constraint (in the order a second one is named)
_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
           "guided_choice", "guided_grammar")
STRUCTURED_FIELDS = frozenset(_FIELDS)
_GUIDED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _response_format(value: Any) -> Constraint | None:
    param = "response_format"
    if not isinstance(value, Mapping):
        raise _bad("response_format must be an object with a type", param)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return JsonObject()
    if kind != "json_schema":
        raise _bad(f"response_format.type must be text, json_object or json_schema, got "
                   f"{clip(kind)}", "response_format.type")
    spec = value.get("json_schema")
    if not isinstance(spec, Mapping) or "schema" not in spec:
        raise _bad("response_format.json_schema must be an object with a schema",
                   "response_format.json_schema")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _bad("response_format.json_schema.strict must be a boolean",
                   "response_format.json_schema.strict")
    return _made(lambda: JsonSchema(spec["schema"], strict=bool(strict)),
                 "response_format.json_schema.schema")


def _grammar(text: Any, param: str) -> Grammar:
    if isinstance(text, str) and "::=" in text:     # GBNF (llama.cpp's, vLLM's)
        try:
            from llguidance.gbnf_to_lark import gbnf_to_lark
            text = gbnf_to_lark(text)
        except ImportError:
            pass                        # the compile step says the extra is missing
        except Exception as e:
            raise _bad(f"{param}: the GBNF grammar does not convert: {e}", param) from None
    return _made(lambda: Grammar(text), param)


def _guided(kind: str, value: Any, param: str) -> Constraint | None:
    if kind == "json":
        return _made(lambda: JsonSchema(value, strict=False), param)
    if kind == "regex":
        return _made(lambda: Regex(value), param)
    if kind == "choice":
        if not isinstance(value, list):
            raise _bad(f"{param} must be a list of strings", param)
        return _made(lambda: Choice(tuple(value)), param)
    if kind == "grammar":
        return _grammar(value, param)
    if value is True:               # json_object
        return JsonObject()
    if value is False or value is None:
        return None
    raise _bad(f"{param} must be a boolean", param)


def _structured_outputs(value: Any) -> Constraint | None:
    param = "structured_outputs"
    if not isinstance(value, Mapping):
        raise _bad("structured_outputs must be an object", param)
    given = [k for k in _GUIDED_KINDS if value.get(k) is not None]
    unknown = sorted(set(value) - set(_GUIDED_KINDS))
    if unknown:
        raise _bad(f"structured_outputs: unsupported option {clip(unknown[0])}",
                   f"{param}.{unknown[0]}")
    if len(given) > 1:
        raise _bad("structured_outputs: give one of json, regex, choice, grammar, "
                   "json_object", f"{param}.{given[1]}")
    if not given:
        return None
    return _guided(given[0], value[given[0]], f"{param}.{given[0]}")


def _made(make: Any, param: str) -> Constraint:
    try:
        return make()
    except InvalidArgument as e:
        raise _bad(e.message, param) from None


def constraint_of(body: Mapping[str, Any], tokenizer: Any, vocab: int) -> Constraint | None:
    """The constraint ``body`` asks for (None: none), compiled for ``tokenizer`` and a
    model of ``vocab`` ids; a 400 naming the field otherwise."""
    found: list[tuple[str, Constraint]] = []
    for key in _FIELDS:
        value = body.get(key)
        if value is None:
            continue
        if key == "response_format":
            c = _response_format(value)
        elif key == "structured_outputs":
            c = _structured_outputs(value)
        else:
            c = _guided(key.removeprefix("guided_"), value, key)
        if c is None:
            continue
        if found:
            raise _bad(f"{key}: {found[0][0]} already constrains the output; give one",
                       key)
        found.append((key, c))
    if not found:
        return None
    key, c = found[0]
    try:
        compile_constraint(c, tokenizer, vocab)
    except InvalidArgument as e:
        param = "response_format.json_schema.schema" if key == "response_format" \
            and isinstance(c, JsonSchema) else key
        raise _bad(e.message, param) from None
    return c
