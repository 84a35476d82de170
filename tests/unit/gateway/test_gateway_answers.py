"""ErrorReply -> HTTP status and headers (every code), and the SSE / JSON answers' exact shape."""

from __future__ import annotations

import json

import pytest

from thunderagent.gateway.errors import STATUS, from_reply, retry_headers
from thunderagent.gateway.responses import StreamEncoder, completion_body, sse_error
from thunderagent.schemas import ErrorCode, ErrorReply, FinalReply, FinishReason, Usage


def test_every_error_code_has_a_status():
    assert set(STATUS) == set(ErrorCode)


@pytest.mark.parametrize(
    ("code", "status", "kind"),
    [
        (ErrorCode.BAD_REQUEST, 400, "invalid_request_error"),
        (ErrorCode.CONTEXT_LENGTH, 400, "invalid_request_error"),
        (ErrorCode.UNKNOWN_MODEL, 404, "invalid_request_error"),
        (ErrorCode.PAYLOAD_TOO_LARGE, 413, "invalid_request_error"),
        (ErrorCode.OVERLOADED, 429, "rate_limit_error"),
        (ErrorCode.CANCELLED, 499, "invalid_request_error"),
        (ErrorCode.INTERNAL, 500, "server_error"),
        (ErrorCode.ENGINE_ERROR, 502, "server_error"),
        (ErrorCode.UNAVAILABLE, 503, "server_error"),
        (ErrorCode.DEADLINE, 504, "server_error"),
    ],
)
def test_error_reply_to_http(code, status, kind):
    err = from_reply(ErrorReply(code=code, message="why", service="router"))
    assert (err.status, err.type) == (status, kind)
    body = json.loads(err.body())
    assert body == {"error": {"message": "why (router)", "type": kind, "param": None,
                              "code": err.code}}  # fmt: skip
    assert err.headers == {}


def test_overloaded_carries_retry_after():
    err = from_reply(ErrorReply(code=ErrorCode.OVERLOADED, message="queue full",
                                retry_after_s=1.25))  # fmt: skip
    assert err.status == 429 and err.code == "rate_limit_exceeded"
    assert err.headers == {"retry-after": "2", "retry-after-ms": "1250"}
    assert retry_headers(0.0) == {"retry-after": "0", "retry-after-ms": "0"}


def test_payload_too_large_and_context_length_codes():
    big = from_reply(ErrorReply(code=ErrorCode.PAYLOAD_TOO_LARGE, message="over 1 MiB"))
    assert (big.status, big.code) == (413, "payload_too_large")
    ctx = from_reply(ErrorReply(code=ErrorCode.CONTEXT_LENGTH, message="too long"))
    assert (ctx.status, ctx.code) == (400, "context_length_exceeded")


FINAL = FinalReply(
    request_id="r1", worker_id="w0", ttft_ms=1, e2e_ms=2,
    usage=Usage(prompt_tokens=10, cached_tokens=8, completion_tokens=3),
    finish_reason=FinishReason.STOP,
)  # fmt: skip


def frames(raw: bytes) -> list:
    assert raw.endswith(b"\n\n")
    out = []
    for frame in raw.decode().split("\n\n")[:-1]:
        assert frame.startswith("data: ")
        data = frame.removeprefix("data: ")
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_chat_stream_frames_as_openai_sends_them():
    enc = StreamEncoder(chat=True, request_id="r1", model="m", created=5, include_usage=True)
    got = frames(enc.tokens("Hel") + enc.tokens("") + enc.tokens("lo") + enc.finish(FINAL))
    assert got[-1] == "[DONE]"
    chunks = got[:-1]
    assert all(c["id"] == "chatcmpl-r1" and c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"].get("content") for c in chunks[1:3]] == ["Hel", "lo"]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:4]] == [None, None, None, "stop"]
    assert chunks[3]["choices"][0]["delta"] == {}
    assert all(c["usage"] is None for c in chunks[:4])
    assert chunks[4]["choices"] == []
    assert chunks[4]["usage"] == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                                  "prompt_tokens_details": {"cached_tokens": 8}}  # fmt: skip
    assert chunks[4]["x_thunderagent"] == {"worker_id": FINAL.worker_id,
                                           "engine_ttft_ms": FINAL.engine_ttft_ms}  # fmt: skip


def test_completion_stream_without_usage():
    enc = StreamEncoder(chat=False, request_id="r1", model="m", created=5, include_usage=False)
    got = frames(enc.tokens("a") + enc.finish(FINAL))
    assert [c["choices"][0]["text"] for c in got[:-1]] == ["a", ""]
    assert got[1]["choices"][0]["finish_reason"] == "stop"
    assert all("usage" not in c and c["object"] == "text_completion" for c in got[:-1])
    assert got[-1] == "[DONE]"


def test_a_stream_without_tokens_still_opens_with_the_role():
    enc = StreamEncoder(chat=True, request_id="r1", model="m", created=5, include_usage=False)
    got = frames(enc.finish(FINAL))
    assert got[0]["choices"][0]["delta"]["role"] == "assistant"
    assert got[1]["choices"][0]["finish_reason"] == "stop" and got[2] == "[DONE]"


def test_error_frame_mid_stream():
    err = from_reply(ErrorReply(code=ErrorCode.ENGINE_ERROR, message="boom"))
    (frame,) = frames(sse_error(err))
    assert frame["error"]["code"] == "engine_error"


def test_non_streamed_bodies():
    body = json.loads(completion_body(FINAL, "hey", chat=True, model="m", created=5))
    assert body["object"] == "chat.completion" and body["id"] == "chatcmpl-r1"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "hey"},
                                "logprobs": None, "finish_reason": "stop"}]  # fmt: skip
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 8}
    text = json.loads(completion_body(FINAL, "hey", chat=False, model="m", created=5))
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == "hey"
