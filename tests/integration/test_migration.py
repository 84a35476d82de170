"""The migration service over real NATS with simulated engines: a prefix moved with NIXL and the
next request routed to its new holder; the planner copying a hot prefix on its own; warm-up for
engines without a KV import path; a target or a source dying mid-transfer."""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import msgspec
import numpy as np
import pytest

from tests.integration.inproc import MODEL, inproc_stack
from tests.integration.migration_stack import (
    BLOCK,
    close_runners,
    engine_json,
    prefill,
    prefix_hash,
    prefix_tokens,
    skip_without_nixl,
    spawn_pooled_engine,
    start_adapter,
    start_index,
    start_migration,
    start_pooled_engine,
    start_router_and_scheduler,
    wait_for,
)
from thunderagent.bus import Bus, connect
from thunderagent.client import ThunderClient
from thunderagent.migration import RouteSeen, WorkerSeen
from thunderagent.migrator.executor import Timeouts
from thunderagent.schemas import (
    Ack,
    Candidate,
    DrainNotice,
    ErrorCode,
    ErrorReply,
    GenerateRequest,
    MigrationMode,
    MigrationOrder,
    MigrationReport,
    RouteDecision,
    RouteDecisionBatch,
    subjects,
)

skip_without_nixl()

pytestmark = pytest.mark.integration


async def order(nats_url: str, message: MigrationOrder, wait_s: float = 20) -> MigrationReport:
    nc = await connect(nats_url, name="test-order")
    try:
        bus = Bus(nc, service="test")
        return await bus.request(subjects.MIGRATION_REQUEST, message, MigrationReport,
                                 timeout=wait_s)  # fmt: skip
    finally:
        await nc.close()


async def collect_reports(nats_url: str, into: list) -> object:
    nc = await connect(nats_url, name="test-events")
    decoder = msgspec.json.Decoder(MigrationReport)

    async def on(msg) -> None:
        into.append(decoder.decode(msg.data))

    await nc.subscribe(subjects.MIGRATION_EVENTS, cb=on)
    return nc


def holding(service, prefix: int, workers: set[str]):
    """A check for ``wait_for``: the index service names exactly ``workers`` for ``prefix``."""

    async def check() -> bool:
        return await service.holders(prefix) == workers

    return check


def pool_bytes(driver, key: int) -> np.ndarray:
    return driver.kv_pool.view(driver.kv_pool.slot_of[key])


async def test_a_migrated_prefix_arrives_intact_and_the_router_follows_it(nats_server):
    runners: list = []
    async with inproc_stack(nats_server.url) as stack:
        try:
            engines = {}
            for w in ("w0", "w1"):
                engines[w] = await start_pooled_engine(stack, w, runners=runners)
            for wid, engine in engines.items():
                await start_adapter(stack, wid, engine.url)
            await start_router_and_scheduler(stack)
            service = await start_migration(stack, auto=False)
            await stack.wait_for_workers(2)
            events: list[MigrationReport] = []
            watcher = await collect_reports(nats_server.url, events)
            client = await ThunderClient.connect(nats_server.url, idle_timeout_s=20)
            tokens = prefix_tokens(8)
            p = prefix_hash(tokens)
            first = await client.generate(
                GenerateRequest(model=MODEL, token_ids=[*tokens, 9, 9], max_tokens=2)
            )
            routed_at = time.monotonic()
            source = first.final.worker_id
            target = "w1" if source == "w0" else "w0"
            await wait_for(holding(service, p, {source}), what="the index to see it")

            report = await order(nats_server.url, MigrationOrder(
                prefix_hash=p, blocks=8, source=source, target=target,
                mode=MigrationMode.MIGRATE, reason="test",
            ))  # fmt: skip
            assert report.phase == "done", report.reason
            src, dst = engines[source].driver, engines[target].driver
            assert (report.transport, report.moved_blocks, report.verified) == ("nixl", 8, True)
            assert report.bytes == 8 * dst.kv_pool.slot_bytes and report.gbps > 0
            status = await engine_json(engines[target].url, "/kv/status")
            pulled = (status["pulled_blocks"], status["pulled_bytes"], status["failed_pulls"])
            assert pulled == (8, report.bytes, 0)
            engine_keys = list(dst.kv_pool.slot_of)  # the target held nothing before
            assert len(engine_keys) == 8 and dst.core.cache.tokens_of(engine_keys) == tokens
            for key in engine_keys:
                assert dst.kv_pool.checksum(dst.kv_pool.slot_of[key]) == (
                    src.kv_pool.expected_checksum(key)
                )
                assert key not in src.core.cache  # a migration frees the source
            await wait_for(holding(service, p, {target}), what="the new holder")
            # the router's index replica follows the same stream; its in-flight guess that the
            # source holds the prompt it sent there lapses (inflight_ttl_s=0.5 in these tests)
            await asyncio.sleep(max(0.3, routed_at + 1.0 - time.monotonic()))

            second = await client.generate(
                GenerateRequest(model=MODEL, token_ids=[*tokens, 5, 5, 5], max_tokens=2)
            )
            assert second.final.worker_id == target
            assert second.final.usage.cached_tokens == 8 * BLOCK
            assert [(e.phase, e.migration_id) for e in events] == [
                ("started", report.migration_id), ("done", report.migration_id)
            ]  # fmt: skip
            await client.close()
            await watcher.close()
        finally:
            await close_runners(runners)


