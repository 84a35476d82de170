"""Feed a WorkerRegistry from NATS: the registrations bucket (watch, including what was there
before we started) and the load reports, plus periodic lease expiry."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import msgspec
from nats.js.errors import BucketNotFoundError
from nats.js.kv import KeyValue

from thunderagent.bus import Bus, Delivery
from thunderagent.fleet import WorkerRegistry
from thunderagent.schemas import LoadReport, WorkerRegistration, subjects

log = logging.getLogger(__name__)

_reg_decoder = msgspec.json.Decoder(WorkerRegistration)


WORKERS_BUCKET_TTL_S = 120.0
"""Garbage collection only: leases are enforced by readers from ``lease_s`` and renewals. One
fixed value, because every process creates the bucket with the same config or not at all."""


async def workers_bucket(bus: Bus) -> KeyValue:
    """Open the registrations bucket, creating it when this process is the first to need it."""
    from nats.js.api import KeyValueConfig

    js = bus.nc.jetstream()
    config = KeyValueConfig(bucket=subjects.WORKERS_BUCKET, history=1, ttl=WORKERS_BUCKET_TTL_S)
    for _ in range(20):
        try:
            return await js.key_value(subjects.WORKERS_BUCKET)
        except BucketNotFoundError:
            pass
        try:
            return await js.create_key_value(config)
        except Exception as err:  # another process created it between our two calls
            log.debug("creating %s: %s", subjects.WORKERS_BUCKET, err)
            await asyncio.sleep(0.05)
    raise RuntimeError(f"cannot open or create the {subjects.WORKERS_BUCKET} bucket")


class FleetWatcher:
    def __init__(
        self,
        bus: Bus,
        registry: WorkerRegistry,
        *,
        clock: Callable[[], float] = time.time,
        expire_every_s: float = 0.5,
        on_change: Callable[[str, str], None] | None = None,
        on_load: Callable[[LoadReport], None] | None = None,
    ) -> None:
        self.bus = bus
        self.registry = registry
        self.clock = clock
        self.expire_every_s = expire_every_s
        self.on_change = on_change or (lambda worker_id, what: None)
        self.on_load = on_load
        self.ready = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        await self.bus.subscribe(subjects.WORKER_LOAD_WILDCARD, LoadReport, self._on_load)
        kv = await workers_bucket(self.bus)
        watcher = await kv.watchall()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._watch(watcher, stop))
            tg.create_task(self._expire_loop(stop))
        await watcher.stop()

    async def _on_load(self, load: LoadReport, _: Delivery) -> None:
        if self.registry.report(load, self.clock()) and self.on_load is not None:
            self.on_load(load)

    async def _watch(self, watcher, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                entry = await watcher.updates(timeout=0.5)
            except TimeoutError:
                continue
            except Exception as err:  # nats-py raises its own TimeoutError subclass
                if type(err).__name__ == "TimeoutError":
                    continue
                raise
            if entry is None:  # end of the initial values
                self.ready.set()
                continue
            self._apply(entry)

    def _apply(self, entry) -> None:
        if entry.operation in ("DEL", "PURGE") or not entry.value:
            if self.registry.remove(entry.key):
                self.on_change(entry.key, "removed")
            return
        try:
            reg = _reg_decoder.decode(entry.value)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            log.warning("bad registration under %r: %s", entry.key, err)
            return
        if self.registry.register(reg, self.clock()):
            self.on_change(reg.worker_id, "registered")

    async def _expire_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            for worker_id in self.registry.expire(self.clock()):
                log.info("worker %s: lease lapsed", worker_id)
                self.on_change(worker_id, "expired")
            try:
                await asyncio.wait_for(stop.wait(), self.expire_every_s)
            except TimeoutError:
                pass
