"""Request priority (issue 23, item 6): parked jobs are admitted by effective priority —
the request's ``priority`` plus one per ``ExecutorConfig.priority_aging_s`` seconds of
waiting — higher first, first come first served among equals, so a job waits behind
later work only if that work's priority is higher by ``d`` and it came within ``d *
priority_aging_s`` (docs/architecture.md, Admission; calfsm/engine/parked.py).

Step mode with zero device latency and one buffer slot per kind (``Desk``): a job holds
the prefill slot until the test serves it, so the others park, and time moves only when
the test advances the virtual clock. The order jobs end in is the order they were
admitted (one slot, one job in flight, a FIFO submit queue); an observer records it.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from fractions import Fraction
from typing import Any

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from calfsm.drivers.sim import LatencyModel
from calfsm.engine.job import JobContext, JobHandle, JobTimings
from calfsm.engine.observe import JobEnded, Observer
from calfsm.engine.parked import ParkedQueue
from calfsm.errors import InvalidArgument
from calfsm.executor import DeviceExecutor, ExecutorConfig
from calfsm.generate.sampling import SamplingParams
from calfsm.generate.streams import FinishReason, Stream
from calfsm.machines.job import JobState
from calfsm.manifest import TaskKind
from calfsm.request import PRIORITY_MAX, PRIORITY_MIN, Request
from calfsm.runtime.stepper import StepScheduler
from tests.helpers.executor import (
    TINY,
    GatedDriver,
    eventually,
    hold_on_device,
    make_executor,
    make_sim,
)
from tests.helpers.serve import MODEL, serve

pytestmark = pytest.mark.timeout(120)

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


class Ends(Observer):
    """Every job's end, in order (:meth:`seqs`: those that ran, i.e. were admitted)."""

    def __init__(self) -> None:
        self.events: list[JobEnded] = []

    def job_ended(self, event: JobEnded) -> None:
        self.events.append(event)

    def seqs(self) -> list[int]:
        return [e.seq_id for e in self.events if e.outcome == "succeeded"]


class Desk:
    """A step-mode executor where prefills wait for the one prefill slot: the job that
    holds it runs when the test calls :meth:`serve`; time moves by :meth:`wait`."""

    def __init__(self, aging_s: float = 1.0, **config: Any) -> None:
        self.ex = make_executor("step", driver=make_sim("step", latency=LatencyModel.zero()),
                                slots_per_engine=1, priority_aging_s=aging_s,
                                admission_timeout_s=1e6, queue_timeout_s=1e6,
                                default_deadline_s=1e6,
                                token_budget=1 << 16, **config)
        self.ends = Ends()
        self.ex.observers.add(self.ends)
        self._seqs = itertools.count()

    def arrive(self, priority: int = 0) -> JobHandle:
        """A one-token prefill of a sequence of its own (its seq id is its number)."""
        return self.ex.enqueue_nowait(Request.prefill(next(self._seqs), [1],
                                                      priority=priority))

    def wait(self, seconds: float) -> None:
        self.ex.clock.advance(seconds)

    def serve(self) -> bool:
        """The job holding the slot runs to its end; the slot goes to the parked job
        that is first, and the one after it is tried. False: no job held the slot."""
        steps = self.ex.steps
        if not steps.can_submit():
            return False
        assert steps.submit() and steps.complete()
        while steps.admit():
            pass
        return True

    def serve_all(self) -> None:
        while self.serve():
            pass
        assert self.ex.stats().admitting == 0

    def close(self) -> None:
        self.ex.close()


@pytest.fixture
def desk():
    d = Desk()
    yield d
    d.close()


# ---- validation ---------------------------------------------------------------------------

@pytest.mark.parametrize("value", [1.5, True, "1", None, [1], PRIORITY_MAX + 1,
                                   PRIORITY_MIN - 1, 2**70])
def test_a_bad_priority_is_refused_naming_the_field(value):
    with pytest.raises(InvalidArgument, match="priority") as e:
        Request.prefill(0, [1], priority=value)
    assert e.value.stage == "request"


