"""Python client: publish a request, stream its replies through one shared reply inbox."""

from thunderagent.client.client import Completion, RequestFailed, ThunderClient
from thunderagent.client.mux import Call, Inbox, ReplyMux, Route

__all__ = ["Call", "Completion", "Inbox", "ReplyMux", "RequestFailed", "Route", "ThunderClient"]
