"""The worker adapter process: an adapter for its engine, or one per data-parallel rank of an
engine that has several (each rank keeps its own KV cache, so each is a worker to the fleet)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from thunderagent.schemas import dp_rank_worker_ids
from thunderagent.shell import ServiceContext
from thunderagent.worker.adapter import AdapterConfig, WorkerAdapter
from thunderagent.worker.engine_client import EngineClient
from thunderagent.worker.engine_info import dp_size
from thunderagent.worker.waits import once_ready

log = logging.getLogger(__name__)


def rank_configs(config: AdapterConfig, ranks: int) -> list[AdapterConfig]:
    """One adapter per rank of an engine with several: rank r is worker ``<id>-dp<r>`` to the
    fleet (the router weighs each rank's cache and load apart, as it would two engines). A
    config naming its rank (``--dp-rank``: a process per rank) is that rank's alone. ValueError
    for a rank the engine does not have."""
    if config.dp_rank is not None and not 0 <= config.dp_rank < ranks:
        raise ValueError(f"--dp-rank {config.dp_rank}: the engine has {ranks} rank(s)")
    if ranks == 1:
        return [config]
    ids = dp_rank_worker_ids(config.worker_id, ranks)
    every = [dataclasses.replace(config, worker_id=w, dp_rank=r) for r, w in enumerate(ids)]
    return every if config.dp_rank is None else [every[config.dp_rank]]


async def main(ctx: ServiceContext, config: AdapterConfig) -> None:
    async with EngineClient(config.engine_url) as engine:
        info = await once_ready(engine.base_url, ctx.stop, lambda: engine.get_json("/server_info"))
        if info is None:
            return
        try:
            configs = rank_configs(config, dp_size(info))
        except ValueError as err:
            raise SystemExit(f"worker: {err}") from None
        if len(configs) > 1:
            log.info("engine %s runs %d data-parallel ranks: workers %s", engine.base_url,
                     len(configs), ", ".join(c.worker_id for c in configs))  # fmt: skip
        async with asyncio.TaskGroup() as tg:
            for c in configs:
                client = engine if c.dp_rank is None else engine.for_rank(c.dp_rank)
                tg.create_task(WorkerAdapter(c, ctx.bus, client).run(ctx.stop))
