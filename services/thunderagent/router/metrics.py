"""The router's metrics (OpenTelemetry instruments, exported on the Prometheus endpoint).

Names match what ops/grafana's dashboard queries; rates are computed there from counters.
"""

from __future__ import annotations

from thunderagent.telemetry.setup import meter


class RouterMetrics:
    def __init__(self) -> None:
        m = meter("thunderagent.router")
        self.requests = m.create_counter(
            "thunderagent_router_requests", description="Requests routed"
        )
        self.predicted_hits = m.create_counter(
            "thunderagent_router_predicted_hits",
            description="Requests routed to a worker with a predicted cache hit (hit rate numerator)",
        )
        self.prompt_tokens = m.create_counter(
            "thunderagent_prompt_tokens", description="Prompt tokens of verified requests"
        )
        self.cached_tokens = m.create_counter(
            "thunderagent_cached_tokens",
            description="Prompt tokens the engine served from cache (reuse rate numerator)",
        )
        self.recompute_tokens = m.create_counter(
            "thunderagent_prefill_recompute_tokens",
            description="Prompt tokens prefilled although another worker had them cached",
        )
        self.routed_prompt_tokens = m.create_counter(
            "thunderagent_router_prompt_tokens", description="Prompt tokens of routed requests"
        )
        self.false_hits = m.create_counter(
            "thunderagent_false_hits",
            description="Verified requests with fewer cached tokens than predicted",
        )
        self.missed_hits = m.create_counter(
            "thunderagent_missed_hits",
            description="Verified requests with more cached tokens than predicted",
        )
        self.verified = m.create_counter(
            "thunderagent_verified_requests", description="Requests whose prediction was checked"
        )
        self.decision_latency = m.create_histogram(
            "thunderagent_routing_decision_seconds",
            unit="s",
            description="Hashing + index walk + scoring per request",
        )
