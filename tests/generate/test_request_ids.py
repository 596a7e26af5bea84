"""Request ids (issue 23, item 1): every stream and job has one (given or generated,
unique among the live requests of an executor), in its errors, log lines, observer events
and metric exemplars; ``executor.abort(request_id)`` cancels it wherever it is, by the
cancel rules of FI11/FI12 (waiting or staged: nothing reaches the device; on the device:
it runs to its end, its result is dropped, every resource comes back);
``executor.requests()`` lists the live ones; ``generate(n=k)`` starts k seeded streams
under one parent id."""

from __future__ import annotations

import asyncio
import logging

import pytest

from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.drivers.sim import SimDriver
from calfsm.engine.job import JobState
from calfsm.engine.observe import Observer
from calfsm.errors import Cancelled, DeadlineExceeded, InvalidArgument
from calfsm.generate.sampling import SamplingParams
from calfsm.generate.stream import FinishReason
from calfsm.machines.job import BEFORE_SUBMIT
from calfsm.request import Request
from calfsm.tools.direct import DirectRunner
from tests.helpers.executor import (
    TINY,
    GatedDriver,
    calls,
    drive,
    finish,
    hold_on_device,
    make_executor,
    make_sim,
)
from tests.helpers.streams import assert_freed

PROMPT = [5, 9, 100, 7, 3]


class Seen(Observer):
    """The request ids observers are told of. The ends of announced jobs (``ended``)
    pair one to one with the job_accepted events; a stream's step prepared ahead that
    was never released ends unannounced (``unannounced``, with its outcome): whether a
    staging loses the race to the step it was prepared behind (the step completed and
    its successor went the ordinary way) is up to the threads' timing."""

    def __init__(self) -> None:
        self.accepted: list[str | None] = []
        self.ended: list[str | None] = []
        self.unannounced: list[tuple[str | None, str]] = []
        self.streams: list[str] = []

    def job_accepted(self, event) -> None:
        self.accepted.append(event.request_id)

    def job_ended(self, event) -> None:
        if event.announced:
            self.ended.append(event.request_id)
        else:
            self.unannounced.append((event.request_id, event.outcome))

    def stream_ended(self, stream, result) -> None:
        self.streams.append(stream.request_id)


def freed(ex, *seqs: int) -> None:
    """Nothing leaked once the plain jobs' sequences are released (a job's KV is its
    sequence's until the caller releases it)."""
    drive(ex, ex.idle)
    for seq in seqs:
        ex.reset_sequence(seq)
    assert_freed(ex)


def gated(mode: str, **config):
    driver = GatedDriver(make_sim(mode))
    return driver, make_executor(mode, driver=driver, **config)


# ---- ids: given, generated, unique, everywhere --------------------------------------

def test_every_stream_and_job_has_an_id_in_its_events(mode):
    seen = Seen()
    with make_executor(mode) as ex:
        ex.add_observer(seen)
        a = ex.generate(PROMPT, SamplingParams(max_tokens=4), request_id="chat-1")
        b = ex.generate(PROMPT, SamplingParams(max_tokens=4))
        job = ex.enqueue_nowait(Request.prefill(7, PROMPT))
        drive(ex, lambda: a.done() and b.done() and job.done())
        assert a.request_id == "chat-1"
        assert b.request_id != a.request_id and b.request_id.startswith("req-")
        assert job.request_id not in (a.request_id, b.request_id)
        freed(ex, 7)
        # every step of a stream carries the stream's id; the job its own
        assert set(seen.accepted) == {"chat-1", b.request_id, job.request_id}
        assert sorted(seen.accepted) == sorted(seen.ended)
        assert seen.accepted.count("chat-1") == 4        # the prefill and 3 decodes
        # a step prepared ahead and not needed (0 or more: timing) is the stream's too
        assert {o for _, o in seen.unannounced} <= {"discarded"}, seen.unannounced
        assert {r for r, _ in seen.unannounced} <= {"chat-1", b.request_id}
        assert sorted(seen.streams) == sorted(["chat-1", b.request_id])
        assert ex.requests() == []


