"""Relay an engine's ZMQ KV events onto NATS: re-hashed, with the adapter's own sequence.

Each engine batch becomes one ``KvEventBatch`` published to JetStream (acked), so the index and
late router replicas can replay it. ZMQ gaps are repaired by replay while the engine still
buffers the missing batches. A gap that cannot be repaired, or an engine restart, clears the
mirror and publishes ``AllCleared`` (the index drops the worker's entries; new stores rebuild
them). A resync request is answered by republishing the whole mirror as one batch, in sequence.
"""

from __future__ import annotations

import asyncio
import logging
import time

from thunderagent.bus import Bus, Delivery
from thunderagent.bus.bus import encode
from thunderagent.schemas import Ack, AllCleared, KvEvent, KvEventBatch, ResyncRequest, subjects
from thunderagent.sglang.mirror import KvMirror
from thunderagent.sglang.zmq_subscriber import (
    Gap,
    Received,
    Restarted,
    Undecodable,
    ZmqKvEventSubscriber,
)
from thunderagent.telemetry import inject_headers

log = logging.getLogger(__name__)


class KvRelay:
    def __init__(self, bus: Bus, worker_id: str, block_size: int) -> None:
        self.bus = bus
        self.worker_id = worker_id
        self.mirror = KvMirror(block_size)
        self.epoch = int(time.time() * 1000)
        self.seq = -1
        self._subject = subjects.kv_events(worker_id)
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        await self.bus.ensure_kv_events_stream()
        await self.bus.subscribe(
            subjects.worker_resync(self.worker_id), ResyncRequest, self.on_resync
        )
        # A fresh epoch starts empty: whatever the index held for this worker is void.
        await self._publish([AllCleared()])

    async def run(
        self, endpoint: str, replay_endpoint: str | None, topic: str, stop: asyncio.Event
    ) -> None:
        async with ZmqKvEventSubscriber(
            endpoint, replay_endpoint=replay_endpoint, topic=topic
        ) as sub:
            # Consume in a task that is cancelled on stop: timing out ``anext`` instead would
            # close the subscriber's async generator after the first quiet period.
            consume = asyncio.create_task(self._consume(sub))
            stopped = asyncio.create_task(stop.wait())
            done, _ = await asyncio.wait({consume, stopped}, return_when=asyncio.FIRST_COMPLETED)
            for task in (consume, stopped):
                task.cancel()
            if consume in done:
                consume.result()

    async def _consume(self, sub: ZmqKvEventSubscriber) -> None:
        async for notice in sub:
            await self.handle(notice)

    async def handle(self, notice) -> None:
        if isinstance(notice, Received):
            events = self.mirror.apply(list(notice.batch.events))
            if events:
                await self._publish(events)
        elif isinstance(notice, Restarted):
            await self.engine_restarted(f"engine event sequence went back to {notice.seq}")
        elif isinstance(notice, Gap) and not notice.recovered:
            log.warning(
                "%s: lost engine events %s: clearing this worker's index",
                self.worker_id,
                notice.lost,
            )
            # The engine cannot be asked for its cache contents, so the mirror cannot be repaired;
            # drop it (the index follows) and let new stores rebuild it. Costs hits, never errors.
            self.mirror.clear()
            await self._publish([AllCleared()])
        elif isinstance(notice, Undecodable):
            log.warning(
                "%s: undecodable KV batch seq %d: %s", self.worker_id, notice.seq, notice.error
            )

    async def refresh_loop(self, interval_s: float, stop: asyncio.Event) -> None:
        """Re-announce every mirrored block every ``interval_s``.

        Engines announce a block once, when it is stored; one that stays resident (a hot system
        prompt) is never announced again. The index's TTL drops blocks nobody re-confirmed, so
        without this a hot prefix would expire while it is cached. Only blocks whose removal
        event was lost for good age out now, which is what the TTL is for.
        """
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
                return
            except TimeoutError:
                pass
            blocks = self.mirror.dump()
            if blocks:
                await self._publish(list(blocks))

    async def engine_restarted(self, reason: str) -> None:
        """The engine's cache is empty now: so are the mirror and this worker's index entries."""
        log.warning("%s: %s: its cache is empty", self.worker_id, reason)
        self.mirror.clear()
        await self._publish([AllCleared()])

    async def _publish(self, events: list[KvEvent]) -> None:
        async with self._lock:  # seq order == publish order
            self.seq += 1
            batch = KvEventBatch(
                worker_id=self.worker_id,
                seq=self.seq,
                ts=time.time(),
                events=events,
                epoch=self.epoch,
            )
            try:
                await self.bus.stream_publish(self._subject, encode(batch), inject_headers())
            except Exception as err:  # NATS away: consumers see the gap and ask for a resync
                log.warning("%s: KV batch %d not published (%r)", self.worker_id, self.seq, err)

    async def on_resync(self, request: ResyncRequest, delivery: Delivery) -> None:
        log.info("%s: resync requested (%s)", self.worker_id, request.reason)
        await self._publish([AllCleared(), *self.mirror.dump()])
        if delivery.reply:
            await self.bus.publish(delivery.reply, Ack(accepted=True))
