"""The migration service's messages: orders and drain notices it takes, the reports it publishes,
and the three-step KV move it drives through the workers' adapters.

A move of one prefix from a source worker to a target worker:

1. ``KvExportRequest`` -> source adapter: pin the prefix and describe it (``KvExportOffer``: its
   token ids, and for engines with a NIXL-registered KV pool the memory of every block with a
   checksum per block);
2. ``KvPullRequest`` -> target adapter: fetch those blocks (NIXL read) or, for an engine without a
   KV import path, prefill the prefix (warm-up); the target inserts the prefix into its cache and
   publishes ``BlocksStored`` like any other cache fill (``KvPullResult``);
3. ``KvRelease`` -> source adapter: unpin, and for a migration (not a replication) free the
   blocks at the source (``KvReleaseResult``). Sent whether step 2 worked or not.
"""

from __future__ import annotations

import enum
from typing import Literal

from msgspec import Struct, field

from thunderagent.schemas.generate import TokenId
from thunderagent.schemas.kv import check_block_hashes


class MigrationMode(enum.StrEnum):
    REPLICATE = "replicate"
    """Copy: the source keeps the prefix."""
    MIGRATE = "migrate"
    """Move: the source frees the prefix once the target holds it."""


class MigrationOrder(Struct, frozen=True, kw_only=True):
    """Operator or benchmark -> migration service (request/reply, answered with the final
    ``MigrationReport``): move this prefix now, outside the service's own decisions."""

    prefix_hash: int
    """Primary hash of the prefix's deepest block (a chained hash names the whole prefix)."""
    blocks: int = 0
    """Blocks in the prefix, when known (informational: the source resolves the chain)."""
    source: str = ""
    """Worker to copy from; empty: a holder the service picks."""
    target: str = ""
    """Worker to copy to; empty: the worker the service would pick."""
    mode: MigrationMode = MigrationMode.REPLICATE
    """Replicate (copy) or migrate (move)."""
    reason: str = ""
    """Free text kept in the report and the trace."""

    def __post_init__(self) -> None:
        check_block_hashes([self.prefix_hash])


class DrainNotice(Struct, frozen=True, kw_only=True):
    """Operator or orchestrator -> migration service (request/reply, answered with an ``Ack``): a
    worker is leaving (drain, scale-in), so its valuable prefixes held nowhere else should move
    before it goes. ``draining=False`` takes the notice back."""

    worker_id: str
    """The worker that is leaving."""
    draining: bool = True
    """True: leaving; False: staying after all."""
    reason: str = ""
    """Why (scale-in, maintenance)."""


class MigrationReport(Struct, frozen=True, kw_only=True):
    """Migration service -> observers, on ``thunderagent.migration.events`` when a move starts
    and when it ends (and the reply to a ``MigrationOrder``)."""

    migration_id: str
    """Id of this move (also the trace's root span attribute)."""
    mode: MigrationMode
    """Replicate, migrate, or (for a drop) migrate with an empty target."""
    phase: Literal["started", "done", "failed"]
    """Where the move is."""
    prefix_hash: int
    """Primary hash of the prefix's deepest block."""
    blocks: int
    """Blocks in the prefix (as planned; the pull result says how many were copied)."""
    source: str
    """Worker the prefix comes from."""
    target: str
    """Worker it goes to (empty for a drop)."""
    reason: str = ""
    """Why the move was decided, or why it failed."""
    transport: str = ""
    """``nixl`` (blocks copied engine to engine) or ``warmup`` (target prefilled the prefix)."""
    moved_blocks: int = 0
    """Blocks the target inserted (blocks it already had are not moved again)."""
    bytes: int = 0
    """KV bytes moved."""
    transfer_s: float = 0.0
    """Seconds the KV transfer itself took (NIXL read, or the warm-up prefill)."""
    total_s: float = 0.0
    """Seconds from the decision to the end of the move (export, pull, release)."""
    gbps: float = 0.0
    """``bytes / transfer_s`` in GB/s (1e9 bytes)."""
    verified: bool = False
    """Every moved block arrived byte-equal to the source's (checksum per block)."""


class KvExportRequest(Struct, frozen=True, kw_only=True):
    """Migration service -> source adapter (request/reply, answered with a ``KvExportOffer``):
    pin this prefix and describe it for a transfer."""

    migration_id: str
    """The move this export belongs to."""
    prefix_hash: int
    """Primary hash of the prefix's deepest block."""
    blocks: int = 0
    """Expected blocks in the prefix (0: whatever the chain holds)."""
    chain: list[int] = field(default_factory=list)
    """Our primary hashes of the prefix's blocks, root first (a run's copy, ``PullHint``):
    the source then offers the longest leading run of them it holds, so a prefix it is still
    prefilling offers the chunks already computed. Empty: the whole prefix or nothing."""
    hold_s: float = 30.0
    """The source unpins by itself this long after the offer if no ``KvRelease`` came (a
    migration service that died mid-move does not pin KV forever)."""


