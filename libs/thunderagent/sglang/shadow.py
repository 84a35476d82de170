"""An engine's prefix cache as its adapter infers it, for engines that publish no KV events.

SGLang publishes KV events only when started with ``--kv-events-config`` (off by default). Its
adapter still sees every run it hands the engine: the prompt, when its prefill is done (the
first token), and the tokens the run generated. SGLang caches a prompt's full pages once they
are prefilled, the output's when the run ends, and evicts the least recently used leaves when
its pool is full. The shadow does the same on the engine model's own radix cache
(``engine.prefix_cache``, the simulated engine's), sized to the engine's pool, and hands back
what changed as the engine model's events. The adapter publishes them as SGLang's own
(``cache_events.to_wire``), so the index, every router replica, the scheduler and the
migration planner follow such a worker as they follow any other; the replay feeds them to its
router the same way.

What it cannot see: requests sent to the engine by anyone else, pages held by running requests
(so it evicts later than the engine may) and a cache flushed by hand or by a weight update
(SGLang's ``update_weights_from_disk`` flushes it). The engine corrects it run by run: SGLang
reports with a run's first output how much of the prompt it found cached (``cached_tokens``).
A block the shadow held when the run was handed over, and no run has confirmed since, that the
engine did not find is gone from the engine, and so is everything stored under it: the shadow
drops them (``refuted``) and says so. A block believed cached that is not costs a prefill, and
lazy verification counts it as any other false hit.
"""

from __future__ import annotations

from collections.abc import Sequence

from thunderagent.engine import CacheEvent
from thunderagent.engine.prefix_cache import PrefixCache
from thunderagent.hashing import BlockHasher, kv_namespace
from thunderagent.sglang import kv_wire
from thunderagent.sglang.cache_events import Namespace, to_wire

UNKNOWN_BLOCKS = 1 << 40
"""An engine that does not report its pool (``max_total_num_tokens``): no eviction modelled."""


class CacheShadow:
    """One engine's cache, from the runs it served; keys are chained block hashes."""

    def __init__(self, capacity_blocks: int) -> None:
        self.cache = PrefixCache(capacity_blocks if capacity_blocks > 0 else UNKNOWN_BLOCKS)

    def cached(
        self, keys: Sequence[int], token_ids: Sequence[int] | None = None, block_size: int = 0
    ) -> list[CacheEvent]:
        """The engine now caches this chain of blocks (a prompt at its first token, a run's
        prompt and output at its end): stored where new, each touched as most recently used,
        leaves evicted for room. The events of what changed."""
        keys = list(keys)
        tokens = list(token_ids) if token_ids is not None else None
        inserted = self.cache.insert(keys, None, tokens, block_size=block_size)
        self.cache.release(keys[:inserted])
        return self.cache.drain_events()

    def mark(self) -> int:
        """Now, for ``refuted``: read when a run is handed to the engine."""
        return self.cache.clock

    def started(
        self, keys: Sequence[int], usable: int, found: int, mark: int,
        token_ids: Sequence[int] | None = None, block_size: int = 0,
    ) -> list[CacheEvent]:  # fmt: skip
        """A run handed over at ``mark`` gave its first output: of its prompt's blocks
        ``keys``, the first ``usable`` could have been found cached (the last token is always
        computed) and the engine found ``found``. What that refutes goes (``refuted``); then
        the prompt is cached. The events of both."""
        refuted = self.refuted(keys[:usable], found, mark)
        return [*refuted, *self.cached(keys, token_ids, block_size)]

    def refuted(self, keys: Sequence[int], found: int, mark: int) -> list[CacheEvent]:
        """The engine found only the first ``found`` blocks of ``keys`` (a prompt's usable
        blocks) cached for a run handed over at ``mark``. If the shadow held the next one and
        no run has used it since, the engine had lost it: it goes, with every block under it.
        The events of what changed."""
        keys = list(keys)
        if found >= len(keys) or self.cache.match(keys[: found + 1]).gpu <= found:
            return []
        used = self.cache.last_used(keys[found])
        if used is None or used > mark:  # cached again since: the engine may hold it now
            return []
        self.cache.discard([keys[found]], extensions=True)
        return self.cache.drain_events()


class EngineShadow:
    """A ``CacheShadow`` of token ids, for an adapter: blocks keyed by the router's own chained
    hashes in the request's namespace (tenant salt, LoRA adapter), events in SGLang's form."""

    def __init__(self, capacity_blocks: int, block_size: int) -> None:
        self.shadow = CacheShadow(capacity_blocks)
        self.block_size = block_size
        self._shared = BlockHasher(block_size)

    def cached(self, token_ids: Sequence[int], space: Namespace | None) -> list[kv_wire.AnyKvEvent]:
        """The engine now caches ``token_ids``' full blocks."""
        keys = self._keys(token_ids, space)
        full = token_ids[: len(keys) * self.block_size]
        events = self.shadow.cached(keys, full, self.block_size)
        return to_wire(events, self.block_size, lambda key: space)

    def mark(self) -> int:
        return self.shadow.mark()

    def started(
        self, token_ids: Sequence[int], space: Namespace | None, found_tokens: int, mark: int
    ) -> list[kv_wire.AnyKvEvent]:
        """A run's first output: the engine reported ``found_tokens`` of the prompt
        ``token_ids`` cached for a run handed over at ``mark`` (``CacheShadow.started``)."""
        keys, bs = self._keys(token_ids, space), self.block_size
        usable = max(0, (len(token_ids) - 1) // bs)
        full = token_ids[: len(keys) * bs]
        events = self.shadow.started(keys, usable, found_tokens // bs, mark, full, bs)
        return to_wire(events, bs, lambda key: space)

    def _keys(self, token_ids: Sequence[int], space: Namespace | None) -> list[int]:
        hasher = self._shared
        if space is not None and (space.cache_salt or space.lora_name):  # tenants: unbounded
            hasher = BlockHasher(self.block_size, kv_namespace(space.cache_salt, space.lora_name))
        return hasher.hash_tokens(token_ids).primary
