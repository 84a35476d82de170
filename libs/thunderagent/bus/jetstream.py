"""JetStream through the bus: the KV-event stream and the workers key-value bucket.

Services never touch nats-py's JetStream API: they publish to a stream with an ack
(``stream_publish``), consume it from a sequence (``consume``: ordered and ephemeral for replicas,
durable with explicit acks for the index service), and read or write the workers bucket
(``bucket``). A message that does not decode is dead-lettered with its reason and skipped: the
consumer's position still advances, so one bad record never stalls a replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

import msgspec
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import (
    BucketNotFoundError,
    KeyDeletedError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
)
from nats.js.kv import KeyValue

from thunderagent.bus.batches import BatchSender
from thunderagent.bus.errors import DECODE_ERRORS
from thunderagent.schemas import subjects

log = logging.getLogger(__name__)

KV_EVENTS_MAX_AGE_S: Final = 3600.0
"""A router replica replays from the Redis snapshot's sequence: one hour of history covers any
snapshot interval with a wide margin; older events are only needed if Redis was lost, and then a
resync from the adapters rebuilds the index anyway."""

KV_EVENTS_MAX_BYTES: Final = 1 << 30

ACK_EVERY: Final = 64
ACK_AFTER_S: Final = 0.1
"""A durable consumer acks cumulatively (``AckPolicy.ALL``: one ack covers every earlier
message): after this many messages or this long after the first one unacked, whichever comes
first. One ack per message was as many messages again as the stream carries; the consumer's
lag stays visible on the server within a tenth of a second."""

WORKERS_BUCKET_TTL_S: Final = 120.0
"""Garbage collection only: leases are enforced by readers from ``lease_s`` and renewals. One
fixed value, because every process creates the bucket with the same config or not at all."""

StreamHandler = Callable[[Any, int], Awaitable[None]]
"""``handler(decoded message, stream sequence)``."""


def kv_events_stream_config() -> StreamConfig:
    return StreamConfig(
        name=subjects.KV_EVENTS_STREAM,
        subjects=[subjects.KV_EVENTS_WILDCARD],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        max_age=KV_EVENTS_MAX_AGE_S,
        max_bytes=KV_EVENTS_MAX_BYTES,
    )


@dataclass(slots=True, frozen=True)
class BucketEntry:
    """One change of a bucket key; ``value`` is None when the key was deleted."""

    key: str
    value: bytes | None


class Bucket:
    """A key-value bucket (the workers' registrations): put, delete, list and watch."""

    def __init__(self, kv: KeyValue) -> None:
        self._kv = kv

    async def put(self, key: str, value: bytes) -> int:
        """Write ``key``; returns the bucket's revision of this write."""
        return await self._kv.put(key, value)

    async def update(self, key: str, value: bytes, last: int) -> int | None:
        """Write ``key`` only if revision ``last`` is still its latest; None when another
        writer came in between (compare-and-set: one round trip, no read first)."""
        try:
            return await self._kv.update(key, value, last=last)
        except KeyWrongLastSequenceError:
            return None

    async def get(self, key: str) -> tuple[int, bytes] | None:
        """``(revision, value)`` of ``key``, or None when it is absent or deleted."""
        try:
            entry = await self._kv.get(key)
        except (KeyNotFoundError, KeyDeletedError):
            return None
        return (entry.revision, entry.value) if entry.value else None

    async def delete(self, key: str) -> None:
        await self._kv.delete(key)

    async def keys(self) -> list[str]:
        try:
            return list(await self._kv.keys())
        except Exception as err:  # nats-py raises NoKeysError for an empty bucket
            if type(err).__name__ == "NoKeysError":
                return []
            raise

    async def watch(self, stop: asyncio.Event) -> AsyncIterator[BucketEntry | None]:
        """Every current key, then None (the initial values are done), then every change."""
        watcher = await self._kv.watchall()
        try:
            while not stop.is_set():
                try:
                    entry = await watcher.updates(timeout=0.5)
                except Exception as err:  # nats-py raises its own TimeoutError subclass
                    if isinstance(err, TimeoutError) or type(err).__name__ == "TimeoutError":
                        continue
                    raise
                if entry is None:
                    yield None
                elif entry.operation in ("DEL", "PURGE") or not entry.value:
                    yield BucketEntry(entry.key, None)
                else:
                    yield BucketEntry(entry.key, entry.value)
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()


def _start_config(start_seq: int, new_only: bool) -> ConsumerConfig:
    """Where a consumer starts: at the next message (``new_only``), at ``start_seq``, or at
    the stream's beginning (0)."""
    if new_only:
        return ConsumerConfig(deliver_policy=DeliverPolicy.NEW)
    if start_seq:
        return ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start_seq
        )
    return ConsumerConfig(deliver_policy=DeliverPolicy.ALL)


