"""The adapter's mirror of its engine's cache, and the translation of SGLang's KV events into
ThunderAgent's (pure: no sockets, no clock).

SGLang names blocks by its own hash (SHA-256 chained); ThunderAgent's index names them by the
xxh3 chain of ``thunderagent.hashing``. Every ``BlockStored`` carries the token ids, so the
mirror re-hashes them, continuing the chain from the parent block's *our* hash, and remembers
engine hash -> (our hash, check hash, tier) so removals, which carry engine hashes only, can be
translated, and so a full dump can be answered at any time.

Tenants: a request with a ``cache_salt`` is cached by SGLang in its own namespace (its block
hashes are seeded by the salt, and its ``BlockStored`` events carry the salt). The mirror starts
such a chain at the salt's root (``namespace_roots(salt)``), exactly as the router hashes a
salted prompt, so a tenant's blocks are found only by that tenant's requests; unsalted chains
keep the shared root. Children continue from their parent's (already salted) hash. LoRA
adapters alike: SGLang keys an adapter's blocks in the adapter's namespace and names it on their
events (``lora_name``), so such a chain starts at the root of (adapter, salt), as the router
hashes a request for that adapter (``kv_namespace``).

A stored block whose parent the mirror does not know (an event was lost for good) cannot be
chained: it is skipped and counted. Such blocks simply never produce hits, which the approximate
index tolerates (a miss costs a prefill, never a wrong answer).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Final, NamedTuple

import msgspec

from thunderagent.hashing import BlockHasher, BlockHashes, kv_namespace, namespace_roots
from thunderagent.schemas import AllCleared, BlocksRemoved, BlocksStored, KvEvent, Medium
from thunderagent.sglang import kv_wire

DUMP_PIECE_BLOCKS: Final = 4096
"""Blocks per piece of a dump driven a piece at a time (~2 ms of the adapter's loop here, at
~0.5 µs a block): a whole dump held it 25 ms for 50k blocks, 0.26 s for 500k (``bench
mirror``), pausing every run's token stream through that adapter."""


class MirrorBlock(msgspec.Struct, frozen=True, gc=False):
    """One engine block, in our hashes. Invisible to the cyclic GC (nothing it holds can form a
    cycle), so the adapter's ``blocks`` dict stays untracked however large the engine's cache
    grows: as a slots dataclass every full collection walked it, ~70 ms per 500k blocks on the
    dev VM, on the process that streams every request's tokens."""

    primary: int
    check: int
    parent_engine_hash: int | None
    tiers: int
    """The tiers holding it (``_TIER_BIT``): with SGLang's hierarchical cache a block is on GPU
    and host at once, and each tier stores and removes it by its own events."""


class KvNamespace(NamedTuple):
    """Where an engine caches a request's blocks apart from everyone else's: its tenant salt,
    its LoRA adapter (one of them at least is set)."""

    cache_salt: str | None
    lora_name: str | None


@dataclass(slots=True)
class MirrorStats:
    stored_blocks: int = 0
    removed_blocks: int = 0
    orphan_blocks: int = 0
    """Stored blocks skipped because their parent was unknown."""
    unknown_removals: int = 0
    """Removed hashes the mirror did not hold (already removed, or never seen)."""
    size_mismatches: int = 0
    """Stored blocks skipped because their event's block size differs from the registered one."""
    other_tier_blocks: int = 0
    """Stored blocks on a tier the index does not track (SGLang's DISK and EXTERNAL HiCache
    levels, or a medium it does not know): skipped."""
    unhashable_blocks: int = 0
    """Stored blocks with token ids outside uint32 (SGLang hashes those wide; no prompt the
    router accepts has them, so they could never be hit): skipped, never a crash."""

    def by_outcome(self) -> dict[str, int]:
        """Blocks per outcome, as the adapter exports them (``thunderagent_kv_mirror_blocks``)."""
        return {
            "stored": self.stored_blocks,
            "removed": self.removed_blocks,
            "orphan": self.orphan_blocks,
            "unknown_removal": self.unknown_removals,
            "size_mismatch": self.size_mismatches,
            "other_tier": self.other_tier_blocks,
            "unhashable": self.unhashable_blocks,
        }