def test_priority_is_kept_as_a_python_int_and_follows_a_decode():
    assert Request.prefill(0, [1]).priority == 0
    r = Request.prefill(0, [1], priority=np.int16(-7))
    assert r.priority == -7 and type(r.priority) is int
    assert Request.prefill(0, [1], priority=PRIORITY_MAX).priority == PRIORITY_MAX
    assert Request.decode(0, 1, 3, priority=PRIORITY_MIN).priority == PRIORITY_MIN
    assert Request.decode(0, 1, 3, priority=9).with_token(5).priority == 9


@pytest.mark.parametrize("value", [0, -1.0, math.inf, math.nan, True, "1"])
def test_the_aging_step_must_be_a_finite_positive_number(value):
    with pytest.raises(InvalidArgument, match="priority_aging_s"):
        ExecutorConfig(priority_aging_s=value)


def test_generate_refuses_a_bad_priority_and_gives_the_sequence_back():
    desk = Desk(max_sequences=1)
    ex = desk.ex
    try:
        with pytest.raises(InvalidArgument, match="priority"):
            ex.generate([1, 2], GREEDY, priority=PRIORITY_MAX + 1)
        with ex.open_sequence() as seq, pytest.raises(InvalidArgument, match="priority"):
            Stream(seq, [1, 2], GREEDY, priority=0.5)
        assert ex.stats().accepted == 0
        stream = ex.generate([1, 2], GREEDY, priority=-3)   # the one sequence is back
        StepScheduler(ex).run_until(stream.done)
        assert stream.result().finish_reason is FinishReason.LENGTH
    finally:
        desk.close()


# ---- the order -----------------------------------------------------------------------------

def test_higher_priority_is_admitted_first_and_equals_first_come_first_served(desk):
    """Sequence 0 takes the slot; sequence 1 is tried and keeps its KV (its admission
    has begun: it is next whatever comes); the rest park and go by priority, equal
    priorities in the order they came."""
    for p in (0, -5, 0, 3, -1, 3, 0, 7):
        desk.arrive(p)
    desk.serve_all()
    assert desk.ends.seqs() == [0, 1, 7, 3, 5, 2, 6, 4]


def test_a_job_whose_admission_began_is_not_passed(desk):
    """A job tried at the head and granted its KV keeps it and stays first: a later job
    of any priority must not wait for the KV it holds."""
    desk.arrive(0)                          # holds the slot
    begun = desk.arrive(-100)               # tried: KV granted, no slot
    assert begun.state == JobState.ADMITTED.value
    desk.arrive(PRIORITY_MAX)
    desk.serve_all()
    assert desk.ends.seqs() == [0, 1, 2]


def test_a_low_priority_job_behind_a_flood_of_higher_ones_waits_at_most_the_bound(desk):
    """One job of priority 3 arrives every second, one job is served every second; a
    job of priority 0 accepted at t passes every one accepted at or after t + 3 s (3
    levels x 1 s aging) and is passed by exactly those accepted before."""
    desk.arrive(0)                          # holds the slot
    desk.arrive(0)                          # begun
    low = desk.arrive(0)
    t0 = low.context.timings.accepted
    for _ in range(10):
        desk.wait(0.5)
        desk.arrive(3)
        desk.wait(0.5)
        desk.serve()
    desk.serve_all()
    ends = desk.ends.events
    before_low = [e for e in ends[:[e.job_id for e in ends].index(low.job_id)]
                  if e.request.priority == 3]
    after_low = [e for e in ends if e.request.priority == 3 and e not in before_low]
    assert [e.timings.accepted - t0 for e in before_low] == [0.5, 1.5, 2.5]
    assert all(e.timings.accepted - t0 >= 3 for e in after_low) and len(after_low) == 7
    # admitted once the two ahead of it and the three that came within 3 s were served
    # (the last of them was begun when the slot went to the one before)
    assert low.context.timings.admitted - t0 == 5


def test_held_jobs_keep_their_place_through_a_recovery(desk):
    """A drain gives back what parked jobs took and parks them again: the order is still
    the rule's."""
    for p in (0, 0, 1, 5, 1):
        desk.arrive(p)
    desk.ex.recover("test")
    StepScheduler(desk.ex).run_until(lambda: desk.ex.health().ready)
    StepScheduler(desk.ex).run_until_idle()
    assert desk.ends.seqs() == [3, 2, 4, 0, 1], desk.ends.events


