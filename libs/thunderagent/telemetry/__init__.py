"""OpenTelemetry setup shared by every process: OTLP traces, Prometheus metrics, W3C propagation.

Tracing is on only when an ``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
variable is set (the standard OTLP/HTTP exporter reads the rest of the ``OTEL_*`` variables
itself). Metrics are served on a Prometheus endpoint when a port is given.
"""

from thunderagent.telemetry.logs import configure_logging
from thunderagent.telemetry.propagation import (
    child_span,
    extract_context,
    inject_headers,
    sampled_flag,
    start_span_if_sampled,
    tracing_active,
)
from thunderagent.telemetry.setup import Telemetry, setup_telemetry, tracer

__all__ = [
    "Telemetry",
    "child_span",
    "configure_logging",
    "extract_context",
    "inject_headers",
    "sampled_flag",
    "setup_telemetry",
    "start_span_if_sampled",
    "tracer",
    "tracing_active",
]
