"""One request's trip over NATS: publish on the model's request subject with a reply subject
from a shared inbox, read the replies, and (optionally) cancel the request if it is abandoned.

All requests of a process share one wildcard subscription (``<inbox>.*``) and are told apart by
the last token of their reply subject, as nats-py's own request/reply does: a subscription per
request would cost a SUB and an UNSUB per request on the server and on this event loop. Used by
``ThunderClient`` and the HTTP gateway alike. With a ``route`` (a router embedded in this
process) the request is not published: the router is called directly and the replies still
arrive on the shared inbox.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import msgspec
from nats.aio.client import Client as NATS
from nats.errors import ConnectionClosedError, MaxPayloadError, OutboundBufferLimitError
from opentelemetry import context as otel_context

from thunderagent.bus.errors import DECODE_ERRORS
from thunderagent.bus.fastpath import subscribe_fast
from thunderagent.schemas import (
    REPLY_DECODER,
    CancelRequest,
    ErrorCode,
    ErrorReply,
    FinalReply,
    GenerateRequest,
    HeldReply,
    ReplyMessage,
    TokenChunk,
    subjects,
)
from thunderagent.telemetry import extract_context, inject_headers

if TYPE_CHECKING:
    from thunderagent.bus import Bus

log = logging.getLogger(__name__)
_encode = msgspec.json.Encoder().encode

RETRY_PAUSE_S = 0.5
"""First wait before resending after an ``unavailable`` answer, doubling each time (a
scheduler restarting needs a moment); after silence it is resent at once."""
_TRANSIENT = frozenset({"router", "scheduler"})


Route = Callable[[GenerateRequest, str], Awaitable[None]]
"""A router in this process: routes a request and hands it on, answers going to the reply
subject (``Router.handle``); given to ``Call``, it replaces the publish to a router replica."""


def _worth_retrying(reply: ReplyMessage | None) -> bool:
    """Silence, or a control-plane service saying it cannot take the request right now."""
    return reply is None or (
        isinstance(reply, ErrorReply)
        and reply.code == ErrorCode.UNAVAILABLE
        and reply.service in _TRANSIENT
    )


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class Inbox:
    """Replies of one request: a deque and at most one waiter (lighter than asyncio.Queue)."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None

    def put(self, msg) -> None:
        self._items.append(msg)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def pop(self):
        return self._items.popleft() if self._items else None

    async def get(self, timeout_s: float | None = None):
        """The next reply; TimeoutError after ``timeout_s`` without one. A timer handle rather
        than ``asyncio.timeout``: this runs on every request's path (1.3 vs 6.5 µs here)."""
        loop = asyncio.get_running_loop()
        while not self._items:
            waiter = self._waiter = loop.create_future()
            timer = None if timeout_s is None else loop.call_later(timeout_s, _expire, waiter)
            try:
                await waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()
        return self._items.popleft()


class ReplyMux:
    """The shared reply subscription: hands each message to the inbox of its request."""

    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self.prefix = nc.new_inbox()
        self._inboxes: dict[str, Inbox] = {}
        self._ids = itertools.count()
        self._sub = None
        self._starting: asyncio.Lock | None = None

    @classmethod
    def on(cls, bus: Bus) -> ReplyMux:
        """The mux over a service's bus connection."""
        return cls(bus.nc)

    async def start(self) -> None:
        """Subscribe (once; later calls return at once)."""
        if self._sub is not None:
            return
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._sub is None:
                self._sub = await subscribe_fast(self.nc, f"{self.prefix}.*", self._on_msg)

    def _on_msg(self, msg) -> None:
        inbox = self._inboxes.get(msg.subject[len(self.prefix) + 1 :])
        if inbox is not None:  # else: the request was abandoned; drop what still comes
            inbox.put(msg)

    def open(self) -> tuple[str, Inbox]:
        token = str(next(self._ids))
        inbox = self._inboxes[token] = Inbox()
        return f"{self.prefix}.{token}", inbox

    def close(self, reply_subject: str) -> None:
        self._inboxes.pop(reply_subject[len(self.prefix) + 1 :], None)

    def __len__(self) -> int:
        return len(self._inboxes)


Spawn = Callable[[Awaitable[None]], object]


