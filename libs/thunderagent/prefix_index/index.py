"""Block hash → workers index, fed by workers' KV events, queried by the router.

Structure and why (numbers measured on the 2-core dev VM, see ``thunderagent.bench.index``):

* A chained hash names a whole prefix, so a flat dict replaces a radix tree: a query looks up the
  prompt's hashes in order, with no nodes or parent links to maintain.
* ``_entries: dict[primary, (mask, check, ttl bucket)]``. ``mask`` has one bit per worker slot:
  "who holds every block so far" is one AND per block, and the walk stops when it is 0.
  A tuple, not a list or a slots dataclass: tuples of ints are untracked by the cyclic GC, while
  a million lists kept it rescanning them (GC was 60 % of ingest with lists), and a dataclass
  ``__init__`` per block costs twice a literal. Updates rebuild the tuple; that only happens when
  a bit or the TTL bucket changes. Two dicts (mask alone, then check and bucket) were measured
  too: queries ~10 % faster, ingest 35 % slower (a second random insert per block).
* The walk is bound by memory latency, not by the interpreter: a 64-block query costs ~3 µs with
  the index in cache and ~15 µs cold. So lookups are issued in chunks by
  ``list(map(dict.get, chunk))``, a tight C loop that lets the CPU overlap the cache misses of
  independent lookups (p99 -30 % here), and the check hash is compared only where a worker is
  credited (``overlap``). (The same trick does not pay on ingest: a batched pre-lookup plus
  ``dict.update`` for all-new events measured 15 % slower than the plain loop.)
* ``_Worker.log: list[primary]``, append-only, with an exact ``count``: clearing, removing or
  dumping a worker costs its blocks, not a scan of the index. A list, not a set: an append is a
  sequential write, a set insert one more random memory access per block (sets cost 30 % of
  ingest). Stale items are filtered on the mask; compacted past twice the count.
* Worker ids are strings outside and bit slots inside; a freed slot is reused (lowest first, so
  masks stay small ints) only after its bit is gone from every entry.
* TTL: a deque of ``(bucket, [primary...])`` in time order. A block confirmed in bucket ``b`` is
  appended to ``b``'s list once; ``expire`` pops whole lists whose time is up and drops an entry
  only if it was not re-confirmed since. Each append is processed once, so expiry is amortised
  O(1) per store instead of a scan per call. A block confirmed at time ``t`` expires at the
  first ``expire(now)`` with ``now >= (t // bucket_s + 1) * bucket_s + ttl_s``, i.e. between
  ``ttl_s`` and ``ttl_s + bucket_s`` after its last confirmation (any worker's store confirms).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

from thunderagent.hashing import BlockHashes
from thunderagent.prefix_index.results import APPLIED, EventResult, Gap, IndexStats, Stale
from thunderagent.prefix_index.snapshot import (
    IndexSnapshot,
    WorkerImage,
    from_snapshot,
    to_snapshot,
)

DEFAULT_TTL_S: Final = 600.0
"""Ten minutes. TTL is the coarse invalidation layer only: engines report evictions precisely
with BlockRemoved events, so TTL just bounds how long a block whose removal was lost can attract
requests (each such ghost hit costs one re-prefill, never an error). Engines do not re-announce a
block that simply stays resident, so a short TTL would drop live, hot prefixes and lose hits;
ten minutes is longer than a typical agent's tool-call pause, and well under the hours a lost
removal could otherwise linger."""

DEFAULT_TTL_BUCKETS: Final = 64
"""TTL buckets per ``ttl_s``: expiry is late by at most ``ttl_s / 64`` (~9 s by default); with
``expire`` called regularly the queue holds ~65 lists, one per bucket with stores."""

LOOKUP_CHUNK: Final = 48
"""Hashes per C-level lookup batch in ``overlap``: enough to overlap cache misses, few enough
that a short match wastes little (lookups past the match are misses on absent keys, the cheap
kind). Measured on 64-block queries: 48 best, 24..64 within ~15 %, batches that double
16 -> 32 -> 64 no better."""

_LOG_SLACK: Final = 1024
"""Stale log items tolerated beyond 2x a worker's count before compaction."""


@dataclass(slots=True)
class _Worker:
    """Per-worker state; ``bit`` is ``1 << slot``, cached because every store ORs it in."""

    name: str
    slot: int
    bit: int
    last_seq: int | None = None
    last_event_at: float | None = None
    count: int = 0
    """Entries whose mask has this worker's bit (exact)."""
    log: list[int] = field(default_factory=list)
    """Primary hashes this worker's bit was set on, possibly stale or repeated."""


