"""An engine step's cache events as its worker's adapter publishes them: one ``KvEventBatch``.

Block keys are the trace's chained primary hashes (``check`` maps each to its check hash);
output blocks (keys no prompt has) are left out: nothing can ever match them.
"""

from __future__ import annotations

from thunderagent.engine import AllCleared, CacheEvent, Removed
from thunderagent.schemas import AllCleared as WireCleared
from thunderagent.schemas import (
    BlocksRemoved,
    BlocksStored,
    KvEvent,
    KvEventBatch,
    Medium,
)


def kv_batch(
    worker_id: str, seq: int, cache_events: list[CacheEvent], check: dict[int, int], t: float
) -> KvEventBatch | None:
    """``cache_events`` as batch ``seq`` of ``worker_id``; None when none is worth sending."""
    events: list[KvEvent] = []
    for ev in cache_events:
        if isinstance(ev, AllCleared):
            events.append(WireCleared())
            continue
        keys = [k for k in ev.block_hashes if k in check]
        if not keys:
            continue
        medium = Medium(ev.medium.value)
        if isinstance(ev, Removed):
            events.append(BlocksRemoved(hashes=keys, medium=medium))
        else:
            parent = ev.parent_key if ev.parent_key in check else None
            stored = BlocksStored(
                hashes=keys, check_hashes=[check[k] for k in keys], parent_hash=parent,
                medium=medium,
            )  # fmt: skip
            events.append(stored)
    if not events:
        return None
    return KvEventBatch(worker_id=worker_id, seq=seq, ts=t, events=events)
