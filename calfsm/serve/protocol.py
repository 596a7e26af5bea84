"""OpenAI request bodies in, checked :class:`GenerationPlan` records out.

One function per endpoint (:func:`parse_completion`, :func:`parse_chat`) reads the JSON
body and returns what to run: the prompts as token ids (text through the server's
tokenizer: the executor's, else the byte-level one; or ids as given), the
:class:`~calfsm.generate.sampling.SamplingParams` of each choice (``stop`` strings go in as its
``stop`` strings when the executor has a tokenizer, else as ``stop_sequences`` of
token ids: either way the library matches them), and the streaming options. Every bad
value is an :class:`~calfsm.serve.httperrors.ApiError` 400 naming the field
(``param``), never a 5xx.

What is accepted: ``model`` (the served name; another is 404), ``prompt`` (a string, a
list of strings, a list of token ids or a list of such lists) or ``messages`` (roles
``system``, ``developer``, ``user``, ``assistant``, ``tool``; content a string or a list of
``{"type": "text", "text": ...}`` parts, or an assistant's null (beside its ``tool_calls``,
or as no text); rendered by the model's chat template when the server has one, else the
built-in one), ``max_tokens`` (and ``max_completion_tokens``, which wins, on both
endpoints; at most the server's cap and what the context leaves after the prompt, else a
400 naming the field; without it, the server's default, at least ``min_tokens``, clipped
to what the context leaves), ``temperature`` (default 1, as OpenAI's), ``top_p``,
``top_k`` (0 off), ``seed``, ``stop`` (a string or up to 4), ``stop_token_ids``, ``n``
(choices, prompts times ``n``: at most ``max_choices`` and at most the sequences the
executor opens at once), ``presence_penalty``, ``frequency_penalty``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos`` (the library's,
:mod:`calfsm.generate.penalties`), ``stream``, ``stream_options`` (``include_usage``;
``continuous_usage_stats``, vLLM's: with ``include_usage``, every chunk carries the usage
so far; ignored without ``stream``), ``user``, ``store`` (a boolean, ignored: nothing is
stored), logprobs: completions'
``logprobs`` (an integer, 0..20: the chosen token's log-probability and that many
alternatives) and chat's ``logprobs`` (a boolean) with ``top_logprobs`` (0..20; only with
``logprobs`` true), structured outputs (``response_format`` ``json_object`` or
``json_schema``, vLLM's ``structured_outputs`` and ``guided_json``, ``guided_regex``,
``guided_choice``, ``guided_grammar``: :mod:`calfsm.serve.structured`), and
``priority`` (an integer in ``[PRIORITY_MIN, PRIORITY_MAX]`` of
:mod:`calfsm.request`, default 0: *higher* is admitted first, as the library's
``Request.priority`` — vLLM's field of the same name is lower-first). Choice ``i`` of a
request (prompt-major, then ``n``) draws from ``seed + i``.
Chat's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` are read by
:mod:`calfsm.serve.toolcalls` (a ``required`` or named tool choice becomes each
choice's constraint). Features the simulated model cannot give (``echo``, ``best_of``,
``suffix``, ``logit_bias``, tools on completions) are refused unless they carry their
default; unknown fields are
refused too, so a typo is never silently ignored. The prompt's ids and length, ``n`` and
``max_tokens`` are judged by the library's own rules (:mod:`calfsm.generate.arguments`, what
``executor.generate`` applies): the server refuses what the library refuses. A message
that quotes a client's value quotes it through :func:`~calfsm.serve.httperrors.clip`
(bounded).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import attrs

from calfsm.errors import InvalidArgument
from calfsm.generate.arguments import (
    MAX_N,
    ContextLimits,
    check_max_tokens,
    check_n,
    check_token_ids,
    context_left,
)
from calfsm.generate.sampling import MAX_LOGPROBS, MAX_STOP_CHARS, MAX_STOP_LENGTH, SamplingParams
from calfsm.generate.tokenizer import Tokenizer, encode_prompt
from calfsm.request import PRIORITY_MAX, PRIORITY_MIN
from calfsm.serve.httperrors import ApiError, clip
from calfsm.serve.httperrors import invalid_argument as _bad
from calfsm.serve.structured import STRUCTURED_FIELDS, constraint_of
from calfsm.serve.tokenizer import ByteTokenizer, encode_chat, render_chat
from calfsm.serve.toolcalls import (
    DEFAULT_TOOL_PARSER,
    TOOL_FIELDS,
    ToolParser,
    ToolPlan,
    parse_tools,
    tool_constraint,
)

__all__ = ["CHAT_ROLES", "GenerationPlan", "Limits", "parse_chat", "parse_completion"]

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
_MAX_STOPS = 4
#: fields that may be sent only with the value OpenAI defaults them to
_DEFAULTS_ONLY: Mapping[str, tuple[Any, ...]] = {
    "echo": (None, False), "best_of": (None, 1), "suffix": (None, ""),
    "logit_bias": (None, {}), "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None, False, True)}
_COMMON = frozenset({"model", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                     "top_k", "seed", "stop", "stop_token_ids", "n", "stream",
                     "stream_options", "user", "priority", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos",
                     "store", *_DEFAULTS_ONLY, *STRUCTURED_FIELDS})
_COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs"}
_CHAT_FIELDS = _COMMON | {"messages", "logprobs", "top_logprobs"}
#: what ``stream_options`` may hold
_STREAM_OPTIONS = frozenset({"include_usage", "continuous_usage_stats"})


@attrs.frozen
class Limits:
    """What the server allows: the model's name, vocabulary and context (``max_seq``:
    prompt and generated tokens together), tokens per choice by default and at most
    (``max_tokens_cap``), choices per request, the sequences the executor opens at once
    (``max_sequences``) and the prompt tokens one prefill carries (``max_prompt``, None:
    ``max_seq``)."""

    model: str
    vocab: int
    max_seq: int
    default_max_tokens: int = 16
    max_choices: int = 16
    max_tokens_cap: int = 4096
    max_sequences: int = MAX_N
    max_prompt: int | None = None

    @property
    def context(self) -> ContextLimits:
        """The model's limits, as the library judges a generation by them."""
        return ContextLimits(self.vocab, self.max_seq,
                             self.max_seq if self.max_prompt is None else self.max_prompt)


