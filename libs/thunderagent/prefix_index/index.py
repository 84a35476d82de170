"""Block hash → workers index, fed by workers' KV events, queried by the router.

Structure and why (measured on the 2-core dev VM with ``thunderagent bench index``):

* A chained hash names a whole prefix, so a flat dict replaces a radix tree: a query looks up
  the prompt's hashes directly, with no nodes to walk from the root.
* ``_entries: dict[primary, Entry]``, an entry being ``(held, closed, check, bucket, kids)``:
  ``held``, one bit per worker slot holding the block; ``closed`` ⊆ ``held``, the workers known
  to hold the block *and every block before it*; the first writer's ``check`` hash; the TTL
  ``bucket`` of the last confirmation; ``kids``, the children that may be closed for someone
  (None, one hash, or a ``Kids`` set at a branch point such as a shared system prompt's last
  block).
* ``closed`` is set when a worker stores a block under a parent closed for it (or at the root)
  and cleared down ``kids`` whenever the worker loses the block (removal, expiry), so along a
  prompt it only ever loses workers and the query bisects for the few depths where it changes
  (``search``): ~11 lookups for a 64-block prompt instead of ~40-64. That is what counts: a
  cold lookup in a million-entry dict is ~4 dependent cache misses, 300-700 ns here, against
  ~50 ns of interpreter work. It may under-state (blocks stored before their parent), which the
  query repairs by following ``held``; it never over-states, so answers stay exact.
* Recording ``kids`` is nearly free: a new block's only kid is the next block of the same event,
  stored in the same entry; only an event's parent gets one extra write.
* Nothing per block is visible to the cyclic GC, so a full collection costs the same with a
  million blocks indexed as with none (~200 ms per million when the entries were tuples and the
  logs lists, every collection walking them): entries are ``gc=False`` structs (``entry``), so
  the dict is never tracked, and the logs and TTL lists are ``array("Q")``, whose items the GC
  does not visit (block hashes are unsigned 64-bit, as the KV event schema enforces). A struct
  takes ~40 ns more to build than a tuple (80 against 39 ns); an allocation the GC tracks per
  block costs more (GC was 60 % of ingest when entries were lists). A new block is one
  ``setdefault``; an existing one is changed in place.
* Each worker's log of the blocks its bit was set on (``worker_log``), with an exact count:
  clearing, removing or dumping a worker costs its blocks, not a scan of the index. A log, not
  a set: a set insert is one more random access per block. It is compacted a little at a time.
* Worker ids are strings outside and bit slots inside; a freed slot is reused (lowest first, so
  masks stay small ints: below 256 they are CPython's cached ints, no allocation, no cache miss)
  only after its bit is gone from every entry.
* TTL: a deque of ``(bucket, array of primary hashes)`` in time order; each event's hashes go to
  the current bucket's list with one ``extend``; ``expire`` reads the lists whose time is up, a
  bounded number of items per call (``ttl.EXPIRE_STEP``), and drops an entry only if it was not
  re-confirmed since (amortised O(1) per stored block). A block confirmed at ``t`` is due at
  ``(t // bucket_s + 1) * bucket_s + ttl_s`` (between ``ttl_s`` and ``ttl_s + bucket_s`` after
  its last confirmation; any worker's store confirms) and goes at the first ``expire`` that
  reaches it, never earlier; with calls every second, within a few seconds of being due.
"""

from __future__ import annotations

import heapq
import math
from array import array
from collections import deque
from collections.abc import Iterable, Sequence
from itertools import zip_longest
from typing import Final

from thunderagent.hashing import BlockHashes
from thunderagent.prefix_index.closure import link, unclose, with_kid
from thunderagent.prefix_index.entry import Entry
from thunderagent.prefix_index.images import IndexImages
from thunderagent.prefix_index.results import APPLIED, EventResult, Gap, IndexStats, Stale
from thunderagent.prefix_index.search import search, walk
from thunderagent.prefix_index.ttl import due, expire_budget, first_time_after
from thunderagent.prefix_index.worker_log import IndexedWorker

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

