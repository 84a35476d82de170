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

    def mark(self) -> int:
        """Read when a run is handed to the engine (``started``)."""
        return self.shadow.mark()

    async def started(self, work: WorkerGenerate, meta: dict, mark: int) -> None:
        """A run's first output: its prompt is cached now. A run that is neither a continuation
        nor half of SGLang's PD first checks the shadow against what its engine reported found
        (``cached_tokens``, in every output's ``meta_info``): what the shadow believed beyond
        it, unconfirmed since ``mark``, goes (a cache flushed with nothing said)."""
        req = work.request
        prompt = req.token_ids or []
        space = KvNamespace(req.cache_salt, req.lora_name)
        if work.output_offset or work.bootstrap is not None or "cached_tokens" not in meta:
            await self.relay.announce(self.shadow.cached(prompt, space))
            return
        found = int(meta["cached_tokens"])
        await self.relay.announce(self.shadow.started(prompt, space, found, mark))

    async def forget(self) -> None:
        """The engine stopped answering: it may come back restarted, its cache empty, and
        nothing would say so, so what was inferred of it goes now."""
        self.shadow = EngineShadow(self.capacity_blocks, self.block_size)
        await self.relay.engine_restarted("engine stopped answering (it publishes no events)")
