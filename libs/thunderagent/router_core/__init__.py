"""The router's decision as one pure core (``RouterCore``), run by the router service and by the
virtual-time replay alike."""

from thunderagent.router_core.core import FeedbackWindow, Routed, RouterCore, RouterParams
from thunderagent.router_core.verification import Dispatch, Verdict, Verifier

__all__ = [
    "Dispatch",
    "FeedbackWindow",
    "Routed",
    "RouterCore",
    "RouterParams",
    "Verdict",
    "Verifier",
]
