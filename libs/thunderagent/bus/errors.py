"""Errors raised by the bus helpers; each names the subject it concerns."""

from __future__ import annotations

import re

import msgspec

DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)
"""What decoding bad input raises: msgspec's errors, and RecursionError for JSON nested some
thousands deep (msgspec recurses into values it skips), which must be rejected like the rest."""


class BusError(Exception):
    def __init__(self, subject: str, message: str) -> None:
        super().__init__(f"{subject}: {message}")
        self.subject = subject


class NoResponders(BusError):
    """Nobody subscribes to the subject (NATS answered 503 at once)."""

    def __init__(self, subject: str) -> None:
        super().__init__(subject, "no responders")


class RequestTimeout(BusError):
    def __init__(self, subject: str, timeout: float) -> None:
        super().__init__(subject, f"no reply within {timeout:.3f}s")
        self.timeout = timeout


class PayloadTooLarge(BusError):
    """The encoded message exceeds what the NATS server accepts (its ``max_payload``)."""

    def __init__(self, subject: str, size: int, limit: int) -> None:
        super().__init__(subject, f"message of {size} bytes exceeds the bus limit of {limit} bytes")
        self.size = size
        self.limit = limit


class BadReply(BusError):
    """The answer was not the expected message: an ``ErrorReply`` (``code`` set: the service
    refused, e.g. the message failed its validation) or bytes that decode as neither."""

    def __init__(self, subject: str, message: str, code: str | None = None) -> None:
        super().__init__(subject, message)
        self.code = code


MAX_SUBJECT_BYTES = 1024
"""Longest subject the bus sends. NATS closes a connection whose protocol line exceeds its
``max_control_line`` (4 KB), and nats-py then closes the client for good; a subject built from a
message field (a reply subject, a router or worker id) must never get that far."""


_WHITE_SPACE = re.compile(r"\s")
"""What ``str.isspace`` calls white space (the same characters), found in C: a Python loop over
the subject's characters cost ~1 µs of every publish."""


class BadSubject(BusError):
    """A subject NATS would refuse (empty, white space, too long): refused before sending."""

    def __init__(self, subject: str) -> None:
        shown = subject if len(subject) <= 80 else subject[:80] + "..."
        super().__init__(shown, f"not a subject the bus sends ({len(subject)} characters)")


def check_subject(subject: str) -> None:
    """Raise :class:`BadSubject` unless ``subject`` is safe to publish to."""
    if (
        not subject
        or (len(subject) * 4 > MAX_SUBJECT_BYTES and len(subject.encode()) > MAX_SUBJECT_BYTES)
        or _WHITE_SPACE.search(subject)
    ):
        raise BadSubject(subject)
