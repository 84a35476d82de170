"""A ``PrefixIndex``'s whole image, apart from its hot paths: taken for a snapshot (Redis, a
replica starting late) and put back in its place."""

from __future__ import annotations

import math
from array import array
from collections import deque

from thunderagent.prefix_index.closure import Kids
from thunderagent.prefix_index.entry import Entry
from thunderagent.prefix_index.snapshot import (
    IndexSnapshot,
    WorkerImage,
    from_snapshot,
    to_snapshot,
)
from thunderagent.prefix_index.worker_log import IndexedWorker


class IndexImages:
    """``PrefixIndex.snapshot`` and ``restore``: they read and replace the index's whole state
    (its fields are set in ``PrefixIndex.__init__``)."""

    def snapshot(self) -> IndexSnapshot:
        """A plain image of the whole index (encode with ``snapshot.encode``)."""
        workers = [
            WorkerImage(
                name=w.name,
                slot=w.slot,
                last_seq=w.last_seq,
                last_event_at=w.last_event_at,
                blocks=list(w.logged()),
                count=w.count,
            )
            for w in self._workers.values()
        ]
        queue = [(bucket, hashes.tolist()) for bucket, hashes in self._pending]
        if queue and self._expired_to:  # what an expiry in steps has read is not kept
            queue[0] = (queue[0][0], queue[0][1][self._expired_to :])
        return to_snapshot(self._entries, workers, len(self._by_slot), self.bucket_s, queue)

    def restore(self, snap: IndexSnapshot, now: float = 0.0) -> None:
        """Replace this index's contents with ``snap``.

        TTL settings stay this index's own: buckets are rescaled to this index's width, and a
        snapshot taken without TTL counts as confirmed at ``now``.
        """
        lists = [img.blocks for img in snap.workers] + [h for _, h in snap.ttl_queue]
        if any(h and (min(h) < 0 or max(h) >= 1 << 64) for h in lists):  # before any change
            raise ValueError("snapshot block hashes must be unsigned 64-bit integers")
        bucket_s = self.bucket_s if self.ttl_s is not None else None
        self._entries, queue = from_snapshot(snap, bucket_s, now, Entry, Kids)
        self._workers = {}
        self._by_slot = [None] * max((w.slot + 1 for w in snap.workers), default=0)
        for img in snap.workers:
            w = IndexedWorker(img.name, img.slot, 1 << img.slot, img.last_seq, img.last_event_at)
            w.log = array("Q", img.blocks)
            w.count = len(img.blocks) if img.count < 0 else img.count
            self._workers[img.name] = w
            self._by_slot[img.slot] = w
        self._free_slots = [s for s, w in enumerate(self._by_slot) if w is None]
        self._rebuild_ttl_queue(queue)

    def _rebuild_ttl_queue(self, queue: list[tuple[int, list[int]]] | None) -> None:
        self._pending = deque()
        self._expired_to = 0
        self._tail = None
        self._tail_bucket = 0
        self._bucket_end = -math.inf
        if self.ttl_s is None:
            return
        if queue:
            self._pending = deque((bucket, array("Q", hashes)) for bucket, hashes in queue)
        else:
            lists: dict[int, array] = {}
            for p, e in self._entries.items():
                lists.setdefault(e.bucket, array("Q")).append(p)
            self._pending = deque((bucket, lists[bucket]) for bucket in sorted(lists))
        if self._pending:
            self._tail_bucket, self._tail = self._pending[-1]
            self._bucket_end = self._first_time_after(self._tail_bucket)
