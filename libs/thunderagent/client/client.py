"""Send a generate request over NATS and stream its replies.

The request goes to ``thunderagent.requests.<model>`` with a fresh inbox as its reply subject;
token chunks and then exactly one final or error reply arrive on that inbox. When no router
subscribes, NATS answers the publish with a 503 status at once, which becomes an error here
instead of a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
from nats.aio.client import Client as NATS
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from thunderagent.bus import connect
from thunderagent.schemas import (
    REPLY_DECODER,
    ErrorCode,
    ErrorReply,
    FinalReply,
    GenerateRequest,
    ReplyMessage,
    TokenChunk,
    subjects,
)
from thunderagent.telemetry import inject_headers

_tracer = trace.get_tracer("thunderagent.client")
_encoder = msgspec.json.Encoder()


class RequestFailed(Exception):
    def __init__(self, error: ErrorReply) -> None:
        super().__init__(f"{error.code.value}: {error.message}")
        self.error = error


@dataclass
class Completion:
    """A finished request as the client saw it."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    final: FinalReply | None = None
    client_ttft_ms: float = 0.0
    client_e2e_ms: float = 0.0


class ThunderClient:
    def __init__(self, nc: NATS, *, idle_timeout_s: float = 60.0) -> None:
        self.nc = nc
        self.idle_timeout_s = idle_timeout_s

    @classmethod
    async def connect(cls, url: str, **kwargs) -> ThunderClient:
        return cls(await connect(url, name="thunderagent-client", deadline_s=10), **kwargs)

    async def close(self) -> None:
        await self.nc.drain()

    async def stream(self, request: GenerateRequest) -> AsyncIterator[ReplyMessage]:
        """Yield every reply message; the last one is a FinalReply or an ErrorReply."""
        if not request.request_id:
            request = msgspec.structs.replace(request, request_id=uuid.uuid4().hex)
        inbox = self.nc.new_inbox()
        queue: asyncio.Queue = asyncio.Queue()

        async def on_msg(msg) -> None:
            queue.put_nowait(msg)

        sub = await self.nc.subscribe(inbox, cb=on_msg)
        # The span is ended by hand rather than made current across ``yield``: a consumer that
        # stops iterating early would otherwise close it from another context.
        span = _tracer.start_span("client generate", kind=SpanKind.PRODUCER)
        span.set_attribute("thunderagent.request_id", request.request_id)
        try:
            headers = inject_headers(context=trace.set_span_in_context(span))
            await self.nc.publish(
                subjects.requests(request.model),
                _encoder.encode(request),
                reply=inbox,
                headers=headers,
            )
            while True:
                reply = await self._next(queue, request)
                if isinstance(reply, ErrorReply):
                    span.set_status(Status(StatusCode.ERROR, reply.message))
                if not isinstance(reply, TokenChunk):
                    span.end()
                    span = None
                yield reply
                if not isinstance(reply, TokenChunk):
                    return
        finally:
            if span is not None:  # the consumer stopped before the final reply
                span.end()
            with contextlib.suppress(Exception):  # the connection may be draining already
                await sub.unsubscribe()

    async def _next(self, queue: asyncio.Queue, request: GenerateRequest) -> ReplyMessage:
        try:
            msg = await asyncio.wait_for(queue.get(), self.idle_timeout_s)
        except TimeoutError:
            return ErrorReply(
                code=ErrorCode.UNAVAILABLE,
                message=f"no reply within {self.idle_timeout_s}s",
                request_id=request.request_id,
                service="client",
            )
        status = (msg.headers or {}).get("Status")
        if status == "503" or (not msg.data and status):
            return ErrorReply(
                code=ErrorCode.UNAVAILABLE,
                message=f"no router subscribes to {subjects.requests(request.model)}",
                request_id=request.request_id,
                service="client",
            )
        try:
            return REPLY_DECODER.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            return ErrorReply(
                code=ErrorCode.INTERNAL,
                message=f"undecodable reply: {err}",
                request_id=request.request_id,
                service="client",
            )

    async def generate(self, request: GenerateRequest) -> Completion:
        """Run a request to completion; raises :class:`RequestFailed` on an error reply."""
        started = time.perf_counter()
        done = Completion(request_id=request.request_id)
        async for reply in self.stream(request):
            if isinstance(reply, TokenChunk):
                if not done.token_ids:
                    done.client_ttft_ms = (time.perf_counter() - started) * 1e3
                done.request_id = reply.request_id
                done.token_ids.extend(reply.token_ids)
                done.text += reply.text
            elif isinstance(reply, FinalReply):
                done.request_id = reply.request_id
                done.final = reply
                if reply.text:
                    done.text = reply.text
            else:
                raise RequestFailed(reply)
        done.client_e2e_ms = (time.perf_counter() - started) * 1e3
        if not done.client_ttft_ms:
            done.client_ttft_ms = done.client_e2e_ms
        return done