@attrs.frozen
class GenerationPlan:
    """One request, checked: ``prompts[i]`` runs with ``params[i]`` (choice ``i``), each
    choice's stream at ``priority``; ``logprobs``: the alternatives per token the answer
    carries (None: no logprobs)."""

    prompts: tuple[tuple[int, ...], ...]
    params: tuple[SamplingParams, ...]
    stream: bool
    include_usage: bool
    n: int = 1                               # choices per prompt
    logprobs: int | None = None
    priority: int = 0
    #: ``stream_options.continuous_usage_stats`` (with ``include_usage``): every chunk
    #: carries the usage so far
    continuous_usage: bool = False
    #: a chat's tools (calfsm.serve.toolcalls): the answer's text is read for tool calls
    #: unless ``tool_choice`` is ``none``
    tools: ToolPlan | None = None

    @property
    def prompt_tokens(self) -> int:
        """The usage's ``prompt_tokens``: each prompt once, however many choices it has."""
        return sum(len(self.prompts[i]) for i in range(0, len(self.prompts), self.n))


def _judged(param: str, check: Any, *args: Any, **kw: Any) -> Any:
    """``check(*args, **kw)``, one of the library's rules (:mod:`calfsm.generate.arguments`): its
    refusal as a 400 naming ``param``."""
    try:
        return check(*args, **kw)
    except InvalidArgument as e:
        raise _bad(e.message, param) from None


def _int(body: Mapping[str, Any], key: str, low: int, default: int | None) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"{key} must be an integer, got {type(value).__name__}", key)
    if value < low:
        raise _bad(f"{key} must be >= {low}, got {clip(value)}", key)
    return value


def _float(body: Mapping[str, Any], key: str, default: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value):
        raise _bad(f"{key} must be a finite number, got {clip(value)}", key)
    return float(value)


def _bool(body: Mapping[str, Any], key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(f"{key} must be a boolean, got {type(value).__name__}", key)
    return value


def _check_fields(body: Any, allowed: frozenset[str], limits: Limits) -> None:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", None)
    unknown = sorted(set(body) - allowed)
    if unknown:
        shown = ", ".join(clip(k) for k in unknown[:4]) + (
            f" and {len(unknown) - 4} more" if len(unknown) > 4 else "")
        raise _bad(f"unrecognized request argument(s): {shown}", unknown[0])
    for key, defaults in _DEFAULTS_ONLY.items():
        if key in body and not any(body[key] == d and type(body[key]) is type(d)
                                   for d in defaults):
            raise _bad(f"{key} is not supported by this server", key)
    model = body.get("model")
    if not isinstance(model, str):
        raise _bad("model must be given, as a string", "model")
    if model != limits.model:
        raise ApiError(404, f"the model {clip(model)} does not exist; this server serves "
                            f"{limits.model!r}", code="model_not_found", param="model")


def _ids(value: list[Any], param: str, vocab: int) -> tuple[int, ...]:
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int):
            raise _bad(f"{param}[{i}] must be a token id in [0, {vocab}), got {clip(t)}",
                       param)
    _judged(param, check_token_ids, value, vocab, field=param)
    return tuple(value)