@dataclass
class KvMirror:
    block_size: int
    hasher: BlockHasher = field(init=False)
    blocks: dict[int, MirrorBlock] = field(default_factory=dict)
    by_primary: dict[int, int] = field(default_factory=dict)
    """Our primary hash -> the engine's hash of that block: an export looks each block up here
    (``chain_to``, ``leading_run``) instead of scanning the whole cache, which took 16-39 ms
    at 500k blocks on the adapter's event loop, once per copy a run asks for."""
    stats: MirrorStats = field(default_factory=MirrorStats)
    twins: dict[int, set[int]] = field(default_factory=dict)
    """Our primary hash -> the engine hashes of the blocks that have it, where more than one do:
    SGLang keys a LoRA adapter's blocks by the adapter's load, so after a reload the old load's
    blocks (never matched again, evicted in time) and the new load's hash to the same prefix
    here. A removal is announced only when no twin is left on that tier (the old load's eviction
    must not take the new load's blocks out of the index)."""
    namespaced_roots: dict[int, KvNamespace] = field(default_factory=dict)
    """Engine hash of the first block of a chain in a tenant's or an adapter's namespace (its
    children are in it too) -> that namespace: a copy of such a prefix must land in it
    (``namespace_of``)."""

    def __post_init__(self) -> None:
        self.hasher = BlockHasher(self.block_size)

    def clear(self) -> None:
        self.blocks.clear()
        self.by_primary.clear()
        self.twins.clear()
        self.namespaced_roots.clear()

    def chain_to(self, prefix_hash: int) -> list[int] | None:
        """The engine's hashes of the prefix whose deepest block is ``prefix_hash`` (ours), root
        first; None when the mirror does not hold all of it (a lost event broke the chain:
        nothing safe to move)."""
        chain: list[int] = []
        h = self.by_primary.get(prefix_hash)
        while h is not None:
            block = self.blocks.get(h)
            if block is None or len(chain) > len(self.blocks):  # gone, or a loop of parents
                return None
            chain.append(h)
            h = block.parent_engine_hash
        chain.reverse()
        return chain or None

    def namespace_of(self, chain: Sequence[int]) -> KvNamespace | None:
        """The (tenant salt, LoRA adapter) the engine chain (root first) is cached under; None
        for the shared namespace (no salt, the base model)."""
        return self.namespaced_roots.get(chain[0]) if chain else None

    def leading_run(self, chain: Sequence[int]) -> list[int]:
        """The engine's hashes of the longest leading run of ``chain`` (ours, root first) the
        mirror holds, each the child of the one before; empty when not even the first."""
        run: list[int] = []
        parent = None
        for primary in chain:
            h = self.by_primary.get(primary)
            if h is None:
                break
            block = self.blocks.get(h)
            if block is None or block.parent_engine_hash != parent:
                break
            run.append(h)
            parent = h
        return run

    def apply(self, events: list[kv_wire.AnyKvEvent]) -> list[KvEvent]:
        """Fold one engine batch into the mirror; returns the same changes in our hashes."""
        out: list[KvEvent] = []
        for ev in events:
            if isinstance(ev, kv_wire.BlockStored):
                stored = self._stored(ev)
                if stored is not None:
                    out.append(stored)
            elif isinstance(ev, kv_wire.BlockRemoved):
                out += self._removed(ev)
            elif isinstance(ev, kv_wire.AllBlocksCleared):
                self.clear()
                out.append(AllCleared())
        return out

    def _skipped(self, ev: kv_wire.BlockStored) -> bool:
        """Whether the stored blocks are skipped (counted by the reason)."""
        n = len(ev.block_hashes)
        if _medium(ev.medium) is None:
            self.stats.other_tier_blocks += n
        elif ev.block_size != self.block_size:
            self.stats.size_mismatches += n
        elif len(ev.token_ids) != n * self.block_size:
            self.stats.orphan_blocks += n
        else:
            return False
        return True

    def _stored(self, ev: kv_wire.BlockStored) -> BlocksStored | None:
        if self._skipped(ev):
            return None
        medium = _medium(ev.medium)
        assert medium is not None
        parent_engine = ev.parent_block_hash
        parent: tuple[int, int] | None = None
        if parent_engine is not None:
            known = self.blocks.get(parent_engine)
            if known is None:
                self.stats.orphan_blocks += len(ev.block_hashes)
                return None
            parent = (known.primary, known.check)
        # a tenant's or an adapter's chain starts at its namespace's root, as the router
        # hashes such a request's prompt
        start = parent
        if start is None and (ev.cache_salt or ev.lora_name) and ev.block_hashes:
            start = namespace_roots(kv_namespace(ev.cache_salt, ev.lora_name))
            self.namespaced_roots[ev.block_hashes[0]] = KvNamespace(ev.cache_salt, ev.lora_name)
        try:
            ours = self.hasher.hash_tokens(ev.token_ids, start)
        except (OverflowError, ValueError, TypeError):
            self.stats.unhashable_blocks += len(ev.block_hashes)
            return None
        self._keep(ev.block_hashes, ours, parent_engine, _TIER_BIT[medium])
        self.stats.stored_blocks += len(ev.block_hashes)
        return BlocksStored(
            hashes=ours.primary,
            check_hashes=ours.check,
            parent_hash=parent[0] if parent else None,
            medium=medium,
        )

    def _keep(
        self, engine_hashes: list[int], ours: BlockHashes, parent: int | None, bit: int
    ) -> None:
        """Remember each stored block under its engine hash and ours, on tier ``bit``."""
        blocks, by_primary = self.blocks, self.by_primary
        for engine_hash, p, c in zip(engine_hashes, ours.primary, ours.check, strict=True):
            old = blocks.get(engine_hash)
            tiers = old.tiers | bit if old is not None and old.primary == p else bit
            blocks[engine_hash] = MirrorBlock(p, c, parent, tiers)
            held = by_primary.get(p)
            if held is not None and held != engine_hash and held in blocks:
                self.twins.setdefault(p, {held}).add(engine_hash)
            by_primary[p] = engine_hash
            parent = engine_hash

    def _removed(self, ev: kv_wire.BlockRemoved) -> list[KvEvent]:
        """The removal, then the blocks it leaves on their other tier announced again on it:
        the index's all-tier view drops a block with any removal, and it is still cached."""
        medium = _medium(ev.medium)
        if medium is None:  # a tier the index does not track: nothing of ours changed
            return []
        bit, hashes, kept = _TIER_BIT[medium], [], []
        for engine_hash in ev.block_hashes:
            block = self.blocks.get(engine_hash)
            if block is None or not block.tiers & bit:
                self.stats.unknown_removals += 1
                continue
            twins = [self.blocks[t] for t in self.twins.get(block.primary, ()) if t != engine_hash]
            announced = not any(t.tiers & bit for t in twins)  # else a twin still holds it
            if announced:
                hashes.append(block.primary)
                kept += [t for t in twins if t.tiers]  # the all-tier view loses them too
            if block.tiers & ~bit:
                left = self.blocks[engine_hash] = msgspec.structs.replace(
                    block, tiers=block.tiers & ~bit
                )
                if announced:
                    kept.append(left)
                continue
            del self.blocks[engine_hash]
            self.namespaced_roots.pop(engine_hash, None)
            self._forget_primary(block.primary, engine_hash)
        self.stats.removed_blocks += len(hashes)
        out: list[KvEvent] = [BlocksRemoved(hashes=hashes, medium=medium)] if hashes else []
        for block in kept:
            again = self._announce(block, _TIER_MEDIUM[block.tiers])
            if again is not None:
                out.append(again)
        return out

    def _forget_primary(self, primary: int, engine_hash: int) -> None:
        """``engine_hash`` left the mirror: ``primary`` is found at a twin of it, or nowhere."""
        twins = self.twins.get(primary)
        if twins is not None:
            twins.discard(engine_hash)
            if len(twins) <= 1:
                del self.twins[primary]
        if self.by_primary.get(primary) == engine_hash:
            if twins:
                self.by_primary[primary] = next(iter(twins))
            else:
                del self.by_primary[primary]

    def _announce(self, block: MirrorBlock, medium: Medium) -> BlocksStored | None:
        """``block`` as stored on ``medium``, under its parent (None when the mirror lost the
        parent: announced as a root it would claim a prefix it does not start)."""
        parent = block.parent_engine_hash
        if parent is not None and parent not in self.blocks:
            return None
        return BlocksStored(
            hashes=[block.primary],
            check_hashes=[block.check],
            parent_hash=None if parent is None else self.blocks[parent].primary,
            medium=medium,
        )

    def dump(self) -> list[BlocksStored]:
        """Every mirrored block whose chain reaches a root, parents before children, each
        naming its parent's hash, a chain's blocks on one tier in one event (a dump is
        re-announced to every consumer every few minutes: an event per block cost each of them
        three times the bytes and a call per block). A block whose parent the mirror lost is
        left out: announced as a root it would claim a prefix it does not start."""
        return [event for piece in self.dump_pieces(None) for event in piece]

    def dump_pieces(
        self, blocks_per_piece: int | None = DUMP_PIECE_BLOCKS
    ) -> Iterator[list[BlocksStored]]:
        """``dump`` in pieces of about ``blocks_per_piece`` blocks (None: one), for a caller
        that lets other work run between them, the cache changing meanwhile: a block removed
        before its piece is left out (its removal went out before), one stored meanwhile is
        announced by its own event, and a chain cut between pieces names its parent."""
        blocks = self.blocks
        runs = _Runs()
        done: dict[int, int | None] = {}
        """Engine hash -> our hash once announced; None: left out (its chain is broken)."""
        for engine_hash in list(blocks):
            block = blocks.get(engine_hash)
            if block is None or engine_hash in done:
                continue  # removed since the dump began, or announced with a child
            parent = block.parent_engine_hash
            if parent is None or parent in done:  # the usual case: a root, or a parent seen
                parent_hash = None if parent is None else done[parent]
                if parent is None or parent_hash is not None:
                    done[engine_hash] = block.primary
                    runs.add(block, parent_hash)
                else:
                    done[engine_hash] = None
            else:  # a parent later in the dict
                self._announce_up_to(engine_hash, done, runs)
            if blocks_per_piece is not None and runs.blocks >= blocks_per_piece:
                yield runs.take()
        if runs.blocks:
            yield runs.take()

    def _announce_up_to(self, engine_hash: int, done: dict[int, int | None], runs: _Runs) -> None:
        """Announce ``engine_hash`` with the ancestors the dump has not decided yet, root side
        first, if the block above them was announced (or they reach the root); else leave them
        all out."""
        blocks = self.blocks
        chain = [engine_hash]
        h = blocks[engine_hash].parent_engine_hash
        while h is not None and h not in done and h in blocks:
            chain.append(h)
            h = blocks[h].parent_engine_hash
        parent_hash = None if h is None else done.get(h)
        ok = h is None or parent_hash is not None  # a root, or under an announced block
        for eh in reversed(chain):
            if not ok:
                done[eh] = None
                continue
            b = blocks[eh]
            done[eh] = b.primary
            runs.add(b, parent_hash)
            parent_hash = b.primary


