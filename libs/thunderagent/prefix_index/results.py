"""Outcomes of applying a worker's KV event, and the index's counters.

Sequence problems are expected outcomes on a lossy path (a restarted adapter, a missed message),
so they are returned values, never exceptions: the caller decides whether to resync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final


class Applied:
    """The event was in sequence and applied. Use the ``APPLIED`` singleton (no allocation)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "APPLIED"


APPLIED: Final = Applied()


@dataclass(slots=True, frozen=True)
class Gap:
    """``got`` skipped past ``expected``: events in between were lost.

    The event itself WAS applied (its blocks are still the best information there is) and the
    worker's sequence advanced to ``got``; the index may now miss blocks the lost events stored
    or keep blocks they removed, until the caller resyncs the worker (``reset_worker`` + dump).
    """

    worker: str
    expected: int
    got: int


@dataclass(slots=True, frozen=True)
class Stale:
    """``got`` is at or below the worker's last applied sequence (a duplicate or a replay
    overlap): the event was ignored."""

    worker: str
    last: int
    got: int


EventResult = Applied | Gap | Stale


@dataclass(slots=True)
class IndexStats:
    """Monotonic counters, exported as metrics by the service shells."""

    gaps: int = 0
    """Events that skipped sequence numbers (applied anyway, see ``Gap``)."""
    stale_events: int = 0
    """Duplicate / out-of-date events ignored."""
    store_collisions: int = 0
    """Stored blocks whose primary hash was already indexed with a different check hash: the
    first writer keeps the entry, the later block is not indexed (it will be a miss)."""
    query_collisions: int = 0
    """Overlap walks stopped by a check-hash mismatch (a primary collision turned into a miss)."""
    orphan_stores: int = 0
    """Stored events whose parent block was not indexed for that worker (a lost event, or a
    parent already evicted/expired); the blocks are indexed anyway."""
    expired_blocks: int = 0
    """Entries dropped by TTL expiry."""
