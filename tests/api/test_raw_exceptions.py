"""A caller's mistake is an InvalidArgument naming what is wrong, never a raw TypeError,
ValueError or OverflowError (issue 20): the byte-level tokenizer's incremental decoder
and ``LlamaBatch``. (``DumpConfig`` is in tests/telemetry/test_dump.py, the drivers' ``wait`` in
the conformance suite.)"""

from __future__ import annotations

import numpy as np
import pytest

from calfsm.errors import InvalidArgument
from calfsm.generate.sampling import MAX_VOCAB
from calfsm.llama.batch import LlamaBatch
from calfsm.serve.tokenizer import ByteTokenizer, IncrementalDecoder


@pytest.mark.parametrize("token", [-1, MAX_VOCAB, 1.5, True, "a", None, 2**70])
def test_the_incremental_decoder_refuses_what_is_no_token_id(token: object) -> None:
    """``push(-1)`` was a ValueError from ``bytes((-1,))``; 2**70 one from ``chr``."""
    dec = IncrementalDecoder()
    assert dec.push(0xE2) == ""                 # a character begun...
    with pytest.raises(InvalidArgument, match="is not a token id"):
        dec.push(token)
    assert dec.push(0x82) + dec.push(0xAC) == "€"     # ...and the decoder unchanged
    assert dec.push(np.int32(65)) == "A"


def test_decode_refuses_ids_outside_the_vocabulary() -> None:
    tok = ByteTokenizer(1024)
    assert tok.decode([72, 105]) == "Hi"
    with pytest.raises(InvalidArgument, match=r"token 1024 is not a token id: an integer "
                                              r"in 0\.\.1023"):
        tok.decode([72, 1024])


@pytest.mark.parametrize("vocab", ["1024", None, 1024.0, True, 255, MAX_VOCAB + 1])
def test_the_tokenizer_refuses_a_vocabulary_that_is_no_count(vocab: object) -> None:
    with pytest.raises(InvalidArgument, match="vocabulary of 256"):
        ByteTokenizer(vocab)            # "1024" and None were TypeErrors


@pytest.mark.parametrize(("fields", "what"), [
    ({"token": 5}, "token must be a sequence"),
    ({"token": "abc"}, "token must be a sequence"),
    ({"token": np.array(5)}, "token must be a sequence"),
    ({"embd": 5}, "embd must be a 2-D"),
    ({"embd": [[1.0]]}, "embd must be a 2-D"),
])
def test_n_tokens_of_a_malformed_batch_is_invalid_argument(fields: dict, what: str) -> None:
    """``LlamaBatch(token=5).n_tokens`` was ``len(5)``: a TypeError."""
    with pytest.raises(InvalidArgument, match=what):
        _ = LlamaBatch(**fields).n_tokens


def test_n_tokens_of_well_formed_batches() -> None:
    assert LlamaBatch().n_tokens == 0
    assert LlamaBatch(token=(1, 2)).n_tokens == 2
    assert LlamaBatch(token=np.array([1, 2, 3])).n_tokens == 3
    assert LlamaBatch(embd=np.zeros((4, 8), np.float32)).n_tokens == 4


def test_add_checks_before_it_changes_anything() -> None:
    """``add`` on a tuple field was an AttributeError, after the fields before it had
    already grown."""
    batch = LlamaBatch(token=[1], pos=(0,), n_seq_id=[1], seq_id=[[0]], logits=[0])
    with pytest.raises(InvalidArgument, match="pos is a tuple"):
        batch.add(2, 1, [0], True)
    assert batch.token == [1]
    with pytest.raises(InvalidArgument, match="seq_ids must be a list"):
        LlamaBatch().add(2, 1, 0, True)
    with pytest.raises(InvalidArgument, match="get_one takes a sequence"):
        LlamaBatch.get_one(5)
    batch = LlamaBatch()
    batch.add(7, 0, [0], True)
    assert (batch.token, batch.pos, batch.n_seq_id, batch.seq_id, batch.logits) == \
        ([7], [0], [1], [[0]], [True])