def test_a_live_id_cannot_be_taken_twice_and_is_free_after_the_end(mode):
    driver, ex = gated(mode)
    with ex:
        held = hold_on_device(ex, driver, Request.prefill(1, PROMPT, request_id="x"))
        with pytest.raises(InvalidArgument, match="already live"):
            ex.generate(PROMPT, request_id="x")
        with pytest.raises(InvalidArgument, match="already live"):
            ex.enqueue_nowait(Request.prefill(2, PROMPT, request_id="x"))
        driver.gate.set()
        finish(ex, held)
        stream = ex.generate(PROMPT, SamplingParams(max_tokens=2), request_id="x")
        drive(ex, stream.done)
        assert stream.result().finish_reason is FinishReason.LENGTH
        freed(ex, 1)


@pytest.mark.parametrize("bad", ["", "a b", "x" * 129, "caf\u00e9", "tab\t", 7])
def test_a_bad_request_id_is_refused(bad):
    with make_executor("step") as ex:
        with pytest.raises(InvalidArgument, match="request_id"):
            ex.generate(PROMPT, request_id=bad)
        with pytest.raises(InvalidArgument, match="request_id"):
            Request.prefill(1, PROMPT, request_id=bad)
        assert ex.requests() == [] and ex.stats().accepted == 0


def test_errors_and_log_lines_carry_the_id(mode, caplog):
    with make_executor(mode) as ex, caplog.at_level(logging.DEBUG, logger="calfsm"):
        stream = ex.generate(PROMPT, SamplingParams(max_tokens=8_000), request_id="late",
                             deadline_s=0.01)
        drive(ex, stream.done)
        result = stream.result()
        assert result.finish_reason is FinishReason.DEADLINE
        assert isinstance(result.error, DeadlineExceeded)
        assert result.error.request_id == "late" and "req=late" in str(result.error)
    busy = FaultPlan.of(FaultRule("infer", "code", seq_id=3))     # DEVICE_BUSY, once
    with make_executor(mode, faults=busy) as ex, \
            caplog.at_level(logging.DEBUG, logger="calfsm"):
        job = ex.enqueue_nowait(Request.prefill(3, PROMPT, request_id="busy"))
        drive(ex, job.done)
        err = job.exception()
        assert err is not None and (err.request_id, err.calrt_code) == ("busy", 17)
        assert any(getattr(r, "request_id", None) == "busy" and r.calrt_code == 17
                   for r in caplog.records)


# ---- abort, in each state ------------------------------------------------------------

def test_abort_a_job_waiting_for_admission_runs_nothing(mode):
    driver, ex = gated(mode, slots_per_engine=1)
    with ex:
        held = hold_on_device(ex, driver, Request.prefill(1, PROMPT))
        waiting = ex.enqueue_nowait(Request.prefill(2, PROMPT, request_id="parked"))
        [info] = [r for r in ex.requests() if r.request_id == "parked"]
        assert info.kind == "job" and info.state in BEFORE_SUBMIT   # no slot: waits
        infers = len(calls(driver, "infer"))
        assert ex.abort("parked")
        driver.gate.set()
        assert isinstance(finish(ex, waiting), Cancelled)
        finish(ex, held)
        assert len(calls(driver, "infer")) == infers           # it never ran (FI11)
        assert not ex.abort("parked")                          # ended: nothing to abort
        freed(ex, 1, 2)


def test_abort_a_job_on_the_device_drops_its_result(mode):
    driver, ex = gated(mode)
    with ex:
        held = hold_on_device(ex, driver, Request.prefill(1, PROMPT, request_id="busy"))
        [info] = ex.requests()
        assert (info.request_id, info.state) == ("busy", JobState.SUBMITTED)
        waits = len(calls(driver, "wait"))
        assert ex.abort("busy")
        assert not held.done()                # the device owns it: still waited for (FI12)
        driver.gate.set()
        assert isinstance(finish(ex, held), Cancelled)
        assert len(calls(driver, "wait")) == waits + 1
        freed(ex, 1)


