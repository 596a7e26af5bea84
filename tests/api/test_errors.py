"""The CalRT error table against the spec (ARCHITECTURE.md, "Errors (spec section 8)").

EXPECTED is written from the spec's table and service mapping, not from
``calfsm.errors.CODE_TABLE``: a wrong row in the code would have to be wrong the same
way here to pass. Codes 3, 6 and 26 are not in the spec's table; their rows follow the
classification the errors module documents (3 with the manifest-difference row, 6 a
programming error, 26 a device row like 25).
"""

from __future__ import annotations

import pickle

import pytest

from calfsm.errors import (
    AdmissionEffect,
    CalfsmError,
    CalrtCode,
    ErrorCategory,
    IllegalTransition,
    Internal,
    JobEffect,
    ManifestError,
    RecoveryAction,
    ResourceExhausted,
    category_of,
    check,
    from_calrt,
)

C = ErrorCategory
REQ, LIFE, ART, COMPAT, TRANS, DEV, PROG, UNK = (
    C.REQUEST, C.LIFECYCLE, C.ARTIFACT, C.COMPATIBILITY, C.TRANSIENT, C.DEVICE,
    C.PROGRAMMING, C.UNKNOWN)

# Service mapping: bad input 400/INVALID_ARGUMENT; KV/queue/memory full 429/
# RESOURCE_EXHAUSTED; deadline 504; device not serving 503; internal shape or calbin
# error 500/INTERNAL; a feature the device lacks 501/UNIMPLEMENTED.
BAD_INPUT = (400, "INVALID_ARGUMENT")
EXHAUSTED = (429, "RESOURCE_EXHAUSTED")
DEADLINE = (504, "DEADLINE_EXCEEDED")
UNAVAILABLE = (503, "UNAVAILABLE")
INTERNAL = (500, "INTERNAL")
UNIMPLEMENTED = (501, "UNIMPLEMENTED")

#: code -> (category, (http, grpc)), one row per CalRT 0.7.6 error code.
EXPECTED: dict[int, tuple[ErrorCategory, tuple[int, str]]] = {
    1: (REQ, EXHAUSTED),        # alloc
    2: (LIFE, UNAVAILABLE),     # already registered
    3: (REQ, INTERNAL),         # not found (manifest difference; not in the spec table)
    4: (ART, INTERNAL),         # bad value
    5: (ART, INTERNAL),         # bad config
    6: (PROG, INTERNAL),        # invalid state (API out of order; not in the spec table)
    7: (LIFE, UNAVAILABLE),     # already configured
    8: (COMPAT, INTERNAL),      # driver
    9: (COMPAT, INTERNAL),      # runtime too old
    10: (ART, INTERNAL),        # file not found
    11: (ART, INTERNAL),        # file read
    12: (ART, INTERNAL),        # file format
    13: (TRANS, DEADLINE),      # timeout
    14: (REQ, BAD_INPUT),       # out of range
    15: (UNK, INTERNAL),        # unexpected
    16: (LIFE, UNAVAILABLE),    # missing config
    17: (TRANS, UNAVAILABLE),   # busy
    18: (DEV, UNAVAILABLE),     # unavailable
    19: (ART, INTERNAL),        # bad calbin
    20: (UNK, INTERNAL),        # unknown
    21: (REQ, INTERNAL),        # dtype (internal shape error)
    22: (REQ, INTERNAL),        # shape (internal shape error)
    23: (COMPAT, INTERNAL),     # dependency
    24: (DEV, UNAVAILABLE),     # map broken
    25: (DEV, UNAVAILABLE),     # soft reset failed
    26: (DEV, UNAVAILABLE),     # hard reset failed (not in the spec table)
    27: (PROG, UNIMPLEMENTED),  # unsupported
    28: (DEV, UNAVAILABLE),     # crash
    29: (PROG, INTERNAL),       # wrong direction
}

#: category -> (job, new admission, action), the spec table's last three columns.
SERVICE: dict[ErrorCategory, tuple[JobEffect, AdmissionEffect, RecoveryAction]] = {
    REQ: (JobEffect.FAIL, AdmissionEffect.CONTINUE, RecoveryAction.RECORD_MANIFEST_DIFF),
    LIFE: (JobEffect.FAIL, AdmissionEffect.PAUSE, RecoveryAction.DRAIN_CHECK_GENERATION),
    ART: (JobEffect.FAIL, AdmissionEffect.REJECT_GENERATION, RecoveryAction.ROLLBACK_MODEL),
    COMPAT: (JobEffect.FAIL, AdmissionEffect.STOP, RecoveryAction.OPERATOR_FIX),
    TRANS: (JobEffect.FAIL_OR_REQUEUE, AdmissionEffect.REDUCE,
            RecoveryAction.BACKOFF_THEN_DRAIN),
    DEV: (JobEffect.FAIL, AdmissionEffect.STOP_NOW, RecoveryAction.QUARANTINE_RESET),
    PROG: (JobEffect.FAIL, AdmissionEffect.FEATURE_OFF, RecoveryAction.NO_RESET),
    UNK: (JobEffect.FAIL, AdmissionEffect.PAUSE, RecoveryAction.TAINT_GENERATION),
}


def test_expected_table_covers_every_calrt_error_code() -> None:
    assert set(EXPECTED) == set(range(1, 30)) == {int(c) for c in CalrtCode} - {0}
    assert set(SERVICE) == set(ErrorCategory)


