"""Send a generate request over NATS and stream its replies.

The request goes to ``thunderagent.requests.<model>`` with a reply subject under the client's one
shared inbox subscription (``mux.ReplyMux``); token chunks and then exactly one final or error
reply arrive there. When no router subscribes, NATS answers the publish with a 503 status at
once, which becomes an error here instead of a timeout; no reply for ``idle_timeout_s`` is an
error too.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
from nats.aio.client import Client as NATS
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from thunderagent.bus import connect
from thunderagent.client.mux import Call, ReplyMux, Route
from thunderagent.schemas import (
    ErrorCode,
    ErrorReply,
    FinalReply,
    GenerateRequest,
    ReplyMessage,
    TokenChunk,
)
from thunderagent.telemetry import inject_headers

_tracer = trace.get_tracer("thunderagent.client")


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
    """``cancel_abandoned``: a stream its consumer leaves before the final reply publishes a
    ``CancelRequest``, so the stack stops the run (the gateway does this for a client that
    disconnects)."""

    def __init__(
        self,
        nc: NATS,
        *,
        idle_timeout_s: float = 60.0,
        cancel_abandoned: bool = False,
        retries: int = 3,
        retry_after_s: float = 5.0,
        route: Route | None = None,
    ) -> None:
        """``route``: a router embedded in this process (``RouterService(...,
        serve_requests=False).router.handle``) instead of publishing to a router replica; give
        the client that replica's connection (``service.ctx.bus.nc``), on which a run's end
        arrives before its answer, so the next turn finds the worker freed."""
        self.nc = nc
        self.route = route
        self.idle_timeout_s = idle_timeout_s
        self.retries = retries
        """Resends of a request that got no first reply in ``retry_after_s`` or was refused
        as unavailable by the control plane (same id: it still runs once)."""
        self.retry_after_s = retry_after_s
        self.mux = ReplyMux(nc)
        self._cancel = cancel_abandoned
        self._tasks: set[asyncio.Task] = set()

    @classmethod
    async def connect(cls, url: str, **kwargs) -> ThunderClient:
        return cls(await connect(url, name="thunderagent-client", deadline_s=10), **kwargs)

    async def close(self) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=2)
        await self.nc.drain()

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stream(self, request: GenerateRequest) -> AsyncIterator[ReplyMessage]:
        """Yield every reply message; the last one is a FinalReply or an ErrorReply."""
        if not request.request_id:
            # 128 random bits as 32 hex digits, like uuid4().hex at a fifth of its cost
            request = msgspec.structs.replace(request, request_id=os.urandom(16).hex())
        await self.mux.start()
        call = Call(self.mux, request, idle_timeout_s=self.idle_timeout_s,
                    spawn=self._spawn if self._cancel else None, service="client",
                    timeout_code=ErrorCode.UNAVAILABLE, retries=self.retries,
                    retry_after_s=self.retry_after_s, route=self.route)  # fmt: skip
        # The span is ended by hand rather than made current across ``yield``: a consumer that
        # stops iterating early would otherwise close it from another context.
        span = _tracer.start_span("client generate", kind=SpanKind.PRODUCER)
        try:
            if span.is_recording():
                span.set_attribute("thunderagent.request_id", request.request_id)
            headers = inject_headers(context=trace.set_span_in_context(span))
            reply = await call.start(headers)
            while True:
                if not isinstance(reply, TokenChunk):
                    if isinstance(reply, ErrorReply):
                        span.set_status(Status(StatusCode.ERROR, reply.message))
                    span.end()
                    span = None
                    yield reply
                    return
                yield reply
                reply = call.next_nowait() or await call.next()
        finally:
            if span is not None:  # the consumer stopped before the final reply
                span.end()
            call.close()

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