def _encode(tok: Tokenizer, text: str, field: str) -> tuple[int, ...]:
    """``text``'s token ids; a text the tokenizer refuses (a reserved code point, a lone
    surrogate) is a 400 naming ``field``."""
    try:
        if isinstance(tok, ByteTokenizer):
            return tuple(tok.encode(text, field=field))
        return tuple(encode_prompt(tok, text))
    except InvalidArgument as e:
        raise _bad(e.message, field) from None


def _prompts(value: Any, tok: Tokenizer, vocab: int) -> list[tuple[int, ...]]:
    """``prompt``: a string, token ids, or a list of either."""
    if isinstance(value, str):
        return [_encode(tok, value, "prompt")]
    if not isinstance(value, list) or not value:
        raise _bad("prompt must be a string, a list of token ids, or a non-empty list of "
                   "those", "prompt")
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return [_ids(value, "prompt", vocab)]
    out = []
    for v in value:
        if isinstance(v, str):
            out.append(_encode(tok, v, "prompt"))
        elif isinstance(v, list):
            out.append(_ids(v, "prompt", vocab))
        else:
            raise _bad("prompt must be a string, a list of token ids, or a list of those",
                       "prompt")
    return out


def _text_content(content: Any, i: int, role: str) -> str | None:
    """A message's content: a string, a list of text parts (joined), or (an assistant's,
    beside its tool calls) null."""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise _bad(f"messages[{i}].content: only text parts are supported",
                           "messages")
            parts.append(part["text"])
        return "".join(parts)
    if content is None and role == "assistant":
        return None
    if not isinstance(content, str):
        raise _bad(f"messages[{i}].content must be a string or a list of text parts",
                   "messages")
    return content


def _tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """An assistant's ``tool_calls``, as OpenAI sends them; each call's ``arguments`` (a
    JSON string) parsed into the object a chat template expects, as vLLM gives it (kept
    as the string when it is not a JSON object: the model wrote it so)."""
    if not isinstance(calls, list):
        raise _bad(f"messages[{i}].tool_calls must be a list", "messages")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or call.get("type", "function") != "function" \
                or not isinstance(function.get("arguments", ""), str | dict):
            raise _bad(f"messages[{i}].tool_calls[{j}] must be {{\"type\": \"function\", "
                       f"\"function\": {{\"name\": ..., \"arguments\": ...}}}}", "messages")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                arguments = parsed
        out.append({**call, "type": "function", "function": {**function,
                                                             "arguments": arguments}})
    return out


