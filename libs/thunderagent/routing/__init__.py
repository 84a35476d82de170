"""Routing policies (pure): given a request and the candidate workers, a ranked candidate list."""

from thunderagent.routing.policy import REGISTRY, RouteInput, RoutingPolicy, get_policy

__all__ = ["REGISTRY", "RouteInput", "RoutingPolicy", "get_policy"]
