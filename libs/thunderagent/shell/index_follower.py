"""Keep a local ``PrefixIndex`` in step with the KV-event stream.

Start: load the latest snapshot from Redis when there is one (a replica starts warm), then
replay the stream from the snapshot's sequence and follow it live. Without Redis, or without a
snapshot, it replays the whole stream: slower to start, same result. The index service uses a
durable consumer (its progress is visible as consumer lag); routers use ordered ephemeral ones.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import msgspec
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from thunderagent.bus import Bus, Delivery
from thunderagent.bus.streams import ensure_kv_events_stream
from thunderagent.prefix_index import PrefixIndex
from thunderagent.prefix_index.feed import FeedOutcome, IndexFeeder
from thunderagent.prefix_index.state import capture, restore
from thunderagent.schemas import KvEventBatch, subjects

log = logging.getLogger(__name__)
_decoder = msgspec.json.Decoder(KvEventBatch)

OnOutcome = Callable[[KvEventBatch, FeedOutcome], Awaitable[None]]


class IndexFollower:
    def __init__(
        self,
        bus: Bus,
        index: PrefixIndex,
        *,
        redis=None,
        durable: str | None = None,
        on_outcome: OnOutcome | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.bus = bus
        self.feeder = IndexFeeder(index)
        self.redis = redis
        self.durable = durable
        self.on_outcome = on_outcome
        self.clock = clock
        self.stream_seq = 0
        self.restored_from = 0
        self.last_event_lag_s = 0.0
        self.caught_up = asyncio.Event()
        self._sub = None

    @property
    def index(self) -> PrefixIndex:
        return self.feeder.index

    async def load_snapshot(self) -> int:
        """Restore from Redis; returns the covered stream sequence (0 without a snapshot)."""
        if self.redis is None:
            return 0
        try:
            data = await self.redis.get(subjects.REDIS_INDEX_SNAPSHOT)
        except Exception as err:  # Redis down: start cold, the stream has everything
            log.warning("no snapshot (Redis unavailable: %s): replaying the whole stream", err)
            return 0
        if not data:
            return 0
        try:
            seq = restore(self.feeder, data, self.clock())
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as err:
            log.warning("snapshot unusable (%s): replaying the whole stream", err)
            self.feeder = IndexFeeder(PrefixIndex(self.index.ttl_s))
            return 0
        log.info("index restored from snapshot at stream seq %d (%d blocks)", seq, len(self.index))
        return seq

    async def start(self) -> None:
        js = self.bus.nc.jetstream()
        await ensure_kv_events_stream(js)
        self.stream_seq = self.restored_from = await self.load_snapshot()
        info = await js.stream_info(subjects.KV_EVENTS_STREAM)
        last = info.state.last_seq
        if last <= self.stream_seq:
            self.caught_up.set()
        config = ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE
            if self.stream_seq
            else DeliverPolicy.ALL,
            opt_start_seq=self.stream_seq + 1 if self.stream_seq else None,
        )
        self._catch_up_to = last
        if self.durable:
            config.ack_policy = AckPolicy.EXPLICIT
            config.max_ack_pending = 100_000
            # The snapshot decides where to resume, so the durable restarts from there.
            try:
                await js.delete_consumer(subjects.KV_EVENTS_STREAM, self.durable)
            except Exception:
                pass
            self._sub = await js.subscribe(
                subjects.KV_EVENTS_WILDCARD,
                durable=self.durable,
                stream=subjects.KV_EVENTS_STREAM,
                config=config,
                cb=self._on_msg,
                manual_ack=True,
            )
        else:
            self._sub = await js.subscribe(
                subjects.KV_EVENTS_WILDCARD,
                stream=subjects.KV_EVENTS_STREAM,
                ordered_consumer=True,
                config=config,
                cb=self._on_msg,
            )

    async def _on_msg(self, msg) -> None:
        meta = msg.metadata
        try:
            batch = _decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            delivery = Delivery(msg.subject, "", dict(msg.headers or {}), msg.data)
            await self.bus.reject(delivery, f"invalid KvEventBatch: {err}")
        else:
            now = self.clock()
            outcome = self.feeder.apply(batch, now)
            self.last_event_lag_s = max(0.0, now - batch.ts)
            if self.on_outcome is not None and outcome is not FeedOutcome.APPLIED:
                await self.on_outcome(batch, outcome)
        self.stream_seq = meta.sequence.stream
        if self.durable:
            await msg.ack()
        if not self.caught_up.is_set() and self.stream_seq >= self._catch_up_to:
            self.caught_up.set()

    def forget_worker(self, worker_id: str) -> None:
        self.feeder.forget(worker_id)

    def snapshot_bytes(self) -> bytes:
        return capture(self.feeder, self.stream_seq, self.clock())

    async def stop(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:
                pass