def test_abort_a_stream_with_a_step_staged_and_one_on_the_device(mode):
    driver, ex = gated(mode)
    with ex:
        stream = ex.generate(PROMPT, SamplingParams(max_tokens=50), request_id="s")
        drive(ex, lambda: ex.requests()[0].tokens >= 3)
        driver.gate.clear()
        drive(ex, lambda: ex.requests()[0].state.endswith(JobState.SUBMITTED)
              if ex.requests() else False)
        [info] = ex.requests()
        assert info.kind == "stream" and info.tokens >= 3 and info.age_s >= 0
        assert ex.abort("s")
        driver.gate.set()
        drive(ex, stream.done)
        assert stream.result().finish_reason is FinishReason.CANCELLED
        assert ex.requests() == []
        assert_freed(ex)


def test_abort_of_an_unknown_id_is_false():
    with make_executor("step") as ex:
        assert not ex.abort("nobody")


# ---- n > 1 ---------------------------------------------------------------------------

def single(seed: int) -> list[int]:
    with make_executor("step") as ex:
        s = ex.generate(PROMPT, SamplingParams(temperature=1.0, seed=seed, max_tokens=12))
        drive(ex, s.done)
        return list(s.result().tokens)


def test_n_streams_are_seeded_runs_of_seed_plus_i(mode):
    params = SamplingParams(temperature=1.0, seed=40, max_tokens=12)
    with make_executor(mode) as ex:
        streams = ex.generate(PROMPT, params, n=4, request_id="many")
        assert [s.request_id for s in streams] == [f"many-{i}" for i in range(4)]
        assert {r.parent for r in ex.requests()} == {"many"}
        drive(ex, lambda: all(s.done() for s in streams))
        got = [list(s.result().tokens) for s in streams]
        assert_freed(ex)
    assert got == [single(40 + i) for i in range(4)]
    assert len({tuple(g) for g in got}) == 4


def test_n_greedy_streams_agree_and_abort_of_the_parent_aborts_all(mode):
    with make_executor(mode) as ex:
        streams = ex.generate(PROMPT, SamplingParams(max_tokens=8_000), n=3,
                              request_id="p")
        assert ex.abort("p")
        drive(ex, lambda: all(s.done() for s in streams))
        assert {s.result().finish_reason for s in streams} == {FinishReason.CANCELLED}
        assert_freed(ex)
        many = ex.generate(PROMPT, SamplingParams(max_tokens=5), n=2)
        drive(ex, lambda: all(s.done() for s in many))
        a, b = (list(s.result().tokens) for s in many)
        with SimDriver(TINY) as d:
            assert a == b == DirectRunner(d, TINY).generate(0, PROMPT, 5)


@pytest.mark.parametrize("n", [0, -1, True, 1.5])
def test_a_bad_n_is_refused(n):
    with make_executor("step") as ex:
        with pytest.raises(InvalidArgument, match="n must be"):
            ex.generate(PROMPT, n=n)
        assert ex.requests() == []


def test_a_parent_id_too_long_for_its_choices_suffix_is_refused_as_such():
    """The children's ids are the parent's with '-i': a parent that fits alone but not
    with the suffix is refused naming the parent, before anything starts."""
    with make_executor("step") as ex:
        with pytest.raises(InvalidArgument, match="no room for the '-3'"):
            ex.generate(PROMPT, n=4, request_id="p" * 127)
        assert ex.requests() == []
        streams = ex.generate(PROMPT, SamplingParams(max_tokens=2), n=4,
                              request_id="p" * 126)
        assert [s.request_id for s in streams][-1] == "p" * 126 + "-3"
        drive(ex, lambda: all(s.done() for s in streams))
        assert {s.result().finish_reason for s in streams} == {FinishReason.LENGTH}


def test_n_over_the_sequences_cancels_those_started():
    with make_executor("step", max_sequences=2) as ex:
        with pytest.raises(Exception, match="sequence"):
            ex.generate(PROMPT, SamplingParams(max_tokens=4), n=3)
        drive(ex, lambda: ex.requests() == [] and ex.idle())
        assert_freed(ex)


# ---- asyncio -------------------------------------------------------------------------

def test_abort_by_id_from_asyncio():
    with make_executor("threaded") as ex:
        async def main() -> FinishReason:
            stream = ex.generate(PROMPT, SamplingParams(max_tokens=8_000),
                                 request_id="async")
            got = 0
            async for _ in stream:
                got += 1
                if got == 3:
                    assert ex.abort("async")
            return (await stream.final()).finish_reason
        assert asyncio.run(main()) is FinishReason.CANCELLED
        assert_freed(ex)
