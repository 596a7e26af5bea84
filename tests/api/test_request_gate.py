"""No public method lets a caller's request reach the device without validation.

Two probes through every public way a request enters the executor (``enqueue``,
``enqueue_nowait``, ``decode_sync``, ``await submit``, a sequence's ``run``, and a
step prepared ahead and released with another request): a token beyond the vocabulary,
and a request for another sequence and position than the one it claims to continue.
Each is refused with InvalidArgument, nothing of it reaches ``infer``, and the device
is never drained or reset for it (found: ``release_staged`` ran a token past the
vocabulary, and a request for another sequence made the device report a CCU exception
and reset generation 1).
"""

from __future__ import annotations

import asyncio

import pytest

from calfsm.engine.job import Successor
from calfsm.errors import CalfsmError, InvalidArgument
from calfsm.executor import step_port
from calfsm.manifest import TaskKind
from calfsm.request import Request
from tests.helpers.executor import TINY, calls, drive, make_executor

VOCAB = TINY.submodel(TaskKind.DECODE).vocab


def _outcome(ex, call):
    """The error ``call()`` raised, or the one its handle ended with."""
    try:
        handle = call()
    except CalfsmError as e:
        return e
    drive(ex, handle.done)
    return handle.exception(0)


def _assert_refused_and_untouched(ex, err, infers_before):
    assert isinstance(err, InvalidArgument), err
    assert len(calls(ex.driver, "infer")) == infers_before
    assert ex.lifecycle_state == "Ready" and ex.generation == 1
    assert ex.stats().recoveries == 0


ENTRIES = {
    "enqueue": lambda ex, r: ex.enqueue(r),
    "enqueue_nowait": lambda ex, r: ex.enqueue_nowait(r),
    "decode_sync": lambda ex, r: ex.decode_sync(r),
}


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_a_token_beyond_the_vocabulary_never_reaches_the_device(mode, entry):
    with make_executor(mode) as ex:
        before = len(calls(ex.driver, "infer"))
        err = _outcome(ex, lambda: ENTRIES[entry](ex, Request.prefill(1, [1, VOCAB + 5])))
        _assert_refused_and_untouched(ex, err, before)


def test_await_submit_refuses_a_token_beyond_the_vocabulary():
    with make_executor("threaded") as ex:
        before = len(calls(ex.driver, "infer"))

        async def main():
            try:
                await ex.submit(Request.decode(1, VOCAB, 0))
            except CalfsmError as e:
                return e
        _assert_refused_and_untouched(ex, asyncio.run(main()), before)


def test_a_sequence_refuses_a_request_of_another_sequence(mode):
    with make_executor(mode) as ex, ex.open_sequence() as seq:
        before = len(calls(ex.driver, "infer"))
        err = _outcome(ex, lambda: seq.run(Request.decode(seq.seq_id + 1, 5, 0)))
        _assert_refused_and_untouched(ex, err, before)


@pytest.mark.parametrize("probe", ["beyond_vocab", "other_sequence_and_position"])
def test_a_released_staged_step_is_validated_like_any_request(mode, probe):
    """A decode staged for sequence 1 at position 3, released with a bad request: the
    step fails InvalidArgument before the device, and the executor goes on serving."""
    with make_executor(mode) as ex:
        first = ex.enqueue_nowait(Request.prefill(1, [1, 2, 3]))
        drive(ex, first.done)
        staged = step_port(ex).stage(Request.decode(1, 0, 3))
        assert staged is not None
        before = len(calls(ex.driver, "infer"))
        bad = Request.decode(1, VOCAB + 5, 3) if probe == "beyond_vocab" \
            else Request.decode(9, 7, 55)
        assert step_port(ex).release(staged, bad)
        drive(ex, staged.done)
        _assert_refused_and_untouched(ex, staged.exception(0), before)
        ok = ex.enqueue_nowait(Request.decode(1, 7, 3))
        drive(ex, ok.done)
        assert ok.exception(0) is None


@pytest.mark.parametrize("probe", ["beyond_vocab", "other_position"])
def test_a_continuations_successor_is_checked_before_the_device(probe):
    """The core runs what a job's continuation returns (a stream's next step) without
    the stream's request: it still checks the token against the vocabulary and that the
    staged step is the one for the position the job fills. Either bad, the step fails
    InvalidArgument before ``infer`` and the device is neither drained nor reset."""
    with make_executor("step") as ex:
        before = len(calls(ex.driver, "infer"))
        first = ex.enqueue_nowait(Request.prefill(1, [1, 2, 3]))
        staged = step_port(ex).stage(Request.decode(1, 0, 3 if probe == "beyond_vocab"
                                                     else 7))
        assert staged is not None
        token = VOCAB + 5 if probe == "beyond_vocab" else 7
        first.context.continuation = lambda job, logits: Successor(staged, token)
        drive(ex, lambda: first.done() and staged.done())
        assert first.exception(0) is None
        _assert_refused_and_untouched(ex, staged.exception(0), before + 1)
