"""Tokenizers: text <-> token ids, and decoding one token at a time.

The executor needs a tokenizer only for text: a ``str`` prompt, the ``text`` of each
:class:`~calfsm.engine.results.TokenEvent`, and stop strings (``SamplingParams.stop``). Anything
with these methods is one (:class:`Tokenizer`, a structural protocol):

- ``encode(text) -> list[int]`` and ``decode(ids) -> str``;
- optionally ``incremental() -> IncrementalDecoder``: a fresh decoder that gives
  ``decode``'s text piece by piece (``push(token) -> str``, then ``flush() -> str``),
  where the pieces join to ``decode(all ids)``. Without it, :func:`incremental_decoder`
  gives a :class:`PrefixDecoder` over ``decode``.

Two come with calfsm: :class:`ByteTokenizer`, the byte-level tokenizer of the reference
server (the simulated model has no vocabulary), and :class:`HFTokenizer`, a thin adapter
over a Hugging Face ``tokenizers.Tokenizer`` (the optional extra ``hf``).

The byte-level tokenizer
------------------------
The simulated model's logits are a hash of the token ids, so any mapping of text to ids
is as good as another. This one is byte-level and reversible, so a client can send text,
read text back and recover the exact token ids from it:

- **encode**: the text's UTF-8 bytes, byte ``b`` -> token id ``b`` (ids 0..255);
- **decode**: each run of ids below 256 is decoded as UTF-8. A byte that is not part of a
  valid UTF-8 character comes out as the private-use character ``U+F0000 + b``; an id
  ``t >= 256`` comes out as two private-use characters, ``U+F1000 + (t >> 12)`` and
  ``U+F2000 + (t & 0xFFF)`` (ids up to ``2**23``, :data:`calfsm.generate.sampling.MAX_VOCAB`);
- the code points ``U+F0000..U+F2FFF`` are **reserved**: ``encode`` reads them back as
  those escapes (anything malformed is an :class:`~calfsm.errors.InvalidArgument`), and
  ``decode`` escapes the bytes of a reserved character like stray bytes.

So ``encode(decode(ids)) == ids`` for every list of ids, and ``decode(encode(text)) ==
text`` for every text without reserved code points. :class:`ByteDecoder` gives the same
text piece by piece: a byte that may start a multi-byte character is held until the
character is complete.

Any other tokenizer: the prefix decoder
---------------------------------------
A token's text may depend on its neighbours (a decoder that joins words with spaces, or
strips the space a word piece begins with at the start of a text), and a byte-level
vocabulary splits characters across tokens. :class:`PrefixDecoder` is the method of vLLM
and TGI: it decodes a small window, the ids since the last text it gave (the *read*
offset) plus the ones before them that gave that text (the *prefix* offset), and gives the
window's text beyond the prefix's text. Text that ends in U+FFFD (an incomplete UTF-8
character: Hugging Face's byte-level decoders say so) or that does not extend the
prefix's text is held back until a later token completes it, or until ``flush()``. Each
step decodes two windows of a few ids, whatever the length of the text so far. The
pieces join to ``decode(all ids)`` for a tokenizer whose decode of a text after a clean
break (a complete character, after the previous token's context) does not change: the
Hugging Face decoders (byte-level, WordPiece, Metaspace, plain space-joined) are of this
kind.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from calfsm.drivers.base import is_int as _is_int
from calfsm.errors import CalfsmError, ErrorCategory, Internal, InvalidArgument, Unsupported
from calfsm.generate.sampling import MAX_VOCAB

__all__ = ["BYTE_IDS", "ByteDecoder", "ByteTokenizer", "HFTokenizer", "IncrementalDecoder",
           "PrefixDecoder", "Tokenizer", "check_tokenizer", "encode_prompt", "escaped_token",
           "incremental_decoder"]

#: what a decoder holds back: an incomplete UTF-8 character, by Hugging Face's decoders
REPLACEMENT = "\ufffd"


@runtime_checkable
class IncrementalDecoder(Protocol):
    """A tokenizer's ``decode``, one token at a time: ``push(token)`` returns the text
    that token completes (maybe ``""``: it may be held back until a later token
    completes it), ``flush()`` the text still held at the end. The pieces join to the
    tokenizer's ``decode`` of all the tokens pushed."""

    def push(self, token: int) -> str: ...

    def flush(self) -> str: ...


