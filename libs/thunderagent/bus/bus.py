"""Typed publish / request / subscribe over one NATS connection.

Every outgoing message carries the current W3C trace context in its headers (none when there
is no context: a plain ``PUB``, no header block); every incoming message is decoded into its
msgspec type, inside a span that continues the sender's trace only when that trace is sampled and
this process traces (``thunderagent.telemetry.propagation``): a message without trace context, or
whose trace was sampled out, costs no span work, and with tracing off none at all. A message that
fails to decode or validate, or whose handler raises, is answered with an ``ErrorReply`` when it
has a reply subject and recorded on the service's dead-letter subject with the raw bytes and the
reason. The subscription keeps running either way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from thunderagent.bus.errors import (
    DECODE_ERRORS,
    BadReply,
    BusError,
    PayloadTooLarge,
    check_subject,
)
from thunderagent.bus.fastpath import subscribe_fast
from thunderagent.bus.jetstream import JetStreamMixin
from thunderagent.bus.replies import Replies
from thunderagent.schemas import DeadLetter, ErrorCode, ErrorReply, subjects
from thunderagent.telemetry import extract_context, inject_headers, sampled_flag, tracing_active
from thunderagent.telemetry.setup import meter

log = logging.getLogger(__name__)
T = TypeVar("T")

LATE_DELIVERY_GRACE_S = 0.05
"""How long a draining subscription still takes messages after the server acknowledged its
UNSUB (a message in flight inside the server lands within microseconds)."""

_encoder = msgspec.json.Encoder()
_decoders: dict[Any, msgspec.json.Decoder] = {}


def encode(message: Any) -> bytes:
    return _encoder.encode(message)


def decoder_for(message_type: Any) -> msgspec.json.Decoder:
    dec = _decoders.get(message_type)
    if dec is None:
        dec = _decoders[message_type] = msgspec.json.Decoder(message_type)
    return dec


@dataclass(slots=True, frozen=True)
class Delivery:
    """Where a decoded message came from; handlers use ``reply`` to answer."""

    subject: str
    reply: str
    headers: dict[str, str]
    raw: bytes


Handler = Callable[[T, Delivery], Awaitable[None]]


@dataclass
class SubscriptionStats:
    """Counters a test or health endpoint can read without a metrics backend."""

    delivered: int = 0
    dead_lettered: int = 0
    handler_errors: int = 0


@dataclass
class Bus(JetStreamMixin):
    """One service's view of NATS. ``service`` names the dead-letter subject and the spans."""

    nc: NATS
    service: str
    stats: dict[str, SubscriptionStats] = field(default_factory=dict)
    _tasks: set[asyncio.Task] = field(default_factory=set)
    _subs: list[Subscription] = field(default_factory=list)
    """What :meth:`subscribe` made: :meth:`drain` removes their interest first."""
    _replies: Replies | None = field(default=None, repr=False)
    """The shared reply subscription of :meth:`request` (made on first use)."""

    def __post_init__(self) -> None:
        self._tracer = trace.get_tracer(f"thunderagent.{self.service}")
        m = meter(f"thunderagent.{self.service}")
        self._dead_counter = m.create_counter(
            "thunderagent_dead_letters",
            description="Messages rejected into the dead-letter subject",
        )

    @property
    def is_connected(self) -> bool:
        return self.nc.is_connected

    def _checked(self, subject: str, message: Any) -> bytes:
        """The encoded message; ``PayloadTooLarge`` (naming the limit) when NATS would refuse
        it, instead of nats-py's bare ``MaxPayloadError``."""
        check_subject(subject)  # a bad one would cost the connection, not just this message
        payload = encode(message)
        limit = self.nc.max_payload
        if limit and len(payload) > limit:
            raise PayloadTooLarge(subject, len(payload), limit)
        return payload

    async def publish(
        self, subject: str, message: Any, *, reply: str = "", headers: dict[str, str] | None = None
    ) -> None:
        payload = self._checked(subject, message)
        # None, not {}: nats-py sends an empty dict as a header block (HPUB) all the same
        headers = inject_headers(headers) or None
        try:
            await self.nc.publish(subject, payload, reply=reply, headers=headers)
        except NatsError as err:  # closed, draining, buffer full: one error type for callers
            raise BusError(subject, f"not published ({err!r})") from err

    async def request(
        self,
        subject: str,
        message: Any,
        response_type: type[T],
        *,
        timeout: float = 2.0,  # noqa: ASYNC109 - passed on to nats-py's request
    ) -> T:
        """Request/reply; raises :class:`NoResponders`, :class:`RequestTimeout` or
        :class:`PayloadTooLarge`."""
        payload = self._checked(subject, message)
        if self._replies is None:
            self._replies = Replies(self.nc)
        headers = inject_headers() or None
        msg = await self._replies.request(subject, payload, timeout=timeout, headers=headers)
        try:
            return decoder_for(response_type).decode(msg.data)
        except DECODE_ERRORS as err:
            raise _bad_reply(subject, msg.data, err) from None

    async def subscribe(
        self,
        subject: str,
        message_type: Any,
        handler: Handler,
        *,
        queue: str = "",
        concurrent: bool = False,
    ) -> Subscription:
        """Decode each message into ``message_type`` and call ``handler(message, delivery)``.

        ``concurrent=True`` runs each handler in its own task (for handlers that stream for a long
        time, such as a generate request), started as the message is read (``fastpath``);
        otherwise messages are handled one at a time in order.
        """
        stats = self.stats.setdefault(subject, SubscriptionStats())
        consumer = _Consumer(self, subject, message_type, handler, stats, concurrent)
        if concurrent:
            sub = await subscribe_fast(self.nc, subject, consumer.spawn, queue=queue)
        else:
            sub = await self.nc.subscribe(subject, queue=queue, cb=consumer.process)
        self._subs.append(sub)
        return sub

    async def reject(
        self, delivery: Delivery, reason: str, code: ErrorCode = ErrorCode.BAD_REQUEST
    ) -> None:
        """Answer the sender with an error (if it can hear one); keep a dead-letter record."""
        stats = self.stats.setdefault(delivery.subject, SubscriptionStats())
        stats.dead_lettered += 1
        self._dead_counter.add(1, {"service": self.service, "reason": code.value})
        log.warning("%s: dead letter on %s: %s", self.service, delivery.subject, reason)
        try:
            if delivery.reply:
                error = ErrorReply(code=code, message=reason, service=self.service)
                await self.publish(delivery.reply, error)
            record = DeadLetter(
                service=self.service,
                subject=delivery.subject,
                reason=reason,
                raw=delivery.raw,
                received_at=time.time(),
                headers=delivery.headers,
                reply=delivery.reply,
            )
            await self.publish(subjects.dead_letter(self.service), record)
        except Exception:  # the connection may be closing; the log line above keeps the record
            log.exception("%s: could not publish dead letter", self.service)

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Stop taking work, finish it, then close. Interest in this bus's subscriptions goes
        first (a server round trip, so nothing more arrives: a queue group's next message goes
        to another member), what already arrived is handled, the handler tasks finish while
        replies and requests still work, and only then does the connection drain."""
        if self.nc.is_closed:
            return
        subs, self._subs = self._subs, []
        if subs:
            drains = (_drain_subscription(self.nc, sub) for sub in subs)
            done = await asyncio.gather(*drains, return_exceptions=True)
            for sub, result in zip(subs, done, strict=True):
                if isinstance(result, Exception):  # unsubscribed before, or the server is gone
                    log.debug("%s: drain of %s: %r", self.service, sub.subject, result)
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)
        if not self.nc.is_closed:
            await self.nc.drain()


async def _drain_subscription(nc: NATS, sub: Subscription) -> None:
    """nats-py's ``Subscription.drain`` after a grace: the server can still deliver a message
    it routed to this subscription before it read the UNSUB (a queue group's pick made by the
    publisher's connection), and nats-py drops a message for a subscription it has removed.
    So: UNSUB, a round trip, a pause for such stragglers while the subscription still takes
    them, then the drain (its own UNSUB is a no-op for the server)."""
    await nc._send_unsubscribe(sub._id)  # nats-py has no public "stop interest, keep taking"
    await nc.flush()
    await asyncio.sleep(LATE_DELIVERY_GRACE_S)
    await sub.drain()


def _type_name(message_type: Any) -> str:
    return getattr(message_type, "__name__", str(message_type))


def _bad_reply(subject: str, data: bytes, err: Exception) -> BadReply:
    """What a reply of the wrong type was: a service's error answer, or garbage."""
    try:
        error = decoder_for(ErrorReply).decode(data)
    except DECODE_ERRORS:
        return BadReply(subject, f"unreadable reply ({err})")
    return BadReply(subject, f"{error.code.value}: {error.message}", error.code.value)


class _Consumer:
    """One subscription's message path: trace context in, decode, handler, rejection out."""

    __slots__ = ("bus", "concurrent", "decoder", "handler", "message_type", "span_name", "stats")

    def __init__(
        self,
        bus: Bus,
        subject: str,
        message_type: Any,
        handler: Handler,
        stats: SubscriptionStats,
        concurrent: bool,
    ) -> None:
        self.bus = bus
        self.decoder = decoder_for(message_type)
        self.message_type = message_type
        self.handler = handler
        self.stats = stats
        self.concurrent = concurrent
        self.span_name = f"{bus.service} {subject.split('.')[1] if '.' in subject else subject}"

    def spawn(self, msg: Msg) -> None:
        task = asyncio.get_running_loop().create_task(self.process(msg))
        self.bus._tasks.add(task)
        task.add_done_callback(self.bus._tasks.discard)

    async def process(self, msg: Msg) -> None:
        headers = msg.headers
        delivery = Delivery(msg.subject, msg.reply or "", headers or {}, msg.data)
        sampled = sampled_flag(headers) if headers else None
        if sampled is None:  # no trace context: no span, nothing to pass on
            await self.handle(msg, delivery, None)
            return
        ctx = extract_context(headers)
        if sampled and tracing_active():
            with self.bus._tracer.start_as_current_span(
                self.span_name, context=ctx, kind=SpanKind.CONSUMER
            ) as span:
                span.set_attribute("messaging.destination.name", msg.subject)
                await self.handle(msg, delivery, span)
            return
        # sampled out, or tracing off here: no span, but the context goes on unchanged
        token = otel_context.attach(ctx)
        try:
            await self.handle(msg, delivery, None)
        finally:
            otel_context.detach(token)

    async def handle(self, msg: Msg, delivery: Delivery, span: trace.Span | None) -> None:
        try:
            decoded = self.decoder.decode(msg.data)
        except DECODE_ERRORS as err:
            if span is not None:
                span.set_status(Status(StatusCode.ERROR, str(err)))
            await self.bus.reject(delivery, f"invalid {_type_name(self.message_type)}: {err}")
            return
        self.stats.delivered += 1
        try:
            await self.handler(decoded, delivery)
        except Exception as err:
            self.stats.handler_errors += 1
            if span is not None:
                span.record_exception(err)
                span.set_status(Status(StatusCode.ERROR, str(err)))
            log.exception("%s: handler for %s failed", self.bus.service, msg.subject)
            await self.bus.reject(
                delivery, f"handler failed: {type(err).__name__}: {err}", ErrorCode.INTERNAL
            )