@pytest.mark.parametrize("code", sorted(EXPECTED), ids=lambda c: CalrtCode(c).name)
def test_code_row(code: int) -> None:
    category, (http, grpc) = EXPECTED[code]
    err = from_calrt(code, "infer", job_id=1)
    assert isinstance(err, CalfsmError)
    assert err.category is category
    assert category_of(code) is category
    job, admission, action = SERVICE[category]
    assert (err.action.job, err.action.admission, err.action.action) == (
        job, admission, action)
    assert (err.http_status, err.grpc_code) == (http, grpc)
    assert (err.calrt_code, err.stage, err.job_id) == (code, "infer", 1)
    assert f"calrt={code}({CalrtCode(code).name})" in str(err)
    with pytest.raises(type(err)) as raised:
        check(code, "infer")
    assert raised.value.category is category


@pytest.mark.parametrize("code", [77, -1, 30, 2**31 - 1])
def test_unknown_code_is_unknown_internal_without_crash(code: int) -> None:
    err = from_calrt(code, "wait", seq_id=4)
    assert type(err) is Internal
    assert err.category is ErrorCategory.UNKNOWN
    assert category_of(code) is ErrorCategory.UNKNOWN
    assert (err.http_status, err.grpc_code) == INTERNAL
    assert err.action.action is RecoveryAction.TAINT_GENERATION
    assert err.calrt_code == code
    assert f"calrt={code}(CODE_{code})" in str(err)
    with pytest.raises(Internal):
        check(code, "wait")


def test_success_is_not_an_error() -> None:
    assert check(0, "infer") is None
    assert check(CalrtCode.SUCCESS, "infer") is None
    with pytest.raises(ValueError):
        from_calrt(0, "infer")
    with pytest.raises(ValueError):
        category_of(0)


def _full() -> CalfsmError:
    err = from_calrt(CalrtCode.DEVICE_BUSY, "submit", job_id=11, seq_id=5, generation=3)
    err.retry_after_s = 0.25
    err.request_id = "r-1"
    return err


def test_str_is_one_line_with_every_context_field() -> None:
    text = str(_full())
    assert "\n" not in text
    for part in ("Unavailable[transient]", "stage=submit", "job=11", "seq=5", "gen=3",
                 "calrt=17(DEVICE_BUSY)", "http=503", "grpc=UNAVAILABLE",
                 "retry_after=0.25s", "req=r-1"):
        assert part in text, part


def test_str_stays_one_line_for_a_multi_line_message() -> None:
    err = Internal("first line\nsecond line\r\nthird", stage="output")
    text = str(err)
    assert "\n" not in text and "\r" not in text
    assert "first line" in text and "third" in text and "stage=output" in text
    assert err.message == "first line\nsecond line\r\nthird"  # the original is kept


def test_str_without_context_shows_dashes() -> None:
    text = str(Internal("boom"))
    assert "stage=- job=- seq=- gen=- calrt=-" in text


def test_with_context_fills_only_unset_fields() -> None:
    err = from_calrt(CalrtCode.TIMEOUT, "wait", job_id=1)
    assert err.with_context(job_id=99, seq_id=2, generation=7) is err
    assert (err.job_id, err.seq_id, err.generation) == (1, 2, 7)
    assert err.context()["seq_id"] == 2
    with pytest.raises(TypeError, match="bogus"):
        err.with_context(bogus=1)


def test_context_dict_for_structured_logging() -> None:
    ctx = _full().context()
    assert ctx == {"error": "Unavailable", "category": "transient", "http_status": 503,
                   "grpc_code": "UNAVAILABLE", "job_id": 11, "seq_id": 5, "generation": 3,
                   "calrt_code": 17, "stage": "submit", "retry_after_s": 0.25,
                   "request_id": "r-1"}
    assert "req=r-1" in str(_full())


@pytest.mark.parametrize("err", [
    _full(),
    from_calrt(1, "alloc", job_id=2),
    ManifestError("submodels[0].exact_name: empty", stage="manifest", generation=4),
    IllegalTransition("job", "Created", "succeed", job_id=8, seq_id=1, generation=2),
], ids=lambda e: type(e).__name__)
def test_pickling_keeps_type_category_and_context(err: CalfsmError) -> None:
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is type(err)
    assert again.category is err.category
    assert again.message == err.message
    for field in ("job_id", "seq_id", "generation", "calrt_code", "stage",
                  "retry_after_s"):
        assert getattr(again, field) == getattr(err, field), field
    assert str(again) == str(err)


def test_pickling_keeps_a_category_that_differs_from_the_class_default() -> None:
    # DEVICE_BUSY raises Unavailable (default category DEVICE) with category TRANSIENT.
    again = pickle.loads(pickle.dumps(_full()))
    assert again.category is ErrorCategory.TRANSIENT


def test_illegal_transition_pickles_its_machine_fields() -> None:
    again = pickle.loads(pickle.dumps(IllegalTransition("kv", "Committed", "commit")))
    assert (again.machine, again.state, again.trigger) == ("kv", "Committed", "commit")


def test_hierarchy() -> None:
    assert issubclass(ManifestError, Internal)
    assert issubclass(ResourceExhausted, CalfsmError)
    assert ManifestError("x").category is ErrorCategory.ARTIFACT
    assert IllegalTransition("m", "s", "t").category is ErrorCategory.PROGRAMMING


def test_illegal_transition_pickles_with_its_category() -> None:
    import pickle

    from calfsm.errors import ErrorCategory, IllegalTransition

    err = IllegalTransition("job", "Succeeded", "admit", category=ErrorCategory.DEVICE,
                            job_id=3)
    back = pickle.loads(pickle.dumps(err))
    assert (back.machine, back.state, back.trigger) == ("job", "Succeeded", "admit")
    assert back.category is ErrorCategory.DEVICE and back.job_id == 3