async def test_the_planner_copies_a_prefix_whose_holder_is_saturated(nats_server):
    runners: list = []
    async with inproc_stack(nats_server.url) as stack:
        try:
            for wid in ("w0", "w1"):
                engine = await start_pooled_engine(stack, wid, runners=runners)
                # one load report at start, then none for a minute: the test sets the load
                await start_adapter(stack, wid, engine.url, load_s=60)
            await stack.wait_for_workers(2)
            params = {"hot_for_s": 0.2, "min_rate": 0.5, "window_s": 5.0, "min_blocks": 2,
                      "cooldown_s": 60.0}  # fmt: skip
            service = await start_migration(stack, params=params)
            tokens = prefix_tokens(6, seed=3)
            p = prefix_hash(tokens)
            await prefill(stack.engine_urls["w0"], tokens, "warm")
            await wait_for(holding(service, p, {"w0"}), what="w0 to hold the prefix")
            await wait_for(lambda: "w0" in service.registry and "w1" in service.registry,
                           what="both registrations")  # fmt: skip
            now = time.time()
            for i in range(5):  # what the router reports for requests hitting w0: 1 req/s
                service.planner.observe_route(RouteSeen("w0", p, 6, MODEL), now + i * 0.01)
            saturated = WorkerSeen("w0", MODEL, running=8, queued=6, prefill_backlog_tokens=50_000,
                                   kv_total_blocks=64, block_size=BLOCK)  # fmt: skip
            service.planner.observe_load(saturated, now)
            service.planner.observe_load(WorkerSeen("w1", MODEL, kv_total_blocks=64,
                                                    block_size=BLOCK), now)  # fmt: skip
            report = await wait_for(lambda: next(iter(service.reports), None), timeout_s=10,
                                    what="a move planned and done")  # fmt: skip
            assert (report.phase, report.mode, report.source, report.target) == (
                "done", MigrationMode.REPLICATE, "w0", "w1")  # fmt: skip
            assert report.reason.startswith("hot:") and report.verified
            await wait_for(holding(service, p, {"w0", "w1"}), what="two holders")
            assert service.planner.replicated_prefixes() == 1
            await asyncio.sleep(0.5)  # cooling down: no second copy, no flapping
            assert len(service.reports) == 1
        finally:
            await close_runners(runners)


async def test_demand_alone_fans_a_prefix_out_to_idle_workers(nats_server):
    """The demand gate: nobody queues, but the prefix is requested more often per holder than
    ``min_rate_per_holder``; copies continue from the new holder as they land."""
    runners: list = []
    async with inproc_stack(nats_server.url) as stack:
        try:
            for wid in ("w0", "w1", "w2"):
                engine = await start_pooled_engine(stack, wid, runners=runners)
                await start_adapter(stack, wid, engine.url, load_s=60)
            await stack.wait_for_workers(3)
            params = {"min_rate_per_holder": 1.0, "min_rate": 0.5, "window_s": 5.0,
                      "min_blocks": 2, "hot_for_s": 0.0}  # fmt: skip
            service = await start_migration(stack, params=params)
            tokens = prefix_tokens(6, seed=7)
            p = prefix_hash(tokens)
            await prefill(stack.engine_urls["w0"], tokens, "warm")
            await wait_for(holding(service, p, {"w0"}), what="w0 to hold the prefix")
            await wait_for(lambda: len(service.registry) == 3, what="three registrations")
            now = time.time()
            for wid in ("w0", "w1", "w2"):  # idle: only demand can open the gate
                seen = WorkerSeen(wid, MODEL, kv_total_blocks=64, block_size=BLOCK)
                service.planner.observe_load(seen, now)
            for i in range(15):  # 3 req/s over the 5 s window, all hitting w0
                service.planner.observe_route(RouteSeen("w0", p, 6, MODEL), now + i * 0.01)
            await wait_for(holding(service, p, {"w0", "w1", "w2"}), timeout_s=15,
                           what="the prefix on all three")  # fmt: skip
            # a move's report is kept once its release step is answered, after the target's
            # events have shown the new holder
            await wait_for(lambda: len(service.reports) == 2, what="both moves reported")
            reports = [r for r in service.reports if r.phase == "done"]
            assert len(reports) == 2 and {r.target for r in reports} == {"w1", "w2"}
            assert all(r.verified and r.reason.startswith("hot:") for r in reports)
            assert "1 holder(s)" in reports[0].reason and "2 holder(s)" in reports[1].reason
            assert service.planner.stats.failed == 0
        finally:
            await close_runners(runners)


