"""Apply ``KvEventBatch`` messages (one per engine batch) to a ``PrefixIndex``.

The batch sequence is checked here, once per batch, per worker and adapter epoch: a batch from a
newer epoch means the adapter restarted and starts the worker over (its first batch clears it);
a batch from an older epoch is a leftover and ignored; a jump in ``seq`` is a gap, reported so
the index service can ask the adapter to resync (it republishes its whole cache as one batch, in
sequence, which every consumer applies the same way). Inside a batch the events are fed to the
index with a private per-worker counter, so the index's own sequence check always passes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from thunderagent.prefix_index.index import PrefixIndex
from thunderagent.schemas import AllCleared, BlocksRemoved, BlocksStored, KvEventBatch


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
    index: PrefixIndex
    cursors: dict[str, _Cursor] = field(default_factory=dict)

    def apply(self, batch: KvEventBatch, now: float) -> FeedOutcome:
        worker = batch.worker_id
        cur = self.cursors.get(worker)
        outcome = FeedOutcome.APPLIED
        if cur is None or batch.epoch > cur.epoch:
            counter = cur.counter + 1 if cur else 0
            self.index.reset_worker(worker, counter - 1)
            cur = self.cursors[worker] = _Cursor(batch.epoch, batch.seq, counter - 1)
            outcome = FeedOutcome.NEW_EPOCH if batch.seq == 0 else FeedOutcome.GAP
        elif batch.epoch < cur.epoch or batch.seq <= cur.seq:
            return FeedOutcome.STALE
        elif batch.seq != cur.seq + 1:
            outcome = FeedOutcome.GAP
        cur.seq = batch.seq
        index = self.index
        for ev in batch.events:
            cur.counter += 1
            if isinstance(ev, BlocksStored):
                index.apply_stored(
                    worker, cur.counter, (ev.hashes, ev.check_hashes), ev.parent_hash, now
                )
            elif isinstance(ev, BlocksRemoved):
                index.apply_removed(worker, cur.counter, ev.hashes, now)
            elif isinstance(ev, AllCleared):
                index.clear_worker(worker, cur.counter, now)
        return outcome

    def evict_locally(self, worker: str, hashes: list[int], now: float) -> None:
        """Drop entries this process found stale (lazy verification), outside the event stream."""
        cur = self.cursors.get(worker)
        if cur is None:
            return
        cur.counter += 1
        self.index.apply_removed(worker, cur.counter, hashes, now)

    def forget(self, worker: str) -> None:
        """The worker left (lease lapsed): drop its entries and its cursor."""
        self.cursors.pop(worker, None)
        self.index.remove_worker(worker)
