"""Finished streams, finished jobs and retired generations are freed by reference
counting, not left for the cyclic garbage collector (docs/soak.md, *Findings*: at a
vocabulary of 151936 each stream holds 2 x 594 KiB of logits rows, and a recovery storm
grew the soak's RSS to 2 GiB between collections).

Each test runs with the collector disabled and watches the objects through weak
references: once the test has dropped its own references (and one more job has moved
the executor's workers past the watched ones), every watched object must be gone. An
error a job or a stream ends with is where the cycles were: its traceback held the
executor's frames, and through them the handle, the stream or the generation."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest

from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.engine.observe import Observer
from calfsm.engine.recovery import RecoveryPolicy
from calfsm.errors import CalrtCode
from calfsm.generate.sampling import SamplingParams
from calfsm.generate.streams import FinishReason
from calfsm.manifest import TaskKind
from calfsm.request import Request
from calfsm.runtime.stepper import StepScheduler
from tests.helpers.executor import TINY, drive, finish, make_executor

pytestmark = pytest.mark.timeout(60)

PROMPT = (5, 6, 7, 8, 9)
VOCAB = TINY.submodel(TaskKind.DECODE).vocab
#: the third infer on sequence 0 (the stream's second decode) is refused by the device
DEVICE_FAULT = FaultPlan.of(FaultRule("infer", "code", seq_id=0, nth=3,
                                      code=int(CalrtCode.DEVICE_UNAVAILABLE)))


@pytest.fixture
def no_gc() -> Iterator[None]:
    """The cyclic collector off for the test (what it would free is what we look for)."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class _Rows(Observer):
    """Weak references to the logits row (``request.target``) of every job that ends."""

    def __init__(self) -> None:
        self.rows: list[weakref.ref] = []

    def job_ended(self, event: Any) -> None:
        target = event.request.target
        if target is not None:
            self.rows.append(weakref.ref(target))


def _alive(refs: dict[str, Any]) -> list[str]:
    out = []
    for name, ref in refs.items():
        items = ref if isinstance(ref, list) else [ref]
        n = sum(r() is not None for r in items)
        if n:
            out.append(f"{name} ({n} of {len(items)})" if isinstance(ref, list) else name)
    return out


def _flush(ex: Any) -> None:
    """One more job, on a sequence of its own: every worker's locals move past the
    watched jobs, and deferred work has run."""
    finish(ex, ex.enqueue(Request.prefill(7, [1, 2])))
    drive(ex, ex.idle)


def _greedy_tokens(mode: str) -> tuple[int, ...]:
    with make_executor(mode) as ex:
        s = ex.generate(PROMPT, SamplingParams(max_tokens=6))
        drive(ex, s.done)
        return s.result(10).tokens


def _params(ending: str, mode: str) -> SamplingParams:
    if ending == "stop":
        want = _greedy_tokens(mode)
        k = next(i for i in range(1, len(want)) if want[i] not in want[:i])
        return SamplingParams(max_tokens=16, stop_token_ids=(want[k],))
    if ending == "error":
        def broken(row: Any) -> int:
            raise ValueError("no token today")
        return SamplingParams(max_tokens=16, sampler=broken)
    return SamplingParams(max_tokens=4 if ending == "length" else 64)


ENDINGS = {"length": FinishReason.LENGTH, "stop": FinishReason.STOP,
           "cancelled": FinishReason.CANCELLED, "error": FinishReason.ERROR,
           "device error": FinishReason.ERROR}


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_a_finished_stream_is_freed_without_the_collector(mode, ending, no_gc):
    params = _params(ending, mode)
    ex = make_executor(mode, faults=DEVICE_FAULT if ending == "device error" else None,
                       recovery=RecoveryPolicy(grace_period_s=0.0))
    rows = _Rows()
    ex.add_observer(rows)
    try:
        seq = ex.open_sequence()
        stream = seq.generate(PROMPT, params, resume=ending != "device error")
        first = weakref.ref(seq.last_job.context)           # the prefill's
        if ending == "cancelled":
            if mode == "threaded":
                next(iter(stream))                          # one token delivered
            else:
                StepScheduler(ex).run_until(lambda: seq.position > len(PROMPT))
            assert stream.cancel()
        drive(ex, stream.done)
        result = stream.result(10)
        assert result.finish_reason == ENDINGS[ending], result
        last = weakref.ref(seq.last_job.context)
        seq.close()
        drive(ex, lambda: seq.state == "Released")
        if ending == "device error":
            drive(ex, lambda: ex.lifecycle_state == "Ready")
        watched = {"stream": weakref.ref(stream), "sequence": weakref.ref(seq),
                   "result": weakref.ref(result), "first job": first, "last job": last,
                   "logits rows": list(rows.rows)}
        assert rows.rows
        stream = seq = result = None        # the test lets go of its own references
        _flush(ex)
        alive = _alive(watched)
        assert not alive, f"only the cycle collector would free: {', '.join(alive)}"
    finally:
        ex.close()


def test_a_retired_generation_is_freed_without_the_collector(mode, no_gc):
    """A stream is mid-flight when ``recover()`` retires its generation; it resumes on
    the next. Once that one is Ready and every job of the old one has ended, the old
    Epoch, its KV coordinator, its buffer pool, its slots and their input host arrays
    are gone. (A slot's output host array is mapped into the driver's buffer; whether
    the driver lets go of it is the driver's business, not checked here.)"""
    ex = make_executor(mode, recovery=RecoveryPolicy(grace_period_s=0.0))
    try:
        old = ex.epoch
        watched = {"epoch": weakref.ref(old), "pool": weakref.ref(old.pool),
                   "kv coordinator": weakref.ref(old.kv),
                   "slots": [weakref.ref(s) for s in old.pool.slots],
                   "input host arrays": [weakref.ref(a) for s in old.pool.slots
                                         for a in (s.token_host, s.position_host)]}
        del old
        seq = ex.open_sequence()
        stream = seq.generate(PROMPT, SamplingParams(max_tokens=24))
        if mode == "threaded":
            next(iter(stream))
        else:
            StepScheduler(ex).run_until(lambda: seq.position > len(PROMPT) + 1)
        assert ex.recover("the test asked")
        drive(ex, lambda: ex.generation == 2 and ex.lifecycle_state == "Ready")
        drive(ex, stream.done)
        result = stream.result(10)
        assert result.finish_reason == FinishReason.LENGTH and result.resumes >= 1, result
        seq.close()
        drive(ex, lambda: seq.state == "Released")
        stream = seq = result = None        # the test lets go of its own references
        _flush(ex)
        alive = _alive(watched)
        assert not alive, f"only the cycle collector would free: {', '.join(alive)}"
    finally:
        ex.close()
