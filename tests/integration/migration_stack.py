"""Helpers for the migration tests: simulated engines with NIXL-registered KV pools (in this
process, or as a separate process that a test can kill), worker adapters, the migration
service, on top of ``InprocStack``."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from tests.integration.inproc import MODEL, InprocStack, inproc_stack, serve_engine
from thunderagent.embedded import ChildProcess, free_port, spawn
from thunderagent.engine import get_profile
from thunderagent.hashing import BlockHasher, kv_namespace
from thunderagent.schemas import subjects
from thunderagent.sglang.zmq_publisher import ZmqKvEventPublisher
from thunderagent.simengine.driver import EngineDriver
from thunderagent.simengine.kv_pool import NixlUnavailable, load_nixl, pool_for
from thunderagent.simengine.server import EngineInfo

BLOCK = 16
KV_BLOCKS = 64
PROFILE = "tiny"
"""64 KiB per block (4 layers x 2 KV heads x 128 dims x 2 bytes x 16 tokens), 64 blocks."""


def skip_without_nixl() -> None:
    """Skip the calling test module, saying why, where the nixl wheel cannot be loaded."""
    try:
        load_nixl()
    except NixlUnavailable as err:  # pragma: no cover - depends on the machine
        pytest.skip(f"NIXL moves need nixl: {err}", allow_module_level=True)


def events_config() -> str:
    return json.dumps({
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{free_port()}",
        "replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
        "topic": "kv",
        "bind": True,
    })  # fmt: skip


@dataclass
class PooledEngine:
    url: str
    driver: EngineDriver | None = None
    """In this process (None for a child process)."""
    child: ChildProcess | None = None


async def start_pooled_engine(
    stack: InprocStack, worker_id: str, *, pool: bool = True, pull_gbps: float = 0.0,
    runners: list, lora_adapters: Sequence[str] = (),
) -> PooledEngine:  # fmt: skip
    """A simulated engine in this process; ``pool=False`` is an engine without a KV import path
    (as stock SGLang); ``lora_adapters`` loaded."""
    config = events_config()
    profile = get_profile(PROFILE).with_engine(block_size=BLOCK, kv_blocks_override=KV_BLOCKS)
    driver = EngineDriver(
        profile,
        publisher=ZmqKvEventPublisher.from_cli(config),
        speedup=20.0,
        kv_pool=pool_for(profile) if pool else None,
    )
    info = EngineInfo(model=MODEL, block_size=BLOCK, kv_events_config=config,
                      lora_adapters=list(lora_adapters))  # fmt: skip
    info.kv_pull_gbps = pull_gbps
    runner, port = await serve_engine(driver, info)
    runners.append((runner, driver))
    url = f"http://127.0.0.1:{port}"
    stack.engine_urls[worker_id] = url
    return PooledEngine(url, driver=driver)


async def spawn_pooled_engine(tmp: Path, name: str, *, pull_gbps: float = 0.0) -> PooledEngine:
    """The same engine as a child process, so a test can kill it for real."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "thunderagent.cli.main", "simengine", "--port", str(port),
        "--model", MODEL, "--profile", PROFILE, "--page-size", str(BLOCK),
        "--kv-blocks", str(KV_BLOCKS), "--kv-pool", "--kv-pull-gbps", str(pull_gbps),
        "--kv-events-config", events_config(), "--speedup", "20",
    ]  # fmt: skip
    child = spawn(name, cmd, log_path=tmp / f"{name}.log")
    url = f"http://127.0.0.1:{port}"
    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + 30
    while True:  # not wait_for_port: it would block this test's event loop
        try:
            await engine_json(url, "/server_info")
            return PooledEngine(url, child=child)
        except (aiohttp.ClientError, OSError, ValueError):
            if not child.alive() or loop.time() > give_up_at:
                raise AssertionError(f"{name} did not start:\n{child.tail()}") from None
            await asyncio.sleep(0.1)


async def start_adapter(stack: InprocStack, worker_id: str, url: str, *, load_s: float = 0.05):
    from thunderagent.worker.adapter import AdapterConfig, WorkerAdapter
    from thunderagent.worker.engine_client import EngineClient

    config = AdapterConfig(worker_id=worker_id, engine_url=url, lease_s=2.0,
                           load_interval_s=load_s)  # fmt: skip

    async def run(ctx, adapter: WorkerAdapter) -> None:
        async with adapter.engine:
            await adapter.run(ctx.stop)

    return await stack.start_service(
        f"worker-{worker_id}", run,
        build=lambda ctx: WorkerAdapter(config, ctx.bus, EngineClient(url)),
    )  # fmt: skip


