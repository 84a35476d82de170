"""The gateway's Prometheus metrics (prometheus_client, default registry).

The gateway serves ``/metrics`` on its own HTTP port, as OpenAI-compatible servers do, so its
instruments are prometheus_client ones and need no OpenTelemetry meter provider; with
``--metrics-port`` the same registry is also served there, next to the OpenTelemetry metrics
every service has (dead letters). Names and labels are the contract in ops/README.md.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

TTFT_BUCKETS_S = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
    7.5, 10.0, 20.0, 30.0, 60.0,
)  # fmt: skip
"""From a cached prompt on an idle engine (milliseconds) to a long prefill behind a queue."""
ITL_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
    0.3, 0.5, 1.0, 2.0,
)  # fmt: skip
"""Decode steps take 5-50 ms; a preempted or handed-off request waits longer between tokens."""
DURATION_BUCKETS_S = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip


class GatewayMetrics:
    """One set per process: prometheus_client refuses a second registration of a name, and
    gateways started in one process (tests) share the registry."""

    _instance: GatewayMetrics | None = None

    def __init__(self) -> None:
        self.requests = Counter(
            "thunderagent_gateway_requests",
            "HTTP requests answered, by route and status (499: the client went away first; a "
            "stream that failed after it started counts with the status of its error)",
            ["route", "status"],
        )
        self.in_flight = Gauge(
            "thunderagent_gateway_requests_in_flight",
            "HTTP requests being served",
            ["route"],
        )
        self.ttft = Histogram(
            "thunderagent_gateway_ttft_seconds",
            "Streamed requests: HTTP request received to first token sent",
            ["route"],
            buckets=TTFT_BUCKETS_S,
        )
        self.itl = Histogram(
            "thunderagent_gateway_inter_token_seconds",
            "Streamed requests: time between token chunks, per token",
            ["route"],
            buckets=ITL_BUCKETS_S,
        )
        self.duration = Histogram(
            "thunderagent_gateway_request_duration_seconds",
            "HTTP request received to last byte sent",
            ["route"],
            buckets=DURATION_BUCKETS_S,
        )

    @classmethod
    def get(cls) -> GatewayMetrics:
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance
