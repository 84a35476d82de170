"""Errors raised by the bus helpers; each names the subject it concerns."""

from __future__ import annotations

import msgspec

DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)
"""What decoding bad input raises: msgspec's errors, and RecursionError for JSON nested some
thousands deep (msgspec recurses into values it skips), which must be rejected like the rest."""


class BusError(Exception):
    def __init__(self, subject: str, message: str) -> None:
        super().__init__(f"{subject}: {message}")
        self.subject = subject

    def is_unavailable(self) -> bool:
        """True when retrying elsewhere (another worker, later) may succeed."""
        return False


class NoResponders(BusError):
    """Nobody subscribes to the subject (NATS answered 503 at once)."""

    def __init__(self, subject: str) -> None:
        super().__init__(subject, "no responders")

    def is_unavailable(self) -> bool:
        return True


class RequestTimeout(BusError):
    def __init__(self, subject: str, timeout: float) -> None:
        super().__init__(subject, f"no reply within {timeout:.3f}s")
        self.timeout = timeout

    def is_unavailable(self) -> bool:
        return True


class PayloadTooLarge(BusError):
    """The encoded message exceeds what the NATS server accepts (its ``max_payload``)."""

    def __init__(self, subject: str, size: int, limit: int) -> None:
        super().__init__(subject, f"message of {size} bytes exceeds the bus limit of {limit} bytes")
        self.size = size
        self.limit = limit
