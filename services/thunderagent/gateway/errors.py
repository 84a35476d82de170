"""Errors in OpenAI's JSON shape, and the one table from ``ErrorCode`` to an HTTP status.

OpenAI answers ``{"error": {"message", "type", "param", "code"}}``; its SDKs pick the exception
class from the status alone (400 BadRequestError, 404 NotFoundError, 429 RateLimitError, ...),
so the status is the contract and ``code`` is the machine-readable detail. Where OpenAI has a
code of its own for the same case (``model_not_found``, ``context_length_exceeded``,
``rate_limit_exceeded``) that one is used; otherwise our ``ErrorCode`` value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import msgspec

from thunderagent.schemas import ErrorCode, ErrorReply

CLIENT_CLOSED = 499
"""nginx's status for "the client closed the connection first": what the request counter
records for a client that went away (no response is sent)."""


@dataclass(frozen=True, slots=True)
class Mapping:
    status: int
    type: str
    code: str


_INVALID = "invalid_request_error"
_SERVER = "server_error"

STATUS: dict[ErrorCode, Mapping] = {
    ErrorCode.BAD_REQUEST: Mapping(400, _INVALID, "bad_request"),
    ErrorCode.CONTEXT_LENGTH: Mapping(400, _INVALID, "context_length_exceeded"),
    ErrorCode.UNKNOWN_MODEL: Mapping(404, _INVALID, "model_not_found"),
    ErrorCode.PAYLOAD_TOO_LARGE: Mapping(413, _INVALID, "payload_too_large"),
    ErrorCode.OVERLOADED: Mapping(429, "rate_limit_error", "rate_limit_exceeded"),
    ErrorCode.CANCELLED: Mapping(CLIENT_CLOSED, _INVALID, "cancelled"),
    ErrorCode.INTERNAL: Mapping(500, _SERVER, "internal"),
    ErrorCode.ENGINE_ERROR: Mapping(502, _SERVER, "engine_error"),
    ErrorCode.UNAVAILABLE: Mapping(503, _SERVER, "unavailable"),
    ErrorCode.DEADLINE: Mapping(504, _SERVER, "deadline_exceeded"),
}
"""Every ``ErrorCode`` has a row (a unit test checks it), so a new code cannot fall through."""


@dataclass(eq=False)
class HttpError(Exception):
    """An error answer: status, OpenAI error body fields, extra headers (``retry-after``)."""

    status: int
    message: str
    type: str = _INVALID
    code: str | None = None
    param: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.status} {self.code}: {self.message}"

    def body(self) -> bytes:
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return msgspec.json.encode({"error": error})


def bad_request(message: str, param: str | None = None) -> HttpError:
    return HttpError(400, message, code="bad_request", param=param)


def from_code(code: ErrorCode, message: str, *, retry_after_s: float | None = None) -> HttpError:
    m = STATUS[code]
    headers = retry_headers(retry_after_s) if retry_after_s is not None else {}
    return HttpError(m.status, message, type=m.type, code=m.code, headers=headers)


def from_reply(error: ErrorReply) -> HttpError:
    """The HTTP answer for an ``ErrorReply`` from the stack."""
    message = error.message
    if error.service:
        message = f"{message} ({error.service})"
    return from_code(error.code, message, retry_after_s=error.retry_after_s)


def retry_headers(retry_after_s: float) -> dict[str, str]:
    """``retry-after`` must be whole seconds (RFC 9110), so it is rounded up; OpenAI's SDKs
    also read ``retry-after-ms``, which keeps the precision."""
    seconds = max(0.0, retry_after_s)
    return {"retry-after": str(math.ceil(seconds)), "retry-after-ms": str(round(seconds * 1e3))}
