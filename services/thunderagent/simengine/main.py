"""Process entry of the simulated engine: aiohttp on uvloop, OTLP tracing from the environment."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import uvloop
from aiohttp import web

from thunderagent.engine import Profile, get_profile
from thunderagent.sglang.zmq_publisher import ZmqKvEventPublisher, start_rank_publishers
from thunderagent.simengine.driver import EngineDriver
from thunderagent.simengine.pd_bootstrap import reserved_decode_tokens
from thunderagent.simengine.server import EngineInfo, SimEngineApp, http_runner
from thunderagent.telemetry import configure_logging, setup_telemetry

if TYPE_CHECKING:  # numpy and nixl load only with --kv-pool
    from thunderagent.simengine.kv_pool import KvPool

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class SimEngineConfig:
    host: str = "127.0.0.1"
    port: int = 30000
    model: str = "sim/llama-3.1-8b"
    profile: str = "llama-3.1-8b-h100"
    block_size: int = 16
    kv_events_config: str | None = None
    speedup: float = 1.0
    host_blocks: int = 0
    link_gbps: float = 25.0
    kv_pool: bool = False
    """Keep real KV bytes per cached block in host memory registered with NIXL (migration)."""
    kv_pool_scale: int = 1
    """Divide the profile's KV bytes per block by this for the pool (small test pools)."""
    kv_blocks: int | None = None
    """KV capacity in blocks instead of the profile's memory formula."""
    kv_pull_gbps: float = 0.0
    """Pace KV pulls to this link speed in GB/s; 0: as fast as NIXL copies."""
    instant: bool = False
    """Zero compute time: every ``/generate`` gets one token at once (``instant.py``)."""
    lora_adapters: list[str] = field(default_factory=list)
    """LoRA adapters loaded, by name (SGLang's ``--lora-paths NAME=PATH``; the path is not read:
    the simulated engine models an adapter's KV namespace, not its weights)."""
    dp_size: int = 1
    """Data-parallel ranks, each with its own scheduler, KV cache and event publisher (SGLang's
    ``--dp-size``); a request names its rank or takes the next in turn."""
    disaggregation_mode: str = "null"
    """SGLang's PD role: ``prefill`` or ``decode`` pair on every request through the prefill
    engine's bootstrap registry (``pd_bootstrap.py``); ``null``: a whole engine."""


async def _serve(config: SimEngineConfig) -> None:
    publishers: list[ZmqKvEventPublisher] = []
    if config.kv_events_config:
        publishers = start_rank_publishers(config.kv_events_config, config.dp_size)
    ranks = _ranks(config, publishers)
    info = _engine_info(config, publishers[0] if publishers else None)
    runner = http_runner(SimEngineApp(ranks, info).app)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port).start()
    if config.disaggregation_mode == "prefill":  # the registry is served on the API port
        info.bootstrap_port = runner.addresses[0][1]
    log.info("simulated engine %s on http://%s:%d (%d DP rank%s)", config.model, config.host,
             config.port, config.dp_size, "s" if config.dp_size > 1 else "")  # fmt: skip
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    for engine in ranks:
        await engine.close()


def _ranks(config: SimEngineConfig, publishers: list[ZmqKvEventPublisher]) -> list[EngineDriver]:
    """One engine per data-parallel rank, each with its own KV cache and event publisher."""
    profile = get_profile(config.profile).with_engine(
        block_size=config.block_size, host_blocks=config.host_blocks
    )
    if config.kv_blocks is not None:
        profile = profile.with_engine(kv_blocks_override=config.kv_blocks)
    kv_pool = _kv_pool(config, profile) if config.kv_pool else None
    return [
        EngineDriver(
            profile,
            publisher=publishers[rank] if publishers else None,
            speedup=config.speedup,
            link_bytes_per_s=config.link_gbps * 1e9,
            kv_pool=kv_pool,
        )
        for rank in range(config.dp_size)
    ]


def _engine_info(config: SimEngineConfig, publisher: ZmqKvEventPublisher | None) -> EngineInfo:
    """What the engine tells its clients about itself (``/server_info``, its PD role)."""
    if config.instant and config.disaggregation_mode != "null":
        raise SystemExit("simengine: --engine instant answers at once; it has no PD mode")
    info = EngineInfo(
        model=config.model,
        block_size=config.block_size,
        kv_events_config=bound_events_config(config.kv_events_config, publisher),
    )
    info.kv_pull_gbps = config.kv_pull_gbps
    info.instant = config.instant
    info.lora_adapters = list(config.lora_adapters)
    info.disaggregation_mode = config.disaggregation_mode
    try:  # read from the environment, as SGLang's decode engine reads it
        info.reserved_decode_tokens = reserved_decode_tokens(os.environ)
    except ValueError as err:
        raise SystemExit(f"simengine: {err}") from None
    return info


def _kv_pool(config: SimEngineConfig, profile: Profile) -> KvPool:
    """The NIXL-registered host KV pool of ``--kv-pool`` (one rank's: migration moves a prefix
    between engines, not between an engine's ranks)."""
    if config.dp_size > 1:
        raise SystemExit("simengine: --kv-pool takes one data-parallel rank (--dp-size 1)")
    from thunderagent.simengine.kv_pool import NixlUnavailable, pool_for

    try:
        kv_pool = pool_for(profile, scale=config.kv_pool_scale)
    except (ValueError, NixlUnavailable) as err:  # too big for this machine, or no nixl
        raise SystemExit(f"simengine: {err}") from None
    log.info("KV pool: %d blocks x %d bytes, NIXL agent %s", kv_pool.slots,
             kv_pool.slot_bytes, kv_pool.name)  # fmt: skip
    return kv_pool


def serve(config: SimEngineConfig) -> None:
    configure_logging(f"simengine:{config.port}")
    telemetry = setup_telemetry("thunderagent-simengine")
    try:
        uvloop.run(_serve(config))
    finally:
        telemetry.shutdown()


def bound_events_config(
    kv_events_config: str | None, publisher: ZmqKvEventPublisher | None
) -> str | None:
    """The events config ``/server_info`` reports, with the addresses rank 0's publisher bound: a
    wildcard port (``tcp://127.0.0.1:*``, what ``thunderagent up`` passes, so no port picked
    in advance can be taken by another process first) becomes the port it got."""
    if not kv_events_config or publisher is None:
        return kv_events_config
    reported = json.loads(kv_events_config)
    if publisher.endpoint:
        reported["endpoint"] = publisher.endpoint
        reported["bind"] = True  # it is bound there: the adapter subscribes by connecting
    if publisher.replay_endpoint:
        reported["replay_endpoint"] = publisher.replay_endpoint
    return json.dumps(reported)
