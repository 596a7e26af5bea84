"""OpenTelemetry spans of each request (issue 38, item 3), read from the SDK's
``InMemorySpanExporter``: the span tree of a streamed request, of a 429, of a request
that lived through a device recovery and resumed (the generation on the event), a
prompt cache hit; the children cover the request's time; the incoming context is the
parent and ``traceparent`` names the request's span; an unsampled request keeps
nothing; a dead collector never holds a request.

Step mode on the virtual clock (the spans' times are the executor's clock), faults
from fault plans.
"""

from __future__ import annotations

import socket
import time

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import StatusCode

from calfsm.drivers.faults import FaultPlan, FaultRule
from calfsm.engine.recovery import RecoveryPolicy
from calfsm.errors import ResourceExhausted
from calfsm.generate.promptcache import PromptCacheConfig
from calfsm.generate.sampling import SamplingParams
from calfsm.generate.streams import FinishReason
from calfsm.runtime.stepper import StepScheduler
from calfsm.telemetry.tracing import RequestTracer, otlp_tracer_provider
from tests.helpers.executor import make_executor

pytestmark = pytest.mark.timeout(60)

PROMPT = [5, 6, 7, 8]
CHILDREN = ("calfsm.admission", "calfsm.prefill", "calfsm.recovery", "calfsm.decode")


@pytest.fixture
def spans():
    """(a tracer whose spans are kept in memory, the exporter that keeps them)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider.get_tracer("test"), exporter
    provider.shutdown()


def run(ex, predicate) -> None:
    StepScheduler(ex).run_until(predicate)


def tree(exporter: InMemorySpanExporter) -> dict[str, tuple[ReadableSpan, list]]:
    """Each request span by its request id (a refusal's: by its reason): (it, its
    children by start)."""
    finished = exporter.get_finished_spans()
    out = {}
    for root in (s for s in finished if s.name == "calfsm.request"):
        kids = sorted((s for s in finished if s.parent is not None
                       and s.parent.span_id == root.context.span_id),
                      key=lambda s: (s.start_time, s.end_time))
        key = root.attributes.get("calfsm.request_id") \
            or root.attributes["calfsm.rejection.reason"]
        out[key] = (root, kids)
    return out


def coverage(root: ReadableSpan, kids: list[ReadableSpan]) -> float:
    """The share of the root's time its children cover (their union)."""
    covered, edge = 0, root.start_time
    for k in kids:
        start, end = max(k.start_time, edge), min(k.end_time, root.end_time)
        if end > start:
            covered += end - start
            edge = end
    return covered / (root.end_time - root.start_time)


def events(span: ReadableSpan) -> dict[str, dict]:
    return {e.name: dict(e.attributes) for e in span.events}


def test_a_streamed_request_is_a_span_with_admission_prefill_and_decode(spans):
    tracer, exporter = spans
    with make_executor("step") as ex:
        rt = RequestTracer(ex, tracer)
        arrival = ex.clock.now()
        ex.clock.advance(0.004)                   # the server read and parsed it
        with tracer.start_as_current_span("client") as parent:
            s = ex.generate(PROMPT, SamplingParams(max_tokens=6), arrival=arrival)
        tp = rt.traceparent(s.request_id)
        assert len(ex.observers) == 2       # the tracer, and its per-job tap while live
        run(ex, lambda: s.done() and ex.idle())
        r = s.result(0)
        assert rt.live_requests() == 0 and rt.traceparent(s.request_id) is None
        assert len(ex.observers) == 1
        rt.close()
    root, kids = tree(exporter)[s.request_id]
    # the incoming context is the parent; traceparent names the request's own span
    assert root.parent.span_id == parent.get_span_context().span_id
    assert root.context.trace_id == parent.get_span_context().trace_id
    assert tp == f"00-{root.context.trace_id:032x}-{root.context.span_id:016x}-" \
                 f"{int(root.context.trace_flags):02x}"
    assert int(tp[-2:], 16) & 1                     # sampled
    assert [k.name for k in kids] == ["calfsm.admission", "calfsm.prefill", "calfsm.decode"]
    admission, prefill, decode = kids
    # the request's span starts at its arrival: its TTFT is the client's
    assert root.attributes["calfsm.ttft_s"] == pytest.approx(r.ttft_s)
    assert r.ttft_s >= 0.004
    assert (prefill.end_time - root.start_time) / 1e9 == pytest.approx(r.ttft_s, abs=1e-6)
    assert admission.attributes["calfsm.front_s"] == pytest.approx(0.004)
    assert admission.attributes["calfsm.kv.reserved_tokens"] == len(PROMPT)
    assert prefill.attributes["calfsm.prompt_cache.hit"] is False
    assert decode.attributes["calfsm.decode.tokens"] == 6
    assert decode.attributes["calfsm.decode.steps"] == 5
    assert decode.attributes["calfsm.decode.rows_per_step"] >= 1
    assert root.attributes["gen_ai.usage.output_tokens"] == 6
    assert root.attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert root.status.status_code is StatusCode.UNSET
    assert coverage(root, kids) >= 0.95


