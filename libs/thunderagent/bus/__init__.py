"""NATS helpers shared by every service: connection with backoff, typed publish/request with
trace context in headers, and subscriptions that turn bad input into error replies and
dead-letter records instead of crashing the service."""

from thunderagent.bus.bus import Bus, Delivery
from thunderagent.bus.connection import connect
from thunderagent.bus.errors import BusError, NoResponders, RequestTimeout

__all__ = ["Bus", "BusError", "Delivery", "NoResponders", "RequestTimeout", "connect"]