async def start_index(stack: InprocStack):
    """The index service without Redis (it replays the stream): the migration service asks it
    who holds what."""
    from thunderagent.index.service import IndexConfig, IndexService

    svc = await stack.start_service(
        "index", lambda ctx, service: service.run(ctx),
        build=lambda ctx: IndexService(IndexConfig(), ctx.bus, None),
    )  # fmt: skip
    await wait_for(lambda: subjects.INDEX_HOLDERS in svc.runtime.bus.stats, what="the index")
    return svc.runtime


async def start_migration(stack: InprocStack, *, index: bool = True, **config_kwargs):
    """The migration service, after an index service to ask (``index=False``: none)."""
    from thunderagent.migrator.service import MigrationConfig, MigrationService

    if index:
        await start_index(stack)
    config = MigrationConfig(interval_s=0.1, **config_kwargs)
    svc = await stack.start_service(
        "migration", lambda ctx, service: service.run(ctx),
        build=lambda ctx: MigrationService(ctx.bus, config),
    )  # fmt: skip
    service = svc.runtime
    await wait_for(lambda: subjects.MIGRATION_DRAIN in service.bus.stats, what="subscriptions")
    return service


async def start_router_and_scheduler(stack: InprocStack) -> None:
    from thunderagent.router.service import RouterConfig, RouterService
    from thunderagent.router_core import RouterParams
    from thunderagent.scheduler.service import SchedulerConfig, SchedulerService

    sched = SchedulerConfig(scheduler="thunder")
    await stack.start_service("scheduler", lambda ctx, s: s.run_service(ctx),
                              build=lambda ctx: SchedulerService(sched, ctx.bus))  # fmt: skip
    # The router credits a worker it just sent a prompt to for inflight_ttl_s (30 s by default)
    # whatever the KV events say since: after a migration that would still name the source.
    params = RouterParams(policy="thunder", seed=1, inflight_ttl_s=0.5)
    router = RouterConfig(params=params)
    await stack.start_service("router", lambda ctx, s: s.run(),
                              build=lambda ctx: RouterService(ctx, router))  # fmt: skip


def prefix_tokens(blocks: int, seed: int = 7) -> list[int]:
    return [(seed * 7919 + i) % 50_000 + 4 for i in range(blocks * BLOCK)]


def prefix_hash(
    tokens: list[int], cache_salt: str | None = None, lora_name: str | None = None
) -> int:
    """Our hash of the prefix's deepest full block: what names it to the migration service (in
    the namespace of a tenant salt and a LoRA adapter, as the router hashes such a prompt)."""
    hasher = BlockHasher(BLOCK, kv_namespace(cache_salt, lora_name))
    return hasher.hash_tokens(tokens).primary[-1]


async def wait_for(predicate, timeout_s: float = 15.0, what: str = "condition"):
    """Poll ``predicate`` (a function, or a coroutine function) until it is truthy."""
    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + timeout_s
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if loop.time() > give_up_at:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def engine_json(url: str, path: str, body: dict | None = None) -> dict:
    async with aiohttp.ClientSession() as s:
        if body is None:
            async with s.get(url + path) as r:
                return await r.json(content_type=None)
        async with s.post(url + path, json=body) as r:
            return await r.json(content_type=None)


async def prefill(url: str, tokens: list[int], rid: str, **fields: str) -> dict:
    """A request straight to an engine (no control plane): its meta_info. ``fields``: more of
    the body (``cache_salt``, ``lora_path``)."""
    body = {"rid": rid, "input_ids": tokens, "sampling_params": {"max_new_tokens": 1}, **fields}
    return (await engine_json(url, "/generate", body))["meta_info"]


@contextlib.asynccontextmanager
async def pooled_stack(nats_url: str):
    """An ``InprocStack`` and the list its in-process engines go on, closed on the way out."""
    runners: list = []
    async with inproc_stack(nats_url) as stack:
        try:
            yield stack, runners
        finally:
            await close_runners(runners)


async def close_runners(runners: list) -> None:
    for runner, driver in runners:
        await runner.cleanup()
        await driver.close()