# ---- the rule as an oracle -------------------------------------------------------------------

class Oracle:
    """The documented rule, written directly: the slot holder, the job whose admission
    began, and the jobs waiting with (id, priority, accepted)."""

    def __init__(self, aging_s: float) -> None:
        self.aging = Fraction(aging_s)
        self.holder: int | None = None
        self.begun: int | None = None
        self.waiting: dict[int, tuple[int, Fraction]] = {}
        self.admitted: list[int] = []

    def effective(self, job: int, now: Fraction) -> Fraction:
        priority, accepted = self.waiting[job]
        return priority + (now - accepted) / self.aging

    def first(self, now: Fraction) -> int:
        """The highest effective priority; among equals the first accepted, then the
        lower id."""
        return max(self.waiting, key=lambda j: (self.effective(j, now),
                                                -self.waiting[j][1], -j))

    def arrive(self, job: int, priority: int, now: Fraction) -> None:
        if self.begun is None and not self.waiting:
            if self.holder is None:
                self.holder = job
                self.admitted.append(job)
            else:
                self.begun = job            # tried: KV granted, no slot
        else:
            self.waiting[job] = (priority, now)

    def cancel(self, job: int) -> None:
        if self.begun == job:
            self.begun = None
        else:
            del self.waiting[job]

    def serve(self, now: Fraction) -> None:
        self.holder = None
        while True:
            if self.begun is not None:
                pick, self.begun = self.begun, None
            elif self.waiting:
                pick = self.first(now)
                del self.waiting[pick]
            else:
                return
            if self.holder is None:
                self.holder = pick
                self.admitted.append(pick)
            else:
                self.begun = pick
                return


OPS = st.lists(st.one_of(
    st.tuples(st.just("arrive"), st.integers(-4, 4) | st.sampled_from(
        [PRIORITY_MIN, PRIORITY_MAX])),
    st.tuples(st.just("wait"), st.integers(0, 3)),
    st.tuples(st.just("serve"), st.just(0)),
    st.tuples(st.just("cancel"), st.integers(0, 1000))), max_size=60)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(ops=OPS, aging_s=st.sampled_from([0.25, 0.5, 1.0, 2.0, 8.0]))
def test_the_admission_order_follows_the_rule_at_every_step(ops, aging_s):
    """Random arrivals (priorities, times), services and cancels: the job admitted at
    each step is the oracle's (arrival times are whole seconds and the aging steps
    powers of two, so the executor's float ranks are exact)."""
    desk = Desk(aging_s)
    oracle = Oracle(aging_s)
    handles: dict[int, JobHandle] = {}
    try:
        for op, value in ops:
            now = Fraction(desk.ex.clock.now())
            if op == "arrive":
                h = desk.arrive(value)
                handles[h.context.seq_id] = h
                oracle.arrive(h.context.seq_id, value, now)
            elif op == "wait":
                desk.wait(value)
            elif op == "serve":
                if desk.serve():
                    oracle.serve(now)
            else:
                parked = sorted(oracle.waiting) + (
                    [oracle.begun] if oracle.begun is not None else [])
                if parked:
                    job = parked[value % len(parked)]
                    assert handles[job].cancel()
                    oracle.cancel(job)
            ran = desk.ends.seqs()
            assert ran == oracle.admitted[:len(ran)]
        while oracle.holder is not None:
            now = Fraction(desk.ex.clock.now())
            assert desk.serve()
            oracle.serve(now)
        assert desk.ends.seqs() == oracle.admitted
    finally:
        desk.close()


def _job(job_id: int, priority: int, accepted: float) -> JobContext:
    job = JobContext(job_id=job_id, request=Request.prefill(0, [1], priority=priority),
                     generation=1, seq_id=0, kind=TaskKind.PREFILL_IDS, past_len=0,
                     token_count=1, deadline=math.inf)
    job.timings = JobTimings(accepted=accepted)
    return job