class PrefixIndex:
    """Which workers hold how many leading blocks of a prompt (see the module docstring)."""

    def __init__(
        self, ttl_s: float | None = DEFAULT_TTL_S, *, ttl_buckets: int = DEFAULT_TTL_BUCKETS
    ) -> None:
        """``ttl_s=None`` turns expiry off (entries live until removed)."""
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0 or None, got {ttl_s!r}")
        if ttl_buckets < 1:
            raise ValueError(f"ttl_buckets must be >= 1, got {ttl_buckets!r}")
        self.ttl_s = ttl_s
        self.bucket_s = 0.0 if ttl_s is None else ttl_s / ttl_buckets
        self.stats = IndexStats()
        self._entries: dict[int, tuple[int, int, int]] = {}
        self._workers: dict[str, _Worker] = {}
        self._by_slot: list[_Worker | None] = []
        self._free_slots: list[int] = []
        self._pending: deque[tuple[int, list[int]]] = deque()
        self._tail_bucket = 0
        self._tail: list[int] | None = None

    # ----------------------------------------------------------------- workers

    def add_worker(self, worker: str, last_seq: int | None = None) -> None:
        """Register ``worker`` (events from unknown workers register them implicitly).

        ``last_seq=None`` accepts any first sequence number; pass ``-1`` to require that the
        first event is seq 0 (a worker known to have just started).
        """
        w = self._workers.get(worker) or self._register(worker)
        w.last_seq = last_seq

    def _register(self, worker: str) -> _Worker:
        if self._free_slots:
            slot = heapq.heappop(self._free_slots)
        else:
            slot = len(self._by_slot)
            self._by_slot.append(None)
        w = _Worker(worker, slot, 1 << slot)
        self._by_slot[slot] = w
        self._workers[worker] = w
        return w

    def remove_worker(self, worker: str) -> bool:
        """Forget ``worker``: its blocks, its sequence and its slot. False if it was unknown."""
        w = self._workers.pop(worker, None)
        if w is None:
            return False
        self._drop_blocks(w)
        self._by_slot[w.slot] = None
        heapq.heappush(self._free_slots, w.slot)
        return True

    def reset_worker(self, worker: str, seq: int | None) -> None:
        """Resync: drop ``worker``'s blocks and restart its sequence at ``seq`` unconditionally
        (the caller then applies the worker's dump as of ``seq`` and its later events)."""
        w = self._workers.get(worker) or self._register(worker)
        self._drop_blocks(w)
        w.last_seq = seq

    @property
    def workers(self) -> list[str]:
        return list(self._workers)

    def worker_seq(self, worker: str) -> int | None:
        """Last applied sequence number of ``worker`` (None: unknown or none yet)."""
        w = self._workers.get(worker)
        return None if w is None else w.last_seq

    def worker_last_event_at(self, worker: str) -> float | None:
        """Clock time of ``worker``'s last applied event (None: unknown or none yet)."""
        w = self._workers.get(worker)
        return None if w is None else w.last_event_at

    def block_counts(self) -> dict[str, int]:
        """Indexed blocks per worker."""
        return {name: w.count for name, w in self._workers.items()}

    def dump_worker(self, worker: str) -> BlockHashes:
        """``worker``'s indexed blocks as (primary, check) lists, in first-stored order (so a
        parent comes before its children unless it was removed and stored again)."""
        w = self._workers.get(worker)
        if w is None:
            return BlockHashes([], [])
        entries = self._entries
        primary = self._live_log(w)
        return BlockHashes(primary, [entries[p][1] for p in primary])

    def _live_log(self, w: _Worker) -> list[int]:
        get = self._entries.get
        bit = w.bit
        return [p for p in dict.fromkeys(w.log) if (e := get(p)) is not None and e[0] & bit]

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, primary: object) -> bool:
        return primary in self._entries

    # ------------------------------------------------------------------ events

    def _sequence(self, w: _Worker, seq: int) -> EventResult:
        last = w.last_seq
        if last is None or seq == last + 1:
            w.last_seq = seq
            return APPLIED
        if seq <= last:
            self.stats.stale_events += 1
            return Stale(w.name, last, seq)
        self.stats.gaps += 1
        w.last_seq = seq
        return Gap(w.name, last + 1, seq)

    def _bucket_list(self, now: float) -> tuple[int, list[int]]:
        """The TTL bucket for a store at ``now`` and the list to append new confirmations to.
        The bucket never moves backwards (a clock step back confirms at the newest bucket), so
        the queue stays in time order."""
        bucket = int(now // self.bucket_s) if self.ttl_s is not None else 0
        if bucket > self._tail_bucket or self._tail is None:
            self._tail_bucket = max(bucket, self._tail_bucket)
            self._tail = []
            self._pending.append((self._tail_bucket, self._tail))
        return self._tail_bucket, self._tail

    def apply_stored(
        self,
        worker: str,
        seq: int,
        hashes: BlockHashes | tuple[Sequence[int], Sequence[int]],
        parent: int | None,
        now: float,
    ) -> EventResult:
        """``worker`` now holds the blocks ``hashes`` (primary, check), a chain under ``parent``.

        Re-storing a block re-confirms it for TTL. A block whose primary hash is indexed with a
        different check hash is a collision: counted, not indexed (the first writer keeps it).
        """
        w = self._workers.get(worker) or self._register(worker)
        result = self._sequence(w, seq)
        if result.__class__ is Stale:
            return result
        w.last_event_at = now
        entries = self._entries
        bit = w.bit
        if parent is not None:
            pe = entries.get(parent)
            if pe is None or not pe[0] & bit:
                self.stats.orphan_stores += 1
        primary, check = hashes
        if len(primary) != len(check):
            raise ValueError(f"{len(primary)} primary hashes but {len(check)} check hashes")
        bucket, tail = self._bucket_list(now)
        log = w.log
        logged = len(log)
        self._store_each(w, primary, check, bucket, tail)
        w.count += len(log) - logged  # the log grows by exactly the bits newly set
        if self.ttl_s is None:
            tail.clear()
        if len(log) > 2 * w.count + _LOG_SLACK:
            w.log = self._live_log(w)
        return result

    def _store_each(
        self, w: _Worker, primary: Sequence[int], check: Sequence[int], bucket: int, tail: list
    ) -> None:
        entries = self._entries
        get = entries.get
        add = w.log.append
        pend = tail.append
        bit = w.bit
        collisions = 0
        for p, c in zip(primary, check, strict=True):
            e = get(p)
            if e is None:
                entries[p] = (bit, c, bucket)
                add(p)
                pend(p)
            elif e[1] != c:
                collisions += 1
            elif not e[0] & bit:
                entries[p] = (e[0] | bit, c, bucket)
                add(p)
                if e[2] != bucket:
                    pend(p)
            elif e[2] != bucket:
                entries[p] = (e[0], c, bucket)
                pend(p)
        self.stats.store_collisions += collisions

    def apply_removed(
        self, worker: str, seq: int, primary: Iterable[int], now: float
    ) -> EventResult:
        """``worker`` evicted the blocks ``primary``; unknown hashes are ignored."""
        w = self._workers.get(worker) or self._register(worker)
        result = self._sequence(w, seq)
        if result.__class__ is Stale:
            return result
        w.last_event_at = now
        w.count -= self._unset(w.bit, primary)
        return result

    def _unset(self, bit: int, primary: Iterable[int]) -> int:
        """Clear ``bit`` on ``primary``'s entries, dropping entries left empty; returns how
        many entries had the bit."""
        entries = self._entries
        get = entries.get
        cleared = 0
        for p in primary:
            e = get(p)
            if e is not None and e[0] & bit:
                cleared += 1
                m = e[0] ^ bit
                if m:
                    entries[p] = (m, e[1], e[2])
                else:
                    del entries[p]
        return cleared

    def clear_worker(self, worker: str, seq: int, now: float | None = None) -> EventResult:
        """The engine dropped its whole cache (an all-blocks-cleared event, in sequence)."""
        w = self._workers.get(worker) or self._register(worker)
        result = self._sequence(w, seq)
        if result.__class__ is Stale:
            return result
        if now is not None:
            w.last_event_at = now
        self._drop_blocks(w)
        return result

    def _drop_blocks(self, w: _Worker) -> None:
        self._unset(w.bit, w.log)
        w.log = []
        w.count = 0

    def expire(self, now: float) -> int:
        """Drop entries nobody re-confirmed within the TTL; returns how many were dropped."""
        ttl = self.ttl_s
        if ttl is None:
            return 0
        pending = self._pending
        width = self.bucket_s
        entries = self._entries
        by_slot = self._by_slot
        dropped = 0
        while pending and (pending[0][0] + 1) * width + ttl <= now:
            bucket, hashes = pending.popleft()
            if hashes is self._tail:
                self._tail = None
            for p in hashes:
                e = entries.get(p)
                if e is None or e[2] > bucket:
                    continue  # removed since, or re-confirmed later
                del entries[p]
                m = e[0]
                dropped += 1
                while m:
                    low = m & -m
                    by_slot[low.bit_length() - 1].count -= 1  # type: ignore[union-attr]
                    m ^= low
        self.stats.expired_blocks += dropped
        return dropped

    # ------------------------------------------------------------------- query

    def overlap(self, primary: Sequence[int], check: Sequence[int] | None) -> dict[str, int]:
        """Leading blocks of the prompt each worker holds: ``{worker: matched_blocks}``.

        Workers with no matched block are absent. The walk ANDs the blocks' masks in order and
        stops at the first unindexed block or when no worker holds every block so far. The
        check hash is compared where a worker is credited (its last matched block), not at
        every block: the check chain names the whole prefix, and the worker's bit in that entry
        means its own store passed the same comparison, so it holds exactly the prompt's
        prefix. On a mismatch the query is re-walked comparing every block and the collision
        is counted in ``stats.query_collisions``: a shorter match, never a wrong worker.
        ``check=None`` skips verification (a caller that only has primary hashes; passing the
        primary hashes as ``check`` instead would make every hit a mismatch).
        ``primary`` and ``check`` are lists (or tuples) of ints.
        """
        get = self._entries.get
        out: dict[str, int] = {}
        mask = -1
        depth = 0
        prev = None
        end = len(primary)
        start = 0
        while start < end:
            batch = list(map(get, primary[start : start + LOOKUP_CHUNK]))
            start += LOOKUP_CHUNK
            for e in batch:
                if e is None:
                    start = end
                    break
                m = mask & e[0]
                if m != mask:
                    if depth:
                        if check is not None and prev[1] != check[depth - 1]:  # type: ignore[index]
                            return self._overlap_verified(primary, check)
                        self._credit(out, mask ^ m, depth)
                    mask = m
                    if not m:
                        return out
                prev = e
                depth += 1
        if depth:
            if check is not None and prev[1] != check[depth - 1]:  # type: ignore[index]
                return self._overlap_verified(primary, check)
            self._credit(out, mask, depth)
        return out

    def _overlap_verified(self, primary: Sequence[int], check: Sequence[int]) -> dict[str, int]:
        """The slow path after a check mismatch: compare every block's check hash and stop at
        the first mismatch (counted once per query)."""
        self.stats.query_collisions += 1
        get = self._entries.get
        out: dict[str, int] = {}
        mask = -1
        depth = 0
        for p, c in zip(primary, check, strict=True):
            e = get(p)
            if e is None or e[1] != c:
                break
            m = mask & e[0]
            if m != mask:
                if depth:
                    self._credit(out, mask ^ m, depth)
                mask = m
                if not m:
                    return out
            depth += 1
        if depth:
            self._credit(out, mask, depth)
        return out

    def _credit(self, out: dict[str, int], bits: int, depth: int) -> None:
        by_slot = self._by_slot
        while bits:
            low = bits & -bits
            out[by_slot[low.bit_length() - 1].name] = depth  # type: ignore[union-attr]
            bits ^= low

    # --------------------------------------------------------------- snapshots

    def snapshot(self) -> IndexSnapshot:
        """A plain image of the whole index (encode with ``snapshot.encode``)."""
        workers = [
            WorkerImage(
                name=w.name,
                slot=w.slot,
                last_seq=w.last_seq,
                last_event_at=w.last_event_at,
                blocks=list(w.log),
                count=w.count,
            )
            for w in self._workers.values()
        ]
        queue = [(bucket, list(hashes)) for bucket, hashes in self._pending]
        return to_snapshot(self._entries, workers, len(self._by_slot), self.bucket_s, queue)

    def restore(self, snap: IndexSnapshot, now: float = 0.0) -> None:
        """Replace this index's contents with ``snap``.

        TTL settings stay this index's own: buckets are rescaled to this index's width, and a
        snapshot taken without TTL counts as confirmed at ``now``.
        """
        bucket_s = self.bucket_s if self.ttl_s is not None else None
        self._entries, queue = from_snapshot(snap, bucket_s, now)
        self._workers = {}
        self._by_slot = [None] * max((w.slot + 1 for w in snap.workers), default=0)
        for img in snap.workers:
            w = _Worker(img.name, img.slot, 1 << img.slot, img.last_seq, img.last_event_at)
            w.log = list(img.blocks)
            w.count = len(img.blocks) if img.count < 0 else img.count
            self._workers[img.name] = w
            self._by_slot[img.slot] = w
        self._free_slots = [s for s, w in enumerate(self._by_slot) if w is None]
        self._rebuild_ttl_queue(queue)

    def _rebuild_ttl_queue(self, queue: list[tuple[int, list[int]]] | None) -> None:
        self._pending = deque()
        self._tail = None
        self._tail_bucket = 0
        if self.ttl_s is None:
            return
        if queue:
            self._pending = deque((bucket, list(hashes)) for bucket, hashes in queue)
            self._tail_bucket = self._pending[-1][0]
            self._tail = self._pending[-1][1]
            return
        lists: dict[int, list[int]] = {}
        for p, (_mask, _check, bucket) in self._entries.items():
            lists.setdefault(bucket, []).append(p)
        for bucket in sorted(lists):
            self._pending.append((bucket, lists[bucket]))
        if lists:
            self._tail_bucket = max(lists)
            self._tail = self._pending[-1][1]