class KvExportOffer(Struct, frozen=True, kw_only=True):
    """Source adapter -> migration service: the pinned prefix, or why there is none."""

    migration_id: str
    """The move."""
    worker_id: str
    """The source worker."""
    blocks: int
    """Blocks pinned and offered, from the root (0: the prefix is not here)."""
    block_size: int = 0
    """Tokens per block."""
    token_ids: list[TokenId] = field(default_factory=list)
    """The prefix's token ids (``blocks * block_size``), for the target's cache keys and for a
    warm-up prefill when the blocks cannot be copied."""
    transport: str = "warmup"
    """``nixl``: the blocks below can be read with NIXL; ``warmup``: tokens only."""
    nixl_agent: str = ""
    """NIXL agent name of the source engine."""
    nixl_metadata: bytes = b""
    """NIXL agent metadata (base64 in JSON), loaded by the target to reach the source."""
    block_addrs: list[int] = field(default_factory=list)
    """Address of each block's bytes in the source's registered host memory, root first."""
    block_bytes: int = 0
    """Bytes per block in the source's KV pool."""
    checksums: list[int] = field(default_factory=list)
    """xxh3-64 of each block's bytes at the source, root first."""
    block_hashes: list[int] = field(default_factory=list)
    """The source engine's own hashes of the blocks, root first: the target caches them under
    the same keys (a re-hash of the tokens would miss a cache salt). Empty: re-hash."""
    cache_salt: str | None = None
    """The tenant salt the prefix is cached under at the source (None: no tenant's): the
    target caches it under the same salt, where only that tenant's requests find it."""
    lora_name: str | None = None
    """The LoRA adapter whose prefix this is (None: the base model's): the target must have
    it loaded, and caches the blocks in its namespace."""
    reason: str = ""
    """Why ``blocks`` is 0 or short."""


class KvPullRequest(Struct, frozen=True, kw_only=True):
    """Migration service -> target adapter (request/reply, answered with a ``KvPullResult``):
    take this prefix into your cache."""

    migration_id: str
    """The move."""
    source_worker: str
    """Where the blocks are."""
    offer: KvExportOffer
    """The source's description of the prefix."""
    timeout_s: float = 30.0
    """The target gives the copy up after this (and answers ``ok=False``) so it ends before the
    migration service stops waiting."""


class KvPullResult(Struct, frozen=True, kw_only=True):
    """Target adapter -> migration service: the prefix is cached here now, or why not. A failed
    pull leaves nothing of the prefix behind (no half-inserted chain)."""

    migration_id: str
    """The move."""
    worker_id: str
    """The target worker."""
    ok: bool
    """The whole prefix is cached here."""
    transport: str = ""
    """``nixl`` or ``warmup``."""
    moved_blocks: int = 0
    """Blocks inserted by this pull."""
    present_blocks: int = 0
    """Leading blocks the target already had (not copied again)."""
    bytes: int = 0
    """KV bytes copied."""
    transfer_s: float = 0.0
    """Seconds of the copy (or of the warm-up prefill)."""
    verified: bool = False
    """Every copied block's checksum matched the source's."""
    reason: str = ""
    """Why not ``ok``."""


class KvRelease(Struct, frozen=True, kw_only=True):
    """Migration service -> source adapter (request/reply, answered with a ``KvReleaseResult``):
    unpin an export; ``drop=True`` also frees the prefix's blocks (a migration's last step, or a
    replica dropped on its own with an empty ``migration_id``)."""

    migration_id: str
    """The export to unpin; empty: nothing pinned, just drop ``prefix_hash``."""
    prefix_hash: int
    """Primary hash of the prefix's deepest block."""
    drop: bool = False
    """Free the prefix's blocks here (blocks other requests use stay)."""


class KvReleaseResult(Struct, frozen=True, kw_only=True):
    """Source adapter -> migration service."""

    migration_id: str
    """The export."""
    worker_id: str
    """The worker."""
    released: bool
    """The export was found and unpinned (False: unknown, or already expired)."""
    dropped_blocks: int = 0
    """Blocks freed by ``drop``."""
    reason: str = ""
    """Why nothing was dropped, when asked to."""
