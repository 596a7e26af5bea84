"""Request construction refuses every value it cannot keep exactly, and check_request
judges a request against its sub-model contract, each failure an InvalidArgument that
names the field."""

from __future__ import annotations

import attrs
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from calfsm.drivers.base import EngineSlot
from calfsm.errors import InvalidArgument
from calfsm.manifest import DType, TaskKind, TensorContract, builtin_manifest
from calfsm.request import EMBED_DTYPES, Request, check_request

TINY = builtin_manifest("tiny")
PREFILL = TINY.submodel(TaskKind.PREFILL_IDS)
DECODE = TINY.submodel(TaskKind.DECODE)
EMBEDS = TINY.submodel(TaskKind.PREFILL_EMBEDS)
HIDDEN = EMBEDS.token_or_embed.shape[-1]
CTX = {"job_id": 7, "seq_id": 3, "generation": 2, "stage": "validate"}
LIMIT = 2**31 - 1


def _request(**changes) -> Request:
    kw = {"seq_id": 3, "kind": TaskKind.PREFILL_IDS, "tokens": [1, 2, 3]}
    kw.update(changes)
    return Request(**kw)


# ---- construction ------------------------------------------------------------------------

class _Thing:
    pass


class _IntArray(np.ndarray):
    pass


@pytest.mark.parametrize(("changes", "field"), [
    ({"tokens": [1.7, 2.2]}, "tokens[0]"),
    ({"tokens": [1, 2.0]}, "tokens[1]"),
    ({"tokens": [True, 2]}, "tokens[0]"),
    ({"tokens": [1, np.True_]}, "tokens[1]"),
    ({"tokens": ["1"]}, "tokens[0]"),
    ({"tokens": [1 + 0j]}, "tokens[0]"),
    ({"tokens": [float("nan")]}, "tokens[0]"),
    ({"tokens": [[1, 2]]}, "tokens[0]"),
    ({"tokens": [2**70]}, "tokens[0]"),
    ({"tokens": [0, 2**63]}, "tokens[1]"),
    ({"tokens": "abc"}, "tokens"),
    ({"tokens": _Thing()}, "tokens"),
    ({"tokens": 5}, "tokens"),
    ({"tokens": None}, "tokens"),
    ({"tokens": np.array([1.0, 2.0])}, "tokens"),
    ({"tokens": np.array([True])}, "tokens"),
    ({"tokens": np.array([[1, 2]])}, "tokens"),
    ({"tokens": np.array([2**64 - 1], np.uint64)}, "tokens"),
    ({"positions": [0.0, 1.0, 2.0]}, "positions[0]"),
    ({"positions": np.array([0, 1, 2], np.float32)}, "positions"),
    ({"seq_id": "3"}, "seq_id"),
    ({"seq_id": 3.0}, "seq_id"),
    ({"seq_id": True}, "seq_id"),
    ({"past_len": 1.5}, "past_len"),
    ({"past_len": "0"}, "past_len"),
    ({"kind": "garbage"}, "kind"),
    ({"kind": 2}, "kind"),
    ({"deadline_s": float("nan")}, "deadline_s"),
    ({"deadline_s": "1"}, "deadline_s"),
    ({"deadline_s": True}, "deadline_s"),
    ({"target": [0.0] * 1024}, "target"),
    ({"target": np.zeros(1024, np.float64)}, "target"),
    ({"target": np.zeros((2, 1024), np.float32)}, "target"),
    ({"target": np.zeros(2048, np.float32)[::2]}, "target"),
    ({"seq_count": 1.0}, "seq_count"),
    ({"engine": 5}, "engine"),
    ({"engine": "PING"}, "engine"),
])
def test_bad_values_raise_invalid_argument_naming_the_field(changes, field) -> None:
    with pytest.raises(InvalidArgument) as info:
        _request(**changes)
    assert info.value.stage == "request"
    assert str(info.value.message).startswith(field), info.value.message


def test_read_only_target_is_refused() -> None:
    t = np.zeros(1024, np.float32)
    t.flags.writeable = False
    with pytest.raises(InvalidArgument, match="target"):
        _request(target=t)


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64, np.uint8,
                                   np.uint16, np.uint32, np.uint64])
