"""Relay an engine's ZMQ KV events onto NATS: re-hashed, with the adapter's own sequence.

Engine batches become ``KvEventBatch``es published to JetStream (acked), so the index and late
router replicas can replay them. One publish is in flight at a time; engine batches that arrive
while it waits for its ack go out together in the next one (in order, one adapter sequence
number), so a quiet engine's events leave at once and a busy one's cost one message per round
trip instead of one each: every consumer (index, routers, scheduler) pays per
message. ZMQ gaps are repaired by replay while the engine still
buffers the missing batches. A gap that cannot be repaired, or an engine restart, clears the
mirror and publishes ``AllCleared`` (the index drops the worker's entries; new stores rebuild
them). A resync request is answered by republishing the whole mirror, in sequence. What would
pass 256 KiB or NATS's payload limit in one message (a large cache's dump) goes as several
batches in a row, each under both, a long chain cut where needed (its second part names the
first's last block as parent): consumers apply them one after the other as they would one.
Other readers of the engine's events (the migration side's token tap) are fed from this one
subscription: a second one would wake the adapter again for every engine batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Final

import msgspec

from thunderagent.bus import Bus, Delivery
from thunderagent.bus.bus import encode
from thunderagent.schemas import (
    Ack,
    AllCleared,
    BlocksRemoved,
    BlocksStored,
    KvEvent,
    KvEventBatch,
    ResyncRequest,
    subjects,
)
from thunderagent.sglang import kv_wire
from thunderagent.sglang.mirror import KvMirror
from thunderagent.sglang.zmq_subscriber import (
    Gap,
    Notice,
    Received,
    Restarted,
    Undecodable,
    ZmqKvEventSubscriber,
)
from thunderagent.telemetry import inject_headers

log = logging.getLogger(__name__)

MAX_MERGED_EVENTS: Final = 4096
"""Engine batches are merged into one message up to this many events; a single larger one (a
resync's whole mirror) is not cut by count, only by size (``MAX_BATCH_BYTES``)."""


MAX_BATCH_BYTES: Final = 256 << 10
"""A batch larger than this (a large cache's dump) is cut, even under NATS's payload limit: each
consumer decodes and applies a message in one go, ~12 ms per MB of chain events here, so a
piece of 256 KiB holds a consumer's event loop ~3 ms (a 50k-block cache's dump: 9 messages of
2.6-2.8 ms each, against 3 of ~8 ms at 1 MiB; a refresh of 500k blocks in one 21 MB message
would hold it ~0.3 s). An engine's own batches are far smaller and go whole."""

PAYLOAD_HEADROOM: Final = 4096
"""Bytes of NATS's payload limit left to a batch's headers (trace context) and sequence."""


def _cut(events: list[KvEvent], parts: int) -> list[list[KvEvent]] | None:
    """``events`` in about ``parts`` pieces of similar block counts, in order; a single event of
    several blocks is cut into pieces, a stored chain's later pieces naming the block before
    them as parent. None when it cannot be cut (one event of one block)."""
    if len(events) == 1:
        (event,) = events
        n = len(event.hashes) if isinstance(event, BlocksStored | BlocksRemoved) else 0
        if n < 2:
            return None
        step = -(-n // min(parts, n))
        return [[_slice(event, i, i + step)] for i in range(0, n, step)]
    target = sum(_weight(e) for e in events) / parts
    pieces: list[list[KvEvent]] = [[]]
    held = 0
    for event in events:
        if held >= target and len(pieces) < parts:
            pieces.append([])
            held = 0
        pieces[-1].append(event)
        held += _weight(event)
    if len(pieces) == 1:  # all the weight in the last event: cut the list in two
        mid = len(events) // 2
        return [events[:mid], events[mid:]]
    return pieces


def _weight(event: KvEvent) -> int:
    return 1 + len(event.hashes) if isinstance(event, BlocksStored | BlocksRemoved) else 1


def _slice(event: BlocksStored | BlocksRemoved, start: int, stop: int) -> KvEvent:
    if isinstance(event, BlocksRemoved):
        return msgspec.structs.replace(event, hashes=event.hashes[start:stop])
    parent = event.hashes[start - 1] if start else event.parent_hash
    return msgspec.structs.replace(
        event, hashes=event.hashes[start:stop], check_hashes=event.check_hashes[start:stop],
        parent_hash=parent,
    )  # fmt: skip


class KvRelay:
    def __init__(self, bus: Bus, worker_id: str, block_size: int) -> None:
        self.bus = bus
        self.worker_id = worker_id
        self.mirror = KvMirror(block_size)
        self.epoch = int(time.time() * 1000)
        self.seq = -1
        self._subject = subjects.kv_events(worker_id)
        self._pending: deque[tuple[list[KvEvent], asyncio.Future | None]] = deque()
        """Event lists not yet published, oldest first, each with who waits for it."""
        self._sender: asyncio.Task | None = None
        self.published = 0
        """Batches published."""
        self.listeners: list[Callable[[Notice], None]] = []
        """Also given every notice from the engine's events, in order."""

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

    async def handle(self, notice: Notice) -> None:
        for listener in self.listeners:
            try:
                listener(notice)
            except Exception:  # another reader's failure must not stop the index's feed
                log.exception("%s: a KV-event listener failed", self.worker_id)
        if isinstance(notice, Received):
            events = self.mirror.apply(list(notice.batch.events))
            if events:
                self._enqueue(events, wait=False)  # read on while it goes out
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

    async def announce(self, events: list[kv_wire.AnyKvEvent]) -> None:
        """Events inferred for an engine that publishes none (``sglang.shadow``): they take its
        own events' path (every listener, the mirror, the stream)."""
        if events:
            batch = kv_wire.KvEventBatch(ts=time.time(), events=events)
            await self.handle(Received(seq=-1, batch=batch))

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
            await self.refresh()

    async def refresh(self) -> None:
        """Re-announce every mirrored block now."""
        await self._republish([])

    async def _republish(self, first: list[KvEvent]) -> None:
        """``first``, then every mirrored block, a piece of the dump at a time: between pieces
        the engine's events are read (they go out among the pieces, in the order they came)
        and the adapter's runs stream on. Returns once all of it is published."""
        sent: list[asyncio.Future | None] = []
        for piece in self.mirror.dump_pieces():
            sent.append(self._enqueue(first + piece, wait=True))
            first = []
            await asyncio.sleep(0)
        if first:
            sent.append(self._enqueue(first, wait=True))
        await asyncio.shield(asyncio.gather(*(done for done in sent if done is not None)))

    async def engine_restarted(self, reason: str) -> None:
        """The engine's cache is empty now: so are the mirror and this worker's index entries."""
        log.warning("%s: %s: its cache is empty", self.worker_id, reason)
        self.mirror.clear()
        await self._publish([AllCleared()])

    async def _publish(self, events: list[KvEvent]) -> None:
        """Publish ``events`` after everything queued before them; returns once they are out."""
        done = self._enqueue(events, wait=True)
        assert done is not None
        await asyncio.shield(done)

    def _enqueue(self, events: list[KvEvent], *, wait: bool) -> asyncio.Future | None:
        loop = asyncio.get_running_loop()
        done = loop.create_future() if wait else None
        self._pending.append((events, done))
        if self._sender is None or self._sender.done():
            self._sender = loop.create_task(self._send_pending())
        return done

    async def _send_pending(self) -> None:
        waiting: list[asyncio.Future] = []
        try:
            while self._pending:
                events: list[KvEvent] = []
                while self._pending and (
                    not events or len(events) + len(self._pending[0][0]) <= MAX_MERGED_EVENTS
                ):
                    more, done = self._pending.popleft()
                    events.extend(more)
                    if done is not None:
                        waiting.append(done)
                await self._send(events)
                for done in waiting:
                    if not done.done():
                        done.set_result(None)
                waiting = []
        finally:  # cancelled (the adapter stops): nobody may wait forever
            for done in [*waiting, *(d for _, d in self._pending if d is not None)]:
                done.cancel()

    async def _send(self, events: list[KvEvent]) -> None:
        """Publish ``events`` as the next batch, or as several in order (one sequence number
        each) where one would pass ``MAX_BATCH_BYTES`` or NATS's payload limit: a large cache's
        dump, a resync."""
        server_limit = self.bus.nc.max_payload
        limit = min(
            MAX_BATCH_BYTES, server_limit - PAYLOAD_HEADROOM if server_limit else MAX_BATCH_BYTES
        )
        todo = [events]
        while todo:
            part = todo.pop()
            batch = KvEventBatch(
                worker_id=self.worker_id, seq=self.seq + 1, ts=time.time(), events=part,
                epoch=self.epoch,
            )  # fmt: skip
            payload = encode(batch)
            if len(payload) > limit and (pieces := _cut(part, len(payload) // limit + 1)):
                todo += reversed(pieces)  # each encoded again, and cut again if need be
                continue
            self.seq += 1
            try:
                await self.bus.stream_publish(self._subject, payload, inject_headers())
                self.published += 1
            except Exception as err:  # NATS away: consumers see the gap and ask for a resync
                log.warning("%s: KV batch %d not published (%r)", self.worker_id, self.seq, err)

    async def close(self) -> None:
        """Publish what is queued (the adapter is stopping)."""
        if self._sender is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._sender), 2.0)

    async def on_resync(self, request: ResyncRequest, delivery: Delivery) -> None:
        log.info("%s: resync requested (%s)", self.worker_id, request.reason)
        await self._republish([AllCleared()])
        if delivery.reply:
            await self.bus.publish(delivery.reply, Ack(accepted=True))