def _messages(value: Any) -> list[dict[str, Any]]:
    """``messages``, checked: each an OpenAI message with a role of :data:`CHAT_ROLES`;
    an assistant's ``tool_calls`` and a tool's ``tool_call_id`` kept for the template."""
    if not isinstance(value, list) or not value:
        raise _bad("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
            raise _bad(f"messages[{i}] must be an object with a role of "
                       f"{', '.join(CHAT_ROLES)}", "messages")
        role = m["role"]
        message = {**m, "content": _text_content(m.get("content"), i, role)}
        if "tool_calls" in m and m["tool_calls"] is not None:
            if role != "assistant":
                raise _bad(f"messages[{i}]: only an assistant's message has tool_calls",
                           "messages")
            message["tool_calls"] = _tool_calls(m["tool_calls"], i)
        elif message["content"] is None:    # an assistant turn with no text (OpenAI's null)
            message["content"] = ""
        if role == "tool" and not isinstance(m.get("tool_call_id", ""), str):
            raise _bad(f"messages[{i}].tool_call_id must be a string", "messages")
        out.append(message)
    return out


def _stops(body: Mapping[str, Any], tok: Tokenizer, vocab: int, text: bool
           ) -> tuple[list[int], list[tuple[int, ...]], tuple[str, ...]]:
    """(``stop_token_ids``, the ``stop`` strings as token-id sequences, the ``stop``
    strings as text): as text when ``text`` (the library matches them on the stream's
    text), else as the token ids of their encoding."""
    stop = body.get("stop")
    texts = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(texts, list) or len(texts) > _MAX_STOPS \
            or not all(isinstance(s, str) and s for s in texts):
        raise _bad(f"stop must be a non-empty string or a list of at most {_MAX_STOPS}",
                   "stop")
    ids = body.get("stop_token_ids") or []
    if not isinstance(ids, list):
        raise _bad("stop_token_ids must be a list of token ids", "stop_token_ids")
    stop_ids = list(_ids(ids, "stop_token_ids", vocab))
    if text:
        for s in texts:
            if len(s) > MAX_STOP_CHARS:
                raise _bad(f"a stop string may hold at most {MAX_STOP_CHARS} characters, "
                           f"got {len(s)}", "stop")
        return stop_ids, [], tuple(texts)
    sequences = []
    for s in texts:
        seq = _encode(tok, s, "stop")
        if len(seq) > MAX_STOP_LENGTH:
            raise _bad(f"a stop string may hold at most {MAX_STOP_LENGTH} tokens (bytes), "
                       f"got {len(seq)}", "stop")
        sequences.append(seq)
    return stop_ids, sequences, ()


def _completion_logprobs(body: Mapping[str, Any]) -> int | None:
    """Completions' ``logprobs``: alternatives per token, 0..20 (``false`` as null)."""
    if body.get("logprobs") is False:
        return None
    k = _int(body, "logprobs", 0, None)
    if k is not None and k > MAX_LOGPROBS:
        raise _bad(f"logprobs must be <= {MAX_LOGPROBS}, got {clip(k)}", "logprobs")
    return k


def _chat_logprobs(body: Mapping[str, Any]) -> int | None:
    """Chat's ``logprobs`` (a boolean) and ``top_logprobs`` (0..20, only with it)."""
    on = _bool(body, "logprobs")
    k = _int(body, "top_logprobs", 0, None)
    if k is not None and k > MAX_LOGPROBS:
        raise _bad(f"top_logprobs must be <= {MAX_LOGPROBS}, got {clip(k)}", "top_logprobs")
    if k is not None and not on:
        raise _bad("top_logprobs needs logprobs set to true", "top_logprobs")
    return (k or 0) if on else None


def _plan(body: Mapping[str, Any], prompts: list[tuple[int, ...]], max_key: str,
          limits: Limits, tok: Tokenizer, logprobs: int | None,
          text_stops: bool) -> GenerationPlan:
    n = _int(body, "n", 1, 1)
    assert n is not None
    if len(prompts) * n > limits.max_choices:
        raise _bad(f"{len(prompts) * n} choices asked for; at most {limits.max_choices} "
                   "per request", "n")
    _judged("n", check_n, len(prompts) * n, limits.max_sequences,
            field="n" if len(prompts) == 1 else "the choices (prompts times n)")
    for p in prompts:
        _judged("prompt", context_left, len(p), limits.context, field="prompt")
    max_tokens, max_field = _int(body, max_key, 1, None), max_key
    if max_tokens is None:
        max_tokens, max_field = _int(body, "max_tokens", 1, None), "max_tokens"
    if max_tokens is not None:
        _check_max_tokens(max_tokens, max_field, max(map(len, prompts)), limits)
    temperature = _float(body, "temperature", 1.0)
    top_p = _float(body, "top_p", 1.0)
    top_k = _int(body, "top_k", -1, 0)
    seed = _int(body, "seed", 0, None)
    stop_ids, stop_sequences, stop_texts = _stops(body, tok, limits.vocab, text_stops)
    options = body.get("stream_options")
    stream = _bool(body, "stream")
    if options is not None and (not isinstance(options, dict)
                                or set(options) - _STREAM_OPTIONS):
        raise _bad("stream_options may hold include_usage and continuous_usage_stats only",
                   "stream_options")
    try:
        include_usage = _bool(options or {}, "include_usage") and stream
        continuous = _bool(options or {}, "continuous_usage_stats") and include_usage
    except ApiError as e:
        raise _bad(e.message, "stream_options") from None
    priority = _int(body, "priority", PRIORITY_MIN, 0)
    assert priority is not None
    if priority > PRIORITY_MAX:
        raise _bad(f"priority must be <= {PRIORITY_MAX}, got {clip(priority)}", "priority")
    _bool(body, "store")                # accepted and ignored: nothing is stored
    penalties = {key: _float(body, key, default) for key, default in (
        ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0))}
    min_tokens = _int(body, "min_tokens", 0, 0)
    ignore_eos = _bool(body, "ignore_eos")
    constraint = constraint_of(body, tok, limits.vocab)
    params = []
    try:
        for i in range(len(prompts) * n):
            room = limits.max_seq - len(prompts[i // n])
            params.append(SamplingParams(
                temperature=temperature, top_k=max(0, top_k or 0), top_p=top_p,
                seed=None if seed is None or temperature == 0 else seed + i,
                stop_token_ids=tuple(stop_ids), stop_sequences=tuple(stop_sequences),
                stop=stop_texts,
                max_tokens=max_tokens or min(max(limits.default_max_tokens, min_tokens),
                                             limits.max_tokens_cap, room),
                logprobs=logprobs, min_tokens=min_tokens, ignore_eos=ignore_eos,
                constraint=constraint, **penalties))
    except InvalidArgument as e:        # SamplingParams names the field it refuses
        raise _bad(e.message, e.field) from None
    return GenerationPlan(tuple(p for p in prompts for _ in range(n)), tuple(params),
                          stream, include_usage, n, logprobs, priority, continuous)


def _check_max_tokens(value: int, field: str, prompt_tokens: int, limits: Limits) -> None:
    """A client's ``max_tokens`` (or chat's ``max_completion_tokens``): at most the
    server's cap, and prompt plus it at most the model's context (as OpenAI answers)."""
    if value > limits.max_tokens_cap:
        raise _bad(f"{field} must be <= {limits.max_tokens_cap} (this server's cap), got "
                   f"{clip(value)}", field)
    _judged(field, check_max_tokens, value, prompt_tokens, limits.context, field=field)


def parse_completion(body: Any, limits: Limits, tok: Tokenizer, *,
                     text_stops: bool = False) -> GenerationPlan:
    """``POST /v1/completions``; ``text_stops``: ``stop`` strings go to the library as
    text (the executor has a tokenizer)."""
    _check_fields(body, _COMPLETION_FIELDS, limits)
    if "prompt" not in body:
        raise _bad("prompt must be given", "prompt")
    return _plan(body, _prompts(body["prompt"], tok, limits.vocab),
                 "max_completion_tokens", limits, tok, _completion_logprobs(body),
                 text_stops)


def parse_chat(body: Any, limits: Limits, tok: Tokenizer, *,
               text_stops: bool = False, chat_template: Any = None,
               tool_parser: ToolParser | str = DEFAULT_TOOL_PARSER) -> GenerationPlan:
    """``POST /v1/chat/completions``: the messages (and tools) through the model's chat
    template (``chat_template``, a :class:`~calfsm.generate.chattemplate.ChatTemplate`;
    one that refuses them is a 400), else the built-in one
    (:func:`~calfsm.serve.tokenizer.chat_prompt`). ``tools``, ``tool_choice`` and
    ``parallel_tool_calls`` are read by :mod:`calfsm.serve.toolcalls` (the answer's text
    by ``tool_parser``); ``required`` or a named function is enforced by a constraint on
    every choice."""
    _check_fields({k: v for k, v in body.items() if k not in TOOL_FIELDS}
                  if isinstance(body, dict) else body, _CHAT_FIELDS, limits)
    tools = parse_tools(body, tool_parser)
    messages = _messages(body.get("messages"))
    try:
        text = render_chat(messages, template=chat_template,
                           tools=tools.specs if tools is not None and tools.tools else None)
        prompt = tuple(encode_chat(tok, text, templated=chat_template is not None))
    except InvalidArgument as e:
        raise _bad(e.message, "messages") from None
    plan = _plan(body, [prompt], "max_completion_tokens", limits, tok,
                 _chat_logprobs(body), text_stops)
    if tools is None:
        return plan
    return attrs.evolve(plan, tools=tools,
                        params=_enforced(plan.params, tools, tok, limits.vocab))


def _enforced(params: tuple[SamplingParams, ...], tools: ToolPlan, tok: Tokenizer,
              vocab: int) -> tuple[SamplingParams, ...]:
    """Each choice's parameters with the constraint that enforces ``tool_choice``
    (``required`` or a named function); as they are otherwise."""
    constraint = tool_constraint(tools, tok, vocab)
    if constraint is None:
        return params
    if any(getattr(p, "constraint", None) is not None for p in params):
        raise _bad("tool_choice required (or a named function) cannot be combined with "
                   "another constraint (response_format)", "tool_choice")
    try:
        return tuple(attrs.evolve(p, constraint=constraint) for p in params)
    except InvalidArgument as e:
        raise _bad(e.message, "tool_choice") from None