_LOG_GROWTH: Final = 2
"""A worker's log is compacted once it holds this many items per block held (plus the slack)."""

_LOG_SLACK: Final = 1024
"""Stale log items tolerated beyond ``_LOG_GROWTH`` x a worker's count before compaction."""


class PrefixIndex(IndexImages):
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
        self._entries: dict[int, Entry] = {}
        self._workers: dict[str, IndexedWorker] = {}
        self._by_slot: list[IndexedWorker | None] = []
        self._free_slots: list[int] = []
        self._pending: deque[tuple[int, array]] = deque()
        self._expired_to = 0
        """Items of ``_pending[0]`` an earlier ``expire`` already read."""
        self._tail_bucket = 0
        self._tail: array | None = None
        self._bucket_end = -math.inf

    # ----------------------------------------------------------------- workers

    def add_worker(self, worker: str, last_seq: int | None = None) -> None:
        """Register ``worker`` (events from unknown workers register them implicitly).

        ``last_seq=None`` accepts any first sequence number; pass ``-1`` to require that the
        first event is seq 0 (a worker known to have just started).
        """
        w = self._workers.get(worker) or self._register(worker)
        w.last_seq = last_seq

    def _register(self, worker: str) -> IndexedWorker:
        if self._free_slots:
            slot = heapq.heappop(self._free_slots)
        else:
            slot = len(self._by_slot)
            self._by_slot.append(None)
        w = IndexedWorker(worker, slot, 1 << slot)
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
        primary = w.live(entries.get)
        return BlockHashes(primary, [entries[p].check for p in primary])

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, primary: object) -> bool:
        return primary in self._entries

    # ------------------------------------------------------------------ events

    def _out_of_sequence(self, w: IndexedWorker, seq: int) -> EventResult:
        """``seq`` is not ``last + 1`` (and ``last`` is known): a stale event or a gap."""
        last: int = w.last_seq  # type: ignore[assignment]
        if seq <= last:
            self.stats.stale_events += 1
            return Stale(w.name, last, seq)
        self.stats.gaps += 1
        w.last_seq = seq
        return Gap(w.name, last + 1, seq)

    def _sequence(self, w: IndexedWorker, seq: int) -> EventResult:
        last = w.last_seq
        if last is None or seq == last + 1:
            w.last_seq = seq
            return APPLIED
        return self._out_of_sequence(w, seq)

    def _bucket_list(self, now: float) -> tuple[int, array]:
        """The TTL bucket for a store at ``now`` and the list to append new confirmations to.
        The bucket never moves backwards (a clock step back confirms at the newest bucket), so
        the queue stays in time order. ``_bucket_end`` is the first time of a later bucket, so
        a store before it skips this call."""
        bucket = int(now // self.bucket_s) if self.ttl_s is not None else 0
        if bucket > self._tail_bucket or self._tail is None:
            self._tail_bucket = max(bucket, self._tail_bucket)
            self._tail = array("Q")
            self._pending.append((self._tail_bucket, self._tail))
            self._bucket_end = self._first_time_after(self._tail_bucket)
        return self._tail_bucket, self._tail

    def _first_time_after(self, bucket: int) -> float:
        return math.inf if self.ttl_s is None else first_time_after(bucket, self.bucket_s)

    def apply_stored(
        self,
        worker: str,
        seq: int,
        hashes: BlockHashes | tuple[Sequence[int], Sequence[int]],
        parent: int | None,
        now: float,
    ) -> EventResult:
        """``worker`` now holds the blocks ``hashes`` (primary, check): a chain, each block the
        child of the one before, the first a child of ``parent``. ``parent=None`` means the
        chain starts at the prompt's first block; a caller that does not know a non-root
        block's parent must pass some hash the worker does not hold (an orphan), never None.

        Re-storing a block re-confirms it for TTL. A block whose primary hash is indexed with a
        different check hash is a collision: counted, not indexed (the first writer keeps it).
        """
        # One function on purpose: this runs once per event, and a call per event (sequence,
        # bucket, link, chain loop) costs ~10 % of ingest at ~5 blocks per event.
        primary, check = hashes
        if len(primary) != len(check):
            raise ValueError(f"{len(primary)} primary hashes but {len(check)} check hashes")
        w = self._workers.get(worker) or self._register(worker)
        last = w.last_seq
        if last is None or seq == last + 1:
            w.last_seq = seq
            result: EventResult = APPLIED
        else:
            result = self._out_of_sequence(w, seq)
            if result.__class__ is Stale:
                return result
        w.last_event_at = now
        entries = self._entries
        bit = w.bit
        cbit = bit  # the worker holds the chain's prefix so far: blocks stored are closed
        if parent is not None:
            pe = entries.get(parent)
            if pe is None or not pe.held & bit:
                self.stats.orphan_stores += 1
                cbit = 0
            elif not pe.closed & bit:
                cbit = 0
            elif primary:
                kids = pe.kids
                if kids is None:  # the usual continuation: the parent was a chain's end
                    pe.kids = primary[0]
                elif kids != primary[0]:
                    link(entries, pe, primary[0])
        tail = self._tail
        if tail is None or now >= self._bucket_end:
            bucket, tail = self._bucket_list(now)
        else:
            bucket = self._tail_bucket
        log = w.log
        try:  # before any entry changes: a hash the arrays refuse leaves the index as it was
            if self.ttl_s is not None:
                tail.extend(primary)  # re-confirmed blocks too: expire skips what is stale
            log.extend(primary)  # every block the bit is set on, plus a few already set
        except OverflowError:
            raise ValueError("block hashes must be unsigned 64-bit integers") from None
        size = len(entries)
        put = entries.setdefault  # one hash lookup for a new block, not a get and a set
        added = 0
        for p, c, nx in zip_longest(primary, check, primary[1:]):
            new = Entry(bit, cbit, c, bucket, nx)
            e = put(p, new)
            if e is new:
                continue
            # Already indexed. Inline: a method call per re-stored block cost 5-10 % of ingest.
            if e.check != c:  # a collision: the first writer keeps the block
                self.stats.store_collisions += 1
                cbit = 0
                continue
            e.closed = closed = e.closed | cbit
            e.bucket = bucket
            cbit = closed & bit
            if cbit and nx is not None and e.kids != nx:
                e.kids = with_kid(entries, e.kids, nx)  # type: ignore[arg-type]
            if not e.held & bit:
                e.held |= bit
                added += 1
        w.count += added + len(entries) - size
        if w.sweep is not None or len(log) > _LOG_GROWTH * w.count + _LOG_SLACK:
            w.compact(entries.get, len(primary))
        return result

    def reconfirm(self, primary: Sequence[int], now: float) -> None:
        """Re-confirm the indexed blocks among ``primary`` for TTL, as a store of them would,
        without touching who holds them: for a caller that knows its worker already holds
        them (``InflightPrefixes.record``, whose prompts repeat their prefixes)."""
        if self.ttl_s is None or not primary:
            return
        tail = self._tail
        if tail is None or now >= self._bucket_end:
            bucket, tail = self._bucket_list(now)
        else:
            bucket = self._tail_bucket
        get = self._entries.get
        queued = array("Q")  # a block confirmed in this bucket already is queued in it
        add = queued.append
        for p in primary:
            if (e := get(p)) is not None and e.bucket != bucket:
                e.bucket = bucket
                add(p)
        tail.extend(queued)  # expire skips an item whose entry was re-confirmed since

    def apply_removed(
        self, worker: str, seq: int, primary: Iterable[int], now: float
    ) -> EventResult:
        """``worker`` evicted the blocks ``primary``; unknown hashes are ignored."""
        w = self._workers.get(worker) or self._register(worker)
        result = self._sequence(w, seq)
        if result.__class__ is Stale:
            return result
        w.last_event_at = now
        w.count -= self._unset(w.bit, primary, True)
        return result

    def _unset(self, bit: int, primary: Iterable[int], cascade: bool) -> int:
        """Clear ``bit`` on ``primary``'s entries, dropping entries left empty; returns how
        many entries had the bit. ``cascade``: also clear it from the closed sets below them
        (not needed when every entry of the worker is being cleared)."""
        entries = self._entries
        get = entries.get
        cleared = 0
        below: list[tuple[object, int]] = []
        for p in primary:
            e = get(p)
            if e is not None and e.held & bit:
                cleared += 1
                if cascade and e.closed & bit and e.kids is not None:
                    below.append((e.kids, bit))
                e.held ^= bit
                if e.held:
                    e.closed &= ~bit
                else:
                    del entries[p]
        if below:
            unclose(self._entries, below)
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

    def _drop_blocks(self, w: IndexedWorker) -> None:
        self._unset(w.bit, w.logged(), False)
        w.forget_log()

    def expire(self, now: float) -> int:
        """Drop entries nobody re-confirmed within the TTL; returns how many were dropped. Reads
        ``EXPIRE_STEP`` items of the due lists, twice as many per bucket's width the oldest of
        them has been due (``ttl.expire_budget``)."""
        ttl = self.ttl_s
        pending = self._pending
        if ttl is None or not pending:
            return 0
        width = self.bucket_s
        budget = expire_budget(pending[0][0], now, ttl, width)
        dropped = 0
        below: list[tuple[object, int]] = []
        while pending and budget > 0 and due(pending[0][0], now, ttl, width):
            bucket, hashes = pending[0]
            start = self._expired_to
            end = min(len(hashes), start + budget)
            budget -= end - start
            part = hashes[start:end] if start or end < len(hashes) else hashes
            dropped += self._drop_unconfirmed(part, bucket, below)
            if end < len(hashes):
                self._expired_to = end
                break
            pending.popleft()
            self._expired_to = 0
            if hashes is self._tail:
                self._tail = None
        if below:
            unclose(self._entries, below)
        self.stats.expired_blocks += dropped
        return dropped

    def _drop_unconfirmed(
        self, hashes: Iterable[int], bucket: int, below: list[tuple[object, int]]
    ) -> int:
        """Drop the entries of ``hashes`` last confirmed in ``bucket``; what was closed under
        them goes to ``below`` (to unclose); returns how many were dropped."""
        entries = self._entries
        by_slot = self._by_slot
        dropped = 0
        for p in hashes:
            e = entries.get(p)
            if e is None or e.bucket > bucket:
                continue  # removed since, or re-confirmed later
            del entries[p]
            dropped += 1
            if e.closed and e.kids is not None:
                below.append((e.kids, e.closed))
            m = e.held
            while m:
                low = m & -m
                by_slot[low.bit_length() - 1].count -= 1  # type: ignore[union-attr]
                m ^= low
        return dropped

    # ------------------------------------------------------------------- query

    def overlap(self, primary: Sequence[int], check: Sequence[int] | None) -> dict[str, int]:
        """Leading blocks of the prompt each worker holds: ``{worker: matched_blocks}``.

        Workers with no matched block are absent. A worker is credited with ``d`` blocks only if
        it holds blocks ``0..d-1`` and the entry of block ``d-1`` carries the prompt's check
        hash: the check chain names the whole prefix, and the worker's bit in that entry means
        its own store passed the same comparison, so it holds exactly the prompt's prefix. On a
        mismatch the query is re-walked comparing every block and the collision is counted in
        ``stats.query_collisions``: a shorter match, never a wrong worker. ``check=None`` skips
        verification (a caller that only has primary hashes; passing the primary hashes as
        ``check`` instead would make every hit a mismatch). ``primary`` and ``check`` are lists
        (or tuples) of ints. See ``search`` for how the depths are found.
        """
        if not primary:
            return {}
        get = self._entries.get
        out = search(get, primary, check, self._credit)
        if out is None:
            self.stats.query_collisions += 1
            out = walk(get, primary, check, self._credit, True)
        return out

    def _credit(self, out: dict[str, int], bits: int, depth: int) -> None:
        by_slot = self._by_slot
        while bits:
            low = bits & -bits
            out.setdefault(by_slot[low.bit_length() - 1].name, depth)  # type: ignore[union-attr]
            bits ^= low
