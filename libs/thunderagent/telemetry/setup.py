"""Tracer and meter providers for one process.

Sampling is the SDK's, from the standard ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG``
(e.g. ``parentbased_traceidratio`` and ``0.01``: a trace's first span keeps 1% of traces and
every later hop follows its parent's decision; default: keep all). With tracing off no tracer
provider is installed, and the bus does no span work at all.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from opentelemetry import metrics, trace

from thunderagent.telemetry.gcpause import export_gc_pauses

log = logging.getLogger(__name__)

_TRACE_ENV = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


def tracing_requested() -> bool:
    return any(os.environ.get(name) for name in _TRACE_ENV) and (
        os.environ.get("OTEL_SDK_DISABLED", "").lower() != "true"
    )


@dataclass(kw_only=True)
class Telemetry:
    """Handles to flush and stop what :func:`setup_telemetry` started."""

    service_name: str
    tracing: bool = False
    sampler: str = ""
    """The tracer provider's sampler, as the SDK describes it (empty: tracing off)."""
    metrics_port: int | None = None
    _shutdowns: list = field(default_factory=list)

    def shutdown(self) -> None:
        for stop in reversed(self._shutdowns):
            try:
                stop()
            except Exception:  # a failing exporter must not block process exit
                log.exception("telemetry shutdown failed")
        self._shutdowns.clear()


def setup_telemetry(service_name: str, *, metrics_port: int | None = None) -> Telemetry:
    """Install global providers. Call once per process, before the first span or instrument."""
    from opentelemetry.sdk.resources import Resource

    resource = Resource.create({"service.name": service_name})
    tel = Telemetry(service_name=service_name)
    if tracing_requested():
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider = TracerProvider(resource=resource)
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(provider)
        tel.tracing = True
        tel.sampler = provider.sampler.get_description()
        log.info("tracing on, sampler %s", tel.sampler)
        tel._shutdowns.append(provider.shutdown)
    if metrics_port is not None:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from opentelemetry.sdk.metrics import MeterProvider

        from thunderagent.telemetry.endpoint import start_metrics_server

        # Loopback by default; containers set THUNDERAGENT_METRICS_ADDR=0.0.0.0 for Prometheus.
        addr = os.environ.get("THUNDERAGENT_METRICS_ADDR", "127.0.0.1")
        server, _thread = start_metrics_server(metrics_port, addr)
        reader = PrometheusMetricReader()
        provider = MeterProvider(resource=resource, metric_readers=[reader])
        metrics.set_meter_provider(provider)
        tel.metrics_port = server.server_port
        tel._shutdowns.append(provider.shutdown)
        tel._shutdowns.append(server.shutdown)
        tel._shutdowns.append(server.server_close)
        service = service_name.removeprefix("thunderagent-")
        tel._shutdowns.append(export_gc_pauses(meter("thunderagent.process"), service))
    return tel


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def meter(name: str) -> metrics.Meter:
    return metrics.get_meter(name)
