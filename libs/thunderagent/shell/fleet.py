"""Feed a WorkerRegistry from NATS: the registrations bucket (watch, including what was there
before we started) and the load reports, plus periodic lease expiry."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import msgspec

from thunderagent.bus import Bucket, BucketEntry, Bus, Delivery
from thunderagent.bus.errors import DECODE_ERRORS
from thunderagent.fleet import WorkerRegistry
from thunderagent.schemas import LoadReport, WorkerRegistration, subjects

log = logging.getLogger(__name__)

_reg_decoder = msgspec.json.Decoder(WorkerRegistration)


async def workers_bucket(bus: Bus) -> Bucket:
    """The registrations bucket, created by whichever process needs it first."""
    return await bus.bucket(subjects.WORKERS_BUCKET)


class FleetWatcher:
    """``on_change(worker_id, what)``: ``registered`` (new, or a new epoch), ``removed`` (the
    adapter deregistered) or ``expired`` (its lease lapsed); ``on_load`` sees every report of a
    registered worker."""

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
        """Set once the registrations that existed at start are loaded: a router takes no
        request before that (it would answer "no worker serves this model")."""

    async def run(self, stop: asyncio.Event) -> None:
        await self.bus.subscribe(subjects.WORKER_LOAD_WILDCARD, LoadReport, self._on_load)
        bucket = await workers_bucket(self.bus)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._watch(bucket, stop))
            tg.create_task(self._expire_loop(stop))

    async def _on_load(self, load: LoadReport, delivery: Delivery) -> None:
        if delivery.subject != subjects.worker_load(load.worker_id):
            # NATS lets a worker publish only its own subject; the report must name the same
            # worker, or one worker could renew another's lease and rewrite its load
            reason = f"load report for {load.worker_id!r} arrived on {delivery.subject}"
            await self.bus.reject(delivery, reason)
            return
        if self.registry.report(load, self.clock()) and self.on_load is not None:
            self.on_load(load)

    async def _watch(self, bucket: Bucket, stop: asyncio.Event) -> None:
        async for entry in bucket.watch(stop):
            if entry is None:  # the initial values are done
                self.ready.set()
            else:
                await self._apply(entry)

    async def _apply(self, entry: BucketEntry) -> None:
        if entry.value is None:
            if self.registry.remove(entry.key):
                self._tell(entry.key, "removed")
            return
        try:
            reg = _reg_decoder.decode(entry.value)
        except DECODE_ERRORS as err:
            where = Delivery(f"$KV.{subjects.WORKERS_BUCKET}.{entry.key}", "", {}, entry.value)
            await self.bus.reject(where, f"invalid WorkerRegistration under {entry.key!r}: {err}")
            return
        if self.registry.register(reg, self.clock()):
            self._tell(reg.worker_id, "registered")

    def _tell(self, worker_id: str, what: str) -> None:
        try:
            self.on_change(worker_id, what)
        except Exception:  # the service's bug: the watch and the expiry loop must go on
            log.exception("worker %s %s: the service's fleet callback failed", worker_id, what)

    async def _expire_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            for worker_id in self.registry.expire(self.clock()):
                log.info("worker %s: lease lapsed", worker_id)
                self._tell(worker_id, "expired")
            try:
                await asyncio.wait_for(stop.wait(), self.expire_every_s)
            except TimeoutError:
                pass
