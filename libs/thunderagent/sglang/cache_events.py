"""The engine model's cache events as SGLang publishes them (its ZMQ ``KvEventBatch`` events):
what the simulated engine sends, and what an adapter announces for an engine that sends none
(``shadow.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from thunderagent.engine import AllCleared, CacheEvent, Removed
from thunderagent.sglang import kv_wire


class Namespace(Protocol):
    """Where an engine caches a request's blocks: its tenant salt and LoRA adapter."""

    @property
    def cache_salt(self) -> str | None: ...

    @property
    def lora_name(self) -> str | None: ...


def to_wire(
    events: list[CacheEvent],
    block_size: int,
    salt_of: Callable[[int], Namespace | None] = lambda key: None,
) -> list[kv_wire.AnyKvEvent]:
    """Engine cache events -> SGLang 0.5.23 KV events (``salt_of``: a block's tenant salt and
    LoRA adapter)."""
    out: list[kv_wire.AnyKvEvent] = []
    for ev in events:
        if isinstance(ev, AllCleared):
            out.append(kv_wire.AllBlocksCleared())
        elif isinstance(ev, Removed):
            out.append(kv_wire.BlockRemoved(block_hashes=ev.block_hashes, medium=ev.medium.value))
        else:
            space = salt_of(ev.block_hashes[0]) if ev.block_hashes else None
            out.append(
                kv_wire.BlockStored(
                    block_hashes=ev.block_hashes,
                    parent_block_hash=ev.parent_key,
                    token_ids=ev.token_ids or [],
                    block_size=block_size,
                    lora_id=None,
                    medium=ev.medium.value,
                    cache_salt=space.cache_salt if space else None,
                    lora_name=space.lora_name if space else None,
                )
            )
    return out