@runtime_checkable
class Tokenizer(Protocol):
    """Text <-> token ids. Optionally also ``incremental() -> IncrementalDecoder`` (a
    fresh decoder per call); :func:`incremental_decoder` uses it when present; and
    ``eos_token_id`` (an int, or None), the model's end-of-sequence token: it ends a
    stream unless ``SamplingParams.ignore_eos`` (``transformers`` tokenizers have it)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def check_tokenizer(tokenizer: Any, *, field: str = "tokenizer") -> Any:
    """``tokenizer`` if it is one (callable ``encode`` and ``decode``, and a callable
    ``incremental`` if it has that attribute), else InvalidArgument naming ``field``."""
    missing = [m for m in ("encode", "decode") if not callable(getattr(tokenizer, m, None))]
    inc = getattr(tokenizer, "incremental", None)
    if missing or (inc is not None and not callable(inc)):
        what = f"no callable {' or '.join(missing)}" if missing \
            else "an incremental attribute that is not callable"
        raise InvalidArgument(f"{field} must be a tokenizer (encode(text) -> ids, "
                              f"decode(ids) -> text): {type(tokenizer).__name__} has "
                              f"{what}", stage="config")
    return tokenizer


def incremental_decoder(tokenizer: Any) -> IncrementalDecoder:
    """A fresh incremental decoder of ``tokenizer``: its own ``incremental()`` if it has
    one, else a :class:`PrefixDecoder` over its ``decode``. An ``incremental()`` that
    fails, or gives no decoder, is Internal (category programming)."""
    inc = getattr(tokenizer, "incremental", None)
    if inc is None:
        return PrefixDecoder(tokenizer)
    try:
        dec = inc()
    except CalfsmError:
        raise
    except Exception as e:
        raise _programming("incremental()", e) from e
    if not (callable(getattr(dec, "push", None)) and callable(getattr(dec, "flush", None))):
        raise Internal(f"the tokenizer's incremental() gave {type(dec).__name__}, not a "
                       f"decoder (push(token) -> str, flush() -> str)",
                       category=ErrorCategory.PROGRAMMING, stage="tokenizer")
    return dec


# ---- the byte-level tokenizer ---------------------------------------------------------

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


def escaped_token(token: int) -> str:
    """The byte-level tokenizer's text of an id of 256 or more: its two escape
    characters."""
    return chr(_HIGH + (token >> 12)) + chr(_LOW + (token & 0xFFF))


class ByteTokenizer:
    """Text <-> token ids for a vocabulary of ``vocab`` ids, byte by byte, reversibly
    (see "The byte-level tokenizer" above); a :class:`Tokenizer`."""

    #: ids 0..255 are the bytes, the rest escapes (what constrained decoding reads)
    byte_level = True

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
        dec = ByteDecoder(self.vocab)
        return "".join(dec.push(t) for t in tokens) + dec.flush()

    def incremental(self) -> ByteDecoder:
        """A decoder of this vocabulary that gives :meth:`decode`'s text token by token."""
        return ByteDecoder(self.vocab)


