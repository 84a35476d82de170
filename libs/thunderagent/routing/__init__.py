"""Routing policies (pure): given a request and the candidate workers, a ranked candidate list."""

from thunderagent.routing.policy import (
    REGISTRY,
    RouteQuery,
    RoutingPolicy,
    WorkerView,
    get_policy,
    policy_names,
    register,
)

__all__ = [
    "REGISTRY",
    "RouteQuery",
    "RoutingPolicy",
    "WorkerView",
    "get_policy",
    "policy_names",
    "register",
]
