"""Tokenizers for the tests, built offline in code, and a sampler that plays a script.

- :class:`PieceTokenizer`: a tokenizer of our own whose tokens are byte strings of
  several characters (and parts of characters), decoded as UTF-8 with U+FFFD for what is
  incomplete, as Hugging Face's byte-level decoders do. It has no ``incremental()``, so
  the executor decodes it with the generic :class:`~calfsm.generate.tokenizer.PrefixDecoder`.
  It needs no package, so the stop-string tests always run with a second tokenizer.
- :func:`hf_bpe` and :func:`hf_wordlevel`: Hugging Face ``tokenizers`` models made from
  a small vocabulary (a byte-level BPE with a few merges; a word-level model whose
  decode joins words with spaces), wrapped in :class:`~calfsm.generate.tokenizer.HFTokenizer`.
- :class:`Script`: a ``SamplingParams.sampler`` that gives the tokens of a list in turn,
  so a stream produces the text a test chooses.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from calfsm.generate.tokenizer import HFTokenizer

#: several characters, parts of characters, and ones that straddle a stop string
PIECES = (b"##", b"###", b"hello", b" world", b"x##y", "€".encode(), b"\xe2\x82",
          b"\x82\xac", b"\xac!", "ö".encode(), b"\n\n", b"STOP", b"ab")


class PieceTokenizer:
    """Ids 0..255 are the bytes, then one id per piece of :data:`PIECES`; ``encode``
    takes the longest piece at each point."""

    def __init__(self, pieces: Sequence[bytes] = PIECES) -> None:
        self.vocab = [bytes([b]) for b in range(256)] + list(pieces)
        self.ids = {p: i for i, p in enumerate(self.vocab)}
        self._longest = max(map(len, self.vocab))

    def encode(self, text: str) -> list[int]:
        data, out, i = text.encode(), [], 0
        while i < len(data):
            n = next(n for n in range(min(self._longest, len(data) - i), 0, -1)
                     if data[i:i + n] in self.ids)
            out.append(self.ids[data[i:i + n]])
            i += n
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return b"".join(self.vocab[i] for i in ids).decode("utf-8", "replace")

    def id_of(self, piece: bytes) -> int:
        return self.ids[piece]


def _hf() -> Any:
    import pytest

    return pytest.importorskip("tokenizers")


#: the byte-level BPE's merges: words, "###", and the first two bytes of "€"
BPE_MERGES = (("#", "#"), ("##", "#"), ("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"),
              ("Ġ", "w"), ("o", "r"), ("Ġw", "or"), ("l", "d"), ("Ġwor", "ld"),
              ("â", "Ĥ"), ("âĤ", "¬"))


def hf_bpe() -> HFTokenizer:
    """A GPT-2-style byte-level BPE: the 256 byte symbols, then :data:`BPE_MERGES`."""
    tk = _hf()
    alphabet = sorted(tk.pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    for a, b in BPE_MERGES:
        vocab[a + b] = len(vocab)
    tok = tk.Tokenizer(tk.models.BPE(vocab, list(BPE_MERGES)))
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    return HFTokenizer(tok)


WORDS = ("[UNK]", "hello", "world", "###", "#", "once", "upon", "a", "time")


def hf_wordlevel() -> HFTokenizer:
    """Whitespace-split words; no decoder, so decode joins the words with spaces."""
    tk = _hf()
    tok = tk.Tokenizer(tk.models.WordLevel({w: i for i, w in enumerate(WORDS)},
                                           unk_token="[UNK]"))
    tok.pre_tokenizer = tk.pre_tokenizers.Whitespace()
    return HFTokenizer(tok)


class Script:
    """A sampler that gives ``tokens`` in turn, one per call (one stream's)."""

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens = list(tokens)
        self.calls = 0

    def __call__(self, row: np.ndarray) -> int:
        token = self.tokens[self.calls]
        self.calls += 1
        return token
