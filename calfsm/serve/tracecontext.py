"""W3C trace context in and out of the server, when the executor traces its requests.

A request's ``traceparent`` (and ``tracestate``) header becomes the OpenTelemetry
context current while its streams start, so their spans
(:mod:`calfsm.telemetry.tracing`) are the caller's trace's; the answer carries the
``traceparent`` of the first choice's span. Without a tracer on the executor
(``DeviceExecutor(tracer=...)``, ``calfsm serve --otlp-traces-endpoint``) neither
happens and opentelemetry is never imported.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["TRACEPARENT", "traced_start", "traceparent_of"]

TRACEPARENT = "traceparent"


@contextlib.contextmanager
def traced_start(request_tracer: Any, headers: Mapping[str, str]) -> Iterator[None]:
    """The request's incoming trace context is current inside (a no-op untraced)."""
    if request_tracer is None or TRACEPARENT not in headers:
        yield
        return
    from opentelemetry import context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    token = context.attach(TraceContextTextMapPropagator().extract(headers))
    try:
        yield
    finally:
        context.detach(token)


def traceparent_of(request_tracer: Any, request_ids: list[str]) -> str | None:
    """The ``traceparent`` to answer with: the first traced stream's span."""
    if request_tracer is None:
        return None
    for rid in request_ids:
        tp = request_tracer.traceparent(rid)
        if tp is not None:
            return tp
    return None
