"""calfsm.generate.tokenizer (issue 23, item 2): the tokenizer protocol, the byte-level tokenizer
(unchanged, and still found where the server always found it), the generic incremental
decoder against ``decode`` for tokenizers of several kinds, and the Hugging Face adapter
(its tests skip where the ``tokenizers`` package is absent)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import calfsm.serve
from calfsm.errors import ErrorCategory, Internal, InvalidArgument
from calfsm.generate.tokenizer import (
    BYTE_IDS,
    ByteDecoder,
    ByteTokenizer,
    HFTokenizer,
    IncrementalDecoder,
    PrefixDecoder,
    Tokenizer,
    check_tokenizer,
    encode_prompt,
    incremental_decoder,
)
from calfsm.serve import tokenizer as serve_tokenizer
from tests.helpers.tokenizer import PieceTokenizer, hf_bpe, hf_wordlevel

VOCAB = 1024
BYTES = ByteTokenizer(VOCAB)
PIECES = PieceTokenizer()


def pushed(decoder: IncrementalDecoder, ids: list[int]) -> list[str]:
    """Every piece ``decoder`` gives for ``ids``, the flush last."""
    return [decoder.push(t) for t in ids] + [decoder.flush()]


# ---- the byte-level tokenizer: unchanged --------------------------------------------

@given(st.lists(st.integers(0, VOCAB - 1), max_size=60))
def test_byte_ids_survive_text_and_the_decoder_gives_decode_piece_by_piece(ids):
    text = BYTES.decode(ids)
    assert BYTES.encode(text) == ids
    assert "".join(pushed(BYTES.incremental(), ids)) == text
    assert "".join(pushed(serve_tokenizer.IncrementalDecoder(), ids)) == text


@given(st.text())
def test_byte_text_survives_ids(text):
    if any(0xF0000 <= ord(c) < 0xF3000 or 0xD800 <= ord(c) < 0xE000 for c in text):
        return
    assert BYTES.encode(text) == list(text.encode())
    assert BYTES.decode(BYTES.encode(text)) == text


def test_the_byte_decoder_holds_a_character_until_it_is_complete():
    dec = BYTES.incremental()
    assert [dec.push(b) for b in "€".encode()] == ["", "", "€"]
    assert dec.push(700) == "\U000f1000\U000f22bc"          # an id >= 256: its escape
    assert dec.push(0xE2) == "" and dec.flush() == "\U000f00e2"     # a stray byte


def test_every_old_import_path_still_works():
    assert serve_tokenizer.ByteTokenizer is ByteTokenizer is calfsm.serve.ByteTokenizer
    assert serve_tokenizer.IncrementalDecoder is ByteDecoder      # its old name there
    assert serve_tokenizer.BYTE_IDS == BYTE_IDS == 256
    assert serve_tokenizer.chat_prompt([("user", "hi")]) == "<|user|>\nhi\n<|assistant|>\n"


def test_the_byte_tokenizer_is_a_tokenizer_with_its_own_decoder():
    assert isinstance(BYTES, Tokenizer)
    assert isinstance(BYTES.incremental(), IncrementalDecoder)
    assert type(incremental_decoder(BYTES)) is ByteDecoder
    assert check_tokenizer(BYTES) is BYTES


# ---- the generic decoder ------------------------------------------------------------

def tokenizers() -> list[Any]:
    return [pytest.param(lambda: PIECES, id="pieces"),
            pytest.param(hf_bpe, id="hf-bpe"), pytest.param(hf_wordlevel, id="hf-words")]


@given(data=st.data())
@pytest.mark.parametrize("make", [p.values[0] for p in tokenizers()],
                         ids=[p.id for p in tokenizers()])
def test_the_prefix_decoder_pieces_join_to_decode(make, data):
    """Random ids, parts of characters included (the byte pieces and the byte-level
    BPE's byte symbols), each prefix of them decoded piece by piece: the pieces and the
    flush join to ``decode`` of the ids, and nothing but the flush ends in U+FFFD."""
    tok = make()
    size = len(tok.vocab) if isinstance(tok, PieceTokenizer) else tok.vocab_size
    ids = data.draw(st.lists(st.integers(0, size - 1), max_size=40))
    pieces = pushed(incremental_decoder(tok), ids)
    assert "".join(pieces) == tok.decode(ids)
    assert not any(p.endswith("\ufffd") for p in pieces[:-1])


def test_the_prefix_decoder_gives_a_character_once_it_is_complete():
    dec = PrefixDecoder(PIECES)
    ids = [PIECES.id_of(p) for p in (b"ab", b"\xe2\x82", b"\xac!", b"\xe2", b"x##y")]
    assert [dec.push(t) for t in ids] == ["ab", "", "€!", "", "\ufffdx##y"]
    assert dec.push(PIECES.id_of(b"\xe2\x82")) == "" and dec.flush() == "\ufffd"
    assert dec.push(ord("z")) == "z"            # after a flush it starts afresh


def test_the_prefix_decoder_keeps_the_words_context():
    """A decode that joins words with spaces: each word after the first comes with its
    space, although a word decoded alone has none."""
    tok = hf_wordlevel()
    ids = tok.encode("once upon a time")
    assert [PrefixDecoder(tok).push(ids[0])] == ["once"]
    assert pushed(PrefixDecoder(tok), ids) == ["once", " upon", " a", " time", ""]


def test_the_prefix_decoder_decodes_a_window_of_a_few_ids_whatever_the_length():
    calls: list[int] = []

    class Counting(PieceTokenizer):
        def decode(self, ids):
            calls.append(len(ids))
            return super().decode(ids)

    tok = Counting()
    text = "".join(pushed(PrefixDecoder(tok), tok.encode("hello world ö€ " * 200)))
    assert text == "hello world ö€ " * 200
    assert max(calls) <= 4, max(calls)


@pytest.mark.parametrize("token", [-1, 1.5, True, "a", None])
def test_the_prefix_decoder_refuses_what_is_no_token_id(token):
    dec = PrefixDecoder(PIECES)
    assert dec.push(0xE2) == ""
    with pytest.raises(InvalidArgument, match="is not a token id"):
        dec.push(token)
    assert dec.push(0x82) + dec.push(0xAC) == "€"           # the decoder unchanged


# ---- protocol checks ----------------------------------------------------------------

@pytest.mark.parametrize("bad, what", [(object(), "no callable encode or decode"),
                                       (type("T", (), {"encode": len})(), "decode"),
                                       (type("T", (), {"encode": len, "decode": len,
                                                       "incremental": 3})(),
                                        "incremental")])
def test_what_is_no_tokenizer_is_refused_naming_the_field(bad, what):
    with pytest.raises(InvalidArgument, match=f"tokenizer must be a tokenizer.*{what}"):
        check_tokenizer(bad)


def test_a_tokenizer_that_fails_is_a_programming_error_with_context():
    class Broken(PieceTokenizer):
        def encode(self, text):
            raise ValueError("no vocabulary")

        def incremental(self):
            raise KeyError("state")

    with pytest.raises(Internal, match="encode raised ValueError: no vocabulary") as e:
        encode_prompt(Broken(), "hi")
    assert e.value.category is ErrorCategory.PROGRAMMING and e.value.stage == "tokenizer"
    with pytest.raises(Internal, match=r"incremental\(\) raised KeyError"):
        incremental_decoder(Broken())
    with pytest.raises(InvalidArgument, match="a text prompt needs a tokenizer"):
        encode_prompt(None, "hi")
    with pytest.raises(InvalidArgument, match="prompt: character 0"):
        encode_prompt(BYTES, "\U000f1000")          # the tokenizer's own error, as is


# ---- the Hugging Face adapter -------------------------------------------------------

def test_hf_tokenizer_encodes_decodes_and_streams():
    tok = hf_bpe()
    ids = tok.encode("hello world ###")
    assert tok.decode(ids) == "hello world ###" and len(ids) == 4
    assert isinstance(tok, Tokenizer) and isinstance(tok.incremental(), PrefixDecoder)
    with pytest.raises(InvalidArgument, match="must be a string"):
        tok.encode(b"hello")


def test_hf_tokenizer_from_a_file_and_its_errors(tmp_path):
    tok = hf_bpe()
    path = tmp_path / "tokenizer.json"
    tok.tokenizer.save(str(path))
    again = HFTokenizer.from_file(path)
    assert again.encode("hello €") == tok.encode("hello €") and again.vocab_size == 269
    with pytest.raises(InvalidArgument, match="cannot read a tokenizer from"):
        HFTokenizer.from_file(tmp_path / "missing.json")
    with pytest.raises(InvalidArgument, match=r"HFTokenizer needs a tokenizers\.Tokenizer"):
        HFTokenizer(PIECES)
