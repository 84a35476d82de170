"""The router's metrics (OpenTelemetry instruments on the Prometheus endpoint).

Names, units and labels follow the contract in ops/README.md, which the Grafana dashboard
queries; rates are computed there from the counters.
"""

from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING

from opentelemetry.metrics import Observation

from thunderagent.telemetry.setup import meter

if TYPE_CHECKING:
    from thunderagent.router.request_path import Router

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


_ROUTERS: weakref.WeakSet[Router] = weakref.WeakSet()


def watch_handoffs(router: Router) -> None:
    """Report ``router``'s bound on hand-offs and how many wait for an ack, at each scrape."""
    _handoff_gauges()
    _ROUTERS.add(router)


@functools.cache
def _handoff_gauges() -> None:
    """Made once per process: OpenTelemetry answers a second instrument of a name with the
    first, so a second router's callback would never be called; this one reads them all."""
    m = meter("thunderagent.router")

    def read(field: str) -> list[Observation]:
        return [Observation(getattr(r.handoffs, field), {"router_id": r.config.router_id})
                for r in list(_ROUTERS)]  # fmt: skip

    m.create_observable_gauge(
        "thunderagent_router_handoffs_in_flight",
        [lambda _: read("in_flight")],
        description="Requests this router has handed on and waits for the ack of",
    )
    m.create_observable_gauge(
        "thunderagent_router_handoff_bound",
        [lambda _: read("limit")],
        description="The bound on them (HandoffLimit): past it requests are answered overloaded",
    )