class ByteDecoder:
    """:meth:`ByteTokenizer.decode` one token at a time (an :class:`IncrementalDecoder`):
    ``push(token)`` returns the text that token completes (maybe ``""``), ``flush()``
    what is held at the end. Token ids are integers in ``[0, vocab)`` (by default every
    id the escapes can carry); anything else is an
    :class:`~calfsm.errors.InvalidArgument`, and the decoder is unchanged."""

    def __init__(self, vocab: int = MAX_VOCAB) -> None:
        if not (_is_int(vocab) and 1 <= vocab <= MAX_VOCAB):
            raise InvalidArgument(f"ByteDecoder: vocab must be an integer in "
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
        return self.flush() + escaped_token(token)

    def flush(self) -> str:
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return _fix(text)


# ---- any tokenizer --------------------------------------------------------------------

class PrefixDecoder:
    """Any tokenizer's ``decode`` one token at a time, by the prefix / read-offset method
    (see the module docstring): an :class:`IncrementalDecoder`. It keeps only the ids of
    its window. Token ids are integers >= 0, else InvalidArgument (the decoder
    unchanged); the tokenizer's own errors pass through."""

    __slots__ = ("_decode", "_ids", "_prefix_text", "_read")

    def __init__(self, tokenizer: Any) -> None:
        self._decode = check_tokenizer(tokenizer).decode
        self._ids: list[int] = []       # the window: the prefix's ids, then the unread
        self._read = 0                  # ids[:_read] gave _prefix_text, already given
        self._prefix_text = ""

    def push(self, token: int) -> str:
        if not (_is_int(token) and token >= 0):
            raise InvalidArgument(f"token {token!r} is not a token id: an integer >= 0",
                                  stage="tokenizer")
        ids = self._ids
        ids.append(int(token))
        text = self._decode(ids)
        before = self._prefix_text
        if len(text) <= len(before) or text.endswith(REPLACEMENT) \
                or not text.startswith(before):
            return ""                   # nothing complete yet: held back
        # the unread ids become the next window's prefix, and their text its text
        del ids[:self._read]
        self._read = len(ids)
        self._prefix_text = self._decode(ids)
        return text[len(before):]

    def flush(self) -> str:
        """The text still held (an incomplete character comes out as U+FFFD); the
        decoder starts afresh."""
        text = self._decode(self._ids) if len(self._ids) > self._read else ""
        before = self._prefix_text
        self._ids, self._read, self._prefix_text = [], 0, ""
        if not text.startswith(before):         # not expected of a tokenizer's decode
            return text
        return text[len(before):]


class HFTokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` as a calfsm :class:`Tokenizer` (the
    optional extra ``hf``: ``pip install "calfsm[hf]"``): encode and decode with the
    special-token choices given here (Hugging Face's defaults), and a
    :class:`PrefixDecoder` for streams. From ``transformers``, pass a fast tokenizer's
    ``backend_tokenizer``. ``eos_token``: the model's end-of-sequence token (an id, or
    its text as the vocabulary has it), which ends a stream unless ``ignore_eos``."""

    #: the model's chat template (:mod:`calfsm.generate.chattemplate`), when loaded with
    #: its configuration (:meth:`from_dir`); None: none
    chat_template: Any = None

    def __init__(self, tokenizer: Any, *, add_special_tokens: bool = True,
                 skip_special_tokens: bool = True, chat_template: Any = None,
                 eos_token: int | str | None = None) -> None:
        for m in ("encode", "decode", "get_vocab_size"):
            if not callable(getattr(tokenizer, m, None)):
                raise InvalidArgument(f"HFTokenizer needs a tokenizers.Tokenizer, got "
                                      f"{type(tokenizer).__name__} (no {m}())",
                                      stage="config")
        self.tokenizer = tokenizer
        self.add_special_tokens = bool(add_special_tokens)
        self.skip_special_tokens = bool(skip_special_tokens)
        self.chat_template = chat_template
        #: the end-of-sequence token's id, or None (streams read it: SamplingParams.ignore_eos)
        self.eos_token_id: int | None = None
        if isinstance(eos_token, str):
            found = tokenizer.token_to_id(eos_token)
            if found is None:
                raise InvalidArgument(f"eos_token {eos_token!r} is not in the vocabulary",
                                      stage="config")
            self.eos_token_id = int(found)
        elif eos_token is not None:
            if isinstance(eos_token, bool) or not isinstance(eos_token, int) \
                    or not 0 <= eos_token < self.vocab_size:
                raise InvalidArgument(f"eos_token must be a token id in [0, "
                                      f"{self.vocab_size}) or its text, got {eos_token!r}",
                                      stage="config")
            self.eos_token_id = eos_token

    @classmethod
    def from_file(cls, path: str | Path, **kw: Any) -> HFTokenizer:
        """The tokenizer saved at ``path`` (a ``tokenizer.json``); read locally, never
        fetched."""
        try:
            from tokenizers import Tokenizer as _HF
        except ImportError as e:
            raise Unsupported(f"HFTokenizer needs the tokenizers package (pip install "
                              f"\"calfsm[hf]\"): {e}", stage="config") from None
        try:
            return cls(_HF.from_file(str(path)), **kw)
        except Exception as e:          # the Rust side raises plain Exceptions
            raise InvalidArgument(f"cannot read a tokenizer from {str(path)!r}: {e}",
                                  stage="config") from None

    @classmethod
    def from_dir(cls, directory: str | Path, **kw: Any) -> HFTokenizer:
        """The tokenizer saved in ``directory`` as Hugging Face saves one
        (``save_pretrained``): ``tokenizer.json``, and the chat template and special
        tokens of ``tokenizer_config.json`` / ``chat_template.jinja`` if there (the
        template needs jinja2, the ``hf`` extra too); the configuration's ``eos_token``
        ends streams (unless given here). Read locally, never fetched."""
        from calfsm.generate.chattemplate import (
            load_chat_template,
            special_tokens_of,
            tokenizer_config,
        )
        root = Path(directory)
        if not (root / "tokenizer.json").is_file():
            raise InvalidArgument(f"{str(root)!r} holds no tokenizer.json (a tokenizer "
                                  f"saved by Hugging Face's save_pretrained)",
                                  stage="config")
        config = tokenizer_config(root)         # read once: the template's and the end's
        template = load_chat_template(root, config=config)
        if "eos_token" not in kw:
            kw["eos_token"] = special_tokens_of(config).get("eos_token")
        return cls.from_file(root / "tokenizer.json", chat_template=template, **kw)

    @property
    def vocab_size(self) -> int:
        """Ids in the vocabulary, added tokens included."""
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, *, add_special_tokens: bool | None = None) -> list[int]:
        """``text``'s ids; ``add_special_tokens`` (None: this tokenizer's choice) is False
        for a prompt rendered by a chat template, which writes its own (a BOS twice
        otherwise), as ``apply_chat_template`` encodes it."""
        if not isinstance(text, str):
            raise InvalidArgument(f"text to encode must be a string, got "
                                  f"{type(text).__name__}", stage="tokenizer")
        add = self.add_special_tokens if add_special_tokens is None else add_special_tokens
        return list(self.tokenizer.encode(text, add_special_tokens=bool(add)).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(t) for t in ids],
                                     skip_special_tokens=self.skip_special_tokens)

    def incremental(self) -> PrefixDecoder:
        return PrefixDecoder(self)

    def __repr__(self) -> str:
        return f"<HFTokenizer {self.vocab_size} ids>"


# ---- what the executor's streams use ---------------------------------------------------

def _programming(what: str, e: Exception) -> Internal:
    return Internal(f"the tokenizer's {what} raised {type(e).__name__}: {e}",
                    category=ErrorCategory.PROGRAMMING, stage="tokenizer")


def encode_prompt(tokenizer: Any, text: str, **options: Any) -> list[int]:
    """A text prompt's token ids, by ``tokenizer`` (None: InvalidArgument, a text prompt
    needs one); ``options`` go to its ``encode`` (``add_special_tokens=False`` for a
    prompt a chat template rendered). A tokenizer that fails with anything but a
    CalfsmError is a bug of its own: Internal (category programming)."""
    if tokenizer is None:
        raise InvalidArgument("a text prompt needs a tokenizer: DeviceExecutor(..., "
                              "tokenizer=...), or give the prompt as token ids",
                              stage="request")
    try:
        return list(tokenizer.encode(text, **options))
    except CalfsmError:
        raise
    except Exception as e:
        raise _programming("encode", e) from e
