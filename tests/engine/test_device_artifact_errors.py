"""A device that says it, or its calbin, is wrong is taken out of service at the first
job it fails (issue 34, item 5; spec section 8).

The case found: a device whose CSR writes come back NOT_FOUND, for names it declared
itself when the generation came up. Counted as a request error, each job failed alone
with a 500 while ``health().ready`` stayed True, until eight in a row drained the
generation. Here, through the library (both runtimes) and the server (a real uvicorn
on 127.0.0.1, every wait bounded):

- at most one job fails before readiness is false: the drain begins before its caller
  hears (the fault is counted, and logged, once);
- that job is classified by the spec's table (device: 503 UNAVAILABLE, never an
  ``internal`` 500), with a retry-after hint while recovery runs, so a stream resumes
  on the next generation;
- every later request is a 503, with Retry-After while recovery runs, without it once
  the executor ended Failed (the documented terminal state: a device that refuses the
  warm-up golden too is not brought back);
- every other code the table files under artifact, device, compatibility or unknown
  stops admission at the first job as well.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import httpx
import pytest

from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.engine.observe import JobEnded, Observer
from calfsm.errors import (
    CODE_TABLE,
    CalfsmError,
    CalrtCode,
    ErrorCategory,
    Internal,
    Unavailable,
    category_of,
)
from calfsm.executor import DeviceExecutor
from calfsm.generate.sampling import SamplingParams
from calfsm.generate.streams import FinishReason
from calfsm.request import Request
from calfsm.runtime.stepper import StepScheduler
from calfsm.serve import realtime_sim
from tests.helpers.executor import (
    TINY,
    GatedDriver,
    drive,
    make_executor,
    make_sim,
    reference_stream,
)
from tests.helpers.serve import MODEL, poll, serve, sse_events
from tests.helpers.streams import direct_runner

pytestmark = pytest.mark.timeout(60)

NOT_FOUND = int(CalrtCode.NOT_FOUND)
#: the issue's plan: from the 8th CSR write on (the warm-up golden makes the first
#: four), every one is refused NOT_FOUND
EVERY_CSR_FROM_8 = FaultRule("set_csr", "code", code=NOT_FOUND, nth=8, every=1)
PARAMS = SamplingParams(max_tokens=2)


class DeviceCodeEnds(Observer):
    """Every job that ended with a code the device returned, and whether its generation
    still served when its end was told (the observers hear before the caller does):
    "Ready" only if the lifecycle is Ready in that same generation (a threaded
    recovery may already have brought the next one up)."""

    def __init__(self, ex: DeviceExecutor) -> None:
        self.ex = ex
        self.ends: list[tuple[CalfsmError, str]] = []

    def job_ended(self, event: JobEnded) -> None:
        if event.error is not None and event.error.calrt_code is not None:
            state, generation = self.ex.lifecycle_state, self.ex.generation
            if generation != event.generation:
                state = f"{state} in generation {generation}"
            self.ends.append((event.error, state))


def _result(ex: DeviceExecutor, stream: Any) -> Any:
    drive(ex, stream.done)
    return stream.result(30)


def _is_the_device_fault(err: CalfsmError) -> None:
    assert not isinstance(err, Internal), err
    assert isinstance(err, Unavailable) and err.http_status == 503, err
    assert err.grpc_code == "UNAVAILABLE" and err.category is ErrorCategory.DEVICE, err
    assert err.calrt_code == NOT_FOUND and err.stage == "csr", err


def _out_of_service_at_once(ends: DeviceCodeEnds) -> None:
    """No job failed with the device's code while its generation still served; the one
    that met it first is a device error (503); any other (threaded: a step that was
    being prepared when the drain began) is a 503 as well, never a 500."""
    assert ends.ends, "no job met the fault"
    assert all(state != "Ready" for _, state in ends.ends), ends.ends
    met = _met(ends)
    assert met, ends.ends
    for err in met:
        _is_the_device_fault(err)
    assert all(e.http_status == 503 for e, _ in ends.ends), ends.ends


def _met(ends: DeviceCodeEnds) -> list[CalfsmError]:
    """The jobs that met the refusal themselves (not one the reset overtook while it
    was being prepared: "the device was reset while the job was prepared")."""
    return [e for e, _ in ends.ends if "declared by the configured device" in e.message
            and not e.message.startswith("the device was reset")]


def test_a_device_refusing_every_csr_write_is_out_of_service_at_its_first_failed_job(
        mode, caplog):
    caplog.set_level(logging.WARNING, logger="calfsm")
    with make_executor(mode, faults=FaultPlan.of(EVERY_CSR_FROM_8)) as ex:
        ends = DeviceCodeEnds(ex)
        ex.add_observer(ends)
        refused: list[Unavailable] = []
        results = []
        for _ in range(8):                      # on main: 8 failed jobs, Ready meanwhile
            try:
                stream = ex.generate([1, 2], PARAMS)
            except Unavailable as e:
                refused.append(e)
                drive(ex, lambda: ex.lifecycle_state in ("Failed", "Ready"))
                continue
            results.append(_result(ex, stream))
        # every job has told its end: threaded, the one that met the refusal may be the
        # decode staged ahead on the admission side, which no caller waits for (its
        # stream ended through its prefill, held for a generation that never came)
        drive(ex, ex.idle)
        # the first job to meet the device's refusal took the generation out of
        # service before its caller heard of it (on main: eight, all while Ready)
        _out_of_service_at_once(ends)
        drive(ex, lambda: ex.lifecycle_state == "Failed")
        # the streams: those before the fault completed; the one the fault hit waited
        # to resume and ended with the executor's 503, never a 500
        cut = [r for r in results if r.finish_reason is not FinishReason.LENGTH]
        assert len(cut) == 1 and cut[0] is results[-1], results
        assert cut[0].finish_reason is FinishReason.ERROR, cut
        assert cut[0].error.http_status == 503, cut
        # every later request is refused at once with a 503; once Failed (the warm-up
        # golden is refused too), without a retry-after hint: restart the process
        assert refused and all(e.http_status == 503 for e in refused), refused
        health = ex.health()
        assert not health.ready and health.state == "Failed"
        # counted and logged once, not per request: the fault drained one generation,
        # each job that met it is one failed job and one line, and the requests
        # refused after it add neither
        stats = ex.stats()
        assert set(stats.errors_by_category) == {"device"}, stats.errors_by_category
        lines = [r.getMessage() for r in caplog.records]
        assert sum(m.startswith("job failed: CSR '") for m in lines) == len(_met(ends)), \
            lines
        assert sum(m.startswith("draining generation") for m in lines) == 1, lines
        before = (len(caplog.records), ex.stats().failed)
        for _ in range(20):
            with pytest.raises(Unavailable) as info:
                ex.generate([1, 2], PARAMS)
            assert info.value.http_status == 503 and info.value.retry_after_s is None
        assert (len(caplog.records), ex.stats().failed) == before


def test_a_one_off_csr_refusal_drains_at_once_and_the_stream_resumes_on_the_next_generation(
        mode):
    prompt = [3, 1, 4]
    want = reference_stream(direct_runner(), prompt,
                            SamplingParams(max_tokens=4))
    plan = FaultPlan.of(FaultRule("set_csr", "code", code=NOT_FOUND, nth=8))
    with make_executor(mode, faults=plan) as ex:
        ends = DeviceCodeEnds(ex)
        ex.add_observer(ends)
        stream = ex.generate(prompt, SamplingParams(max_tokens=4))
        result = _result(ex, stream)
        drive(ex, ex.idle)                  # the staged step's end told (see above)
        _out_of_service_at_once(ends)
        met = _met(ends)
        assert len(met) == 1, ends.ends                 # the rule fires once
        assert met[0].retry_after_s is not None         # the caller may come back
        # the stream waited for the next generation and replayed: the fault-free tokens
        assert result.finish_reason is FinishReason.LENGTH, result
        assert list(result.tokens) == want
        assert ex.generation == 2 and ex.stats().recoveries == 1
        drive(ex, lambda: ex.lifecycle_state == "Ready")
        assert ex.health().ready
        again = _result(ex, ex.generate(prompt, SamplingParams(max_tokens=4)))
        assert list(again.tokens) == want



class _HoldLine(logging.Handler):
    """Holds the thread that logs a matching line until the test lets it go (bounded):
    a descheduled thread, on purpose."""

    def __init__(self, thread: str, prefix: str) -> None:
        super().__init__()
        self.thread, self.prefix = thread, prefix
        self.held, self.go = threading.Event(), threading.Event()

    def handle(self, record: logging.LogRecord) -> bool:
        # not emit(): that runs under the handler's lock, which other threads' lines
        # would wait for
        if threading.current_thread().name == self.thread \
                and record.getMessage().startswith(self.prefix) and not self.held.is_set():
            self.held.set()
            self.go.wait(10)
        return True


def test_a_step_staged_ahead_that_met_the_fault_keeps_the_executor_busy_until_its_end_is_told():
    """The flake this pins (threaded, a loaded machine): the decode staged ahead met the
    refusal on the admission thread and drained; the recovery failed and the stream
    ended (its prefill held for the next generation) while that thread had not yet told
    the staged step's end. ``idle()`` said True meanwhile, the deferred work that staged
    it being under way, so nothing a test or the soak waits for covered that end. Here
    the admission thread is held at that point on purpose."""
    gated = GatedDriver(make_sim("threaded", faults=FaultPlan.of(EVERY_CSR_FROM_8)))
    hold = _HoldLine("calfsm-admission", "job failed: CSR '")
    logging.getLogger("calfsm").addHandler(hold)
    try:
        with make_executor("threaded", driver=gated) as ex:
            ends = DeviceCodeEnds(ex)
            ex.add_observer(ends)
            gated.gate.clear()                  # the prefill stays on the device...
            stream = ex.generate([1, 2], PARAMS)
            assert hold.held.wait(10), "the staged step never met the refusal"
            gated.gate.set()                    # ...until its successor met the fault
            result = stream.result(10)
            assert result.finish_reason is FinishReason.ERROR, result
            assert result.error.http_status == 503, result
            assert ex.lifecycle_state == "Failed"
            # the staged step has not ended yet: the executor is not idle
            assert not ends.ends
            assert not ex.idle()
            hold.go.set()
            assert ex.wait_until(ex.idle, 10)
            _out_of_service_at_once(ends)
            assert len(_met(ends)) == 1, ends.ends
    finally:
        hold.go.set()
        logging.getLogger("calfsm").removeHandler(hold)


#: every code the spec's table files under artifact, device, compatibility or unknown,
#: an integer CalRT 0.7.6 does not define, and NOT_FOUND for a CSR the device declared
_OUT_OF_SERVICE = [*sorted(
    int(c) for c, (cat, _) in CODE_TABLE.items()
    if cat in (ErrorCategory.ARTIFACT, ErrorCategory.DEVICE, ErrorCategory.COMPATIBILITY,
               ErrorCategory.UNKNOWN)), 99, NOT_FOUND]


def test_every_code_saying_the_device_or_calbin_is_wrong_stops_admission_at_the_first_job():
    """One refused CSR write (the first job's first, after the warm-up's four): that job
    fails as the table says, and the executor is no longer Ready when it has."""
    for code in _OUT_OF_SERVICE:
        plan = FaultPlan.of(FaultRule("set_csr", "code", code=code, nth=5))
        with make_executor("step", faults=plan) as ex:
            ends = DeviceCodeEnds(ex)
            ex.add_observer(ends)
            h = ex.enqueue(Request.prefill(1, [1, 2, 3]))
            StepScheduler(ex).run_until(h.done)
            err = h.exception(0)
            assert err is not None and err.calrt_code == code, (code, err)
            want = ErrorCategory.DEVICE if code == NOT_FOUND else category_of(code)
            assert err.category is want, (code, err)
            if want is ErrorCategory.DEVICE:
                assert err.http_status == 503, (code, err)
            assert [s for _, s in ends.ends] != ["Ready"], (code, ends.ends)
            assert not ex.health().ready, code
            with pytest.raises(Unavailable):
                ex.enqueue_nowait(Request.prefill(2, [1, 2, 3]))


def _completion(c: httpx.Client, i: int, stream: bool) -> tuple[int, Any]:
    """(status, what came back): the JSON body, or for a 200 SSE answer its events."""
    body = {"model": MODEL, "prompt": [1 + i, 2], "temperature": 0, "max_tokens": 3,
            "stream": stream}
    with c.stream("POST", "/v1/completions", json=body) as r:
        if stream and r.status_code == 200:
            return 200, sse_events(r.iter_lines())
        r.read()
        return r.status_code, r.json()


def _last_event(events: list[Any]) -> dict[str, Any]:
    return [e for e in events if isinstance(e, dict)][-1]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_the_server_answers_a_csr_failing_device_with_503s_and_never_a_500(stream):
    ex = DeviceExecutor(realtime_sim(TINY, decode_ms=0, faults=FaultPlan.of(
        EVERY_CSR_FROM_8)), TINY)
    ends = DeviceCodeEnds(ex)
    ex.add_observer(ends)
    srv = serve(ex)
    answers: list[tuple[int, Any]] = []
    try:
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            assert c.get("/ready").status_code == 200
            for i in range(6):          # bounded: the first faulted request ends it
                status, answer = _completion(c, i, stream)
                answers.append((status, answer))
                if status != 200 or (stream and "error" in _last_event(answer)):
                    break
                assert ex.lifecycle_state == "Ready"
            # the generation is out of service from the first failed job on
            r = c.get("/ready")
            assert r.status_code == 503, r.text
            if ex.lifecycle_state != "Failed":
                assert int(r.headers["retry-after"]) >= 1
            poll(lambda: ex.lifecycle_state == "Failed", 20, "the executor never failed")
            for i in range(3):
                r = c.post("/v1/completions",
                           json={"model": MODEL, "prompt": [9, i], "max_tokens": 2})
                assert r.status_code == 503 and "retry-after" not in r.headers, r.text
                assert r.json()["error"]["code"] == "unavailable", r.text
            r = c.get("/ready")
            assert r.status_code == 503 and r.json()["state"] == "Failed", r.text
    finally:
        srv.stop()
        ex.close()
    _out_of_service_at_once(ends)
    assert all(s in (200, 503) for s, _ in answers), [s for s, _ in answers]
    status, last = answers[-1]
    # the request the fault hit: a 503 (or, for a stream already under way, its last
    # event), the device's answer, not a server error
    error = _last_event(last)["error"] if stream and status == 200 else last["error"]
    assert status in (200, 503) if stream else status == 503, answers
    assert error["code"] == "unavailable", error
    assert error["type"] == "service_unavailable_error", error


def test_a_refused_csr_write_is_classified_by_whether_the_device_declared_the_csr():
    """The one place the rule lives: NOT_FOUND for a CSR the device declared is a device
    error (503); for a name nothing declared it keeps the table's row (a manifest
    difference); any other code keeps its row wherever the CSR came from."""
    from calfsm.errors import csr_refused  # here: the other tests run on main too

    err = csr_refused(NOT_FOUND, "cur_seq", declared=True, job_id=4, seq_id=9)
    assert isinstance(err, Unavailable) and err.category is ErrorCategory.DEVICE
    assert (err.calrt_code, err.stage, err.job_id, err.seq_id) == (3, "csr", 4, 9)
    assert err.http_status == 503 and "cur_seq" in err.message
    undeclared = csr_refused(NOT_FOUND, "bogus", declared=False)
    assert undeclared.category is category_of(NOT_FOUND) and undeclared.stage == "csr"
    for code in (int(CalrtCode.INVALID_VALUE), int(CalrtCode.DEVICE_CRASHED), 99):
        for declared in (True, False):
            got = csr_refused(code, "cur_seq", declared=declared)
            assert got.category is category_of(code) and got.calrt_code == code
