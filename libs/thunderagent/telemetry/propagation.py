"""W3C trace context in NATS headers (and HTTP headers: same carrier shape)."""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import context as otel_context
from opentelemetry import propagate


def inject_headers(
    headers: dict[str, str] | None = None, *, context: otel_context.Context | None = None
) -> dict[str, str]:
    """Return ``headers`` (or a new dict) with ``traceparent``/``tracestate`` of the current span.

    With tracing off and no incoming context nothing is added; with tracing off but a context
    extracted from an incoming message, the same ``traceparent`` is passed on, so a trace stays
    whole across a hop that does not export spans.
    """
    carrier = headers if headers is not None else {}
    propagate.inject(carrier, context=context)
    return carrier


def extract_context(headers: Mapping[str, str] | None) -> otel_context.Context:
    """Context carried by incoming headers (empty context when there are none)."""
    return propagate.extract(dict(headers or {}))
