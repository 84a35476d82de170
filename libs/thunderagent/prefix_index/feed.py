"""Apply ``KvEventBatch`` messages (one per engine batch) to a ``PrefixIndex``.

The batch sequence is checked here, once per batch, per worker and adapter epoch: a batch from a
newer epoch means the adapter restarted and starts the worker over (its first batch clears it);
a batch from an older epoch is a leftover and ignored; a jump in ``seq`` is a gap, reported so
the index service can ask the adapter to resync (it republishes its whole cache in sequence, in
batches of at most 256 KiB, which every consumer applies the same way). Inside a batch the
events are fed to the index with a private per-worker counter, so the index's own sequence
check always passes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from thunderagent.prefix_index.index import PrefixIndex
from thunderagent.schemas import (
    AllCleared,
    BlocksRemoved,
    BlocksStored,
    KvEvent,
    KvEventBatch,
    Medium,
)


class FeedOutcome(Enum):
    APPLIED = "applied"
    GAP = "gap"
    """Applied, but batches were missed before it: resync the worker."""
    STALE = "stale"
    """A duplicate or a batch from an older adapter epoch: ignored."""
    NEW_EPOCH = "new_epoch"
    """The adapter restarted: its previous entries were dropped, this batch applied."""


@dataclass(slots=True)
class _Cursor:
    epoch: int
    seq: int
    counter: int


@dataclass
class IndexFeeder:
    """Feeds ``index`` (every tier) and, once a host-memory tier shows up, ``gpu`` (GPU only).

    While every event has been GPU-medium the two are identical, so ``gpu`` stays None and costs
    nothing; the first host-tier event clones ``index`` into it, after which GPU-medium events go
    to both and host-tier ones only to ``index``. A block in ``index`` but not in ``gpu`` is held
    in host memory only: a hit there saves prefill at the price of a PCIe copy (the routing
    policy credits it less).
    """

    index: PrefixIndex
    cursors: dict[str, _Cursor] = field(default_factory=dict)
    gpu: PrefixIndex | None = None

    @property
    def gpu_index(self) -> PrefixIndex:
        return self.gpu if self.gpu is not None else self.index

    def holders(self, prefix: int) -> list[str]:
        """Workers whose GPU cache holds ``prefix`` (the primary hash of its deepest block; a
        chained hash names the whole prefix), sorted: what the migration planner asks, live
        (the index service's answer) and in the replay."""
        return sorted(self.gpu_index.overlap([prefix], None))

    def apply(self, batch: KvEventBatch, now: float) -> FeedOutcome:
        worker = batch.worker_id
        cur = self.cursors.get(worker)
        outcome = FeedOutcome.APPLIED
        if cur is None or batch.epoch > cur.epoch:
            counter = cur.counter + 1 if cur else 0
            for index in self._indexes():
                index.reset_worker(worker, counter - 1)
            cur = self.cursors[worker] = _Cursor(batch.epoch, batch.seq, counter - 1)
            outcome = FeedOutcome.NEW_EPOCH if batch.seq == 0 else FeedOutcome.GAP
        elif batch.epoch < cur.epoch or batch.seq <= cur.seq:
            return FeedOutcome.STALE
        elif batch.seq != cur.seq + 1:
            outcome = FeedOutcome.GAP
        cur.seq = batch.seq
        for ev in batch.events:
            cur.counter += 1
            if not isinstance(ev, AllCleared) and ev.medium != Medium.GPU and self.gpu is None:
                self.gpu = _clone(self.index, now)
            for index in self._indexes(ev):
                _apply(index, worker, cur.counter, ev, now)
        return outcome

    def _indexes(self, ev: KvEvent | None = None) -> tuple[PrefixIndex, ...]:
        if self.gpu is None:
            return (self.index,)
        if ev is None or isinstance(ev, AllCleared) or ev.medium == Medium.GPU:
            return (self.index, self.gpu)
        return (self.index,)

    def reset(self) -> None:
        """Forget everything (a snapshot turned out unusable: the stream is replayed instead)."""
        self.index = PrefixIndex(self.index.ttl_s)
        self.gpu = None
        self.cursors = {}

    def expire(self, now: float) -> int:
        """TTL expiry of every tier; returns the entries dropped from the all-tier index."""
        if self.gpu is not None:
            self.gpu.expire(now)
        return self.index.expire(now)

    def forget(self, worker: str) -> None:
        """The worker left (lease lapsed): drop its entries and its cursor."""
        self.cursors.pop(worker, None)
        for index in self._indexes():
            index.remove_worker(worker)


def stored_hashes(batch: KvEventBatch) -> list[list[int]]:
    """The primary hashes of each ``BlocksStored`` in the batch (what prefix grouping waits for)."""
    return [ev.hashes for ev in batch.events if isinstance(ev, BlocksStored) and ev.hashes]


def _apply(index: PrefixIndex, worker: str, seq: int, ev: KvEvent, now: float) -> None:
    if isinstance(ev, BlocksStored):
        index.apply_stored(worker, seq, (ev.hashes, ev.check_hashes), ev.parent_hash, now)
    elif isinstance(ev, BlocksRemoved):
        index.apply_removed(worker, seq, ev.hashes, now)
    elif isinstance(ev, AllCleared):
        index.clear_worker(worker, seq, now)


def _clone(index: PrefixIndex, now: float) -> PrefixIndex:
    copy = PrefixIndex(index.ttl_s)
    copy.restore(index.snapshot(), now)
    return copy
