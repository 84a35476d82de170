"""Migration service: watches where prefixes are hot and where workers have room, and moves KV.

Feeds the pure planner (``thunderagent.migration``) from what the control plane already sees:
routing decisions (demand per prefix), load reports (queues, prefill backlog, KV held by running
requests), the fleet (workers joining and leaving) and drain notices; who holds each tracked
prefix it asks the index service at every tick (``holders``). Every ``interval_s`` it asks the
planner for actions and carries each out as a three-step move through the workers' adapters
(``executor``). Operators and benchmarks can order a move (``thunderagent.migration.request``)
and announce a leaving worker (``thunderagent.migration.drain``). While the index service does
not answer it plans nothing and refuses orders, saying why.

One instance per fleet: the planner's state (moves in flight, replicas it made) is not shared.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field

from thunderagent.bus import Bus, BusError, Delivery
from thunderagent.fleet import WorkerRegistry
from thunderagent.migration import (
    Action,
    Drop,
    Migrate,
    MigrationParams,
    MigrationPlanner,
    RouteSeen,
    WorkerSeen,
)
from thunderagent.migrator.executor import Executor, Timeouts, mode_of
from thunderagent.migrator.holders import IndexHolders
from thunderagent.migrator.metrics import MigrationMetrics
from thunderagent.schemas import (
    Ack,
    DrainNotice,
    LoadReport,
    MigrationMode,
    MigrationOrder,
    MigrationReport,
    RouteDecisionBatch,
    is_valid_worker_id,
    subjects,
)
from thunderagent.shell import FleetWatcher, ServiceContext, TaskSet

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class MigrationConfig:
    params: dict = field(default_factory=dict)
    """``MigrationParams`` overrides (``--param FIELD=VALUE``)."""
    interval_s: float = 0.5
    """How often the planner is asked: a fraction of its ``hot_for_s``."""
    auto: bool = True
    """Plan moves by itself; False: only orders and drains (no hot-spot copies)."""
    timeouts: Timeouts = field(default_factory=Timeouts)


class MigrationService:
    def __init__(self, bus: Bus, config: MigrationConfig) -> None:
        self.bus = bus
        self.config = config
        params = MigrationParams.from_dict(config.params)
        self.planner = MigrationPlanner(params, id_prefix=f"mig-{uuid.uuid4().hex[:6]}")
        self.registry = WorkerRegistry()
        self.index = IndexHolders(bus)
        self._index_silent = False
        self.executor = Executor(bus, config.timeouts)
        self.reports: list[MigrationReport] = []
        """Final reports, newest last (bounded): tests and the health of the service."""
        self.last_gbps = 0.0
        self._tasks = TaskSet("migration")
        self.metrics = MigrationMetrics(self._gauges)

    # ---- observations --------------------------------------------------------------------
    async def holders(self, prefix: int) -> set[str]:
        """Registered workers whose GPU cache holds the prefix (its deepest block), as the
        index service says; raises :class:`BusError` when it does not answer."""
        return self._registered(await self.index.of([prefix]))(prefix)

    def _registered(self, held: dict[int, list[str]]):
        """``holders(prefix)`` for the planner: the index's answer, less unregistered workers."""
        return lambda prefix: {w for w in held.get(prefix, ()) if w in self.registry}

    async def on_decisions(self, batch: RouteDecisionBatch, _: Delivery) -> None:
        now = time.time()
        for decision in batch.decisions:
            # counted on arrival (up to a batch window late): demand is counted over seconds,
            # and arrival order keeps each prefix's hit times in order across router replicas
            self.planner.observe_route(RouteSeen.of(decision), now)

    def on_load(self, load: LoadReport) -> None:
        state = self.registry.get(load.worker_id)
        reg = state.registration if state is not None else None
        seen = WorkerSeen(
            worker_id=load.worker_id,
            model=reg.model if reg else "",
            lora_adapters=frozenset(reg.lora_adapters) if reg else frozenset(),
            running=load.running,
            queued=load.queued,
            prefill_backlog_tokens=load.prefill_backlog_tokens,
            live_tokens=load.num_tokens,
            kv_total_blocks=load.kv_total_blocks,
            block_size=reg.block_size if reg else 16,
        )
        self.planner.observe_load(seen, time.time())

    def on_fleet_change(self, worker_id: str, what: str) -> None:
        if what in ("expired", "removed"):
            self.planner.forget_worker(worker_id)

    async def on_drain(self, notice: DrainNotice, delivery: Delivery) -> None:
        if not is_valid_worker_id(notice.worker_id):
            await self.bus.reject(delivery, f"bad worker id {notice.worker_id!r}")
            return
        self.planner.set_draining(notice.worker_id, notice.draining)
        log.info(
            "worker %s %s (%s)",
            notice.worker_id,
            "is draining" if notice.draining else "stays",
            notice.reason,
        )
        if delivery.reply:
            await self.bus.publish(delivery.reply, Ack(accepted=True))

    # ---- orders --------------------------------------------------------------------------
    async def on_order(self, order: MigrationOrder, delivery: Delivery) -> None:
        try:
            held = self._registered(await self.index.of([order.prefix_hash]))
            move = self.planner.order(
                order.prefix_hash,
                time.time(),
                held,
                blocks=order.blocks,
                source=order.source,
                target=order.target,
                migrate=order.mode is MigrationMode.MIGRATE,
                reason=order.reason or "ordered",
            )
        except (ValueError, BusError) as err:  # BusError: the index service did not answer
            report = MigrationReport(
                migration_id="",
                mode=order.mode,
                phase="failed",
                prefix_hash=order.prefix_hash,
                blocks=order.blocks,
                source=order.source,
                target=order.target,
                reason=str(err),
            )
        else:
            self.metrics.decisions.add(1, {"mode": move_kind(move), "origin": "order"})
            report = await self.execute(move)
        if delivery.reply:
            await self.bus.publish(delivery.reply, report)

    # ---- execution -----------------------------------------------------------------------
    async def execute(self, action: Action) -> MigrationReport:
        report = await self.executor.run(action, self._publish_report)
        now = time.time()
        attrs = {"mode": move_kind(action), "transport": report.transport or "none"}
        if report.phase == "done":
            self.planner.on_transfer_done(action.action_id, now, moved_bytes=report.bytes)
            self.metrics.bytes.add(report.bytes, attrs)
            if report.transfer_s > 0 and not isinstance(action, Drop):
                self.metrics.transfer.record(report.transfer_s, attrs)
            if report.transport == "nixl" and report.gbps > 0:
                self.last_gbps = report.gbps
        else:
            log.warning("%s failed: %s", action.action_id, report.reason)
            self.planner.on_transfer_failed(action.action_id, now, report.reason)
        self.metrics.moves.add(1, {**attrs, "outcome": report.phase})
        self.reports = [*self.reports[-99:], report]
        return report

    async def _publish_report(self, report: MigrationReport) -> None:
        await self.bus.publish(subjects.MIGRATION_EVENTS, report)

    async def plan_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.config.interval_s)
            except TimeoutError:
                pass
            if stop.is_set():
                return
            await self.plan_once()

    async def plan_once(self) -> list[Action]:
        """Ask the planner (even with ``auto`` off, or the index service silent: moves that
        timed out are failed there)."""
        if not self.config.auto:
            self.planner.expire(time.time())
            return []
        try:
            held = await self.index.of(self.planner.demand.prefixes())
        except BusError as err:
            self.planner.expire(time.time())
            self.metrics.skipped_ticks.add(1)
            if not self._index_silent:  # once per outage, not twice a second
                log.warning("no plans while the index service does not answer (%s)", err)
            self._index_silent = True
            return []
        if self._index_silent:
            log.info("the index service answers again: planning resumes")
            self._index_silent = False
        actions = self.planner.plan(time.time(), self._registered(held))
        for action in actions:
            log.info("%s %s: %s", move_kind(action), action.action_id, action.reason)
            self.metrics.decisions.add(1, {"mode": move_kind(action), "origin": "planner"})
            self._tasks.spawn(self.execute(action), name=action.action_id)
        return actions

    def _gauges(self) -> dict[str, float]:
        now = time.time()
        p = self.planner
        hot = sum(1 for x in p.demand.prefixes() if p.demand.rate(x, now) >= p.params.min_rate)
        return {
            "inflight": len(p.inflight),
            "replicated_prefixes": p.replicated_prefixes(),
            "hot_prefixes": hot,
            "last_gbps": self.last_gbps,
        }

    async def run(self, ctx: ServiceContext) -> None:
        bus = ctx.bus
        fleet = FleetWatcher(
            bus, self.registry, on_change=self.on_fleet_change, on_load=self.on_load
        )
        await bus.subscribe(subjects.ROUTE_DECISIONS, RouteDecisionBatch, self.on_decisions)
        await bus.subscribe(
            subjects.MIGRATION_REQUEST,
            MigrationOrder,
            self.on_order,
            queue=subjects.MIGRATION_QUEUE,
            concurrent=True,
        )
        await bus.subscribe(
            subjects.MIGRATION_DRAIN, DrainNotice, self.on_drain, queue=subjects.MIGRATION_QUEUE
        )
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(fleet.run(ctx.stop))
                tg.create_task(self.plan_loop(ctx.stop))
        finally:
            self._tasks.cancel()


def move_kind(action: Action) -> str:
    if isinstance(action, Drop):
        return "drop"
    return "migrate" if isinstance(action, Migrate) else mode_of(action).value


async def main(ctx: ServiceContext, config: MigrationConfig) -> None:
    await MigrationService(ctx.bus, config).run(ctx)
