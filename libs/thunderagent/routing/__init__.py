"""Routing policies (pure): given a request and the candidate workers, a ranked candidate list.

Importing the package registers every built-in policy in ``POLICIES``.
"""

from thunderagent.routing import (  # noqa: F401  (each module registers its policy)
    dynamo_kv,
    least_loaded,
    llm_d,
    round_robin,
    sglang_cache_aware,
    smg_cache_aware,
    thunder,
)
from thunderagent.routing.policy import (
    POLICIES,
    PolicyHooks,
    RouteQuery,
    RoutingFeedback,
    RoutingPolicy,
    WorkerView,
)

__all__ = [
    "POLICIES",
    "PolicyHooks",
    "RouteQuery",
    "RoutingFeedback",
    "RoutingPolicy",
    "WorkerView",
]
