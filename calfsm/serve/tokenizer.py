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

:func:`chat_prompt` is the chat template: each message as ``<|role|>\\n`` + content +
``\\n``, then ``<|assistant|>\\n``.
"""

from __future__ import annotations

from collections.abc import Sequence

from calfsm.generate.tokenizer import BYTE_IDS, ByteDecoder, ByteTokenizer, escaped_token

__all__ = ["BYTE_IDS", "ByteTokenizer", "IncrementalDecoder", "chat_prompt", "token_bytes",
           "token_label"]

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


def chat_prompt(messages: Sequence[tuple[str, str]]) -> str:
    """The chat template: ``<|role|>\\ncontent\\n`` per message, then the assistant's turn."""
    return "".join(f"<|{role}|>\n{content}\n" for role, content in messages) \
        + "<|assistant|>\n"
