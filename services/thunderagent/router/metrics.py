"""The router's metrics (OpenTelemetry instruments on the Prometheus endpoint).

Names, units and labels follow the contract in ops/README.md, which the Grafana dashboard
queries; rates are computed there from the counters.
"""

from __future__ import annotations

from thunderagent.telemetry.setup import meter

DECISION_BUCKETS_S = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1,
)  # fmt: skip
"""Routing takes tens of microseconds; the SDK's default buckets start at 5 ms and would put
every decision in the first bucket."""


class RouterMetrics:
    def __init__(self) -> None:
        m = meter("thunderagent.router")
        self.predicted_hits = m.create_counter(
            "thunderagent_predicted_hit_requests",
            description="Verified requests that were routed with a predicted cache hit",
        )
        self.false_hits = m.create_counter(
            "thunderagent_false_hit_requests",
            description="Predicted hits where the engine found fewer cached tokens than predicted",
        )
        self.missed_hits = m.create_counter(
            "thunderagent_missed_hit_requests",
            description="Requests where the engine found more cached tokens than predicted",
        )
        self.recomputed_tokens = m.create_counter(
            "thunderagent_recomputed_prompt_tokens",
            unit="{token}",
            description="Prompt tokens prefilled although some worker had them cached at routing",
        )
        self.decision_latency = m.create_histogram(
            "thunderagent_route_decision_duration",
            unit="s",
            description="Hashing + index walk + scoring per request",
            explicit_bucket_boundaries_advisory=list(DECISION_BUCKETS_S),
        )
        self.shed = m.create_counter(
            "thunderagent_shed_requests",
            description="Requests answered overloaded unrouted: the hand-offs this router "
            "waits on were at their limit (HandoffLimit)",
        )
