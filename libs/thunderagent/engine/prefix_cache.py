"""Paged prefix (radix) cache and KV-pool allocator, keyed by chained block keys.

Invariants
----------
* A block key names its whole prefix (the caller chains the hash), so a block is stored with its
  parent key and a request's hit is the longest run of its leading keys that are cached.
* A GPU block's parent is on the GPU (eviction takes leaves only and host loads go parent
  first); a host block's parent is on the GPU or the host.
* Only unreferenced leaves are evicted, least recently used first (a parent is touched whenever
  a child is, so it never looks older than its children).
* The GPU pool holds cached blocks plus ``reserved`` blocks: blocks owned privately by running
  requests (partial blocks, chunks not yet inserted, generated tokens).
  ``gpu_blocks + reserved <= capacity`` always.
* Events are emitted exactly when the contents change, so replaying them rebuilds the contents.

Why a heap with lazy deletion for LRU: a leaf's position must follow its last-access stamp,
not the moment it became a leaf (a parent becomes a leaf when its last child is evicted, and
it may be older than other leaves). Stale heap entries are skipped on pop and compacted.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from thunderagent.engine.events import AllCleared, CacheEvent, Medium, Removed, Stored


@dataclass(slots=True)
class _Block:
    """One cached block; per-block objects are fine here because caches hold ~1e5 blocks."""

    parent: int | None
    medium: Medium
    ref: int = 0
    children: int = 0
    """Cached children on any tier."""
    gpu_children: int = 0
    stamp: int = 0
    tokens: list[int] | None = None
    """The block's token ids when the caller gave them: SGLang's events carry them on every
    store, tier moves included, and a subscriber re-hashing tokens needs them there too."""


@dataclass(slots=True, frozen=True)
class Match:
    """Leading keys cached on the GPU, then (continuing the run) on the host tier."""

    gpu: int
    host: int


class PrefixCache:
    """Block cache with refcounts, LRU leaf eviction and an optional host tier."""

    def __init__(self, capacity: int, host_capacity: int = 0) -> None:
        if capacity <= 0 or host_capacity < 0:
            raise ValueError(f"bad capacity {capacity} / host_capacity {host_capacity}")
        self.capacity = capacity
        self.host_capacity = host_capacity
        self.gpu_blocks = 0
        self.host_blocks = 0
        self.reserved = 0
        self.pinned = 0
        """GPU blocks some running request holds (refcount > 0): KV in use, not evictable."""
        self._blocks: dict[int, _Block] = {}
        self._gpu_heap: list[tuple[int, int]] = []
        self._host_heap: list[tuple[int, int]] = []
        self._clock = 0
        self._events: list[CacheEvent] = []

    # ---- queries -------------------------------------------------------------------------
    @property
    def free(self) -> int:
        return self.capacity - self.gpu_blocks - self.reserved

    @property
    def clock(self) -> int:
        """The last use stamp handed out: a block whose ``last_used`` is at most a clock read
        earlier has not been used since."""
        return self._clock

    def last_used(self, key: int) -> int | None:
        """``key``'s use stamp (None when not cached)."""
        block = self._blocks.get(key)
        return block.stamp if block is not None else None

    def __contains__(self, key: int) -> bool:
        return key in self._blocks

    def medium(self, key: int) -> Medium | None:
        block = self._blocks.get(key)
        return None if block is None else block.medium

    def match(self, keys: list[int]) -> Match:
        """Longest cached run of leading keys, split into GPU part and host part."""
        blocks = self._blocks
        gpu = host = 0
        parent = None
        for key in keys:
            block = blocks.get(key)
            if block is None or block.parent != parent:
                break
            parent = key
            if block.medium is Medium.GPU and host == 0:
                gpu += 1
            elif block.medium is Medium.CPU_PINNED:
                host += 1
            else:
                break
        return Match(gpu, host)

    def contents(self) -> dict[int, Medium]:
        """Every cached key and its tier (tests compare it with the event stream)."""
        return {key: block.medium for key, block in self._blocks.items()}

    def refcount(self, key: int) -> int:
        return self._blocks[key].ref

    def drain_events(self) -> list[CacheEvent]:
        events, self._events = self._events, []
        return events

    def tokens_of(self, keys: list[int]) -> list[int] | None:
        """The blocks' token ids, flat, in order; None when a block is missing or was stored
        without tokens (a KV export needs them to name the blocks at the target)."""
        out: list[int] = []
        for key in keys:
            block = self._blocks.get(key)
            if block is None or block.tokens is None:
                return None
            out.extend(block.tokens)
        return out

    def discard(self, keys: list[int], *, extensions: bool = True) -> int:
        """Evict the unreferenced GPU blocks of a chain, deepest first, stopping at the first
        block that must stay (pinned, or a parent of a block that stays). Returns blocks
        evicted; blocks in use are never touched.

        ``extensions=True`` (a migration freeing its prefix at the source) first evicts the
        GPU blocks that extend the chain: they are unreachable once it is gone. ``False`` (a
        replica dropped because its prefix went cold) leaves a chain that anything extends
        alone: those extensions are other prompts' contexts (an agent program built on a
        shared tool prompt), which the prefix's own demand figures do not count."""
        done = 0
        last = self._blocks.get(keys[-1]) if keys else None
        if extensions and last is not None and last.gpu_children:
            done += self._discard_below(keys[-1])
        for key in reversed(keys):
            block = self._blocks.get(key)
            if block is None or block.medium is not Medium.GPU:
                continue
            if block.ref or block.gpu_children:
                break
            self._evict_gpu(key, block)
            done += 1
        return done

    def _discard_below(self, root: int) -> int:
        """Evict the unreferenced GPU blocks under ``root``, children before parents. A full
        scan for the children (blocks store only counts): drops are rare, caches ~1e5 blocks."""
        kids: dict[int, list[int]] = {}
        for key, block in self._blocks.items():
            if block.medium is Medium.GPU and block.parent is not None:
                kids.setdefault(block.parent, []).append(key)
        order: list[int] = []
        stack = list(kids.get(root, ()))
        while stack:
            key = stack.pop()
            order.append(key)
            stack.extend(kids.get(key, ()))
        done = 0
        for key in reversed(order):  # every child comes after its parent in ``order``
            block = self._blocks[key]
            if block.ref == 0 and block.gpu_children == 0:
                self._evict_gpu(key, block)
                done += 1
        return done

    # ---- references ----------------------------------------------------------------------
    def acquire(self, keys: list[int]) -> None:
        """Pin GPU blocks for a running request and mark them used now."""
        stamp = self._tick()
        for key in keys:
            block = self._blocks[key]
            if block.medium is not Medium.GPU:
                raise ValueError(f"acquire of block {key} not on GPU")
            self.pinned += block.ref == 0
            block.ref += 1
            block.stamp = stamp

    def release(self, keys: list[int]) -> None:
        """Unpin; a block that becomes an unreferenced GPU leaf joins the eviction heap."""
        for key in keys:
            block = self._blocks[key]
            if block.ref <= 0:
                raise ValueError(f"release of unreferenced block {key}")
            block.ref -= 1
            self.pinned -= block.ref == 0
            if block.ref == 0 and block.gpu_children == 0:
                heapq.heappush(self._gpu_heap, (block.stamp, key))
        # stale entries pile up here too when the cache never fills (evict never runs)
        if len(self._gpu_heap) > 4 * len(self._blocks) + 64:
            self._compact()

    # ---- pool ----------------------------------------------------------------------------
    def reserve(self, n: int) -> bool:
        """Take ``n`` private blocks, evicting LRU leaves if needed; all or nothing."""
        short = n - self.free
        if short > 0:
            self.evict(short)
            if n > self.free:
                return False
        self.reserved += n
        return True

    def unreserve(self, n: int) -> None:
        if n > self.reserved:
            raise ValueError(f"unreserve {n} > reserved {self.reserved}")
        self.reserved -= n

    def evict(self, n: int) -> int:
        """Evict up to ``n`` unreferenced GPU leaves (to the host tier when it exists)."""
        done = 0
        heap = self._gpu_heap
        blocks = self._blocks
        while done < n and heap:
            stamp, key = heapq.heappop(heap)
            block = blocks.get(key)
            if (
                block is None
                or block.medium is not Medium.GPU
                or block.ref
                or block.gpu_children
                or block.stamp != stamp
            ):
                continue
            self._evict_gpu(key, block)
            done += 1
        if len(heap) > 4 * len(blocks) + 64:
            self._compact()
        return done

    # ---- insertion -----------------------------------------------------------------------
    def insert(
        self,
        keys: list[int],
        parent_key: int | None,
        token_ids: list[int] | None = None,
        *,
        reserved: bool = False,
        block_size: int = 0,
    ) -> int:
        """Insert a chain of blocks under ``parent_key`` and pin every one of them.

        ``reserved=True``: the caller holds one reserved block per key; new or promoted blocks
        take it over and duplicates give it back. ``reserved=False``: room is made by eviction,
        and insertion stops at the first block that does not fit. Returns blocks inserted and
        pinned (a prefix of ``keys``). ``token_ids`` is flat, ``block_size`` ids per key.
        """
        if parent_key is not None and self.medium(parent_key) is not Medium.GPU:
            raise ValueError(f"parent {parent_key} is not a GPU block")
        if reserved:
            self.unreserve(len(keys))  # new blocks take these blocks back one by one
        stamp = self._tick()
        self._touch_ancestors(parent_key, stamp)
        parent = parent_key
        for i, key in enumerate(keys):
            block = self._blocks.get(key)
            needs_block = block is None or block.medium is Medium.CPU_PINNED
            if needs_block and not reserved:
                if not self._room_for_one():
                    return i
                block = self._blocks.get(key)  # making room may have dropped it from the host
            if block is None:
                block = self._create(key, parent)
                tokens = (
                    None if token_ids is None else token_ids[i * block_size : (i + 1) * block_size]
                )
                block.tokens = tokens
                self._emit_stored(key, parent, tokens, Medium.GPU)
            elif block.medium is Medium.CPU_PINNED:
                self._promote(key, block)
            self.pinned += block.ref == 0
            block.ref += 1
            block.stamp = stamp
            parent = key
        return len(keys)

    def load(self, keys: list[int]) -> int:
        """Move host-tier blocks (a chain continuing a pinned GPU prefix) back to the GPU,
        evicting GPU leaves for room, and pin them. Returns how many were loaded (a prefix)."""
        stamp = self._tick()
        for key in keys:  # refresh first so making room does not pick these on the host
            block = self._blocks.get(key)
            if block is not None and block.medium is Medium.CPU_PINNED:
                block.stamp = stamp
                if block.children == 0:
                    heapq.heappush(self._host_heap, (stamp, key))
        for i, key in enumerate(keys):
            if not self._room_for_one():
                return i
            block = self._blocks.get(key)
            if block is None or block.medium is not Medium.CPU_PINNED:
                return i
            self._promote(key, block)
            self.pinned += block.ref == 0
            block.ref += 1
        return len(keys)

    def clear(self) -> bool:
        """Flush everything; refused (False) while any block is pinned or reserved."""
        if self.reserved or any(block.ref for block in self._blocks.values()):
            return False
        self._blocks.clear()
        self._gpu_heap.clear()
        self._host_heap.clear()
        self.gpu_blocks = self.host_blocks = 0
        self._events.append(AllCleared())
        return True

    # ---- internals -----------------------------------------------------------------------
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _touch_ancestors(self, key: int | None, stamp: int) -> None:
        """Keep parents at least as recent as children (SGLang touches the whole path)."""
        blocks = self._blocks
        while key is not None:
            block = blocks[key]
            if block.stamp == stamp:
                return
            block.stamp = stamp
            key = block.parent

    def _room_for_one(self) -> bool:
        return self.free > 0 or (self.evict(1) == 1 and self.free > 0)

    def _create(self, key: int, parent: int | None) -> _Block:
        block = _Block(parent=parent, medium=Medium.GPU)
        self._blocks[key] = block
        self.gpu_blocks += 1
        if parent is not None:
            up = self._blocks[parent]
            up.children += 1
            up.gpu_children += 1
        return block

    def _promote(self, key: int, block: _Block) -> None:
        """Host -> GPU; the parent is on the GPU already (callers go parent first)."""
        block.medium = Medium.GPU
        self.host_blocks -= 1
        self.gpu_blocks += 1
        if block.parent is not None:
            self._blocks[block.parent].gpu_children += 1
        self._emit_removed(key, Medium.CPU_PINNED)
        self._emit_stored(key, block.parent, block.tokens, Medium.GPU)

    def _evict_gpu(self, key: int, block: _Block) -> None:
        self.gpu_blocks -= 1
        self._emit_removed(key, Medium.GPU)
        parent = self._blocks.get(block.parent) if block.parent is not None else None
        if parent is not None:
            parent.gpu_children -= 1
            if parent.gpu_children == 0 and parent.ref == 0 and parent.medium is Medium.GPU:
                heapq.heappush(self._gpu_heap, (parent.stamp, block.parent))
        if self.host_capacity:
            block.medium = Medium.CPU_PINNED
            self.host_blocks += 1
            self._emit_stored(key, block.parent, block.tokens, Medium.CPU_PINNED)
            if block.children == 0:
                heapq.heappush(self._host_heap, (block.stamp, key))
            while self.host_blocks > self.host_capacity and self._evict_host():
                pass
        else:
            self._drop(key, block)

    def _evict_host(self) -> bool:
        heap = self._host_heap
        while heap:
            stamp, key = heapq.heappop(heap)
            block = self._blocks.get(key)
            if (
                block is None
                or block.medium is not Medium.CPU_PINNED
                or block.children
                or block.stamp != stamp
            ):
                continue
            self.host_blocks -= 1
            self._emit_removed(key, Medium.CPU_PINNED)
            self._drop(key, block)
            return True
        return False

    def _drop(self, key: int, block: _Block) -> None:
        del self._blocks[key]
        if block.parent is None:
            return
        parent = self._blocks[block.parent]
        parent.children -= 1
        if parent.medium is Medium.CPU_PINNED and parent.children == 0:
            heapq.heappush(self._host_heap, (parent.stamp, block.parent))

    def _compact(self) -> None:
        blocks = self._blocks
        self._gpu_heap = [
            (b.stamp, k)
            for k, b in blocks.items()
            if b.medium is Medium.GPU and not b.ref and not b.gpu_children
        ]
        heapq.heapify(self._gpu_heap)
        self._host_heap = [
            (b.stamp, k)
            for k, b in blocks.items()
            if b.medium is Medium.CPU_PINNED and not b.children
        ]
        heapq.heapify(self._host_heap)

    def _emit_removed(self, key: int, medium: Medium) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, Removed) and last.medium is medium:
            last.block_hashes.append(key)
        else:
            self._events.append(Removed([key], medium))

    def _emit_stored(
        self, key: int, parent: int | None, tokens: list[int] | None, medium: Medium
    ) -> None:
        """Append to the previous Stored event when this block continues its chain."""
        last = self._events[-1] if self._events else None
        if (
            isinstance(last, Stored)
            and last.medium is medium
            and last.block_hashes[-1] == parent
            and (last.token_ids is None) == (tokens is None)
        ):
            last.block_hashes.append(key)
            if tokens is not None and last.token_ids is not None:
                last.token_ids.extend(tokens)
            return
        self._events.append(Stored([key], parent, None if tokens is None else list(tokens), medium))