def test_a_429_is_a_failed_admission_with_its_estimate(spans):
    tracer, exporter = spans
    params = SamplingParams(max_tokens=100)
    with make_executor("step") as ex:
        rt = RequestTracer(ex, tracer)
        running, refused = [], None
        while refused is None:      # 100 steps of 10 ms each: 60 s holds some 60 streams
            try:
                running.append(ex.generate(PROMPT, params, deadline_s=60.0))
            except ResourceExhausted as e:
                refused = e
        for s in running:
            s.cancel()
        run(ex, lambda: all(s.done() for s in running) and ex.idle())
        rt.close()
    root, kids = tree(exporter)["capacity"]
    assert root.status.status_code is StatusCode.ERROR
    assert root.attributes["http.response.status_code"] == 429
    assert [k.name for k in kids] == ["calfsm.admission"]
    admission = kids[0]
    assert admission.status.status_code is StatusCode.ERROR
    assert admission.attributes["calfsm.rejection.reason"] == "capacity"
    assert admission.attributes["calfsm.retry_after_s"] == refused.retry_after_s
    assert admission.attributes["calfsm.admission.estimate"] == refused.message
    assert "device work" in admission.attributes["calfsm.admission.estimate"]


def test_a_stream_refused_by_a_full_wait_queue_ends_its_admission_failed(spans):
    tracer, exporter = spans
    with make_executor("step", max_waiting=1) as ex:
        rt = RequestTracer(ex, tracer)
        first = ex.generate(PROMPT, SamplingParams(max_tokens=2))
        second = ex.generate(PROMPT, SamplingParams(max_tokens=2))    # one waits already
        assert second.done() and isinstance(second.result(0).error, ResourceExhausted)
        run(ex, lambda: first.done() and ex.idle())
        rt.close()
    root, kids = tree(exporter)[second.request_id]
    assert root.status.status_code is StatusCode.ERROR
    assert root.attributes["http.response.status_code"] == 429
    assert [k.name for k in kids] == ["calfsm.admission"]
    assert kids[0].status.status_code is StatusCode.ERROR
    assert events(kids[0])["calfsm.rejected"]["calfsm.rejection.reason"] == "max_waiting"
    assert len(tree(exporter)) == 2                 # the refusal is not a request of its own


@pytest.mark.parametrize("nth, before_first_token", [(1, True), (4, False)])
def test_a_request_that_lived_through_a_recovery_and_resumed(spans, nth, before_first_token):
    """A CCU exception on the stream's ``nth`` device job: the device recovers into
    generation 2, the stream replays its history there and ends as if nothing happened;
    its span says so (a fault, the recovery with its generation, the resume), and its
    children still cover its time."""
    tracer, exporter = spans
    rule = FaultRule("infer", "ccu_exception", seq_id=0, nth=nth)
    with make_executor("step", faults=FaultPlan.of(rule),
                       recovery=RecoveryPolicy(grace_period_s=0.01)) as ex:
        rt = RequestTracer(ex, tracer)
        s = ex.generate(PROMPT, SamplingParams(max_tokens=8))
        run(ex, lambda: s.done() and ex.idle())
        r = s.result(0)
        rt.close()
    assert r.finish_reason is FinishReason.LENGTH and r.resumes == 1, r
    root, kids = tree(exporter)[s.request_id]
    ev = events(root)
    assert ev["calfsm.device_fault"]["calfsm.generation"] == 1
    assert ev["calfsm.recovery"]["calfsm.generation"] == 2
    assert ev["calfsm.resume"]["calfsm.generation"] == 2
    assert root.attributes["calfsm.resumes"] == 1
    names = [k.name for k in kids]
    if before_first_token:
        assert names == ["calfsm.admission", "calfsm.prefill", "calfsm.recovery",
                         "calfsm.prefill", "calfsm.decode"]
        failed, recovery, replay = kids[1], kids[2], kids[3]
        assert failed.status.status_code is StatusCode.ERROR
        assert failed.attributes["calfsm.generation"] == 1
        assert recovery.attributes["calfsm.generation"] == 2
        assert replay.attributes["calfsm.replay"] is True
        assert replay.attributes["calfsm.generation"] == 2
    else:           # the decode span goes on through it
        assert names == ["calfsm.admission", "calfsm.prefill", "calfsm.decode"]
    assert coverage(root, kids) >= 0.95


