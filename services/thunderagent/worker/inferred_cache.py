"""What an adapter announces for an engine that publishes no KV events (SGLang's default): the
cache its shadow infers from the runs it serves (``thunderagent.sglang.shadow``), published
through the relay as the engine's own events would be."""

from __future__ import annotations

from collections.abc import Sequence

from thunderagent.schemas import WorkerGenerate
from thunderagent.sglang.mirror import KvNamespace
from thunderagent.sglang.shadow import EngineShadow
from thunderagent.worker.kv_relay import KvRelay


class InferredCache:
    def __init__(self, relay: KvRelay, capacity_blocks: int, block_size: int) -> None:
        self.relay = relay
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self.shadow = EngineShadow(capacity_blocks, block_size)

    async def cached(self, token_ids: Sequence[int], work: WorkerGenerate) -> None:
        """A run's engine now caches ``token_ids`` (``Generation.cached``)."""
        req = work.request
        space = KvNamespace(req.cache_salt, req.lora_name)
        await self.relay.announce(self.shadow.cached(token_ids, space))

    async def forget(self) -> None:
        """The engine stopped answering: it may come back restarted, its cache empty, and
        nothing would say so, so what was inferred of it goes now."""
        self.shadow = EngineShadow(self.capacity_blocks, self.block_size)
        await self.relay.engine_restarted("engine stopped answering (it publishes no events)")
