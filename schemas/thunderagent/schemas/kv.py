"""KV cache events as the worker adapter republishes them: our block hashes, our sequence numbers.

The adapter re-hashes the token ids of the engine's events with ThunderAgent's scheme (see
``thunderagent.hashing``), so nothing downstream depends on an engine's internal hash.
"""

from __future__ import annotations

import enum
from typing import Annotated, Final

from msgspec import Meta, Struct

Counter64 = Annotated[int, Meta(ge=0, le=2**63 - 1)]
"""A sequence number or epoch: anything wider cannot be snapshotted (msgpack int64)."""
_HASH_MIN, _HASH_END = 0, 2**64


def check_block_hashes(*lists: list[int]) -> None:
    """Block hashes are unsigned 64-bit (ours are xxh3; an engine's own hashes never reach this
    schema): the index keeps them in ``array("Q")`` logs and snapshots them as uint64. msgspec
    bounds stop at int64, so the range is checked after decoding (min/max run in C)."""
    for hashes in lists:
        if hashes and (min(hashes) < _HASH_MIN or max(hashes) >= _HASH_END):
            raise ValueError("block hashes must be unsigned 64-bit integers, in [0, 2**64)")


class Medium(enum.StrEnum):
    GPU = "GPU"
    CPU_PINNED = "CPU_PINNED"
    """Host-memory tier (SGLang hierarchical cache); loading back costs a PCIe transfer."""


class BlocksStored(Struct, frozen=True, kw_only=True, tag="stored", tag_field="type"):
    """Blocks that became reusable on the worker, in prefix order."""

    hashes: list[int]
    """Chained primary block hashes (unsigned 64-bit), one per full block, parent first."""
    check_hashes: list[int]
    """Independent second hash per block, compared on a hit (a collision becomes a miss)."""
    parent_hash: int | None = None
    """Hash of the block before ``hashes[0]``; None when the first block starts the prompt."""
    medium: Medium = Medium.GPU
    """Where the blocks live."""

    def __post_init__(self) -> None:
        if len(self.hashes) != len(self.check_hashes):
            raise ValueError(
                f"one check hash per block: {len(self.hashes)} hashes but "
                f"{len(self.check_hashes)} check_hashes"
            )
        check_block_hashes(
            self.hashes, self.check_hashes, [] if self.parent_hash is None else [self.parent_hash]
        )


class BlocksRemoved(Struct, frozen=True, kw_only=True, tag="removed", tag_field="type"):
    """Blocks the worker evicted (from ``medium``)."""

    hashes: list[int]
    """Primary hashes (unsigned 64-bit) of the evicted blocks."""
    medium: Medium = Medium.GPU
    """Tier they left."""

    def __post_init__(self) -> None:
        check_block_hashes(self.hashes)


class AllCleared(Struct, frozen=True, kw_only=True, tag="cleared", tag_field="type"):
    """The worker dropped its whole cache (flush or engine restart)."""


KvEvent = BlocksStored | BlocksRemoved | AllCleared


class KvEventBatch(Struct, frozen=True, kw_only=True):
    """One engine batch of cache events; one NATS message per batch, never one per block."""

    worker_id: str
    """Worker whose cache changed."""
    seq: Counter64
    """Per-worker sequence number from 0; a jump means events were lost and triggers a resync."""
    ts: float
    """Adapter wall-clock time when the batch was published (Unix seconds)."""
    events: list[KvEvent]
    """Events in the order the engine applied them."""
    epoch: Counter64 = 0
    """Adapter incarnation (start time in ms); a new epoch restarts ``seq`` at 0."""


class ResyncRequest(Struct, frozen=True, kw_only=True):
    """Index -> adapter (request/reply, answered with an ``Ack``): republish your whole cache.

    The adapter answers by publishing, in sequence on its KV-event subject, one batch holding
    ``AllCleared`` followed by every block it mirrors, so every consumer (index and router
    replicas alike) repairs itself the same way, from the stream."""

    worker_id: str
    """Worker to resync."""
    reason: str
    """Why (gap, restart, startup)."""


MAX_HOLDERS_QUERY: Final = 1024
"""Prefixes per ``HoldersQuery``; a caller with more sends several. Bounded by the answer: 1,024
prefixes held by 64 workers each, ids of 12 characters, is ~1 MB, NATS's default payload limit."""


class HoldersQuery(Struct, frozen=True, kw_only=True):
    """Any service -> index service (``INDEX_HOLDERS``, request/reply, answered with a
    ``HoldersReply``): which workers hold each prefix in their GPU cache. The migration service
    asks this every planning tick instead of following the KV-event stream itself: one index
    fewer to feed, one delivery fewer per KV message."""

    prefixes: Annotated[list[int], Meta(max_length=MAX_HOLDERS_QUERY)]
    """Primary hash of each prefix's deepest block."""

    def __post_init__(self) -> None:
        check_block_hashes(self.prefixes)


class HoldersReply(Struct, frozen=True, kw_only=True):
    """Index service -> asker: the holders of each queried prefix, in the query's order."""

    holders: list[list[str]]
    """Worker ids holding the prefix's deepest block in GPU (none: empty), sorted."""
