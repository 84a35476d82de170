"""W3C trace context in NATS headers (and HTTP headers: same carrier shape), and the sampling
rule every receiver follows.

Parent-based sampling: only the trace's first span (the client or the gateway) samples, by
``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` (the SDK reads them). Every later hop
honours the ``sampled`` flag of the ``traceparent`` it received: a message whose sender was
sampled out, or that carries no trace context at all (load reports, KV batches, progress),
creates no span. With tracing off in a process (no exporter configured) it does no span work.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind

TRACEPARENT = "traceparent"
_NO_TRACING = (trace.ProxyTracerProvider, trace.NoOpTracerProvider)


def inject_headers(
    headers: dict[str, str] | None = None, *, context: otel_context.Context | None = None
) -> dict[str, str]:
    """Return ``headers`` (or a new dict) with ``traceparent``/``tracestate`` of the current span.

    With tracing off and no incoming context nothing is added; with tracing off but a context
    extracted from an incoming message, the same ``traceparent`` is passed on, so a trace stays
    whole across a hop that does not export spans.
    """
    carrier = headers if headers is not None else {}
    if not (context if context is not None else otel_context.get_current()):
        return carrier  # an empty context has nothing to inject (the common untraced case)
    propagate.inject(carrier, context=context)
    return carrier


def extract_context(headers: Mapping[str, str] | None) -> otel_context.Context:
    """Context carried by incoming headers (empty context when there are none)."""
    return propagate.extract(dict(headers or {}))


def tracing_active() -> bool:
    """True when this process records spans (an SDK tracer provider is installed)."""
    return not isinstance(trace.get_tracer_provider(), _NO_TRACING)


def sampled_flag(headers: Mapping[str, str] | None) -> bool | None:
    """The ``sampled`` flag of the incoming ``traceparent``; None when there is none (or it is
    malformed: then it is no trace context at all)."""
    if not headers:
        return None
    value = headers.get(TRACEPARENT)
    if not value:
        return None
    parts = value.split("-")
    if len(parts) < 4 or len(parts[3]) < 2:
        return None
    try:
        return bool(int(parts[3][:2], 16) & 1)
    except ValueError:
        return None


@contextlib.contextmanager
def start_span_if_sampled(
    tracer: trace.Tracer,
    name: str,
    headers: Mapping[str, str] | None,
    kind: SpanKind = SpanKind.CONSUMER,
) -> Iterator[trace.Span | None]:
    """A span continuing the sender's trace when that trace is sampled and this process traces;
    else no span, with the sender's context (if any) made current so it is passed on as it
    came. Yields the span or None."""
    flag = sampled_flag(headers)
    if flag is None:
        yield None
        return
    ctx = extract_context(headers)
    if flag and tracing_active():
        with tracer.start_as_current_span(name, context=ctx, kind=kind) as span:
            yield span
        return
    token = otel_context.attach(ctx)
    try:
        yield None
    finally:
        otel_context.detach(token)


@contextlib.contextmanager
def child_span(tracer: trace.Tracer, name: str) -> Iterator[trace.Span]:
    """A child of the current span when that span records; else the no-op span, with no span
    work at all (the common case: tracing off, or the request sampled out). Its attributes
    may be set either way."""
    if not trace.get_current_span().is_recording():
        yield trace.INVALID_SPAN
        return
    with tracer.start_as_current_span(name) as span:
        yield span