async def _attach_ordered(
    consumer: StreamConsumer,
    js: Any,
    stream: str,
    subject: str,
    config: ConsumerConfig,
    on_msg: Any,
) -> None:
    """Attach an ordered, ephemeral subscription from ``config``, and the way to recreate it
    from a sequence after a reconnect."""

    async def subscribe_from(start: int) -> Any:
        cfg = _start_config(start, new_only=False)
        return await js.subscribe(
            subject, stream=stream, ordered_consumer=True, config=cfg, cb=on_msg
        )

    sub = await js.subscribe(
        subject, stream=stream, ordered_consumer=True, config=config, cb=on_msg
    )
    consumer.attach(sub, subscribe_from)


class StreamConsumer:
    """A running consumer; ``stop`` unsubscribes (the durable keeps its position).

    An ephemeral consumer lives on the server only while it is connected: after a NATS restart
    the server has forgotten it, so ``resume`` subscribes again from the message after the last
    one delivered (the bus calls it on every reconnect)."""

    def __init__(self) -> None:
        self._sub: Any = None
        self._resubscribe: Callable[[int], Awaitable[Any]] | None = None
        self.last_seq = 0
        self.stopped = False

    def attach(self, sub: Any, resubscribe: Callable[[int], Awaitable[Any]] | None = None) -> None:
        """The subscription delivering to it (``resubscribe(seq)``: an ephemeral consumer's
        way back after a reconnect)."""
        self._sub, self._resubscribe = sub, resubscribe

    async def resume(self) -> None:
        if self._resubscribe is None or self.stopped:
            return
        with contextlib.suppress(Exception):
            await self._sub.unsubscribe()
        self._sub = await self._resubscribe(self.last_seq + 1)
        log.info("stream consumer resumed at seq %d", self.last_seq + 1)

    async def stop(self) -> None:
        self.stopped = True
        with contextlib.suppress(Exception):  # the connection may be closing
            await self._sub.unsubscribe()


