"""Index service (placeholder until the prefix index lands): creates the KV-event stream."""

from __future__ import annotations

from dataclasses import dataclass

from thunderagent.runtime import ServiceContext


@dataclass(kw_only=True)
class IndexConfig:
    redis_url: str = "redis://127.0.0.1:6379/0"


async def main(ctx: ServiceContext, config: IndexConfig) -> None:
    await ctx.stop.wait()
