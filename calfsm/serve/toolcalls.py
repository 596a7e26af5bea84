"""Tool calling on ``/v1/chat/completions``: ``tools``, ``tool_choice``,
``parallel_tool_calls`` in; the model's text parsed into OpenAI ``tool_calls`` out.

A model calls a tool by writing the call in the format it was trained on; a *tool parser*
(:class:`ToolParser`, registered by name in :data:`TOOL_PARSERS`, chosen with
``ServerConfig.tool_call_parser`` / ``--tool-call-parser``) knows one such format. The
default, ``hermes``, is the format of Hermes, Qwen2.5 and Qwen3 (their chat templates
teach it)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``llama3_json`` reads Llama 3.1-3.3's bare JSON calls (``{"name": ..., "parameters":
{...}}``, several separated by ``;``); :class:`TaggedJsonParser` and
:func:`register_tool_parser` add others.

A parser reads a choice's text as it streams (:class:`ToolCallStream`): text outside the
tags is the message's ``content`` (whitespace alone next to a call is dropped), each call
becomes OpenAI's tool-call deltas, its ``id``, ``type`` and ``name`` first, then its
``arguments`` in fragments as the model writes them. The non-streaming answer runs the
same parser over the whole text, so both give the same calls. A call whose body is not a
call (no ``name``) stays in the content as written; a call cut short (``max_tokens``)
keeps the arguments written so far and the choice ends ``length``; a choice that wrote
at least one whole call and stopped ends ``tool_calls``.

``tool_choice``: ``none`` (tools are shown to the template, the text is not parsed),
``auto`` (the default with tools: parsed), ``required`` and a named function
(``{"type": "function", "function": {"name": ...}}``): parsed, and **enforced** by
constrained decoding (:func:`tool_grammar`: a Lark grammar of the parser's wrapper around
each function's JSON schema, so the arguments always parse against the schema).
``parallel_tool_calls: false`` lets a choice make one call (the grammar allows one; in
``auto``, calls after the first are dropped).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any, Protocol

import attrs

from calfsm.errors import CalfsmError, InvalidArgument
from calfsm.generate import constraint
from calfsm.serve.generation import Piece
from calfsm.serve.httperrors import clip
from calfsm.serve.httperrors import invalid_argument as _bad

__all__ = ["DEFAULT_TOOL_PARSER", "TOOL_FIELDS", "TOOL_PARSERS", "JsonCallsParser", "Parsed",
           "TaggedJsonParser", "Tool", "ToolCallStream", "ToolParser", "ToolPlan",
           "collect_tool_calls", "parse_tools", "register_tool_parser", "tool_constraint",
           "tool_grammar", "tool_parser", "with_tool_calls"]

#: the request fields this module reads
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
DEFAULT_TOOL_PARSER = "hermes"
#: OpenAI's rule for a function's name
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CHOICES = ("none", "auto", "required")
#: a function with no ``parameters`` takes none (OpenAI's reading)
_NO_PARAMETERS: Mapping[str, Any] = {"type": "object", "properties": {},
                                     "additionalProperties": False}
#: JSON as the enforced calls write it: one space after ``,`` and ``:``, no other
#: whitespace (what Hermes-style models write; noise logits cannot pad it)
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# ---- the request ---------------------------------------------------------------------

@attrs.frozen
class Tool:
    """One function offered (``tools[i]``): its name, JSON schema of its ``parameters``
    and ``strict``; ``spec``: the tool as the client sent it (for the chat template)."""

    name: str
    parameters: Mapping[str, Any]
    spec: Mapping[str, Any]
    strict: bool | None = None


@attrs.frozen
class ToolPlan:
    """A chat's tools, checked: ``choice`` is ``none``, ``auto``, ``required`` or
    ``function`` (then ``function`` names it); ``parallel``: more than one call allowed."""

    tools: tuple[Tool, ...]
    choice: str
    parser: ToolParser
    parallel: bool = True
    function: str | None = None

    @property
    def parses(self) -> bool:
        """The text is read for tool calls (``tool_choice`` is not ``none``)."""
        return self.choice != "none" and bool(self.tools)

    @property
    def enforced(self) -> bool:
        """The calls are enforced by constrained decoding (``required``, a named one)."""
        return self.choice in ("required", "function")

    @property
    def specs(self) -> list[dict[str, Any]]:
        """The tools as the chat template gets them (the client's own objects)."""
        return [dict(t.spec) for t in self.tools]


def _tool(value: Any, i: int) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(value, dict) or value.get("type", "function") != "function" \
            or not isinstance(value.get("function"), dict):
        raise _bad(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": "
                   f"...}}}}", "tools")
    function = value["function"]
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise _bad(f"{where}.function.name must be 1 to 64 letters, digits, _ or -, got "
                   f"{clip(name)}", "tools")
    if not isinstance(function.get("description", ""), str):
        raise _bad(f"{where}.function.description must be a string", "tools")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = _NO_PARAMETERS
    elif not isinstance(parameters, dict):
        raise _bad(f"{where}.function.parameters must be a JSON schema (an object), got "
                   f"{clip(parameters)}", "tools")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _bad(f"{where}.function.strict must be a boolean", "tools")
    return Tool(name, parameters, {**value, "type": "function"}, strict)


def parse_tools(body: Mapping[str, Any], parser: ToolParser | str = DEFAULT_TOOL_PARSER
                ) -> ToolPlan | None:
    """A chat request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, checked
    (a 400 naming the field); None: no tools and nothing asked of them."""
    if isinstance(parser, str):
        parser = tool_parser(parser)
    raw, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad(f"parallel_tool_calls must be a boolean, got {clip(parallel)}",
                   "parallel_tool_calls")
    if raw is None:
        raw = []
    if not isinstance(raw, list):
        raise _bad("tools must be a list of functions", "tools")
    tools = tuple(_tool(t, i) for i, t in enumerate(raw))
    names = [t.name for t in tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise _bad(f"tools names {clip(twice[0])} more than once", "tools")
    function = None
    if choice is None:
        choice = "auto" if tools else "none"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str):
            raise _bad("tool_choice must be none, auto, required or {\"type\": \"function\","
                       " \"function\": {\"name\": ...}}", "tool_choice")
        function = fn["name"]
        if function not in names:
            raise _bad(f"tool_choice names the function {clip(function)}, which is not "
                       f"in tools", "tool_choice")
        choice = "function"
    elif choice not in _CHOICES:
        raise _bad(f"tool_choice must be none, auto, required or a function, got "
                   f"{clip(choice)}", "tool_choice")
    if choice in ("required", "function") and not tools:
        raise _bad(f"tool_choice {choice!r} needs tools", "tool_choice")
    if not tools and choice == "none" and parallel is None:
        return None
    return ToolPlan(tools, choice, parser, parallel is not False, function)


# ---- parsers -------------------------------------------------------------------------

@attrs.frozen
class Parsed:
    """What a piece of text became: ``content`` for the client, and tool-call deltas in
    OpenAI's form (``{"index", "id", "type", "function": {"name", "arguments"}}`` to
    open a call, ``{"index", "function": {"arguments": fragment}}`` after)."""

    content: str = ""
    calls: tuple[dict[str, Any], ...] = ()

    def __add__(self, other: Parsed) -> Parsed:
        return Parsed(self.content + other.content, self.calls + other.calls)


class ToolCallStream(Protocol):
    """One choice's text, read for tool calls as it comes: :meth:`feed` each piece,
    :meth:`finish` at the end; ``calls`` (calls opened so far) and ``unfinished`` (the
    text ended inside a call)."""

    calls: int
    unfinished: bool

    def feed(self, text: str) -> Parsed: ...

    def finish(self) -> Parsed: ...


class ToolParser(Protocol):
    """A model's tool-call format: its streaming reader, and the Lark grammar (in
    llguidance's dialect) of the calls it accepts, for the enforcement."""

    name: str

    def stream(self, *, parallel: bool = True) -> ToolCallStream: ...

    def grammar(self, tools: Sequence[Tool], *, parallel: bool) -> str: ...


def new_call_id() -> str:
    """A tool call's id, in OpenAI's style."""
    return "call_" + uuid.uuid4().hex[:24]


def _partial_suffix(text: str, tag: str) -> int:
    """The length of ``text``'s longest suffix that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _calls_grammar(separator: str, parallel: bool, rules: Sequence[str]) -> str:
    """A parser's whole grammar: one ``call`` (``rules`` define it), or, ``parallel``,
    several joined by ``separator``."""
    start = f"start: call ({_lark_string(separator)} call)*" if parallel else "start: call"
    return "\n".join(["%llguidance {}", start, *rules]) + "\n"


def _call_rules(rule: str, tools: Sequence[Tool], arguments_key: str) -> list[str]:
    """Lark rules: ``rule`` is one call's JSON object, ``{"name": NAME, KEY: ARGS}``,
    of any of ``tools``, its arguments valid against the function's schema, written as
    :data:`_JSON_STYLE`; strict (unless the function says ``strict: false``): a keyword
    the matcher does not implement is refused, never ignored."""
    lines = [f"{rule}: " + " | ".join(f"fn_{i}" for i in range(len(tools)))]
    for i, tool in enumerate(tools):
        head = f'{{"name": {json.dumps(tool.name)}, "{arguments_key}": '
        schema = dict(tool.parameters)
        schema["x-guidance"] = {**_JSON_STYLE, "lenient": tool.strict is False,
                                **dict(schema.get("x-guidance") or {})}
        lines.append(f"fn_{i}: {_lark_string(head)} args_{i} \"}}\"")
        lines.append(f"args_{i}: %json {json.dumps(schema, ensure_ascii=False)}")
    return lines


class TaggedJsonParser:
    """Calls written as ``START`` + ``{"name": NAME, "arguments": {...}}`` + ``END``,
    separated by ``separator`` (Hermes: ``<tool_call>\\n``, ``\\n</tool_call>``,
    ``\\n``); ``arguments`` also read as ``parameters`` (``arguments_key`` is the one
    the grammar writes)."""

    def __init__(self, name: str, start: str, end: str, *, separator: str = "\n",
                 arguments_key: str = "arguments") -> None:
        if not start.strip() or not end.strip():
            raise InvalidArgument("a tool parser's start and end tags must not be blank",
                                  stage="config")
        self.name = name
        self.start, self.end = start.strip(), end.strip()
        #: the wrapper exactly as the grammar writes it (with its newlines)
        self.open_text, self.close_text = start, end
        self.separator = separator
        self.arguments_key = arguments_key

    def stream(self, *, parallel: bool = True) -> ToolCallStream:
        return _TaggedStream(self, parallel)

    def grammar(self, tools: Sequence[Tool], *, parallel: bool) -> str:
        return _calls_grammar(self.separator, parallel, [
            f"call: {_lark_string(self.open_text)} body {_lark_string(self.close_text)}",
            *_call_rules("body", tools, self.arguments_key)])

    def __repr__(self) -> str:
        return f"<TaggedJsonParser {self.name} {self.start}...{self.end}>"


#: a call body's beginning when it can be streamed: the name first, then the arguments
#: (matched once their value's first character came)
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"'
                   r'\s*:\s*(?=\S)')
#: a body whose beginning is no such head by this many characters is read at its end
_HEAD_WITHIN = 4096
#: what may close the arguments' object and the call's (held back until the end tag)
_CLOSERS = frozenset(" \t\r\n}")


class _TaggedStream:
    """The reader of :class:`TaggedJsonParser` (see the module docstring). Each piece
    costs in proportion to its own length (and to what is held back), not to the text
    so far: a call's body is kept in parts and joined once, at its end tag."""

    def __init__(self, parser: TaggedJsonParser, parallel: bool) -> None:
        self.p = parser
        self.parallel = parallel
        self.calls = 0
        self.unfinished = False
        self._outside = True
        self._held = ""            # outside: a suffix that may begin the start tag
        self._space = ""           # outside: trailing whitespace, held
        self._before = ""          # inside: the whitespace before the start tag
        self._parts: list[str] = []     # inside: the call's body so far, in parts
        self._tail = ""            # inside: the body's last characters (the end tag's)
        self._early: str | None = ""    # inside: the body while its head is not read
        self._skip = False         # inside a call parallel_tool_calls=false drops
        self._head = False         # the call is open (its name sent)
        self._args_at = 0          # where the arguments begin in the body
        self._pending = ""         # the arguments written and not sent
        self._sent = 0             # characters of the arguments sent
        self._index = -1
        self._trim = False         # after a call: leading whitespace is dropped
        self._wrote = False        # content came after the last call (its blank kept)

    # -- outside the tags --
    def _content(self, text: str) -> str:
        """Text outside the tags as content: trailing whitespace held (dropped if a call
        follows), leading whitespace after a call dropped."""
        if self._trim:
            text = text.lstrip()
            if not text:
                return ""
            self._trim = False
        whole = self._space + text
        keep = len(whole.rstrip())
        self._space = whole[keep:]
        if keep:
            self._trim = False
            self._wrote = True
        return whole[:keep]

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        end = self.p.end
        while text:
            if self._outside:
                buf = self._held + text
                at = buf.find(self.p.start)
                if at < 0:
                    k = _partial_suffix(buf, self.p.start)
                    self._held = buf[len(buf) - k:]
                    return out + Parsed(self._content(buf[:len(buf) - k]))
                out += Parsed(self._content(buf[:at]))
                self._before, self._space, self._held = self._space, "", ""
                self._outside, self._head, self._trim, self._wrote = False, False, True, False
                self._parts, self._tail, self._early, self._pending = [], "", "", ""
                self._skip = self.calls > 0 and not self.parallel
                text = buf[at + len(self.p.start):]
            else:
                # the end tag can only be where the new text is (or end in it)
                window = self._tail + text
                at = window.find(end)
                if at < 0:
                    self._parts.append(text)
                    self._tail = window[-(len(end) - 1):]
                    out += self._arguments(text)
                    return out
                cut = at - len(self._tail)      # < 0: the tag began in the body's tail
                self._parts.append(text[:max(cut, 0)])
                out += self._arguments(text[:max(cut, 0)])
                out += self._close(min(cut, 0))
                self._outside = True
                text = window[at + len(end):]
        return out

    # -- inside a call --
    def _open(self, name: str, arguments: str = "") -> Parsed:
        self.calls += 1
        self._index += 1
        return Parsed(calls=({"index": self._index, "id": new_call_id(), "type": "function",
                              "function": {"name": name, "arguments": arguments}},))

    def _more(self, fragment: str) -> Parsed:
        self._sent += len(fragment)
        return Parsed(calls=({"index": self._index, "function": {"arguments": fragment}},)) \
            if fragment else Parsed()

    def _arguments(self, text: str) -> Parsed:
        """The new ``text`` of a body: its head read (the call opened) and the
        arguments sent as far as they are known not to be the closing braces or the
        start of the end tag."""
        if self._skip:
            return Parsed()
        out = Parsed()
        if not self._head:
            if self._early is None:
                return out
            self._early += text
            head = _HEAD.match(self._early)
            if head is None:
                if len(self._early) > _HEAD_WITHIN:
                    self._early = None          # read whole at the end tag
                return out
            try:
                name = json.loads(f'"{head.group(1)}"')
            except ValueError:
                self._early = None
                return out
            self._head, self._args_at, self._sent = True, head.end(), 0
            self._pending, self._early = self._early[head.end():], None
            out += self._open(name)
        else:
            self._pending += text
        pending = self._pending
        if self._sent == 0 and not pending.startswith("{"):
            return out                           # not an object: sent whole at the end
        j = len(pending) - _partial_suffix(pending, self.p.end)
        while j > 0 and pending[j - 1] in _CLOSERS:
            j -= 1
        self._pending = pending[j:]
        return out + self._more(pending[:j])

    def _close(self, cut: int) -> Parsed:
        """The end tag (``cut``: the characters of the body before it that were its
        start): the call's last fragment, or the whole call when its name was not
        first, or the text as content when it is no call."""
        body = "".join(self._parts)
        if cut:
            body = body[:cut]
        self._parts, self._tail, self._pending = [], "", self._pending[:len(self._pending) + cut]
        if self._skip:
            return Parsed()
        try:
            call = json.loads(body)
        except ValueError:
            call = None
        arguments = None
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            key = "arguments" if "arguments" in call else "parameters"
            value = call.get(key, {})
            arguments = value if isinstance(value, str) \
                else json.dumps(value, ensure_ascii=False)
        if not self._head:
            if arguments is None:            # no call: the text as the model wrote it
                return self._not_a_call(body + self.p.end)
            return self._open(call["name"], arguments)
        written = body[self._args_at:].rstrip()
        if written.endswith("}"):
            written = written[:-1].rstrip()
        try:
            same = call is not None and written.startswith("{") and \
                json.loads(written) == call.get("arguments", call.get("parameters"))
        except ValueError:
            same = False
        if same or arguments is None:        # as written (or a body that is no JSON)
            return self._more(written[self._sent:])
        if self._sent == 0:                  # as JSON (a string's value: as it is)
            return self._more(arguments)
        return Parsed()                      # sent already, and not to be taken back

    def _not_a_call(self, rest: str) -> Parsed:
        """A start tag and what followed it that made no call: content, as written."""
        self._space, self._trim = self._before, False
        return Parsed(self._content(self.p.start + rest))

    def finish(self) -> Parsed:
        if self._outside:
            text, self._held = self._held, ""
            out = self._content(text)
            if self.calls == 0 or self._wrote:
                out, self._space = out + self._space, ""
            return Parsed(out)
        if self._skip:
            return Parsed()
        if not self._head:                    # cut before it was a call: text it stays
            self._outside = True
            return self._not_a_call("".join(self._parts)) + Parsed(self._space)
        self.unfinished = True                # cut short: the arguments written so far
        pending, self._pending = self._pending, ""
        return self._more(pending)


class JsonCallsParser:
    """Calls written as bare JSON objects, ``{"name": NAME, "parameters": {...}}``,
    separated by ``;``, maybe after ``prefix``: Llama 3.1-3.3's JSON tool calls (vLLM's
    ``llama3_json``). An output whose first text is ``{`` or ``prefix`` is calls (an
    object that is no call, or text after them, is content); any other is content."""

    def __init__(self, name: str, *, prefix: str = "<|python_tag|>", separator: str = "; ",
                 arguments_key: str = "parameters") -> None:
        self.name = name
        self.start, self.end = prefix, ""
        self.separator = separator
        self.arguments_key = arguments_key

    def stream(self, *, parallel: bool = True) -> ToolCallStream:
        return _JsonCallsStream(self, parallel)

    def grammar(self, tools: Sequence[Tool], *, parallel: bool) -> str:
        return _calls_grammar(self.separator, parallel,
                              _call_rules("call", tools, self.arguments_key))

    def __repr__(self) -> str:
        return f"<JsonCallsParser {self.name}>"


class _JsonCallsStream(_TaggedStream):
    """The reader of :class:`JsonCallsParser`: the output's start decides (calls or
    text); each object's end is found by its braces (outside strings); its head,
    arguments and end are read as :class:`_TaggedStream` reads a tagged call's."""

    def __init__(self, parser: JsonCallsParser, parallel: bool) -> None:
        super().__init__(parser, parallel)    # type: ignore[arg-type]
        self._mode: str | None = None         # None: undecided; "calls" or "text"
        self._lead = ""                       # the output's start while undecided
        self._depth = 0
        self._in_string = self._escaped = False

    def feed(self, text: str) -> Parsed:
        if self._mode is None:
            self._lead += text
            lead = self._lead.lstrip()
            prefix = self.p.start
            if not lead or (prefix and len(lead) < len(prefix) and prefix.startswith(lead)):
                return Parsed()
            if prefix and lead.startswith(prefix):
                text = lead[len(prefix):]
            elif lead.startswith("{"):
                text = lead
            else:
                self._mode, text, self._lead = "text", self._lead, ""
                return Parsed(text)
            self._mode, self._lead = "calls", ""
        if self._mode == "text":
            return Parsed(text)
        out, run = Parsed(), 0
        for i, c in enumerate(text):
            if self._depth == 0:
                if c == "{":
                    self._depth, run = 1, i
                    self._parts, self._early, self._pending, self._head = [], "", "", False
                    self._outside, self._skip = False, self.calls > 0 and not self.parallel
                elif c not in " \t\r\n;":         # text after the calls: content
                    self._mode = "text"
                    return out + Parsed(text[i:])
            elif self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c == "{":
                self._depth += 1
            elif c == "}":
                self._depth -= 1
                if self._depth == 0:                  # the object's end
                    self._parts.append(text[run:i + 1])
                    out += self._arguments(text[run:i + 1])
                    out += self._close(0)
                    self._outside = True
        if self._depth:
            self._parts.append(text[run:])
            out += self._arguments(text[run:])
        return out

    def _not_a_call(self, rest: str) -> Parsed:
        return Parsed(rest)

    def finish(self) -> Parsed:
        if self._mode is None:
            lead, self._lead = self._lead, ""
            return Parsed(lead)
        if self._mode == "text" or self._depth == 0 or self._skip:
            return Parsed()
        if not self._head:                    # cut before it was a call: text it stays
            return Parsed("".join(self._parts))
        self.unfinished = True
        pending, self._pending = self._pending, ""
        return self._more(pending)


#: tool parsers by name (``--tool-call-parser NAME``)
TOOL_PARSERS: dict[str, ToolParser] = {}


def register_tool_parser(parser: ToolParser, *, replace: bool = False) -> ToolParser:
    """Make ``parser`` choosable by its name (``ServerConfig.tool_call_parser``)."""
    if not isinstance(getattr(parser, "name", None), str) or not parser.name:
        raise InvalidArgument("a tool parser needs a name", stage="config")
    if parser.name in TOOL_PARSERS and not replace:
        raise InvalidArgument(f"a tool parser named {parser.name!r} is registered already",
                              stage="config")
    TOOL_PARSERS[parser.name] = parser
    return parser


def tool_parser(name: str) -> ToolParser:
    """The parser registered as ``name``, else InvalidArgument naming those there are."""
    try:
        return TOOL_PARSERS[name]
    except (KeyError, TypeError):
        raise InvalidArgument(f"no tool-call parser named {name!r}; there are "
                              f"{', '.join(sorted(TOOL_PARSERS))}", stage="config",
                              field="tool_call_parser") from None


register_tool_parser(TaggedJsonParser("hermes", "<tool_call>\n", "\n</tool_call>"))
register_tool_parser(JsonCallsParser("llama3_json"))


# ---- enforcement ---------------------------------------------------------------------

def tool_grammar(tools: Sequence[Tool], tool_choice: str, parallel: bool,
                 parser: ToolParser, function: str | None = None) -> str | None:
    """The Lark grammar (llguidance's dialect) the output must match for
    ``tool_choice``: ``required`` — one call of any of ``tools`` (one or more when
    ``parallel``); ``function`` — one call of the function named ``function``; each
    call's arguments valid against its function's JSON schema. None: nothing to enforce
    (``none``, ``auto``)."""
    if tool_choice == "required":
        return parser.grammar(tools, parallel=parallel)
    if tool_choice == "function":
        chosen = [t for t in tools if t.name == function]
        if not chosen:
            raise _bad(f"tool_choice names the function {clip(function)}, which is not in "
                       f"tools", "tool_choice")
        return parser.grammar(chosen, parallel=False)
    return None


def tool_constraint(plan: ToolPlan, tokenizer: Any = None, vocab: int | None = None) -> Any:
    """The ``SamplingParams.constraint`` enforcing ``plan`` (None: nothing to enforce):
    :func:`tool_grammar` as a :class:`calfsm.generate.constraint.Grammar`, compiled for
    ``tokenizer`` and ``vocab`` when given (cached: the stream finds it compiled), so a
    schema the matcher does not support is a 400 naming ``tools`` here. Without
    constrained decoding (its extra, llguidance) it is a 400 naming ``tool_choice``: a
    ``required`` or named tool choice is never left unenforced."""
    lark = tool_grammar(plan.tools, plan.choice, plan.parallel, plan.parser, plan.function)
    if lark is None:
        return None
    what = "tool_choice required" if plan.choice == "required" \
        else f"tool_choice naming {plan.function!r}"
    missing = _bad(f"{what} is enforced by constrained decoding, which this server does "
                   f"not have (it needs the constraints extra: pip install "
                   f"\"calfsm[constraints]\")", "tool_choice")
    if not constraint.constraints_available():
        raise missing
    try:
        grammar = constraint.Grammar(lark)
        if tokenizer is not None and vocab is not None:
            constraint.compile_constraint(grammar, tokenizer, vocab)
    except CalfsmError as e:
        raise _bad(f"{what} cannot be enforced: {e.message}", "tools") from None
    return grammar


# ---- the answer ----------------------------------------------------------------------

async def with_tool_calls(pieces: AsyncIterator[Piece], plan: ToolPlan
                          ) -> AsyncIterator[Piece]:
    """``pieces`` (a request's choices, merged) with each choice's text read by
    ``plan``'s parser: a piece's text is its content, its ``tool_calls`` the deltas it
    completed; a choice that wrote whole calls and stopped ends ``tool_calls``."""
    readers: dict[int, ToolCallStream] = {}
    try:
        async for piece in pieces:
            reader = readers.get(piece.index)
            if reader is None:
                reader = readers[piece.index] = plan.parser.stream(parallel=plan.parallel)
            parsed = reader.feed(piece.text)
            reason = piece.finish_reason
            if reason is not None or piece.error is not None:
                parsed += reader.finish()
                if reason == "stop" and reader.calls and not reader.unfinished:
                    reason = "tool_calls"
            yield attrs.evolve(piece, text=parsed.content, tool_calls=parsed.calls,
                               finish_reason=reason)
    finally:
        aclose = getattr(pieces, "aclose", None)
        if aclose is not None:
            await aclose()


def collect_tool_calls(deltas: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One choice's tool-call deltas joined into OpenAI's ``message.tool_calls``."""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        fn = d.get("function") or {}
        call = calls.get(d["index"])
        if call is None:
            calls[d["index"]] = {"id": d.get("id"), "type": "function",
                                 "function": {"name": fn.get("name"),
                                              "arguments": fn.get("arguments", "")}}
        else:
            call["function"]["arguments"] += fn.get("arguments", "")
    return [calls[i] for i in sorted(calls)]
