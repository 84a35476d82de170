"""Dead-letter record: a message a service could not use, kept with the reason."""

from __future__ import annotations

from msgspec import Struct, field


class DeadLetter(Struct, frozen=True, kw_only=True):
    """Published on ``thunderagent.deadletter.<service>`` for every rejected message."""

    service: str
    """Service that rejected the message."""
    subject: str
    """Subject the message arrived on."""
    reason: str
    """Why it was rejected (decode or validation error, handler failure)."""
    raw: bytes
    """The message body exactly as received (base64 in JSON)."""
    received_at: float
    """Unix seconds."""
    headers: dict[str, str] = field(default_factory=dict)
    """The message's NATS headers."""
    reply: str = ""
    """Its reply subject, if any (an error reply was sent there)."""
