"""Keep an ``IndexFeeder`` in step with the KV-event stream.

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

from thunderagent.bus import Bus, StreamConsumer
from thunderagent.prefix_index import PrefixIndex
from thunderagent.prefix_index.feed import FeedOutcome, IndexFeeder
from thunderagent.prefix_index.state import capture, restore
from thunderagent.schemas import KvEventBatch, subjects

log = logging.getLogger(__name__)

OnOutcome = Callable[[KvEventBatch, FeedOutcome], Awaitable[None]]


class IndexFollower:
    def __init__(
        self,
        bus: Bus,
        feeder: IndexFeeder,
        *,
        redis=None,
        durable: str | None = None,
        on_outcome: OnOutcome | None = None,
        apply: Callable[[KvEventBatch, float], FeedOutcome] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.bus = bus
        self.feeder = feeder
        self.apply = apply or feeder.apply
        """How a batch reaches the index: the router's core also clears its in-flight overlay."""
        self.redis = redis
        self.durable = durable
        self.on_outcome = on_outcome
        self.clock = clock
        self.stream_seq = 0
        self.restored_from = 0
        self.last_event_lag_s = 0.0
        self.caught_up = asyncio.Event()
        self._catch_up_to = 0
        self._consumer: StreamConsumer | None = None

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
            self.feeder.reset()
            return 0
        log.info("index restored from snapshot at stream seq %d (%d blocks)", seq, len(self.index))
        return seq

    async def start(self) -> None:
        await self.bus.ensure_kv_events_stream()
        self.stream_seq = self.restored_from = await self.load_snapshot()
        self._catch_up_to = await self.bus.stream_last_seq(subjects.KV_EVENTS_STREAM)
        if self._catch_up_to <= self.stream_seq:
            self.caught_up.set()
        self._consumer = await self.bus.consume(
            subjects.KV_EVENTS_STREAM,
            subjects.KV_EVENTS_WILDCARD,
            KvEventBatch,
            self._on_batch,
            start_seq=self.stream_seq + 1 if self.stream_seq else 0,
            durable=self.durable,
            owner=_publisher,
        )

    async def _on_batch(self, batch: KvEventBatch, seq: int) -> None:
        now = self.clock()
        outcome = self.apply(batch, now)
        self.last_event_lag_s = max(0.0, now - batch.ts)
        self.stream_seq = seq
        if self.on_outcome is not None:
            await self.on_outcome(batch, outcome)
        if not self.caught_up.is_set() and seq >= self._catch_up_to:
            self.caught_up.set()

    def snapshot_bytes(self) -> bytes:
        return capture(self.feeder, self.stream_seq, self.clock())

    async def stop(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()


def _publisher(batch: KvEventBatch) -> str:
    """A batch must come on its own worker's subject (``kv.events.<worker>``)."""
    return batch.worker_id