NAMESPACES = {
    "base model": {},
    "tenant": {"cache_salt": "tenant-a"},
    "lora adapter": {"lora_path": "sql-adapter"},
}


@pytest.mark.parametrize("fields", list(NAMESPACES.values()), ids=list(NAMESPACES))
async def test_engines_without_a_kv_import_path_warm_up_instead(nats_server, fields):
    """A tenant's or an adapter's prefix is warmed up in its namespace: the target's copy
    serves that tenant's or adapter's next request, not the base model's."""
    runners: list = []
    async with inproc_stack(nats_server.url) as stack:
        try:
            for wid in ("w0", "w1"):
                engine = await start_pooled_engine(stack, wid, pool=False, runners=runners,
                                                   lora_adapters=["sql-adapter"])  # fmt: skip
                await start_adapter(stack, wid, engine.url)
            await stack.wait_for_workers(2)
            service = await start_migration(stack, auto=False)
            workers = service.planner.workers  # the adapters each registered: targets for one
            await wait_for(lambda: all(w in workers and workers[w].load.lora_adapters
                                       == {"sql-adapter"} for w in ("w0", "w1")),
                           what="the planner to see each worker's adapter")  # fmt: skip
            tokens = prefix_tokens(5, seed=11)
            p = prefix_hash(tokens, fields.get("cache_salt"), fields.get("lora_path"))
            await prefill(stack.engine_urls["w0"], tokens, "warm", **fields)
            await wait_for(holding(service, p, {"w0"}), what="w0 to hold the prefix")
            report = await order(nats_server.url, MigrationOrder(prefix_hash=p, source="w0",
                                                                 target="w1"))  # fmt: skip
            assert report.phase == "done", report.reason
            assert (report.transport, report.moved_blocks, report.bytes) == ("warmup", 5, 0)
            assert not report.verified  # nothing was copied, so nothing to compare
            await wait_for(holding(service, p, {"w0", "w1"}), what="w1 to hold it")
            meta = await prefill(stack.engine_urls["w1"], [*tokens, 1, 2], "after", **fields)
            assert meta["cached_tokens"] == 5 * BLOCK
            if fields:  # in its own namespace only: the base model's prompt finds nothing
                meta = await prefill(stack.engine_urls["w1"], [*tokens, 1, 2], "base")
                assert meta["cached_tokens"] == 0
        finally:
            await close_runners(runners)


async def test_a_target_dying_mid_transfer_fails_the_move_and_the_source_still_serves(
    nats_server, tmp_path
):
    runners: list = []
    async with inproc_stack(nats_server.url) as stack:
        dead = await spawn_pooled_engine(tmp_path, "target", pull_gbps=0.001)  # 1 MiB: ~1 s
        try:
            src = await start_pooled_engine(stack, "w0", runners=runners)
            await start_adapter(stack, "w0", src.url)
            await start_adapter(stack, "w1", dead.url)
            await stack.wait_for_workers(2)
            service = await start_migration(stack, auto=False,
                                            timeouts=Timeouts(pull_s=8.0, hold_s=20.0))  # fmt: skip
            tokens = prefix_tokens(16, seed=5)
            p = prefix_hash(tokens)
            await prefill(src.url, tokens, "warm")
            await wait_for(holding(service, p, {"w0"}), what="w0 to hold the prefix")
            keys = [k for k in src.driver.kv_pool.slot_of if k in src.driver.core.cache]
            moving = asyncio.create_task(order(nats_server.url, MigrationOrder(
                prefix_hash=p, source="w0", target="w1", mode=MigrationMode.MIGRATE)))  # fmt: skip
            for _ in range(300):  # until the target is part-way through its copy
                status = await engine_json(dead.url, "/kv/status")
                if status["imports"]:
                    break
                await asyncio.sleep(0.01)
            assert status["imports"] == 1 and [src.driver.core.cache.refcount(k) for k in keys]
            dead.child.popen.send_signal(signal.SIGKILL)
            report = await moving
            assert report.phase == "failed" and "target w1" in report.reason
            assert service.planner.stats.failed == 1 and service.planner.inflight == {}
            # the source was released, kept every block, and serves the prefix from cache
            await wait_for(lambda: all(src.driver.core.cache.refcount(k) == 0 for k in keys),
                           what="the source's pin released")  # fmt: skip
            assert all(k in src.driver.core.cache for k in keys)
            meta = await prefill(src.url, [*tokens, 3], "after")
            assert meta["cached_tokens"] == 16 * BLOCK
            await asyncio.sleep(0.3)
            assert await service.holders(p) == {"w0"}  # the target never announced a block of it
        finally:
            dead.child.stop(grace_s=1)
            await close_runners(runners)


