"""NATS helpers shared by every service: connection with backoff, typed publish/request with
trace context in headers, JetStream (the KV-event stream, the workers bucket), and
subscriptions that turn bad input into error replies and dead-letter records instead of
crashing the service."""

from thunderagent.bus.bus import Bus, Delivery
from thunderagent.bus.connection import connect
from thunderagent.bus.errors import (
    BadReply,
    BusError,
    NoResponders,
    PayloadTooLarge,
    RequestTimeout,
)
from thunderagent.bus.jetstream import Bucket, BucketEntry, StreamConsumer

__all__ = [
    "BadReply",
    "Bucket",
    "BucketEntry",
    "Bus",
    "BusError",
    "Delivery",
    "NoResponders",
    "PayloadTooLarge",
    "RequestTimeout",
    "StreamConsumer",
    "connect",
]