def test_a_prompt_cache_hit_is_on_the_prefill(spans):
    tracer, exporter = spans
    with make_executor("step", prompt_cache=PromptCacheConfig(4, 1024)) as ex:
        rt = RequestTracer(ex, tracer)
        a = ex.generate(PROMPT, SamplingParams(max_tokens=2))
        run(ex, lambda: a.done() and ex.idle())
        b = ex.generate([*PROMPT, 9, 10], SamplingParams(max_tokens=2))
        run(ex, lambda: b.done() and ex.idle())
        rt.close()
    cached = b.result(0).usage.cached_tokens
    assert cached > 0
    prefill = tree(exporter)[b.request_id][1][1]
    assert prefill.name == "calfsm.prefill"
    assert prefill.attributes["calfsm.prompt_cache.hit"] is True
    assert prefill.attributes["calfsm.prompt_cache.reused_tokens"] == cached
    assert prefill.attributes["calfsm.prefill.tokens"] == 6 - cached


def test_an_unsampled_request_keeps_nothing():
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_OFF)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with make_executor("step") as ex:
        rt = RequestTracer(ex, provider.get_tracer("test"))
        s = ex.generate(PROMPT, SamplingParams(max_tokens=3))
        assert rt.live_requests() == 0 and rt.traceparent(s.request_id) is None
        assert len(ex.observers) == 1       # the per-job events are not observed at all
        run(ex, lambda: s.done() and ex.idle())
        rt.close()
        assert len(ex.observers) == 0
    assert exporter.get_finished_spans() == ()


def test_the_executor_takes_a_tracer(spans):
    tracer, exporter = spans
    with make_executor("step") as ex:
        assert ex.request_tracer is None            # off: no observer at all
    from calfsm.executor import DeviceExecutor, ExecutorConfig
    from tests.helpers.executor import TINY, make_sim
    with DeviceExecutor(make_sim("step"), TINY, ExecutorConfig(threaded=False),
                        tracer=tracer) as ex:
        assert isinstance(ex.request_tracer, RequestTracer)
        s = ex.generate(PROMPT, SamplingParams(max_tokens=2))
        run(ex, lambda: s.done() and ex.idle())
    assert s.request_id in tree(exporter)


def test_a_dead_collector_never_holds_a_request():
    """Spans for a collector nobody listens on: every request ends as fast as without
    tracing (the batch processor's queue takes the spans; its thread fails to send)."""
    with socket.socket() as sock:               # a port that was free: nobody listens
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    provider = otlp_tracer_provider(f"http://127.0.0.1:{port}/v1/traces",
                                    max_queue_size=64, export_timeout_s=0.5)
    try:
        with make_executor("step") as ex:
            rt = RequestTracer(ex, provider.get_tracer("test"))
            t0 = time.monotonic()
            streams = [ex.generate(PROMPT, SamplingParams(max_tokens=4)) for _ in range(64)]
            run(ex, lambda: all(s.done() for s in streams) and ex.idle())
            took = time.monotonic() - t0
            rt.close()
        assert all(s.result(0).finish_reason is FinishReason.LENGTH for s in streams)
        assert took < 20, took      # a blocked export would cost 0.5 s a span, 320 s in all
    finally:
        provider.shutdown()


def test_no_observer_without_a_tracer():
    """Tracing off costs nothing: the executor registers no observer for it."""
    with make_executor("step") as ex:
        assert len(ex.observers) == 0
        assert trace.get_current_span() is trace.INVALID_SPAN


def test_a_request_admitted_at_time_zero_is_not_taken_for_a_failure(spans):
    """On a virtual clock that a zero-latency device never moves, every time is 0.0:
    still a time (the prefill was admitted, then decoded), not the 'unset' of JobTimings."""
    from calfsm.drivers.sim import LatencyModel
    from calfsm.executor import DeviceExecutor, ExecutorConfig
    from tests.helpers.executor import TINY, make_sim
    tracer, exporter = spans
    with DeviceExecutor(make_sim("step", latency=LatencyModel.zero()), TINY,
                        ExecutorConfig(threaded=False), tracer=tracer) as ex:
        s = ex.generate(PROMPT, SamplingParams(max_tokens=3))
        run(ex, lambda: s.done() and ex.idle())
        assert ex.clock.now() == 0.0
    _, kids = tree(exporter)[s.request_id]
    assert [k.name for k in kids] == ["calfsm.admission", "calfsm.prefill", "calfsm.decode"]
    assert all(k.status.status_code is StatusCode.UNSET for k in kids)