async def test_a_source_dying_mid_transfer_leaves_nothing_at_the_target(nats_server, tmp_path):
    runners: list = []
    async with inproc_stack(nats_server.url) as stack:
        dead = await spawn_pooled_engine(tmp_path, "source")
        try:
            dst = await start_pooled_engine(stack, "w1", pull_gbps=0.001, runners=runners)
            await start_adapter(stack, "w0", dead.url)
            await start_adapter(stack, "w1", dst.url)
            await stack.wait_for_workers(2)
            service = await start_migration(stack, auto=False,
                                            timeouts=Timeouts(pull_s=6.0, hold_s=20.0))  # fmt: skip
            tokens = prefix_tokens(16, seed=9)
            p = prefix_hash(tokens)
            await prefill(dead.url, tokens, "warm")
            await wait_for(holding(service, p, {"w0"}), what="w0 to hold the prefix")
            cached_before = dict(dst.driver.core.cache.contents())
            moving = asyncio.create_task(order(nats_server.url, MigrationOrder(
                prefix_hash=p, source="w0", target="w1")))  # fmt: skip
            await wait_for(lambda: dst.driver.core.cache.reserved, what="the copy to start")
            dead.child.popen.send_signal(signal.SIGKILL)
            report = await moving
            assert report.phase == "failed", report
            assert "NIXL read" in report.reason
            core, pool = dst.driver.core, dst.driver.kv_pool
            assert core.cache.contents() == cached_before  # no half-inserted prefix
            assert core.cache.reserved == 0 and pool.used == len(cached_before)
            assert (await engine_json(dst.url, "/kv/status"))["imports"] == 0
            assert "w1" not in await service.holders(p)
        finally:
            dead.child.stop(grace_s=1)
            await close_runners(runners)


async def test_a_draining_worker_hands_over_the_prefix_only_it_holds(nats_server):
    runners: list = []
    async with inproc_stack(nats_server.url) as stack:
        try:
            for wid in ("w0", "w1"):
                engine = await start_pooled_engine(stack, wid, runners=runners)
                await start_adapter(stack, wid, engine.url)
            await stack.wait_for_workers(2)
            service = await start_migration(stack)
            tokens = prefix_tokens(4, seed=13)
            p = prefix_hash(tokens)
            await prefill(stack.engine_urls["w0"], tokens, "warm")
            await wait_for(holding(service, p, {"w0"}), what="w0 to hold the prefix")
            service.planner.observe_route(RouteSeen("w0", p, 4, MODEL), time.time())
            nc = await connect(nats_server.url, name="test-drain")
            ack = await Bus(nc, service="test").request(
                subjects.MIGRATION_DRAIN, DrainNotice(worker_id="w0", reason="scale-in"), Ack
            )
            await nc.close()
            assert ack.accepted
            report = await wait_for(lambda: next(iter(service.reports), None),
                                    what="the drain move")  # fmt: skip
            assert (report.phase, report.mode, report.source, report.target) == (
                "done", MigrationMode.MIGRATE, "w0", "w1")  # fmt: skip
            assert report.reason.startswith("drain")
            await wait_for(holding(service, p, {"w1"}), what="w1 alone to hold it")
        finally:
            await close_runners(runners)


