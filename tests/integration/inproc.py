"""Run the real services inside the test's event loop: each with its own NATS connection and
stop event, simulated engines on real HTTP ports. Faster than processes, same code paths."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from thunderagent.bus import Bus, connect
from thunderagent.embedded import free_port
from thunderagent.engine import get_profile
from thunderagent.sglang.zmq_publisher import start_rank_publishers
from thunderagent.shell import ServiceContext
from thunderagent.shell.fleet import workers_bucket
from thunderagent.simengine.driver import EngineDriver
from thunderagent.simengine.main import bound_events_config
from thunderagent.simengine.server import EngineInfo, SimEngineApp, http_runner
from thunderagent.telemetry import Telemetry

MODEL = "sim/test-model.v1"


async def serve_engine(
    engine: EngineDriver | list[EngineDriver], info: EngineInfo, port: int = 0
) -> tuple[web.AppRunner, int]:
    """A simulated engine (one driver, or one per data-parallel rank) serving HTTP on
    loopback, on ``port`` or a free one; ``runner.cleanup()`` stops it."""
    port = port or free_port()
    runner = http_runner(SimEngineApp(engine, info).app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, port


@dataclass
class RunningService:
    name: str
    bus: Bus
    stop: asyncio.Event
    task: asyncio.Task
    runtime: Any = None
    """The service object, when it was started from one (for the test to inspect)."""


@dataclass
class InprocStack:
    nats_url: str
    services: dict[str, RunningService] = field(default_factory=dict)
    engines: dict[str, EngineDriver] = field(default_factory=dict)
    """worker id -> its engine (rank 0's, for an engine of several data-parallel ranks)."""
    dp_ranks: dict[str, list[EngineDriver]] = field(default_factory=dict)
    """worker id -> its engine's ranks, one driver each."""
    engine_urls: dict[str, str] = field(default_factory=dict)
    _runners: list[web.AppRunner] = field(default_factory=list)
    _engine_setup: dict[str, tuple] = field(default_factory=dict)

    async def start_service(
        self,
        name: str,
        main: Callable[..., Awaitable[None]],
        *,
        build: Callable[[ServiceContext], Any] | None = None,
    ) -> RunningService:
        """Run ``main(ctx)``; with ``build``, run ``main(ctx, build(ctx))`` and keep the built
        object as the service's ``runtime``."""
        nc = await connect(self.nats_url, name=name)
        bus = Bus(nc, service=name)
        stop = asyncio.Event()
        ctx = ServiceContext(name=name, bus=bus, stop=stop, telemetry=Telemetry(service_name=name))
        runtime = build(ctx) if build is not None else None
        coro = main(ctx, runtime) if build is not None else main(ctx)
        task = asyncio.create_task(coro, name=name)
        svc = RunningService(name, bus, stop, task, runtime)
        self.services[name] = svc
        return svc

    async def stop_service(self, name: str) -> None:
        svc = self.services.pop(name)
        svc.stop.set()
        try:
            await asyncio.wait_for(svc.task, 5)
        finally:
            with contextlib.suppress(Exception):
                await svc.bus.nc.close()

    async def start_engine(
        self,
        worker_id: str,
        *,
        profile: str = "tiny",
        block_size: int = 16,
        speedup: float = 1.0,
        kv_events: bool = True,
        port: int | None = None,
        events_config: str | None = None,
        host_blocks: int = 0,
        instant: bool = False,
        model: str = MODEL,
        dp_size: int = 1,
        lora_adapters: list[str] | None = None,
        disaggregation_mode: str = "null",
    ) -> str:
        """Start a simulated engine; ``port``/``events_config`` reuse a previous engine's
        addresses (a restart: same URL, empty cache, event sequence from 0); ``instant``: the
        zero-compute mode (one token at once); ``disaggregation_mode``: SGLang's PD role."""
        if kv_events and events_config is None:
            # one rank: ports picked here; several: their publishers draw consecutive ports
            port_of = (lambda: free_port()) if dp_size == 1 else (lambda: "*")
            events_config = json.dumps(
                {
                    "publisher": "zmq",
                    "endpoint": f"tcp://127.0.0.1:{port_of()}",
                    "replay_endpoint": f"tcp://127.0.0.1:{port_of()}",
                    "topic": "kv",
                    # SGLang connects a PUB socket to a concrete host; bind it here instead
                    "bind": True,
                }
            )
        publishers = start_rank_publishers(events_config, dp_size) if kv_events else []
        ranks = [
            EngineDriver(
                get_profile(profile).with_engine(block_size=block_size, host_blocks=host_blocks),
                publisher=publishers[rank] if publishers else None,
                speedup=speedup,
            )
            for rank in range(dp_size)
        ]
        engine = ranks[0]
        events_config = bound_events_config(events_config, publishers[0] if publishers else None)
        info = EngineInfo(model=model, block_size=engine.block_size, kv_events_config=events_config)
        info.instant = instant
        info.lora_adapters = list(lora_adapters or [])
        info.disaggregation_mode = disaggregation_mode
        port = port or free_port()
        if disaggregation_mode == "prefill":  # its bootstrap registry is on its API port
            info.bootstrap_port = port
        runner, port = await serve_engine(ranks, info, port)
        self._runners.append(runner)
        self.engines[worker_id] = engine
        self.dp_ranks[worker_id] = ranks
        self.engine_urls[worker_id] = f"http://127.0.0.1:{port}"
        self._engine_setup[worker_id] = (runner, port, events_config, profile, block_size, speedup)
        return self.engine_urls[worker_id]

    async def kill_engine(self, worker_id: str) -> None:
        """The engine goes away mid-stream: its HTTP server closes every connection."""
        runner = self._engine_setup[worker_id][0]
        await runner.cleanup()
        self._runners.remove(runner)
        for engine in self.dp_ranks[worker_id]:
            await engine.close()

    async def restart_engine(self, worker_id: str) -> None:
        """Stop the engine and start a fresh one on the same HTTP and ZMQ addresses."""
        runner, port, events_config, profile, block_size, speedup = self._engine_setup[worker_id]
        await runner.cleanup()
        self._runners.remove(runner)
        for engine in self.dp_ranks[worker_id]:
            await engine.close()
        await self.start_engine(
            worker_id,
            profile=profile,
            block_size=block_size,
            speedup=speedup,
            kv_events=events_config is not None,
            port=port,
            events_config=events_config,
        )

    @property
    def relays(self) -> dict:
        """worker id -> the adapter's KV relay (for tests that inspect or perturb it)."""
        out = {}
        for name, svc in self.services.items():
            if name.startswith("worker-") and svc.runtime is not None:
                out[name.removeprefix("worker-")] = svc.runtime.relay
        return out

    async def wait_for_workers(self, count: int, timeout_s: float = 10.0) -> None:
        nc = await connect(self.nats_url, name="wait")
        try:
            bucket = await workers_bucket(Bus(nc, service="wait"))
            loop = asyncio.get_running_loop()
            give_up_at = loop.time() + timeout_s
            while True:
                keys = await bucket.keys()
                if len(keys) >= count:
                    return
                if loop.time() > give_up_at:
                    raise TimeoutError(f"{len(keys)}/{count} workers registered")
                await asyncio.sleep(0.05)
        finally:
            await nc.close()

    async def close(self) -> None:
        crashed = [
            f"{svc.name}: {svc.task.exception()!r}"
            for svc in self.services.values()
            if svc.task.done() and not svc.task.cancelled() and svc.task.exception()
        ]
        for name in list(self.services):
            with contextlib.suppress(Exception):
                await self.stop_service(name)
        for runner in self._runners:
            await runner.cleanup()
        for ranks in self.dp_ranks.values():
            for engine in ranks:
                await engine.close()
        if crashed:
            raise AssertionError("services crashed during the test: " + "; ".join(crashed))


@contextlib.asynccontextmanager
async def inproc_stack(nats_url: str) -> AsyncIterator[InprocStack]:
    stack = InprocStack(nats_url)
    try:
        yield stack
    finally:
        await stack.close()


async def start_full_stack(
    stack: InprocStack,
    workers: int = 2,
    *,
    policy: str = "least_loaded",
    redis_url: str | None = None,
    scheduler: str = "thunder",
    scheduler_params: dict | None = None,
    roles: list[str] | None = None,
    adapter: dict | None = None,
    scheduler_config: dict | None = None,
    with_scheduler: bool = True,
    models: list[str] | None = None,
    pd_modes: list[str] | None = None,
    router_params: dict | None = None,
    **engine_kwargs,
) -> None:
    """Router, scheduler and ``workers`` adapters with engines (plus the index service when a
    Redis URL is given); returns when the workers are registered."""
    from thunderagent.router.service import RouterConfig, RouterService
    from thunderagent.router_core import RouterParams
    from thunderagent.scheduler.service import SchedulerConfig, SchedulerService
    from thunderagent.schemas import WorkerRole
    from thunderagent.worker.adapter import AdapterConfig, WorkerAdapter
    from thunderagent.worker.engine_client import EngineClient
    from thunderagent.worker.service import main as adapter_main

    async def run_worker(ctx, adapter: WorkerAdapter) -> None:
        async with adapter.engine:
            await adapter.run(ctx.stop)

    for i in range(workers):
        wid = f"w{i}"
        if models:
            engine_kwargs["model"] = models[i]
        if pd_modes:  # SGLang's PD: the engines' own modes give the workers their roles
            engine_kwargs["disaggregation_mode"] = pd_modes[i]
        url = await stack.start_engine(wid, **engine_kwargs)
        config = AdapterConfig(
            worker_id=wid,
            engine_url=url,
            **{"lease_s": 2.0, **(adapter or {})},
            load_interval_s=0.05,
            role=WorkerRole(roles[i]) if roles else WorkerRole.BOTH,
        )
        if engine_kwargs.get("dp_size", 1) > 1:  # the service's own entry: a worker per rank
            await stack.start_service(f"worker-{wid}", lambda ctx, c=config: adapter_main(ctx, c))
            continue
        await stack.start_service(
            f"worker-{wid}",
            run_worker,
            build=lambda ctx, c=config: WorkerAdapter(c, ctx.bus, EngineClient(c.engine_url)),
        )
    if redis_url:
        import redis.asyncio as aioredis

        from thunderagent.index.service import IndexConfig, IndexService

        index_config = IndexConfig(redis_url=redis_url, snapshot_interval_s=0.5)

        async def run_index(ctx, service: IndexService) -> None:
            try:
                await service.run(ctx)
            finally:
                await service.redis.aclose()

        await stack.start_service(
            "index",
            run_index,
            build=lambda ctx: IndexService(
                index_config, ctx.bus, aioredis.from_url(redis_url, socket_timeout=2)
            ),
        )
    sched_config = SchedulerConfig(
        scheduler=scheduler, params=scheduler_params or {}, **(scheduler_config or {})
    )
    if with_scheduler:
        await stack.start_service(
            "scheduler",
            lambda ctx, service: service.run_service(ctx),
            build=lambda ctx: SchedulerService(sched_config, ctx.bus),
        )
    params = RouterParams(policy=policy, seed=1, **(router_params or {}))
    router_config = RouterConfig(params=params, redis_url=redis_url)
    await stack.start_service(
        "router", lambda ctx, svc: svc.run(), build=lambda ctx: RouterService(ctx, router_config)
    )
    await stack.wait_for_workers(workers * engine_kwargs.get("dp_size", 1))
    # the router subscribes to requests only after its index replica has caught up
    await asyncio.wait_for(stack.services["router"].runtime.serving.wait(), 15)