class JetStreamMixin:
    """JetStream methods of ``Bus`` (``nc``, ``publish``-style encoding and ``reject`` come from
    the Bus itself)."""

    nc: Any

    async def ensure_kv_events_stream(self) -> None:
        """Create the KV-event stream if it does not exist (same config from every process)."""
        js = self.nc.jetstream()
        try:
            await js.stream_info(subjects.KV_EVENTS_STREAM)
            return
        except NotFoundError:
            pass
        try:
            await js.add_stream(kv_events_stream_config())
        except Exception as err:  # created concurrently by another process: fine if it exists
            await js.stream_info(subjects.KV_EVENTS_STREAM)
            log.debug("stream created concurrently: %s", err)

    async def stream_publish(
        self, subject: str, payload: bytes, headers: dict[str, str] | None = None
    ) -> int:
        """Publish into a stream and wait for its ack; returns the stream sequence."""
        ack = await self.nc.jetstream().publish(subject, payload, headers=headers)
        return ack.seq

    async def stream_last_seq(self, stream: str) -> int:
        info = await self.nc.jetstream().stream_info(stream)
        return info.state.last_seq

    async def consume(
        self,
        stream: str,
        subject: str,
        message_type: Any,
        handler: StreamHandler,
        *,
        start_seq: int = 0,
        new_only: bool = False,
        durable: str | None = None,
        owner: Callable[[Any], str] | None = None,
    ) -> StreamConsumer:
        """Deliver ``stream``'s messages on ``subject`` from ``start_seq`` (0: the beginning;
        ``new_only``: from now on) to ``handler(message, seq)``, in order.

        ``owner(message)`` names who may publish it: a message whose subject does not end in
        that token (a worker publishing in another's name) is dead-lettered, like one that does
        not decode or whose handler fails; none of them stops the consumer.

        Without ``durable`` the consumer is ordered and ephemeral (a replica that rebuilds its
        state from a snapshot). With it, acks are cumulative (``ACK_EVERY``) and the consumer is
        recreated at ``start_seq``: the caller's snapshot, not the server, decides where to
        resume.
        """
        js = self.nc.jetstream()
        config = _start_config(start_seq, new_only)
        # made before subscribing: a message delivered while ``subscribe`` is still running
        # must already move the position a resume starts from
        consumer = StreamConsumer()
        if durable:
            acks = BatchSender[Any](_ack_latest, ACK_AFTER_S, ACK_EVERY, what="stream acks")
            on_msg = self._stream_callback(stream, message_type, handler, owner, None, acks)
            config.ack_policy = AckPolicy.ALL
            config.max_ack_pending = 100_000
            with contextlib.suppress(Exception):  # no such consumer yet
                await js.delete_consumer(stream, durable)
            sub = await js.subscribe(
                subject, durable=durable, stream=stream, config=config, cb=on_msg, manual_ack=True
            )
            consumer.attach(sub)
            return consumer

        on_msg = self._stream_callback(stream, message_type, handler, owner, consumer, None)
        await _attach_ordered(consumer, js, stream, subject, config, on_msg)
        self._ephemeral_consumers().append(consumer)
        return consumer

    def _stream_callback(
        self,
        stream: str,
        message_type: Any,
        handler: StreamHandler,
        owner: Callable[[Any], str] | None,
        position: StreamConsumer | None,
        acks: BatchSender[Any] | None,
    ) -> Callable[[Any], Awaitable[None]]:
        """nats-py's callback for one consumer: skip what ``position`` has seen (an ephemeral
        consumer resumed after a reconnect), decode, check the publisher, hand over, and
        dead-letter whatever fails; ``acks``: a durable consumer's cumulative acks."""
        decoder = msgspec.json.Decoder(message_type)

        async def on_msg(msg: Any) -> None:
            seq = stream_seq(msg)
            if position is not None:
                if seq <= position.last_seq:
                    return  # delivered again after a resume: handled already
                position.last_seq = seq
            try:
                decoded = decoder.decode(msg.data)
            except DECODE_ERRORS as err:
                await self._reject_stream(msg, f"invalid {message_type.__name__}: {err}")
            else:
                if owner is not None and msg.subject.rsplit(".", 1)[-1] != owner(decoded):
                    await self._reject_stream(msg, f"{msg.subject} may not publish for "
                                                   f"{owner(decoded)!r}")  # fmt: skip
                else:
                    try:
                        await handler(decoded, seq)
                    except Exception as err:  # one bad message must not stop the stream
                        log.exception("stream %s seq %d: handler failed", stream, seq)
                        await self._reject_stream(msg, f"handler failed: {err!r}")
            if acks is not None:
                acks.add(msg)

        return on_msg

    def _ephemeral_consumers(self) -> list[StreamConsumer]:
        """This connection's ephemeral consumers; made (with the reconnect hook that resumes
        them) on first use."""
        consumers = getattr(self, "_ephemeral", None)
        if consumers is not None:
            return consumers
        consumers = self._ephemeral = []
        previous = self.nc._reconnected_cb

        async def reconnected() -> None:
            if previous is not None:
                await previous()
            for consumer in [c for c in consumers if not c.stopped]:
                try:
                    await consumer.resume()
                except Exception:  # the next reconnect tries again
                    log.warning("could not resume a stream consumer", exc_info=True)

        self.nc._reconnected_cb = reconnected
        return consumers

    async def _reject_stream(self, msg: Any, reason: str) -> None:
        from thunderagent.bus.bus import Delivery

        delivery = Delivery(msg.subject, "", dict(msg.headers or {}), msg.data)
        await self.reject(delivery, reason)  # type: ignore[attr-defined]

    async def bucket(self, name: str, ttl_s: float = WORKERS_BUCKET_TTL_S) -> Bucket:
        """Open a key-value bucket, creating it when this process is the first to need it."""
        js = self.nc.jetstream()
        config = KeyValueConfig(bucket=name, history=1, ttl=ttl_s)
        for _ in range(20):
            try:
                return Bucket(await js.key_value(name))
            except BucketNotFoundError:
                pass
            try:
                return Bucket(await js.create_key_value(config))
            except Exception as err:  # another process created it between our two calls
                log.debug("creating %s: %s", name, err)
                await asyncio.sleep(0.05)
        raise RuntimeError(f"cannot open or create the {name} bucket")


async def _ack_latest(handled: list[Any]) -> None:
    """Under ``AckPolicy.ALL`` an ack of the latest message covers every earlier one."""
    await handled[-1].ack()


_ACK_TOKENS_V1 = 9
"""``$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<ns>.<pending>``."""


def stream_seq(msg: Any) -> int:
    """A JetStream message's stream sequence, read from its reply subject. nats-py's
    ``msg.metadata`` parses the same subject into a ``datetime`` and two dataclasses: 7.5 µs a
    message on stop 56's VM against 0.4 µs for this, paid by every consumer of every KV batch.
    The server's newer form (with a domain and an account hash) goes to nats-py's parser."""
    reply = msg.reply or ""
    tokens = reply.split(".")
    if len(tokens) == _ACK_TOKENS_V1 and tokens[0] == "$JS" and tokens[1] == "ACK":
        return int(tokens[5])
    return msg.metadata.sequence.stream
