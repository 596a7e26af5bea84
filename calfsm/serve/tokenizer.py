"""The byte-level tokenizer of the reference server: text <-> token ids, reversibly.

The simulated model has no vocabulary: its logits are a hash of the token ids, so any
mapping of text to ids is as good as another. This one is byte-level and reversible, so
a client can send text, read text back and recover the exact token ids from it:

- **encode**: the text's UTF-8 bytes, byte ``b`` -> token id ``b`` (ids 0..255);
- **decode**: each run of ids below 256 is decoded as UTF-8. A byte that is not part of a
  valid UTF-8 character comes out as the private-use character ``U+F0000 + b``; an id
  ``t >= 256`` comes out as two private-use characters, ``U+F1000 + (t >> 12)`` and
  ``U+F2000 + (t & 0xFFF)`` (ids up to ``2**23``, :data:`calfsm.sampling.MAX_VOCAB`);
- the code points ``U+F0000..U+F2FFF`` are **reserved**: ``encode`` reads them back as
  those escapes (anything malformed is an :class:`~calfsm.errors.InvalidArgument`), and
  ``decode`` escapes the bytes of a reserved character like stray bytes.

So ``encode(decode(ids)) == ids`` for every list of ids, and ``decode(encode(text)) ==
text`` for every text without reserved code points. :class:`IncrementalDecoder` gives
the same text piece by piece, one token at a time (for streaming): the pieces join to
``decode(ids)``; a byte that may start a multi-byte character is held until the
character is complete.

One token on its own (what logprobs name it by, :func:`token_bytes` and
:func:`token_label`): its bytes are byte ``b`` for an id below 256, else the UTF-8 of
its two escape characters; its label is the character for an ASCII byte, OpenAI's
``bytes:\\xNN`` for a byte that is not a whole UTF-8 character on its own (128..255),
and the escape characters for an id of 256 or more. Labels are distinct for distinct
ids.

:func:`chat_prompt` is the chat template: each message as ``<|role|>\\n`` + content +
``\\n``, then ``<|assistant|>\\n``, encoded as above.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterable, Sequence

import numpy as np

from calfsm.errors import InvalidArgument
from calfsm.sampling import MAX_VOCAB

__all__ = ["BYTE_IDS", "ByteTokenizer", "IncrementalDecoder", "chat_prompt", "token_bytes",
           "token_label"]

#: token ids that are bytes; the model's vocabulary must hold at least these
BYTE_IDS = 256
_STRAY = 0xF0000                 # U+F0000 + b: byte b outside a valid UTF-8 character
_HIGH = 0xF1000                  # U+F1000 + (t >> 12), then ...
_LOW = 0xF2000                   # ... U+F2000 + (t & 0xFFF): token t >= 256
_RESERVED_END = 0xF3000
_RESERVED = re.compile("[\U000F0000-\U000F2FFF]")
_SURROGATE = re.compile("[\udc80-\udcff]")


def _escape_bytes(data: bytes) -> str:
    return "".join(chr(_STRAY + b) for b in data)


def _fix(text: str) -> str:
    """UTF-8 decoded with ``surrogateescape`` -> the tokenizer's text: stray bytes (lone
    surrogates U+DC80..U+DCFF) and reserved characters become stray-byte escapes."""
    if _RESERVED.search(text):
        text = _RESERVED.sub(lambda m: _escape_bytes(m.group().encode()), text)
    if _SURROGATE.search(text):
        text = _SURROGATE.sub(lambda m: chr(_STRAY + ord(m.group()) - 0xDC00), text)
    return text


def _is_int(x: object) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def _token_text(token: int) -> str:
    return chr(_HIGH + (token >> 12)) + chr(_LOW + (token & 0xFFF))


class ByteTokenizer:
    """Text <-> token ids for a vocabulary of ``vocab`` ids (see the module docstring)."""

    def __init__(self, vocab: int) -> None:
        if not (_is_int(vocab) and BYTE_IDS <= vocab <= MAX_VOCAB):
            raise InvalidArgument(f"the byte-level tokenizer needs a vocabulary of "
                                  f"{BYTE_IDS}..{MAX_VOCAB} ids, got {vocab!r}",
                                  stage="tokenizer")
        self.vocab = int(vocab)

    def encode(self, text: str, *, field: str = "prompt") -> list[int]:
        """Token ids of ``text``; a reserved code point that is not a well-formed escape
        of an id in the vocabulary raises InvalidArgument naming ``field``."""
        if not isinstance(text, str):
            raise InvalidArgument(f"{field} must be a string", stage="request")
        if _RESERVED.search(text) is None:
            try:
                return list(text.encode("utf-8"))
            except UnicodeEncodeError as e:
                raise InvalidArgument(f"{field} is not valid Unicode (a lone surrogate at "
                                      f"character {e.start})", stage="request") from None
        return self._encode_escaped(text, field)

    def _encode_escaped(self, text: str, field: str) -> list[int]:
        out: list[int] = []
        i, n = 0, len(text)
        while i < n:
            c = ord(text[i])
            if c < _STRAY or c >= _RESERVED_END:
                try:
                    out.extend(text[i].encode("utf-8"))
                except UnicodeEncodeError:
                    raise InvalidArgument(f"{field} is not valid Unicode (a lone surrogate "
                                          f"at character {i})", stage="request") from None
                i += 1
            elif c < _STRAY + BYTE_IDS:
                out.append(c - _STRAY)
                i += 1
            elif _HIGH <= c < _HIGH + (MAX_VOCAB >> 12) and i + 1 < n \
                    and _LOW <= ord(text[i + 1]) < _LOW + 0x1000:
                token = ((c - _HIGH) << 12) | (ord(text[i + 1]) - _LOW)
                if not BYTE_IDS <= token < self.vocab:
                    raise InvalidArgument(
                        f"{field}: character {i} escapes token {token}, which is "
                        f"{'a byte' if token < BYTE_IDS else 'outside the vocabulary'}"
                        f" (ids {BYTE_IDS}..{self.vocab - 1} are escaped)", stage="request")
                out.append(token)
                i += 2
            else:
                raise InvalidArgument(f"{field}: character {i} (U+{c:05X}) is a reserved "
                                      "code point that is not a well-formed token escape",
                                      stage="request")
        return out

    def decode(self, tokens: Iterable[int]) -> str:
        """The text of ``tokens``; an id outside ``[0, vocab)`` is an InvalidArgument."""
        dec = IncrementalDecoder(self.vocab)
        return "".join(dec.push(t) for t in tokens) + dec.flush()


class IncrementalDecoder:
    """:meth:`ByteTokenizer.decode` one token at a time: ``push(token)`` returns the text
    that token completes (maybe ``""``), ``flush()`` what is held at the end. Token ids
    are integers in ``[0, vocab)`` (by default every id the escapes can carry); anything
    else is an :class:`~calfsm.errors.InvalidArgument`, and the decoder is unchanged."""

    def __init__(self, vocab: int = MAX_VOCAB) -> None:
        if not (_is_int(vocab) and 1 <= vocab <= MAX_VOCAB):
            raise InvalidArgument(f"IncrementalDecoder: vocab must be an integer in "
                                  f"1..{MAX_VOCAB}, got {vocab!r}", stage="tokenizer")
        self.vocab = int(vocab)
        self._utf8 = codecs.getincrementaldecoder("utf-8")("surrogateescape")

    def push(self, token: int) -> str:
        if not (_is_int(token) and 0 <= token < self.vocab):
            raise InvalidArgument(f"token {token!r} is not a token id: an integer in "
                                  f"0..{self.vocab - 1}", stage="tokenizer")
        token = int(token)
        if token < BYTE_IDS:
            return _fix(self._utf8.decode(bytes((token,))))
        return self.flush() + _token_text(token)

    def flush(self) -> str:
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return _fix(text)


def token_bytes(token: int) -> bytes:
    """The bytes of ``token`` on its own (its share of the decoded text's UTF-8)."""
    return bytes((token,)) if token < BYTE_IDS else _token_text(token).encode()


def token_label(token: int) -> str:
    """``token`` on its own as text, in OpenAI's convention for logprobs."""
    if token < 0x80:
        return chr(token)
    if token < BYTE_IDS:
        return f"bytes:\\x{token:02x}"
    return _token_text(token)


def chat_prompt(messages: Sequence[tuple[str, str]]) -> str:
    """The chat template: ``<|role|>\\ncontent\\n`` per message, then the assistant's turn."""
    return "".join(f"<|{role}|>\n{content}\n" for role, content in messages) \
        + "<|assistant|>\n"