def test_numpy_integers_of_every_dtype_are_accepted(dtype) -> None:
    r = Request(dtype(3), TaskKind.PREFILL_IDS, np.array([1, 2], dtype),
                np.array([4, 5], dtype), past_len=dtype(4), seq_count=dtype(1))
    assert (r.seq_id, r.past_len, r.seq_count) == (3, 4, 1)
    assert type(r.seq_id) is int and type(r.past_len) is int
    assert r.tokens.dtype == np.int64 and r.tokens.tolist() == [1, 2]
    assert r.positions.dtype == np.int64 and r.positions.tolist() == [4, 5]
    d = Request.decode(dtype(3), dtype(9), dtype(4))
    assert (d.seq_id, d.tokens.tolist(), d.positions.tolist(), d.past_len) == (3, [9], [4], 4)


def test_python_ints_lists_tuples_and_ranges_are_kept_exactly() -> None:
    big = 2**63 - 1
    assert _request(tokens=[0, big, -big - 1]).tokens.tolist() == [0, big, -big - 1]
    assert _request(tokens=(5, 6)).tokens.tolist() == [5, 6]
    assert _request(tokens=range(3)).tokens.tolist() == [0, 1, 2]
    assert _request(tokens=[]).token_count == 0          # judged by check_request
    sub = _request(tokens=np.arange(3, dtype=np.int32).view(_IntArray)).tokens
    assert type(sub) is np.ndarray and sub.dtype == np.int64 and sub.tolist() == [0, 1, 2]


def test_defaults_positions_from_past_len_and_past_len_from_positions() -> None:
    r = _request(past_len=5)
    assert r.positions.tolist() == [5, 6, 7] and r.past_len == 5
    r = _request(positions=[9, 10, 11])
    assert r.past_len == 9
    r = _request()
    assert r.past_len == 0 and r.positions.tolist() == [0, 1, 2]
    assert Request.prefill(1, [4, 4], past_len=2).positions.tolist() == [2, 3]


def test_kind_and_engine_by_value() -> None:
    r = _request(kind="decode", tokens=[1], engine=0)
    assert r.kind is TaskKind.DECODE and r.engine is EngineSlot.PING


def test_decode_refuses_a_float_token_instead_of_truncating_it() -> None:
    with pytest.raises(InvalidArgument, match=r"\]: token must be an integer"):
        Request.decode(0, 1.7, 3)
    with pytest.raises(InvalidArgument, match=r"\]: position must be an integer"):
        Request.decode(0, 1, 3.0)
    with pytest.raises(InvalidArgument, match=r"\]: token 1180591620717411303424 does not fit"):
        Request.decode(0, 2**70, 3)
    with pytest.raises(InvalidArgument, match=r"\]: seq_id must be an integer"):
        Request.decode("0", 1, 3)


def test_evolve_validates_again() -> None:
    with pytest.raises(InvalidArgument, match=r"\]: tokens\[0\] must be an integer"):
        attrs.evolve(_request(), tokens=[0.5])


@pytest.mark.parametrize("embeds, match", [
    ([[0.0] * 4], "embeds must be a 2-D"),
    (np.zeros((2, 4), np.float64), "float64"),
    (np.zeros(4, np.float32), "embeds must be a 2-D"),
    (np.zeros((2, 4), np.int32), "int32"),
    (np.array([[0.0, np.inf]], np.float32), "finite"),
    (np.array([[0.0, np.nan]], ml_dtypes.bfloat16), "finite"),
])
def test_bad_embeddings(embeds, match) -> None:
    with pytest.raises(InvalidArgument, match=match) as info:
        Request.prefill_embeds(0, embeds)
    assert info.value.stage == "request"


@pytest.mark.parametrize("dtype", list(EMBED_DTYPES.values()))
def test_embeddings_are_kept_as_given(dtype) -> None:
    e = np.ones((3, 4), dtype)
    r = Request.prefill_embeds(2, e, past_len=4)
    assert r.tokens is e and r.kind is TaskKind.PREFILL_EMBEDS
    assert r.token_count == 3 and r.positions.tolist() == [4, 5, 6] and r.past_len == 4


@given(st.lists(st.one_of(st.integers(), st.floats(), st.booleans(), st.text(max_size=2),
                          st.none()), max_size=6))
