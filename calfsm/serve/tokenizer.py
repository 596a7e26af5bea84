"""The reference server's text: the byte-level tokenizer and the chat template.

:class:`ByteTokenizer` lives in :mod:`calfsm.generate.tokenizer` (the executor decodes its
streams' text with it); it is re-exported here, where the server has always found it.
``IncrementalDecoder`` here is its decoder, :class:`calfsm.generate.tokenizer.ByteDecoder` (the
name it had here), not the protocol :class:`calfsm.generate.tokenizer.IncrementalDecoder`.

One token on its own (what logprobs name it by, :func:`token_bytes` and
:func:`token_label`): its bytes are byte ``b`` for an id below 256, else the UTF-8 of
its two escape characters; its label is the character for an ASCII byte, OpenAI's
``bytes:\\xNN`` for a byte that is not a whole UTF-8 character on its own (128..255),
and the escape characters for an id of 256 or more. Labels are distinct for distinct
ids.

:func:`chat_prompt` is the built-in chat template, the default for the byte-level
tokenizer: each message as ``<|role|>\\n`` + content + ``\\n``, then ``<|assistant|>\\n``;
an assistant's tool calls follow its content, each as ``<tool_call>\\n{"name": ...,
"arguments": ...}\\n</tool_call>\\n`` (Hermes' format), and the tools offered, if any, come
first as ``<|tools|>\\n`` and one JSON schema a line. :func:`render_chat` renders a chat
with the model's own template (:class:`calfsm.generate.chattemplate.ChatTemplate`) when
the server has one, else with this one; :func:`encode_chat` encodes the result as
``apply_chat_template`` does (no special tokens added: the template writes its own).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from calfsm.generate.tokenizer import (
    BYTE_IDS,
    ByteDecoder,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    encode_prompt,
    escaped_token,
)

__all__ = ["BYTE_IDS", "ByteTokenizer", "IncrementalDecoder", "chat_prompt", "encode_chat",
           "render_chat", "token_bytes", "token_label"]

#: the byte-level decoder, by the name it had here
IncrementalDecoder = ByteDecoder


def token_bytes(token: int) -> bytes:
    """The bytes of ``token`` on its own (its share of the decoded text's UTF-8)."""
    return bytes((token,)) if token < BYTE_IDS else escaped_token(token).encode()


def token_label(token: int) -> str:
    """``token`` on its own as text, in OpenAI's convention for logprobs."""
    if token < 0x80:
        return chr(token)
    if token < BYTE_IDS:
        return f"bytes:\\x{token:02x}"
    return escaped_token(token)


def _tool_call_text(call: Mapping[str, Any]) -> str:
    function = call.get("function", call)
    arguments = function.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return (f'<tool_call>\n{{"name": {json.dumps(function.get("name"), ensure_ascii=False)}, '
            f'"arguments": {arguments}}}\n</tool_call>\n')


def chat_prompt(messages: Sequence[tuple[str, str] | Mapping[str, Any]], *,
                tools: Sequence[Any] | None = None) -> str:
    """The built-in chat template: ``<|role|>\\ncontent\\n`` per message (a ``(role,
    content)`` pair or an OpenAI message: its tool calls after its content), then the
    assistant's turn; the tools offered first, if any."""
    out = []
    if tools:
        out.append("<|tools|>\n" + "".join(json.dumps(t, ensure_ascii=False) + "\n"
                                           for t in tools))
    for m in messages:
        if isinstance(m, tuple):
            out.append(f"<|{m[0]}|>\n{m[1]}\n")
            continue
        content = m.get("content")
        out.append(f"<|{m['role']}|>\n{'' if content is None else content}\n")
        out.extend(_tool_call_text(c) for c in m.get("tool_calls") or ())
    return "".join(out) + "<|assistant|>\n"


def render_chat(messages: Sequence[Mapping[str, Any]], *, template: Any = None,
                tools: Sequence[Any] | None = None, **variables: Any) -> str:
    """The prompt's text for a chat: through ``template`` (a
    :class:`~calfsm.generate.chattemplate.ChatTemplate`: the model's own), with the
    assistant's turn to come, else through :func:`chat_prompt`. A template that refuses
    the messages raises InvalidArgument (a 400)."""
    if template is None:
        return chat_prompt(messages, tools=tools)
    return str(template.render(messages, tools=tools, add_generation_prompt=True,
                               **variables))


def encode_chat(tokenizer: Tokenizer, text: str, *, templated: bool) -> list[int]:
    """A rendered chat's token ids: a model's template writes its own special tokens
    (a BOS), so none are added to it (as ``apply_chat_template`` encodes), when the
    tokenizer lets that be said (``encode(text, add_special_tokens=False)``)."""
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.encode(text, field="messages")
    if templated and isinstance(tokenizer, HFTokenizer):
        return encode_prompt(tokenizer, text, add_special_tokens=False)
    return encode_prompt(tokenizer, text)
