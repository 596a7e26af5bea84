"""The reference server's text: the byte-level tokenizer and the chat template.

:class:`ByteTokenizer` lives in :mod:`calfsm.tokenizer` (the executor decodes its
streams' text with it); it is re-exported here, where the server has always found it.
``IncrementalDecoder`` here is its decoder, :class:`calfsm.tokenizer.ByteDecoder` (the
name it had here), not the protocol :class:`calfsm.tokenizer.IncrementalDecoder`.

:func:`chat_prompt` is the chat template: each message as ``<|role|>\\n`` + content +
``\\n``, then ``<|assistant|>\\n``.
"""

from __future__ import annotations

from collections.abc import Sequence

from calfsm.tokenizer import BYTE_IDS, ByteDecoder, ByteTokenizer

__all__ = ["BYTE_IDS", "ByteTokenizer", "IncrementalDecoder", "chat_prompt"]

#: the byte-level decoder, by the name it had here
IncrementalDecoder = ByteDecoder


def chat_prompt(messages: Sequence[tuple[str, str]]) -> str:
    """The chat template: ``<|role|>\\ncontent\\n`` per message, then the assistant's turn."""
    return "".join(f"<|{role}|>\n{content}\n" for role, content in messages) \
        + "<|assistant|>\n"