class Call:
    """One request in flight. ``close()`` always runs; with ``spawn`` given, a request that was
    published and got no final or error reply is cancelled there (a ``CancelRequest`` published
    from a task made by ``spawn``), so the stack stops the work.

    Errors become ``ErrorReply`` answers naming ``service``: a request over the bus's payload
    limit, a closed connection, no router (NATS's 503), an undecodable reply, and no reply for
    ``idle_timeout_s`` (``timeout_code``)."""

    def __init__(
        self,
        mux: ReplyMux,
        request: GenerateRequest,
        *,
        idle_timeout_s: float,
        spawn: Spawn | None = None,
        service: str = "client",
        timeout_code: ErrorCode = ErrorCode.DEADLINE,
        retries: int = 0,
        retry_after_s: float = 5.0,
        route: Route | None = None,
    ) -> None:
        self.mux = mux
        self._route = route
        self.request = request
        self.retries = retries
        """Times the request may be sent again (same id, same reply subject) while no output
        came: no first reply within ``retry_after_s`` (a router died holding it), or the
        scheduler or router answered ``unavailable`` (restarting). The scheduler runs a request
        id at most once, so a retry never generates twice."""
        self.retry_after_s = retry_after_s
        self.idle_timeout_s = idle_timeout_s
        self.service = service
        self.timeout_code = timeout_code
        self.reply_subject, self._inbox = mux.open()
        self._spawn = spawn
        self.published = False
        self.finished = False
        self._delivered = 0
        """Output positions the client has had tokens for (``TokenChunk.index`` + its length)."""
        self.cancel_reason = "client disconnected"

    async def start(self, headers: dict[str, str] | None = None) -> ReplyMessage:
        """Publish the request (with ``headers``, else the current trace context) and wait for
        its first reply. With retries, a send heard by nobody within ``retry_after_s`` is sent
        again; once a send is answered ``HeldReply`` (a live router handed a resend to the
        scheduler, or the worker running it has nothing to send yet) the request just waits.
        If no send was heard at all, the answer is the router's ``unavailable`` after the last
        one's ``retry_after_s``, not the idle timeout: a router replica that is hung (stopped,
        swapping) holds what it reads without a word."""
        error = await self.publish(headers)
        if error is not None:
            self.finished = True
            return error
        if not self.retries:
            return await self.next()
        sends, started = 1, time.monotonic()
        while True:
            reply = await self._first(self.retry_after_s)
            if isinstance(reply, HeldReply):
                return await self.next()
            if not _worth_retrying(reply):  # not None: silence is worth retrying
                self._new(reply)  # the positions of a first chunk count as delivered
                return reply
            if not self.retries:
                return reply if reply is not None else self._unheard(sends, started)
            self.retries -= 1
            pause = RETRY_PAUSE_S * 2**self.request.retry  # 0.5, 1, 2 s...
            await asyncio.sleep(pause if reply is not None else 0.0)
            self.finished = False
            self.request = msgspec.structs.replace(self.request, retry=self.request.retry + 1)
            log.info("request %s: no answer yet (%s): sending it again",
                     self.request.request_id, reply.message if reply else "silence")  # fmt: skip
            error = await self.publish(headers)
            if error is not None:
                self.finished = True
                return error
            sends += 1

    def _unheard(self, sends: int, started: float) -> ErrorReply:
        """Every send went unanswered: no live router took the request."""
        waited = time.monotonic() - started
        self.cancel_reason = f"no router answered in {waited:.0f}s"
        return ErrorReply(
            code=ErrorCode.UNAVAILABLE,
            message=f"no router answered the request in {waited:.0f} s ({sends} sends): "
            f"a router replica may be hung",
            request_id=self.request.request_id,
            service="router",
        )

    async def _first(self, within_s: float) -> ReplyMessage | None:
        """The first reply (a ``HeldReply`` included); None when ``within_s`` passed without."""
        try:
            msg = await self._inbox.get(within_s)
        except TimeoutError:
            return None
        return self._decode(msg)

    async def publish(self, headers: dict[str, str] | None = None) -> ErrorReply | None:
        """Publish the request (or hand it to the router in this process); an ``ErrorReply``
        when it could not be."""
        if self._route is not None:
            # the router answers errors on the reply subject, as a router replica does; the
            # trace context it would have found in the headers is made current instead
            token = otel_context.attach(extract_context(headers)) if headers else None
            try:
                await self._route(self.request, self.reply_subject)
            finally:
                if token is not None:
                    otel_context.detach(token)
            self.published = True
            return None
        nc = self.mux.nc
        payload = _encode(self.request)
        limit = nc.max_payload
        if limit and len(payload) > limit:
            return self._error(
                ErrorCode.PAYLOAD_TOO_LARGE,
                f"request of {len(payload)} bytes is too large for NATS: it exceeds the bus "
                f"limit of {limit} bytes",
            )
        if headers is None:
            headers = inject_headers()
        try:
            await nc.publish(subjects.requests(self.request.model), payload,
                             reply=self.reply_subject, headers=headers or None)  # fmt: skip
        except MaxPayloadError as err:
            return self._error(ErrorCode.PAYLOAD_TOO_LARGE, f"request too large for NATS: {err}")
        except (ConnectionClosedError, OutboundBufferLimitError) as err:
            return self._error(ErrorCode.UNAVAILABLE, f"NATS unavailable: {err!r}")
        self.published = True
        return None

    def next_nowait(self) -> ReplyMessage | None:
        """The next reply already here, or None (a ``HeldReply`` is not one, nor are tokens
        the client already has: both are skipped)."""
        while (msg := self._inbox.pop()) is not None:
            reply = self._decode(msg)
            if self._new(reply):
                return reply
        return None

    async def next(self) -> ReplyMessage:
        """The next reply, ``HeldReply`` skipped (one may trail a resend the first token beat)
        and tokens the client already has skipped; the ``timeout_code`` error after
        ``idle_timeout_s`` without one."""
        while True:
            msg = self._inbox.pop()
            if msg is None:
                try:
                    msg = await self._inbox.get(self.idle_timeout_s)
                except TimeoutError:
                    self.cancel_reason = f"{self.service}: no reply within {self.idle_timeout_s:g}s"
                    return self._error(self.timeout_code, self.cancel_reason)
            reply = self._decode(msg)
            if self._new(reply):
                return reply

    def _new(self, reply: ReplyMessage) -> bool:
        """Whether ``reply`` is news to the client. A chunk whose tokens all sit at positions
        already delivered is a second run's copy: a run the scheduler could not confirm it had
        stopped (its worker answered neither the hand-off nor the abort) streams on beside the
        one that replaced it, both from the same position. The client keeps one stream."""
        if isinstance(reply, HeldReply):
            return False
        if isinstance(reply, TokenChunk) and reply.token_ids:
            end = reply.index + len(reply.token_ids)
            if end <= self._delivered:
                return False
            self._delivered = end
        return True

    def _decode(self, msg) -> ReplyMessage:
        headers = msg.headers
        status = headers.get("Status") if headers else None
        if status == "503" or (not msg.data and status):
            self.finished = True  # nothing was started: nothing to cancel
            model = self.request.model
            # the router service is what is missing (none up, or one restarting): said as its
            # own ``unavailable``, so a caller's retries cover a router restart
            return ErrorReply(
                code=ErrorCode.UNAVAILABLE,
                message=f"no router subscribes to {subjects.requests(model)}",
                request_id=self.request.request_id,
                service="router",
            )
        try:
            reply = REPLY_DECODER.decode(msg.data)
        except DECODE_ERRORS as err:
            return self._error(ErrorCode.INTERNAL, f"undecodable reply: {err}")
        if isinstance(reply, FinalReply | ErrorReply):
            self.finished = True
        return reply

    def _error(self, code: ErrorCode, message: str) -> ErrorReply:
        return ErrorReply(
            code=code, message=message, request_id=self.request.request_id, service=self.service
        )

    def close(self) -> None:
        """Stop reading replies; cancel the request if it is still running somewhere."""
        self.mux.close(self.reply_subject)
        if self._spawn is not None and self.published and not self.finished:
            cancel = CancelRequest(request_id=self.request.request_id, reason=self.cancel_reason)
            # A task: close() runs while the handler is being cancelled, where an await could
            # be interrupted; the publish itself is a buffer append.
            self._spawn(self._publish_cancel(cancel))

    async def _publish_cancel(self, cancel: CancelRequest) -> None:
        try:
            headers = inject_headers()
            await self.mux.nc.publish(subjects.SCHED_CANCEL, _encode(cancel),
                                      headers=headers or None)  # fmt: skip
        except Exception as err:  # connection closing: the scheduler's own timeouts remain
            log.warning("request %s: cancel not sent: %r", cancel.request_id, err)
