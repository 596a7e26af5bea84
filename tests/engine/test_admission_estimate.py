"""Admission that keeps deadlines (issue 20, item 2): a stream that cannot end in time,
or that would make a running one late, is refused at once with a 429 and a Retry-After
from the measured service rate; an admitted stream ends in time; a running stream's
next step is never refused.

Step mode on the virtual clock (10 ms a decode, 0.2 ms a prefilled token on TINY), so
the figures are exact and the runs replay.
"""

from __future__ import annotations

import pytest

from calfsm.engine.observe import Observer
from calfsm.engine.stepcost import ServiceModel, WarmupTiming
from calfsm.errors import ResourceExhausted
from calfsm.generate.livestreams import finish_times
from calfsm.generate.sampling import SamplingParams
from calfsm.generate.streams import FinishReason
from calfsm.manifest import TaskKind
from tests.helpers.executor import TINY, drive, make_executor

pytestmark = pytest.mark.timeout(120)

PROMPT = [1, 2, 3, 4]


def test_processor_sharing_finish_times():
    # three streams sharing a device: 1 s, 2 s and 3 s of work
    assert finish_times([3.0, 1.0, 2.0]) == [6.0, 3.0, 5.0]
    assert finish_times([]) == []
    assert finish_times([2.0, 2.0]) == [4.0, 4.0]


def test_64_streams_of_100_tokens_either_finish_in_time_or_are_refused_at_once():
    """64 clients ask for 100 tokens each within 60 s of a device that runs one 10 ms
    step at a time (64 s of work in all): the executor admits what it can finish in
    time and refuses the rest at once; nothing admitted ends with a deadline."""
    params = SamplingParams(max_tokens=100)
    rejected = []

    class Rejections(Observer):
        def request_rejected(self, error, reason):
            rejected.append(reason)

    with make_executor("step") as ex:
        ex.add_observer(Rejections())
        streams, refused = [], []
        for _ in range(64):
            try:
                streams.append(ex.generate(PROMPT, params, deadline_s=60.0))
            except ResourceExhausted as e:
                refused.append(e)
        drive(ex, lambda: all(s.done() for s in streams), timeout=60)
        results = [s.result(0) for s in streams]
        assert refused and streams, (len(refused), len(streams))
        assert all(r.finish_reason is FinishReason.LENGTH for r in results), \
            {r.finish_reason for r in results}
        assert all(e.http_status == 429 and e.retry_after_s > 0 for e in refused)
        assert rejected == ["capacity"] * len(refused)
        # the device is well used: at least 80% of what fits in 60 s was admitted
        assert len(streams) >= 0.8 * 60 / 1.0 / 1.2, len(streams)


def test_a_new_stream_that_would_make_a_running_one_late_is_refused():
    """A running stream with a tight deadline: a new stream with no deadline at all is
    refused while the running one needs the device, and admitted once it ended."""
    with make_executor("step") as ex:
        tight = ex.generate(PROMPT, SamplingParams(max_tokens=50), deadline_s=0.8)
        with pytest.raises(ResourceExhausted) as info:
            ex.generate(PROMPT, SamplingParams(max_tokens=50))
        assert "running stream" in info.value.message
        assert info.value.retry_after_s == pytest.approx(1.2 * 0.5, rel=0.2)
        drive(ex, tight.done)
        assert tight.result(0).finish_reason is FinishReason.LENGTH
        late = ex.generate(PROMPT, SamplingParams(max_tokens=50))
        drive(ex, late.done)
        assert late.result(0).finish_reason is FinishReason.LENGTH


def test_a_deadline_too_short_even_alone_is_not_refused():
    """Waiting would not help a stream whose deadline is shorter than its own work on an
    idle device: it runs and ends ``deadline`` with what it got."""
    with make_executor("step") as ex:
        s = ex.generate(PROMPT, SamplingParams(max_tokens=100), deadline_s=0.1)
        drive(ex, s.done)
        r = s.result(0)
        assert r.finish_reason is FinishReason.DEADLINE and 1 <= len(r.tokens) < 100


def test_the_estimate_can_be_turned_off():
    with make_executor("step", admission_estimate=False) as ex:
        tight = ex.generate(PROMPT, SamplingParams(max_tokens=50), deadline_s=0.8)
        other = ex.generate(PROMPT, SamplingParams(max_tokens=50))
        drive(ex, lambda: tight.done() and other.done())
        assert tight.result(0).finish_reason is FinishReason.DEADLINE


def test_a_running_streams_steps_are_never_refused_by_max_waiting(mode):
    """max_waiting=1: a stream's first step is the one job waiting; its later steps
    (one queued and one prepared ahead at a time) are its own going on, never a 429,
    while a second new stream is refused while the first one's step waits."""
    with make_executor(mode, max_waiting=1) as ex:
        s = ex.generate(PROMPT, SamplingParams(max_tokens=40))
        drive(ex, s.done)
        r = s.result(0)
        assert r.finish_reason is FinishReason.LENGTH and len(r.tokens) == 40, r.error


def test_a_running_streams_step_has_no_admission_budget_of_its_own():
    """Six streams share the device, so each step waits about 50 ms for its turn, past
    30 ms admission and queue budgets: those bound new work only, and a running
    stream's steps wait as long as the stream's own deadline allows."""
    with make_executor("step", admission_timeout_s=0.03, queue_timeout_s=0.03,
                       admission_estimate=False) as ex:
        streams = [ex.generate(PROMPT, SamplingParams(max_tokens=20)) for _ in range(6)]
        drive(ex, lambda: all(s.done() for s in streams))
        assert [s.result(0).finish_reason for s in streams] == [FinishReason.LENGTH] * 6


def test_a_late_short_prefill_does_not_price_a_long_prompt_as_minutes():
    """Under load the 3-token warm-up prefill came 60 ms late, and one 2-token prefill
    took 30 ms from the queue (2 ms a decode): taken as 20 ms and 14 ms a token, a
    6000-token prompt was priced at minutes, and a server refused it (429) against its
    60 s deadline. A prefill teaches the cost per token only when its
    tokens are expected to cost at least a step (TINY: 0.2 ms a token, 10 ms a step, so
    50 tokens); a long one does."""
    svc = ServiceModel(TINY.timing, execution_timeout_s=None)
    svc.calibrate(WarmupTiming(3, 0.070, (0.002,)))   # a warm-up 60 ms late, 3 tokens
    assert svc.expected_s(TaskKind.PREFILL_IDS, 6000) == pytest.approx(0.010 + 6000 * 200e-6)
    svc.observe(TaskKind.DECODE, 1, queued=0.0, done=0.002)
    svc.observe(TaskKind.PREFILL_IDS, 2, queued=1.0, done=1.030)
    assert svc.service_s(TaskKind.PREFILL_IDS, 6000) == pytest.approx(0.002 + 6000 * 200e-6)
    svc.observe(TaskKind.PREFILL_IDS, 100, queued=2.0, done=2.052)    # 0.5 ms a token
    assert svc.service_s(TaskKind.PREFILL_IDS, 6000) == pytest.approx(0.002 + 6000 * 500e-6)
