"""Router shell: one replica on NATS around ``Router`` (``request_path``).

This shell feeds the router's pure ``RouterCore`` what NATS brings: registrations and load
reports (the fleet watcher), KV-event batches (the index follower: Redis snapshot, then the
stream), where the scheduler sent each request (``Dispatched``) or that it ran none
(``Dropped``), how runs ended
(``ProgressBatch``), and the requests themselves. Any number of replicas share the ``router``
queue group; each keeps its own index replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import redis.asyncio as aioredis

from thunderagent.bus import BusError
from thunderagent.router.request_path import Router, RouterConfig
from thunderagent.schemas import (
    CreditGrant,
    Dispatched,
    Dropped,
    GenerateRequest,
    ProgressBatch,
    RouterHello,
    subjects,
)
from thunderagent.shell import FleetWatcher, ServiceContext
from thunderagent.shell.index_follower import IndexFollower

log = logging.getLogger(__name__)

TICK_S = 0.25
"""How often the core's periodic work runs (TTL expiry; feedback every ``feedback_interval_s``)."""
HELLO_S = 1.0
"""The replica tells the scheduler it is alive this often (its credit share depends on it)."""


class RouterService:
    """One router replica: fleet view, index follower, request and feedback subscriptions."""

    def __init__(
        self, ctx: ServiceContext, config: RouterConfig, *, serve_requests: bool = True
    ) -> None:
        """``serve_requests=False`` embeds the replica in another process (a gateway, a
        client): it keeps its index, fleet view, credit and feedback subscriptions, but takes
        no requests from the bus; the host calls ``router.handle`` itself, which saves the
        NATS hop from the host to a router process (as Dynamo's frontend and SMG route
        in-process)."""
        self.ctx = ctx
        self.serve_requests = serve_requests
        self.router = Router(config, ctx.bus)
        self.core = self.router.core
        self.redis = None
        if config.redis_url:
            self.redis = aioredis.from_url(
                config.redis_url, socket_timeout=2, socket_connect_timeout=2
            )
        self.follower = IndexFollower(
            ctx.bus, self.core.feeder, redis=self.redis, apply=self.core.apply_kv
        )
        self.fleet = FleetWatcher(ctx.bus, self.core.fleet, on_change=self._on_fleet_change)
        self.router.fleet_ready = self.fleet.ready
        self.serving = asyncio.Event()
        """Set once the NATS server has the request subscription (after the index replica has
        caught up): until then a client gets "no router subscribes"."""

    def _on_fleet_change(self, worker_id: str, what: str) -> None:
        if what in ("expired", "removed"):
            self.core.remove(worker_id)
        elif what == "registered" and (state := self.core.fleet.get(worker_id)) is not None:
            self.router.served_models.add(state.registration.model)
            self.core.on_registered(worker_id)

    async def _tick(self, stop: asyncio.Event) -> None:
        hello = RouterHello(router_id=self.router.config.router_id)
        next_hello = 0.0
        while not stop.is_set():
            self.core.tick(time.time())
            now = time.monotonic()
            self.router.stalls.beat(now)
            if now >= next_hello:
                next_hello = now + HELLO_S
                try:
                    await self.ctx.bus.publish(subjects.ROUTER_PRESENCE, hello)
                except BusError as err:  # NATS away: say hello again next time
                    log.warning("router presence not published: %s", err)
            try:
                await asyncio.wait_for(stop.wait(), TICK_S)
            except TimeoutError:
                pass

    async def run(self) -> None:
        bus, router = self.ctx.bus, self.router
        await self.follower.start()
        await bus.subscribe(
            subjects.router_dispatched(router.config.router_id), Dispatched, router.on_dispatched
        )
        await bus.subscribe(
            subjects.router_dropped(router.config.router_id), Dropped, router.on_dropped
        )
        await bus.subscribe(
            subjects.router_credits(router.config.router_id), CreditGrant, router.on_credits
        )
        await bus.subscribe(subjects.PROGRESS_WILDCARD, ProgressBatch, router.on_progress)
        # Concurrent: a request waits for the scheduler's ack without holding up the next one;
        # the decision itself runs without an await, so the core stays consistent.
        if self.serve_requests:
            await bus.subscribe(
                subjects.REQUESTS_WILDCARD,
                GenerateRequest,
                router.on_request,
                queue=subjects.ROUTER_QUEUE,
                concurrent=True,
            )
        await bus.nc.flush()
        self.serving.set()
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self.fleet.run(self.ctx.stop))
                tg.create_task(self._tick(self.ctx.stop))
        finally:
            await router.decisions.close()
            await self.follower.stop()
            if self.redis is not None:
                await self.redis.aclose()


@contextlib.asynccontextmanager
async def embedded_router(ctx: ServiceContext, config: RouterConfig) -> AsyncIterator[Router]:
    """A replica inside the caller's process (``serve_requests=False``), running for the block
    on ``ctx``'s connection: yields the ``Router`` whose ``handle`` the caller routes with, once
    the replica's index has caught up. Give its callers ``ctx.bus``'s connection (on it a run's
    end arrives before the run's answer). Leaving the block stops the replica."""
    service = RouterService(ctx, config, serve_requests=False)
    running = asyncio.create_task(service.run())
    serving = asyncio.ensure_future(service.serving.wait())
    await asyncio.wait({running, serving}, return_when=asyncio.FIRST_COMPLETED)
    if not serving.done():
        serving.cancel()
        running.result()  # its error, if it failed
        raise RuntimeError("the embedded router replica stopped before it served")
    try:
        yield service.router
    finally:
        ctx.stop.set()
        await running


async def main(ctx: ServiceContext, config: RouterConfig) -> None:
    await RouterService(ctx, config).run()
