"""Log hygiene (issue 20, item 6): a client's error is not a warning; a fault storm's
repeated warnings are rate-limited, each kind a burst per minute with a count of what was
left out, while every event is still counted (stats, metrics)."""

from __future__ import annotations

import logging

import pytest

from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.errors import CalrtCode, InvalidArgument
from calfsm.generate.sampling import SamplingParams
from calfsm.request import Request
from calfsm.util.lograte import RateLimitedLog
from tests.helpers.executor import drive, make_executor

pytestmark = pytest.mark.timeout(120)


def _calfsm_warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("calfsm")
            and r.levelno >= logging.WARNING]


def test_a_fault_storm_writes_a_bounded_number_of_lines(caplog):
    """Over a hundred recoveries after device faults (CCU exceptions, refused submits,
    NaN outputs) and hundreds of failed jobs, each quarantining a slot, losing KV and
    draining the generation, with streams resuming through them: at most 200 warning
    lines (each kind a burst of 10 a minute), while the counters see every failure."""
    plan = FaultPlan.of(
        FaultRule("infer", "ccu_exception", nth=5, every=31),
        FaultRule("infer", "code", nth=7, every=43, code=int(CalrtCode.DEVICE_UNAVAILABLE)),
        FaultRule("infer", "nan", nth=11, every=59))
    caplog.set_level(logging.DEBUG, logger="calfsm")
    with make_executor("step", faults=plan) as ex:
        for _ in range(10):
            streams = [ex.generate([i, 1, 2], SamplingParams(max_tokens=12), max_resumes=9)
                       for i in range(8)]
            drive(ex, lambda streams=streams: all(s.done() for s in streams)
                  and ex.lifecycle_state == "Ready")
        stats = ex.stats()
    failed = stats.failed + stats.quarantined
    lines = _calfsm_warnings(caplog)
    assert stats.recoveries >= 100 and failed >= 500, stats
    # one "job failed" warning per failed job alone was `failed` lines before
    assert len(lines) <= 200 and len(lines) < failed / 3, (len(lines), failed)


def test_a_clients_bad_request_is_not_a_warning(caplog):
    caplog.set_level(logging.DEBUG, logger="calfsm")
    with make_executor("step") as ex:
        h = ex.enqueue_nowait(Request.prefill(1, [5000]))       # beyond TINY's vocab
        drive(ex, h.done)
        assert isinstance(h.exception(0), InvalidArgument)
    assert not _calfsm_warnings(caplog)
    assert any(r.levelno == logging.DEBUG and "job failed" in r.getMessage()
               for r in caplog.records)


def test_the_limiter_lets_a_burst_through_and_counts_the_rest():
    now = [0.0]
    log = logging.getLogger("calfsm.test.lograte")
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Keep()
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        limited = RateLimitedLog(log, burst=3, period_s=10.0, clock=lambda: now[0])
        sent = [limited.warning("k", "event %d", i) for i in range(10)]
        assert sent == [True] * 3 + [False] * 7
        assert limited.suppressed("k") == 7
        assert limited.warning("other", "another kind") is True     # its own burst
        now[0] = 10.0
        assert limited.warning("k", "event again")
        assert seen[-1] == "event again [7 more like this were not logged in the last 10 s]"
    finally:
        log.removeHandler(handler)
