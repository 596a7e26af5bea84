"""A tokenizer that makes the simulated model say what a test wants.

The simulated device's logits are a hash of the tokens, so its text is noise: it never
writes a tool call, a JSON object or an answer a client can check. :class:`ScriptedTokenizer`
reads prompts as the byte-level tokenizer does, but reads each stream's output as the
next *reply* of its script, a few characters per token, whatever the tokens are. The
tokens, their count, timing and the stream's machinery are the real ones; only the text
is chosen. A reply ends with :data:`END`: a client that sends ``stop=[END]`` gets the
reply and a ``stop`` finish, as a model's end of turn would give. With no reply queued,
a stream's text is the byte-level tokenizer's.

It is for tests of what reads the text (the server's tool-call parser, a client library);
never for serving.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

from calfsm.generate.tokenizer import ByteDecoder, ByteTokenizer, IncrementalDecoder

__all__ = ["END", "ScriptedTokenizer"]

#: the end of a reply: send it as a stop string to end the stream there
END = "<|end|>"


class _Reply:
    """A stream's decoder: the reply, ``chars`` characters per token."""

    def __init__(self, text: str, chars: int) -> None:
        self._text = text
        self._chars = chars
        self._at = 0

    def push(self, token: int) -> str:
        piece = self._text[self._at:self._at + self._chars]
        self._at += len(piece)
        return piece

    def flush(self) -> str:
        return ""


class ScriptedTokenizer(ByteTokenizer):
    """The byte-level tokenizer for prompts; each new stream's text is the next reply
    :meth:`script` queued (``chars_per_token`` characters a token, then :data:`END`),
    else the bytes of its tokens. Streams take replies in the order they start."""

    def __init__(self, vocab: int, *, chars_per_token: int = 3) -> None:
        super().__init__(vocab)
        self.chars_per_token = chars_per_token
        self._replies: deque[str] = deque()
        self._lock = threading.Lock()

    def script(self, *replies: str) -> None:
        """Queue ``replies``: the next streams' texts, in order."""
        with self._lock:
            self._replies.extend(replies)

    @property
    def pending(self) -> Sequence[str]:
        """The replies no stream has taken yet."""
        with self._lock:
            return tuple(self._replies)

    def incremental(self) -> IncrementalDecoder:     # type: ignore[override]
        with self._lock:
            reply = self._replies.popleft() if self._replies else None
        if reply is None:
            return ByteDecoder(self.vocab)
        return _Reply(reply + END, self.chars_per_token)