async def test_bad_orders_and_notices_get_an_error_reply_and_a_dead_letter(nats_server):
    async with inproc_stack(nats_server.url) as stack:
        service = await start_migration(stack, auto=False)
        nc = await connect(nats_server.url, name="test-bad")
        try:
            dead = []

            async def on_dead(msg) -> None:
                dead.append(msg)

            await nc.subscribe(subjects.dead_letter("migration"), cb=on_dead)
            reply = await nc.request(subjects.MIGRATION_REQUEST, b'{"prefix_hash": "x"}',
                                     timeout=5)  # fmt: skip
            error = msgspec.json.decode(reply.data, type=ErrorReply)
            assert error.code == ErrorCode.BAD_REQUEST and "prefix_hash" in error.message
            reply = await nc.request(subjects.MIGRATION_DRAIN, b'{"worker_id": "a.b"}', timeout=5)
            assert "bad worker id" in msgspec.json.decode(reply.data, type=ErrorReply).message
            unknown = await Bus(nc, service="test").request(
                subjects.MIGRATION_REQUEST, MigrationOrder(prefix_hash=42), MigrationReport,
                timeout=5,
            )  # fmt: skip
            assert unknown.phase == "failed" and "no worker is known" in unknown.reason
            reply = await nc.request(subjects.MIGRATION_REQUEST, b'{"prefix_hash": -1}',
                                     timeout=5)  # fmt: skip
            assert "unsigned 64-bit" in msgspec.json.decode(reply.data, type=ErrorReply).message
            await wait_for(lambda: len(dead) == 3, what="three dead letters")
            assert service.planner.stats.failed == 0  # refused before anything started
        finally:
            await nc.close()


async def test_without_an_index_service_orders_fail_saying_why_and_ticks_plan_nothing(
    nats_server, caplog
):
    async with inproc_stack(nats_server.url) as stack:
        service = await start_migration(stack, index=False)
        hot = RouteDecision(
            request_id="r1", model=MODEL, worker_id="w0", overlap_blocks=6, prompt_blocks=8,
            candidates=[Candidate(worker_id="w0", score=1.0, overlap_blocks=6)],
            policy="thunder", decided_at=time.time(), prefix_hash=0xBEEF,
        )  # fmt: skip
        await service.on_decisions(RouteDecisionBatch(router_id="r1", decisions=[hot]), None)
        assert service.planner.demand.prefixes() == [0xBEEF]
        # the service's own ticks (every 0.1 s) run beside the test's: count what either said
        caplog.set_level(logging.INFO, logger="thunderagent.migrator.service")

        def said(text: str) -> int:
            return sum(text in r.getMessage() for r in caplog.records)

        for _ in range(3):  # each tick is skipped, the service lives on, one warning
            assert await service.plan_once() == []
        assert said("no plans while the index service does not answer") == 1
        report = await order(nats_server.url, MigrationOrder(prefix_hash=0xBEEF), wait_s=10)
        assert report.phase == "failed" and subjects.INDEX_HOLDERS in report.reason
        assert not stack.services["migration"].task.done()
        await start_index(stack)  # the index comes up: the next order is judged on its merits
        report = await order(nats_server.url, MigrationOrder(prefix_hash=0xBEEF), wait_s=10)
        assert report.phase == "failed" and "no worker is known" in report.reason
        assert await service.plan_once() == []  # nothing hot enough, and planned
        assert said("planning resumes") == 1, "one line when the index answers again"
        assert said("no plans while") == 1, "and still one warning for the outage"


async def test_route_decisions_are_the_planners_demand(nats_server):
    async with inproc_stack(nats_server.url) as stack:
        service = await start_migration(stack, auto=False)
        nc = await connect(nats_server.url, name="test-routes")
        try:
            bus = Bus(nc, service="test")
            hit = RouteDecision(
                request_id="r1", model=MODEL, worker_id="w0", overlap_blocks=6, prompt_blocks=8,
                candidates=[Candidate(worker_id="w0", score=1.0, overlap_blocks=6)],
                policy="thunder", decided_at=time.time(), prefix_hash=0xBEEF, lora_name="sql",
            )  # fmt: skip
            spilled = RouteDecision(
                request_id="r2", model=MODEL, worker_id="w1", overlap_blocks=0, prompt_blocks=8,
                candidates=[Candidate(worker_id="w1", score=1.0),
                            Candidate(worker_id="w0", score=0.5, overlap_blocks=6)],
                policy="thunder", decided_at=time.time(),
            )  # fmt: skip
            batch = RouteDecisionBatch(router_id="r1", decisions=[hit, spilled])
            await bus.publish(subjects.ROUTE_DECISIONS, batch)
            await bus.publish(
                subjects.ROUTE_DECISIONS, RouteDecisionBatch(router_id="r2", decisions=[hit])
            )
            await wait_for(lambda: service.planner.demand.hits(0xBEEF, time.time()) == 3,
                           what="three requests counted for the prefix")  # fmt: skip
            demand = service.planner.demand.get(0xBEEF)
            assert (demand.blocks, demand.lora_name) == (6, "sql"), "a copy needs the adapter"
        finally:
            await nc.close()