@settings(max_examples=100, deadline=None)
@given(ops=st.lists(st.one_of(
    st.tuples(st.just("push"), st.integers(-3, 3), st.integers(0, 5)),
    st.tuples(st.just("pop"), st.just(0), st.just(0)),
    st.tuples(st.just("remove"), st.integers(0, 500), st.just(0))), max_size=200))
def test_the_parked_queue_pops_by_rank_and_removes_anywhere(ops):
    """The queue alone, with many removals (its dropped entries are compacted): what it
    pops is the highest effective priority at any time, first accepted among equals."""
    q = ParkedQueue(0.5)
    live: dict[int, JobContext] = {}
    ids = itertools.count()
    clock = 0
    for op, a, b in ops:
        if op == "push":
            clock += b
            job = _job(next(ids), a, float(clock))
            q.push(job)
            live[job.job_id] = job
        elif op == "pop" and live:
            want = max(live.values(), key=lambda j: (
                j.request.priority + Fraction(clock - int(j.timings.accepted)) * 2,
                -j.timings.accepted, -j.job_id))
            assert q.pop() is want
            del live[want.job_id]
        elif op == "remove" and live:
            job = sorted(live.values(), key=lambda j: j.job_id)[a % len(live)]
            assert q.remove(job) and not q.remove(job) and job not in q
            del live[job.job_id]
        assert len(q) == len(live) and {j.job_id for j in q} == set(live)
    assert [j.job_id for j in q.take_all()] == [j.job_id for j in sorted(
        live.values(), key=lambda j: (j.timings.accepted - j.request.priority * 0.5,
                                      j.job_id))]
    assert not q and len(q) == 0


def test_the_parked_queue_puts_begun_jobs_first_and_refuses_a_second_push():
    q = ParkedQueue(1.0)
    a, b, c = _job(1, 5, 0.0), _job(2, -5, 1.0), _job(3, -9, 2.0)
    q.push(a)
    q.push(b, begun=True)
    q.push(c, begun=True)
    with pytest.raises(ValueError):
        q.push(b)
    assert q.remove(c) and not q.remove(c) and b in q
    assert [q.pop(), q.pop()] == [b, a]
    with pytest.raises(IndexError):
        q.pop()


# ---- streams --------------------------------------------------------------------------------

def _passes(ends: list[JobEnded], aging_s: float) -> list[tuple[JobEnded, JobEnded]]:
    """Pairs (k, j) where k was admitted before j though the rule puts j first: k came
    more than (k's priority - j's) x aging_s after j began to wait (its acceptance, or
    its release for a step prepared ahead), and k's priority is not that much higher."""
    out = []
    for i, j in enumerate(ends):
        start = max(j.timings.accepted, j.timings.released)
        for k in ends[:i]:
            gap = max(0, k.request.priority - j.request.priority)
            if k.timings.accepted > start + gap * aging_s:
                out.append((k, j))
    return out


def test_every_step_of_a_stream_carries_its_priority(desk):
    ex = desk.ex
    streams = [ex.generate([1, 2, 3], GREEDY, priority=p) for p in (4, -2)]
    StepScheduler(ex).run_until(lambda: all(s.done() for s in streams))
    for s in streams:
        assert s.result().finish_reason is FinishReason.LENGTH and s.priority in (4, -2)
    by_seq = {s.sequence.seq_id: s.priority for s in streams}
    assert len(desk.ends.events) >= 2 * 4
    for e in desk.ends.events:
        assert e.request.priority == by_seq[e.seq_id], e


