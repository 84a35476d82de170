"""Index service: the authoritative block -> workers index.

Consumes every worker's KV events from JetStream (durable consumer), asks an adapter to resync
when its sequence shows a gap, forgets a worker whose lease lapsed, expires unconfirmed blocks
(TTL) and writes snapshots to Redis, from which router replicas start warm (each router keeps
its own replica, fed by the same stream: a routing decision never waits on this service).
Redis being down delays snapshots; it never stops indexing.

It also answers ``HoldersQuery``: which workers hold each of a list of prefixes. The migration
service plans from these answers, twice a second, instead of keeping an index replica of its
own: a replica costs its process a delivery, a decode and an apply for every KV message, all
the time, to answer a few lookups per planning tick.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from thunderagent.bus import Bus, BusError, Delivery
from thunderagent.fleet import WorkerRegistry
from thunderagent.prefix_index import DEFAULT_TTL_S, PrefixIndex
from thunderagent.prefix_index.feed import FeedOutcome, IndexFeeder
from thunderagent.schemas import (
    Ack,
    HoldersQuery,
    HoldersReply,
    KvEventBatch,
    ResyncRequest,
    subjects,
)
from thunderagent.shell import FleetWatcher, ServiceContext, TaskSet
from thunderagent.shell.index_follower import IndexFollower
from thunderagent.telemetry.setup import meter

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class IndexConfig:
    redis_url: str = "redis://127.0.0.1:6379/0"
    ttl_s: float = DEFAULT_TTL_S
    snapshot_interval_s: float = 5.0
    """Bounds how much of the stream a new router replica replays after loading the snapshot."""
    resync_cooldown_s: float = 2.0
    """At most one resync request per worker in this time: a burst of gaps needs only one."""


class IndexService:
    def __init__(self, config: IndexConfig, bus: Bus, redis) -> None:
        """``redis=None``: no snapshots (a restart replays the whole stream)."""
        self.config = config
        self.bus = bus
        self.redis = redis
        self.follower = IndexFollower(
            bus,
            IndexFeeder(PrefixIndex(config.ttl_s)),
            redis=redis,
            durable=subjects.INDEX_DURABLE,
            on_outcome=self.on_outcome,
        )
        self._last_resync: dict[str, float] = {}
        self.resyncs_requested = 0
        self._tasks = TaskSet("index")
        m = meter("thunderagent.index")
        self.resyncs = m.create_counter("thunderagent_index_resyncs", description="Resync requests")
        m.create_observable_gauge(
            "thunderagent_index_blocks",
            [lambda _: [_obs(len(self.follower.index))]],
            description="Blocks in the index",
        )
        m.create_observable_gauge(
            "thunderagent_kv_event_lag_seconds",
            [lambda _: [_obs(self.follower.last_event_lag_s)]],
            description="Age of the last KV event when the index applied it",
        )

    async def on_outcome(self, batch: KvEventBatch, outcome: FeedOutcome) -> None:
        if outcome is FeedOutcome.GAP:
            # not awaited: the stream consumer must not stall while the adapter answers
            self._tasks.spawn(self.request_resync(batch.worker_id, "sequence gap"))

    async def on_holders(self, query: HoldersQuery, delivery: Delivery) -> None:
        if delivery.reply:
            holders = self.follower.feeder.holders
            reply = HoldersReply(holders=[holders(p) for p in query.prefixes])
            await self.bus.publish(delivery.reply, reply)

    async def request_resync(self, worker_id: str, reason: str) -> None:
        now = time.monotonic()
        if now - self._last_resync.get(worker_id, -1e9) < self.config.resync_cooldown_s:
            return
        self._last_resync[worker_id] = now
        self.resyncs_requested += 1
        self.resyncs.add(1, {"reason": reason})
        log.warning("worker %s: %s: requesting resync", worker_id, reason)
        try:
            await self.bus.request(
                subjects.worker_resync(worker_id),
                ResyncRequest(worker_id=worker_id, reason=reason),
                Ack,
                timeout=5,
            )
        except BusError as err:
            log.warning("resync of %s failed: %s", worker_id, err)

    def on_fleet_change(self, worker_id: str, what: str) -> None:
        if what in ("expired", "removed"):
            log.info("worker %s %s: dropping its index entries", worker_id, what)
            self.follower.feeder.forget(worker_id)

    async def periodic(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.config.snapshot_interval_s)
            except TimeoutError:
                pass
            self.follower.feeder.expire(time.time())
            await self.write_snapshot()

    async def write_snapshot(self) -> None:
        if self.redis is None:
            return
        try:
            data = self.follower.snapshot_bytes()
        except (OverflowError, ValueError, TypeError) as err:  # never end the service over it
            log.error("snapshot not written (cannot encode the index: %s)", err)
            return
        try:
            await self.redis.set(subjects.REDIS_INDEX_SNAPSHOT, data)
        except Exception as err:  # Redis down: keep indexing, try again next time
            log.warning("snapshot not written (Redis: %s)", err)

    async def run(self, ctx: ServiceContext) -> None:
        registry = WorkerRegistry()
        fleet = FleetWatcher(ctx.bus, registry, on_change=self.on_fleet_change)
        await self.follower.start()
        await ctx.bus.subscribe(
            subjects.INDEX_HOLDERS, HoldersQuery, self.on_holders, queue=subjects.INDEX_QUEUE
        )
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(fleet.run(ctx.stop))
                tg.create_task(self.periodic(ctx.stop))
        finally:
            await self.follower.stop()
            await self.write_snapshot()


def _obs(value: float):
    from opentelemetry.metrics import Observation

    return Observation(value)


async def main(ctx: ServiceContext, config: IndexConfig) -> None:
    redis = aioredis.from_url(config.redis_url, socket_timeout=2, socket_connect_timeout=2)
    try:
        await IndexService(config, ctx.bus, redis).run(ctx)
    finally:
        await redis.aclose()