def test_any_token_list_is_kept_exactly_or_refused(values) -> None:
    try:
        r = _request(tokens=values)
    except InvalidArgument as e:
        assert e.stage == "request" and e.message.startswith("tokens")
        return
    assert r.tokens.dtype == np.int64
    assert r.tokens.tolist() == values
    assert all(type(v) is int for v in values)


# ---- check_request -------------------------------------------------------------------

def _check(request: Request, contract=PREFILL, seq_limit: int = LIMIT) -> None:
    check_request(request, contract, seq_limit=seq_limit, context=CTX)


def _embeds(n: int, hidden: int = HIDDEN, dtype=None) -> np.ndarray:
    return np.ones((n, hidden), dtype or EMBED_DTYPES[EMBEDS.token_or_embed.dtype])


def test_good_requests_pass() -> None:
    _check(_request())
    _check(Request.decode(3, DECODE.vocab - 1, DECODE.max_seq - 1), DECODE)
    _check(Request.prefill(3, [0] * PREFILL.max_tokens), PREFILL)
    _check(Request.prefill_embeds(3, _embeds(EMBEDS.max_tokens), past_len=5), EMBEDS)
    _check(_request(target=np.zeros(PREFILL.vocab, np.float32)))


@pytest.mark.parametrize("request_, contract, match", [
    (_request(tokens=[]), PREFILL, "token_count must be > 0"),
    (_request(positions=[-1, 0, 1]), PREFILL, "past_len must be >= 0"),
    (_request(past_len=PREFILL.max_seq - 2), PREFILL, "exceeds max_seq"),
    (Request.decode(3, 1, DECODE.max_seq), DECODE, "exceeds max_seq"),
    (_request(seq_count=2), PREFILL, "seq_count 2"),
    (_request(seq_count=0), PREFILL, "seq_count 0"),
    (_request(seq_id=-1), PREFILL, "seq_id must be in"),
    (_request(seq_id=LIMIT), PREFILL, "seq_id must be in"),
    (_request(positions=[0, 1]), PREFILL, "3 tokens but 2 positions"),
    (_request(kind=TaskKind.DECODE), DECODE, "one token, got 3"),
    (Request.prefill(3, [1] * (PREFILL.max_tokens + 1)),
     attrs.evolve(PREFILL, max_seq=2 * PREFILL.max_tokens), "exceed tensor"),
    (_request(positions=[0, 2, 3]), PREFILL, "positions must run 0..2"),
    (_request(positions=[1, 2, 3], past_len=0), PREFILL, "positions must run 0..2"),
    (_request(tokens=[0, PREFILL.vocab]), PREFILL, "token ids must be in"),
    (_request(tokens=[-1, 3]), PREFILL, "token ids must be in"),
    (Request.decode(3, -1, 0), DECODE, "token ids must be in"),
    (Request.decode(3, DECODE.vocab, 0), DECODE, "token ids must be in"),
    (_request(target=np.zeros(PREFILL.vocab - 1, np.float32)), PREFILL, "target holds"),
    (Request.decode(3, 1, 0), PREFILL, "checked against the prefill_ids contract"),
    (Request.prefill_embeds(3, _embeds(2, HIDDEN + 1)), EMBEDS, "hidden size"),
    (Request.prefill_embeds(3, _embeds(2, dtype=np.float32)), EMBEDS, "takes BF16"),
    (Request.prefill_embeds(3, _embeds(EMBEDS.max_tokens + 1)), EMBEDS, "exceed tensor"),
])
def test_check_request_names_the_fact(request_, contract, match) -> None:
    with pytest.raises(InvalidArgument, match=match) as info:
        _check(request_, contract)
    e = info.value
    assert (e.job_id, e.seq_id, e.generation, e.stage) == (7, 3, 2, "validate")


def test_seq_limit_is_the_callers() -> None:
    _check(_request(seq_id=9), seq_limit=10)
    with pytest.raises(InvalidArgument, match=r"\[0, 9\)"):
        _check(_request(seq_id=9), seq_limit=9)


def test_embedding_tensor_of_an_integer_dtype_cannot_be_written() -> None:
    t = EMBEDS.token_or_embed
    ints = attrs.evolve(EMBEDS, token_or_embed=TensorContract(
        t.name, t.shape, DType.S16, t.byte_size, t.sliceable))
    with pytest.raises(InvalidArgument, match="not a float dtype"):
        _check(Request.prefill_embeds(3, _embeds(2)), ints)