@pytest.mark.parametrize("flood_priority", [0, 2])
def test_a_running_stream_is_not_starved_by_new_work(flood_priority):
    """A stream of priority 0 runs while streams of ``flood_priority`` keep coming, three
    at a time, competing for the one decode slot: under strict priority it would never
    get a step. With aging it ends, and no job, its steps included, was passed but by
    the rule."""
    aging_s = 0.25
    latency = LatencyModel(decode_s=0.02, prefill_per_token_s=0.001)
    ex = make_executor("step", driver=make_sim("step", latency=latency),
                       slots_per_engine=1, priority_aging_s=aging_s)
    ends = Ends()
    ex.observers.add(ends)
    try:
        slow = ex.generate([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=12),
                           priority=0)
        flood: list[Stream] = []
        sched = StepScheduler(ex, seed=3)
        for _ in range(100_000):
            if slow.done():
                break
            flood = [s for s in flood if not s.done()]
            while len(flood) < 3:
                flood.append(ex.generate([9, 8], GREEDY, priority=flood_priority))
            assert sched.step() is not None
        else:
            raise AssertionError("the stream of priority 0 never ended")
        assert slow.result().finish_reason is FinishReason.LENGTH
        assert len(slow.result().tokens) == 12
        for s in flood:
            s.cancel()
        sched.run_until_idle()
        done = [e for e in ends.events if e.outcome == "succeeded"]
        flood_steps = [e for e in done if e.seq_id != slow.sequence.seq_id]
        assert len(flood_steps) > 12         # it did compete
        assert _passes(done, aging_s) == []
    finally:
        ex.close()


# ---- threaded, through await ------------------------------------------------------------------

def test_threaded_streams_through_await_start_in_priority_order():
    """Threaded mode: the one prefill slot is held on the device while four streams
    start (each parked before the next); once it is let go their prefills run
    highest priority first, and each stream is read with ``async for``."""
    gated = GatedDriver(make_sim("threaded"))
    # aging slow enough that the real seconds between the streams' starts do not count
    with make_executor("threaded", driver=gated, slots_per_engine=1,
                       admission_timeout_s=60, priority_aging_s=600) as ex:
        ends = Ends()
        ex.observers.add(ends)
        held_seq = ex.open_sequence()
        held = hold_on_device(ex, gated, Request.prefill(held_seq.seq_id, [1, 2]))
        streams = []
        try:
            for i, p in enumerate((0, -1, 2, 1), 1):
                streams.append(ex.generate([3, 4, i], GREEDY, priority=p))
                assert eventually(lambda i=i: ex.stats().admitting == i), ex.stats()
        finally:
            gated.gate.set()

        async def read(stream: Stream) -> list[int]:
            tokens = [event.token async for event in stream]
            assert (await stream.final()).finish_reason is FinishReason.LENGTH
            return tokens

        async def main() -> list[list[int]]:
            return await asyncio.gather(*(read(s) for s in streams))

        held.result(10)
        held_seq.close()
        got = asyncio.run(main())
        assert all(len(t) == 4 for t in got)
        seq = {s.sequence.seq_id: s.priority for s in streams}
        prefills = [seq.get(e.seq_id) for e in ends.events
                    if e.kind is TaskKind.PREFILL_IDS and e.seq_id in seq]
        # the first stream's prefill was tried while the slot was held (it is begun);
        # the others follow by priority
        assert prefills == [0, 2, 1, -1], prefills


# ---- the server ----------------------------------------------------------------------------

class Priorities(Observer):
    def __init__(self) -> None:
        self.seen: list[int] = []

    def job_ended(self, event: JobEnded) -> None:
        self.seen.append(event.request.priority)


@pytest.fixture(scope="module")
def server():
    ex = DeviceExecutor(make_sim("threaded"), TINY, ExecutorConfig(max_sequences=16))
    srv = serve(ex)
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as client:
            yield ex, client
    finally:
        srv.stop()
        ex.close()


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": [1, 2, 3]}),
    ("/v1/completions", {"prompt": "hi", "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
])
def test_the_server_runs_every_step_at_the_priority_sent(server, path, body):
    ex, client = server
    seen = Priorities()
    ex.observers.add(seen)
    try:
        r = client.post(path, json={"model": MODEL, "max_tokens": 3, "temperature": 0,
                                    "priority": -12, **body})
        assert r.status_code == 200, r.text
    finally:
        ex.observers.remove(seen)
    assert len(seen.seen) >= 3 and set(seen.seen) == {-12}


@pytest.mark.parametrize("value", ["high", 1.5, True, [1], PRIORITY_MAX + 1,
                                   PRIORITY_MIN - 1])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_the_server_refuses_a_bad_priority_with_400(server, path, value):
    _, client = server
    body = {"model": MODEL, "priority": value}
    body |= {"prompt": "x"} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": "x"}]}
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "priority" and "priority" in err["message"]
