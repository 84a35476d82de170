"""Python client: publish a request, stream the reply inbox."""

from thunderagent.client.client import Completion, RequestFailed, ThunderClient

__all__ = ["Completion", "RequestFailed", "ThunderClient"]
