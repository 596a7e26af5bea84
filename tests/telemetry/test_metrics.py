"""The executor's Prometheus metrics (issue 15, part 2) and the observer API they use.

Every check scrapes ``generate_latest(m.registry)`` and parses it with the Prometheus
text parser, as a scraper would: the histograms count exactly the streams, gaps and
jobs the test sent (with sums equal to the jobs' own timings), the counters split by
finish reason, outcome, error category and rejection reason, and the gauges show a job
held on the device. Step mode (a seeded StepScheduler on the virtual clock) where the
numbers must be exact; one threaded test shows a stream is counted before its consumer
has its result. Faults come from fault plans.
"""

from __future__ import annotations

import logging
import threading

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.engine.observe import JobAccepted, JobEnded, Observer, Observers
from calfsm.engine.recovery import RecoveryPolicy
from calfsm.errors import (
    CalrtCode,
    ExecutorClosed,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from calfsm.generate.sampling import SamplingParams
from calfsm.generate.streams import FinishReason
from calfsm.machines.job import JobState
from calfsm.request import Request
from calfsm.runtime.stepper import StepScheduler
from calfsm.runtime.sync import THREADS
from calfsm.telemetry.metrics import REJECTIONS, ExecutorMetrics
from tests.helpers.executor import make_executor

pytestmark = pytest.mark.timeout(60)

PROMPT = [5, 6, 7, 8]


def scrape(m: ExecutorMetrics) -> dict[tuple[str, frozenset], float]:
    """Every sample of a scrape: (sample name, its labels) -> value."""
    text = generate_latest(m.registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name, frozenset(s.labels.items())] = s.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[name, frozenset(labels.items())]


def total_over(samples: dict, name: str) -> float:
    """A sample summed over all its label values."""
    return sum(v for (n, _), v in samples.items() if n == name)


def run(ex, predicate, seed: int = 0) -> None:
    StepScheduler(ex, seed).run_until(predicate)


@pytest.fixture
def step_ex():
    with make_executor("step") as ex:
        yield ex


@pytest.fixture
def metrics(step_ex):
    m = ExecutorMetrics(step_ex)
    yield m
    m.close()


# ---- histograms count what was sent ---------------------------------------------------

def test_stream_histograms_count_every_stream_and_every_gap(step_ex, metrics):
    lengths = (1, 4, 7)
    streams = [step_ex.generate(PROMPT, SamplingParams(max_tokens=n)) for n in lengths]
    run(step_ex, lambda: all(s.done() for s in streams) and step_ex.idle())
    results = [s.result(0) for s in streams]
    got = scrape(metrics)
    assert value(got, "calfsm_time_to_first_token_seconds_count") == 3
    assert value(got, "calfsm_time_per_output_token_seconds_count") == sum(
        n - 1 for n in lengths)
    assert value(got, "calfsm_e2e_request_latency_seconds_count") == 3
    assert value(got, "calfsm_time_to_first_token_seconds_sum") == pytest.approx(
        sum(r.ttft_s for r in results))
    assert value(got, "calfsm_time_per_output_token_seconds_sum") == pytest.approx(
        sum(sum(r.inter_token_s) for r in results))
    assert value(got, "calfsm_requests_finished_total", finish_reason="length") == 3
    assert value(got, "calfsm_prompt_tokens_total") == 3 * len(PROMPT)
    assert value(got, "calfsm_generation_tokens_total") == sum(lengths)
    assert value(got, "calfsm_num_requests_running") == 0
    # one prefill and n - 1 decodes a stream; every job succeeded and reached the device
    st = step_ex.stats()
    assert value(got, "calfsm_jobs_total", outcome="succeeded") == st.succeeded == sum(
        lengths)
    for name in ("job_queue_time", "job_device_time", "job_latency"):
        assert value(got, f"calfsm_{name}_seconds_count", kind="prefill_ids") == 3
        assert value(got, f"calfsm_{name}_seconds_count", kind="decode") == sum(
            n - 1 for n in lengths)
    assert value(got, "calfsm_time_to_first_token_seconds_bucket", le="+Inf") == 3


def test_job_histogram_sums_are_the_jobs_own_timings(step_ex, metrics):
    """Spec 10.3: each job's JobTimings feed the histograms when it ends. One buffer
    slot, so the second job waits for admission behind the first."""
    handles = [step_ex.enqueue_nowait(Request.prefill(seq, PROMPT)) for seq in range(4)]
    run(step_ex, lambda: all(h.done() for h in handles))
    timings = [h.result(0).timings for h in handles]
    got = scrape(metrics)
    kind = "prefill_ids"
    assert value(got, "calfsm_job_admission_wait_seconds_sum", kind=kind) == pytest.approx(
        sum(t.admitted - t.accepted for t in timings))
    assert value(got, "calfsm_job_queue_time_seconds_sum", kind=kind) == pytest.approx(
        sum(t.submitted - t.queued for t in timings))
    assert value(got, "calfsm_job_device_time_seconds_sum", kind=kind) == pytest.approx(
        sum(t.device_wait_ms for t in timings) / 1e3)
    assert value(got, "calfsm_job_latency_seconds_sum", kind=kind) == pytest.approx(
        sum(t.completed - t.accepted for t in timings))
    # two slots of the kind: the jobs after them waited for one to come back
    assert max(t.admitted - t.accepted for t in timings) > 0


def test_a_prepared_step_waits_for_admission_only_from_its_release(step_ex, metrics):
    """A stream's decode staged while the step before runs is not waiting for admission
    then: its admission wait counts from when its token was known."""
    s = step_ex.generate(PROMPT, SamplingParams(max_tokens=6))
    run(step_ex, s.done)
    events = list(s)
    staged = [e.timings for e in events if e.timings.released]
    assert staged, "no step was prepared ahead"
    got = scrape(metrics)
    decode_admission = value(got, "calfsm_job_admission_wait_seconds_sum", kind="decode")
    assert decode_admission == pytest.approx(sum(
        t.admitted - (t.released or t.accepted) for t in (e.timings for e in events[1:])))
    assert all(t.admitted - t.released < t.admitted - t.accepted for t in staged)


# ---- counters by reason -----------------------------------------------------------------

def test_cancels_count_by_finish_reason_and_outcome(step_ex, metrics):
    stream = step_ex.generate(PROMPT, SamplingParams(max_tokens=50))
    run(step_ex, lambda: step_ex.stats().succeeded >= 2)     # two tokens out
    assert stream.cancel()
    job = step_ex.enqueue_nowait(Request.prefill(9, PROMPT))
    assert job.cancel()                              # before submit: never on the device
    run(step_ex, lambda: stream.done() and job.done() and step_ex.idle())
    got = scrape(metrics)
    assert value(got, "calfsm_requests_finished_total", finish_reason="cancelled") == 1
    assert value(got, "calfsm_requests_finished_total", finish_reason="length") == 0
    st = step_ex.stats()
    assert st.cancelled >= 2
    assert value(got, "calfsm_jobs_total", outcome="cancelled") == st.cancelled
    assert value(got, "calfsm_errors_total", category="request") == \
        st.errors_by_category["request"]


def test_a_stream_deadline_counts_as_deadline(step_ex, metrics):
    s = step_ex.generate(PROMPT, SamplingParams(max_tokens=50), deadline_s=0.035)
    run(step_ex, lambda: s.done() and step_ex.idle())
    r = s.result(0)
    assert r.finish_reason == FinishReason.DEADLINE
    got = scrape(metrics)
    assert value(got, "calfsm_requests_finished_total", finish_reason="deadline") == 1
    assert value(got, "calfsm_e2e_request_latency_seconds_count") == 1
    assert value(got, "calfsm_time_per_output_token_seconds_count") == len(r.tokens) - 1


@pytest.mark.parametrize(("effect", "category"), [("nan", "unknown"),
                                                  ("ccu_exception", "device")])
def test_a_device_fault_counts_quarantine_error_recovery_and_generation(effect, category):
    plan = FaultPlan.of(FaultRule("infer", effect, seq_id=3))
    with make_executor("step", faults=plan,
                       recovery=RecoveryPolicy(grace_period_s=0.01)) as ex:
        m = ExecutorMetrics(ex)
        h = ex.enqueue_nowait(Request.prefill(3, PROMPT))
        run(ex, lambda: h.done() and ex.lifecycle_state == "Ready" and ex.generation == 2)
        got = scrape(m)
        assert value(got, "calfsm_jobs_total", outcome="quarantined") == 1
        assert value(got, "calfsm_errors_total", category=category) == 1
        assert total_over(got, "calfsm_errors_total") == 1
        assert value(got, "calfsm_recoveries_total") == 1
        assert value(got, "calfsm_generation") == 2
        assert value(got, "calfsm_lifecycle_state", state="Ready") == 1
        assert total_over(got, "calfsm_lifecycle_state") == 1
        assert value(got, "calfsm_ready") == 1
        # the quarantined job still reached the device: its device time is counted
        assert value(got, "calfsm_job_device_time_seconds_count", kind="prefill_ids") == 1
        m.close()


def test_a_stale_completion_is_counted():
    """FI14: a reset that does not abort a job; its completion arrives for a retired
    generation and is dropped."""
    plan = FaultPlan.of(FaultRule("infer", "stale", seq_id=3))
    with make_executor("step", faults=plan,
                       recovery=RecoveryPolicy(grace_period_s=0.0)) as ex:
        m = ExecutorMetrics(ex)
        h = ex.enqueue_nowait(Request.prefill(3, PROMPT))
        sched = StepScheduler(ex)
        sched.run_until(lambda: h.state == JobState.SUBMITTED)
        assert ex.recover("test: reset under a running job")
        sched.run_until(lambda: h.done() and ex.lifecycle_state == "Ready")
        got = scrape(m)
        assert value(got, "calfsm_stale_completions_total") == 1
        assert value(got, "calfsm_recoveries_total") == 1
        m.close()


def test_a_resumed_stream_counts_its_resume():
    rule = FaultRule("infer", "ccu_exception", seq_id=0, nth=4)
    with make_executor("step", faults=FaultPlan.of(rule),
                       recovery=RecoveryPolicy(grace_period_s=0.01)) as ex:
        m = ExecutorMetrics(ex)
        s = ex.generate(PROMPT, SamplingParams(max_tokens=8))
        run(ex, lambda: s.done() and ex.idle())
        r = s.result(0)
        assert r.finish_reason == FinishReason.LENGTH and r.resumes == 1, r
        got = scrape(m)
        assert value(got, "calfsm_resumes_total") == 1
        assert value(got, "calfsm_requests_finished_total", finish_reason="length") == 1
        m.close()


def test_rejections_by_reason():
    with make_executor("step", max_waiting=1, max_sequences=1, token_budget=16) as ex:
        m = ExecutorMetrics(ex)
        first = ex.enqueue_nowait(Request.prefill(1, PROMPT))
        with pytest.raises(ResourceExhausted):          # one waits already: 429
            ex.enqueue_nowait(Request.prefill(2, PROMPT))
        run(ex, first.done)
        big = ex.enqueue_nowait(Request.prefill(2, list(range(1, 20))))   # > 16 tokens
        run(ex, big.done)
        assert isinstance(big.exception(0), ResourceExhausted)
        seq = ex.open_sequence()
        with pytest.raises(ResourceExhausted):          # the one sequence id is taken
            ex.open_sequence()
        seq.close()
        assert ex.recover("test: not ready")
        with pytest.raises(Unavailable):
            ex.enqueue_nowait(Request.prefill(1, PROMPT))
        run(ex, lambda: ex.lifecycle_state == "Ready")
        got = scrape(m)
        for reason, n in (("max_waiting", 1), ("kv_budget", 1), ("sequences", 1),
                          ("not_ready", 1), ("closed", 0), ("broken", 0)):
            assert value(got, "calfsm_rejections_total", reason=reason) == n, reason
        assert {r for (n, labels), _ in got.items() if n == "calfsm_rejections_total"
                for _, r in labels} == set(REJECTIONS)
        ex.close()
        with pytest.raises(ExecutorClosed):
            ex.enqueue_nowait(Request.prefill(1, PROMPT))
        assert value(scrape(m), "calfsm_rejections_total", reason="closed") == 1
        m.close()


# ---- gauges at scrape time --------------------------------------------------------------

def test_gauges_show_a_job_on_the_device_and_one_waiting(step_ex, metrics):
    stream = step_ex.generate(PROMPT, SamplingParams(max_tokens=3))
    a = step_ex.enqueue_nowait(Request.prefill(7, PROMPT))
    sched = StepScheduler(step_ex)
    sched.run_until(lambda: bool(step_ex.on_device()))
    got = scrape(metrics)
    assert value(got, "calfsm_jobs_inflight") == 1
    assert value(got, "calfsm_num_requests_running") == 1
    assert value(got, "calfsm_num_requests_waiting") == step_ex.stats().queued >= 1
    assert value(got, "calfsm_buffers_leased") == step_ex.epoch.pool.stats().leased >= 2
    kv = step_ex.epoch.kv.stats()
    assert value(got, "calfsm_kv_tokens_used") == kv.budget_used > 0
    assert value(got, "calfsm_kv_usage_ratio") == pytest.approx(
        kv.budget_used / kv.token_budget)
    sched.run_until(lambda: stream.done() and a.done() and step_ex.idle())
    got = scrape(metrics)
    for name in ("jobs_inflight", "num_requests_running", "num_requests_waiting",
                 "buffers_leased", "buffers_quarantined", "kv_tokens_used"):
        assert value(got, f"calfsm_{name}") == 0, name
    assert value(got, "calfsm_buffers_total") == step_ex.epoch.pool.stats().total


# ---- threaded: counted before the caller has it ------------------------------------------

def test_threaded_a_stream_is_counted_before_its_consumer_sees_the_result():
    with make_executor("threaded") as ex:
        m = ExecutorMetrics(ex)
        for i in range(1, 21):
            r = ex.generate(PROMPT, SamplingParams(max_tokens=3)).result(10)
            assert r.finish_reason == FinishReason.LENGTH
            got = scrape(m)
            assert value(got, "calfsm_requests_finished_total", finish_reason="length") == i
            assert value(got, "calfsm_e2e_request_latency_seconds_count") == i
        h = ex.enqueue(Request.prefill(3, PROMPT))
        h.result(10)
        got = scrape(m)
        assert value(got, "calfsm_job_latency_seconds_count", kind="prefill_ids") == 21
        m.close()


# ---- attaching and detaching ---------------------------------------------------------------

def test_close_detaches_and_frees_the_names(step_ex):
    registry = CollectorRegistry()
    m = ExecutorMetrics(step_ex, registry=registry, namespace="calfsm")
    assert m.registry is registry and len(step_ex.observers) == 1
    with pytest.raises(ValueError):                 # the names are taken
        ExecutorMetrics(step_ex, registry=registry)
    assert len(step_ex.observers) == 1              # the failed one did not attach
    m.close()
    m.close()
    assert len(step_ex.observers) == 0 and m.executor is None
    assert generate_latest(registry) == b""
    h = step_ex.enqueue_nowait(Request.prefill(1, PROMPT))
    run(step_ex, h.done)
    again = ExecutorMetrics(step_ex, registry=registry)
    got = scrape(again)
    # events before attaching are not seen; the executor's own books are
    assert not any(n.startswith("calfsm_job_latency_seconds") for n, _ in got)
    assert value(got, "calfsm_jobs_total", outcome="succeeded") == 1
    again.close()


def test_a_namespace_prefixes_every_metric(step_ex):
    m = ExecutorMetrics(step_ex, namespace="npu0")
    names = {n for n, _ in scrape(m)}
    assert names and all(n.startswith("npu0_") for n in names), names
    m.close()


# ---- the observer API ----------------------------------------------------------------------

class Recorder(Observer):
    def __init__(self) -> None:
        self.jobs: list[JobEnded] = []
        self.ended: list = []

    def job_ended(self, event: JobEnded) -> None:
        self.jobs.append(event)

    def stream_ended(self, stream, result) -> None:
        self.ended.append(result)


class Raising(Observer):
    def job_ended(self, event: JobEnded) -> None:
        raise RuntimeError("observer bug")

    def stream_ended(self, stream, result) -> None:
        raise RuntimeError("observer bug")


def test_an_observer_that_raises_is_logged_and_breaks_nothing(step_ex, caplog):
    rec = Recorder()
    step_ex.add_observer(Raising())
    step_ex.add_observer(rec)
    with caplog.at_level(logging.ERROR, logger="calfsm.engine.observe"):
        s = step_ex.generate(PROMPT, SamplingParams(max_tokens=3))
        run(step_ex, lambda: s.done() and step_ex.idle())
    assert s.result(0).finish_reason == FinishReason.LENGTH
    assert [e.outcome for e in rec.jobs] == ["succeeded"] * 3
    assert len(rec.ended) == 1
    assert sum("observer" in r.message and "raised" in r.message
               for r in caplog.records) == 4
    assert step_ex.stats().failed == 0


class SeenBeforeDone(Observer):
    """Records whether a stream or job was already done when its event came."""

    def __init__(self) -> None:
        self.handles: dict[int, object] = {}
        self.done_at_event: list[bool] = []

    def job_ended(self, event: JobEnded) -> None:
        h = self.handles.get(event.job_id)
        if h is not None:
            self.done_at_event.append(h.done())

    def stream_ended(self, stream, result) -> None:
        self.done_at_event.append(stream.done())


@pytest.mark.parametrize("mode", ["step", "threaded"])
def test_events_come_before_the_caller_can_see_the_outcome(mode):
    with make_executor(mode) as ex:
        seen = SeenBeforeDone()
        ex.add_observer(seen)
        streams = [ex.generate(PROMPT, SamplingParams(max_tokens=3)) for _ in range(3)]
        handles = []
        for seq in (10, 11):
            h = ex.enqueue_nowait(Request.prefill(seq, PROMPT))
            seen.handles[h.job_id] = h
            handles.append(h)
        handles[1].cancel()
        if mode == "step":
            run(ex, lambda: all(s.done() for s in streams) and ex.idle())
        for s in streams:
            s.result(10)
        for h in handles:
            h.exception(10)
        assert len(seen.done_at_event) == 3 + 2
        assert not any(seen.done_at_event)


def test_job_ended_carries_the_outcome_the_error_and_the_result(step_ex):
    rec = Recorder()
    step_ex.add_observer(rec)
    ok = step_ex.enqueue_nowait(Request.prefill(1, PROMPT))
    gone = step_ex.enqueue_nowait(Request.prefill(2, PROMPT))
    gone.cancel()
    run(step_ex, lambda: ok.done() and gone.done())
    by_id = {e.job_id: e for e in rec.jobs}
    assert by_id[ok.job_id].outcome == "succeeded"
    assert by_id[ok.job_id].result is ok.result(0)
    assert by_id[gone.job_id].outcome == "cancelled"
    assert by_id[gone.job_id].error is gone.exception(0)
    assert step_ex.remove_observer(rec) and not step_ex.remove_observer(rec)


class Books(Observer):
    """Every job event in order: accepted, refused at enqueue, ended."""

    def __init__(self) -> None:
        self.log: list[tuple[str, object]] = []

    def job_accepted(self, event: JobAccepted) -> None:
        self.log.append(("accepted", event))

    def job_refused(self, error, request) -> None:
        self.log.append(("refused", (error, request)))

    def job_ended(self, event: JobEnded) -> None:
        self.log.append(("ended", event))


def _books_of_a_run(seed: int) -> tuple[Books, list, int]:
    """Two streams (one cancelled after a few jobs), a plain job, and three refusals at
    enqueue (a bad argument, during a recovery, after close): the books, the errors the
    caller got, and the jobs the executor made."""
    books, caller_got = Books(), []
    with make_executor("step") as ex:
        ex.add_observer(books)
        sched = StepScheduler(ex, seed)
        streams = [ex.generate(PROMPT, SamplingParams(max_tokens=8)) for _ in range(2)]
        plain = ex.enqueue_nowait(Request.prefill(9, PROMPT))
        sched.run_until(lambda: ex.stats().succeeded >= 3)
        assert streams[0].cancel()
        sched.run_until(lambda: all(s.done() for s in streams) and plain.done()
                        and ex.idle())
        with pytest.raises(InvalidArgument) as bad:
            ex.enqueue_nowait("not a request")
        caller_got.append(bad.value)
        assert ex.recover("test")
        with pytest.raises(Unavailable) as recovering:
            ex.enqueue(Request.prefill(9, PROMPT))
        caller_got.append(recovering.value)
        sched.run_until(lambda: ex.lifecycle_state == "Ready")
        made = ex.stats().accepted
    with pytest.raises(ExecutorClosed) as closed:
        ex.enqueue_nowait(Request.prefill(9, PROMPT))
    caller_got.append(closed.value)
    return books, caller_got, made


def test_every_accepted_job_ends_once_and_every_refusal_is_seen():
    """Streams whose steps are prepared ahead (released, and discarded when one is
    cancelled), a plain job and refusals at enqueue, from four seeds: each job_accepted
    is followed by exactly one job_ended of that job; the only other ends are steps
    prepared ahead that never ran (``announced`` False, discarded, never accepted); each
    refusal the caller got is seen once; the executor's count of jobs made is the two
    together; and in some seed a cancel discards a step prepared ahead."""
    discarded = 0
    for seed in range(4):
        books, caller_got, made = _books_of_a_run(seed)
        log = books.log
        accepted = {e.job_id: (i, e) for i, (k, e) in enumerate(log) if k == "accepted"}
        ends = [(i, e) for i, (k, e) in enumerate(log) if k == "ended"]
        assert len(accepted) == sum(k == "accepted" for k, _ in log)       # once each
        assert len({e.job_id for _, e in ends}) == len(ends)                # once each
        announced = {e.job_id: (i, e) for i, e in ends if e.announced}
        assert announced.keys() == accepted.keys(), seed
        for job_id, (i, acc) in accepted.items():       # accepted first, then its end
            end_at, end = announced[job_id]
            assert i < end_at and acc.request is end.request, (seed, job_id)
        never_ran = [e for _, e in ends if not e.announced]
        assert all(e.job_id not in accepted and e.outcome == "discarded"
                   for e in never_ran), seed
        assert made == len(accepted) + len(never_ran), seed
        assert any(e.staged for _, e in accepted.values()), seed
        refused = [v[0] for k, v in log if k == "refused"]
        assert len(refused) == len(caller_got), seed
        assert all(a is b for a, b in zip(refused, caller_got, strict=True)), seed
        discarded += len(never_ran)
    assert discarded, "no seed discarded a step prepared ahead"


def test_observers_refuse_misuse_and_skip_what_is_not_overridden():
    obs = Observers(THREADS)
    with pytest.raises(InvalidArgument):
        obs.add(object())
    only_streams = type("OnlyStreams", (Observer,), {
        "stream_ended": lambda self, stream, result: None})()
    obs.add(only_streams)
    assert not obs.jobs                  # no JobEnded is built for it
    with pytest.raises(InvalidArgument, match="already"):
        obs.add(only_streams)
    obs.add(Recorder())
    assert obs.jobs and len(obs) == 2


def test_observers_may_come_and_go_while_jobs_run():
    with make_executor("threaded") as ex:
        stop = threading.Event()

        def churn() -> None:
            while not stop.is_set():
                r = Recorder()
                ex.add_observer(r)
                ex.remove_observer(r)

        t = threading.Thread(target=churn)
        t.start()
        try:
            for _ in range(10):
                assert ex.generate(PROMPT, SamplingParams(max_tokens=4)).result(10) \
                    .finish_reason == FinishReason.LENGTH
        finally:
            stop.set()
            t.join(10)
        assert ex.stats().failed == 0 and len(ex.observers) == 0


def test_infer_refused_counts_transient_error():
    """A refused infer the policy does not requeue fails the job as transient."""
    plan = FaultPlan.of(FaultRule("infer", "code", seq_id=4,
                                  code=int(CalrtCode.DEVICE_BUSY)))
    with make_executor("step", faults=plan) as ex:
        m = ExecutorMetrics(ex)
        h = ex.enqueue_nowait(Request.prefill(4, PROMPT))
        run(ex, h.done)
        got = scrape(m)
        assert value(got, "calfsm_jobs_total", outcome="failed") == 1
        assert value(got, "calfsm_errors_total", category="transient") == 1
        m.close()