@dataclass(slots=True)
class _Run:
    """A dump's chain of blocks on one tier, each the child of the one before."""

    medium: Medium
    parent: int | None
    hashes: list[int] = field(default_factory=list)
    checks: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _Runs:
    """One piece of a dump as chains: a block extends its tier's newest run when it is the
    child of that run's last block, else starts a run."""

    runs: list[_Run] = field(default_factory=list)
    last: dict[Medium, _Run] = field(default_factory=dict)
    blocks: int = 0

    def add(self, block: MirrorBlock, parent_hash: int | None) -> None:
        self.blocks += 1
        for medium, bit in _TIER_BIT.items():
            if not block.tiers & bit:
                continue
            run = self.last.get(medium)
            if run is None or parent_hash is None or run.hashes[-1] != parent_hash:
                run = self.last[medium] = _Run(medium, parent_hash)
                self.runs.append(run)
            run.hashes.append(block.primary)
            run.checks.append(block.check)

    def take(self) -> list[BlocksStored]:
        """The piece's events; the next piece starts afresh."""
        events = [
            BlocksStored(
                hashes=r.hashes, check_hashes=r.checks, parent_hash=r.parent, medium=r.medium
            )
            for r in self.runs
        ]
        self.runs, self.last, self.blocks = [], {}, 0
        return events


_TIER_BIT: Final = {Medium.GPU: 1, Medium.CPU_PINNED: 2}
_TIER_MEDIUM: Final = {bit: medium for medium, bit in _TIER_BIT.items()}
"""A single tier's bit -> its medium (the tier a block is left on after the other's removal)."""


def _medium(name: str | None) -> Medium | None:
    """The tier of an engine event; None for one the index does not track."""
    if not name:
        return Medium.GPU
    try:
        return Medium(name)
    except ValueError:
        return None
