"""OpenAI response bodies and server-sent-event frames, built from the stack's replies. Pure.

Streams are framed as OpenAI frames them: ``data: {json}\\n\\n`` per chunk, the chat role in the
first delta, ``finish_reason`` on the last choice chunk, with ``stream_options.include_usage``
a ``usage: null`` on every chunk and one more chunk with empty ``choices`` and the usage, then
``data: [DONE]\\n\\n``. An error after the stream has started is one ``data: {"error": ...}``
frame (the OpenAI SDKs raise it as an ``APIError``), with no ``[DONE]``. The usage chunk (and a
whole answer) also carries ``x_thunderagent``: the worker that ran the request and the engine's
own time to first token.
"""

from __future__ import annotations

from typing import Any

import msgspec

from thunderagent.gateway.errors import HttpError
from thunderagent.schemas import FinalReply, FinishReason, Usage

DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.Encoder().encode

FINISH = {FinishReason.LENGTH: "length", FinishReason.STOP: "stop", FinishReason.ABORT: "abort"}


def usage(u: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def extension(final: FinalReply) -> dict[str, Any]:
    """Where the request ran and what the engine itself took to its first token, next to the
    usage (clients ignore unknown keys): benchmarks subtract it to get what the stack added."""
    return {"worker_id": final.worker_id, "engine_ttft_ms": final.engine_ttft_ms}


def response_id(request_id: str, *, chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"


def completion_body(final: FinalReply, text: str, *, chat: bool, model: str, created: int) -> bytes:
    """The whole (non-streamed) answer."""
    finish = FINISH.get(final.finish_reason, "stop")
    if chat:
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return _encode({
        "id": response_id(final.request_id, chat=chat),
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage(final.usage),
        "x_thunderagent": extension(final),
    })  # fmt: skip


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + _encode(payload) + b"\n\n"


def sse_error(err: HttpError) -> bytes:
    return b"data: " + err.body() + b"\n\n"


class StreamEncoder:
    """The frames of one streamed answer, in order: :meth:`tokens` per token chunk, then
    :meth:`finish` once."""

    __slots__ = ("_base", "_chat", "_include_usage", "_started")

    def __init__(
        self, *, chat: bool, request_id: str, model: str, created: int, include_usage: bool
    ) -> None:
        self._chat = chat
        self._include_usage = include_usage
        self._started = False
        self._base: dict[str, Any] = {
            "id": response_id(request_id, chat=chat),
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": model,
        }

    def _chunk(self, choice: dict[str, Any]) -> bytes:
        payload = {**self._base, "choices": [choice]}
        if self._include_usage:
            payload["usage"] = None
        return sse(payload)

    def _choice(self, text: str | None, finish: str | None, *, role: bool = False) -> dict:
        if not self._chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    def _start(self) -> bytes:
        """Chat streams open with the assistant role and empty content, as OpenAI's do."""
        self._started = True
        return self._chunk(self._choice("", None, role=True)) if self._chat else b""

    def tokens(self, text: str) -> bytes:
        head = b"" if self._started else self._start()
        if not text:
            return head
        return head + self._chunk(self._choice(text, None))

    def finish(self, final: FinalReply) -> bytes:
        head = b"" if self._started else self._start()
        finish = FINISH.get(final.finish_reason, "stop")
        out = head + self._chunk(self._choice(None if self._chat else "", finish))
        if self._include_usage:
            out += sse({**self._base, "choices": [], "usage": usage(final.usage),
                        "x_thunderagent": extension(final)})  # fmt: skip
        return out + DONE
