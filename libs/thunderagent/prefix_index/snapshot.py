"""Plain, msgspec-serialisable image of a ``PrefixIndex`` (the index service stores it in Redis).

Column lists rather than one record per block: msgspec encodes a list of ints in C at hundreds of
MB/s, ``restore`` rebuilds the entries with one ``dict(zip(...))``, and worker logs and the TTL
queue are copied as they are, so neither side loops in Python per (block, worker) pair (only the
few branch points' kid sets are rebuilt one by one).

Version 2 adds the ``closed`` masks and the kids (``index`` needs both to answer queries by
search); a version 1 snapshot is refused with ``ValueError`` (the index service then replays the
event stream instead).
"""

from __future__ import annotations

from operator import attrgetter
from typing import Final

import msgspec

from thunderagent.hashing import SCHEME_VERSION

SNAPSHOT_VERSION: Final = 2
WORD_BITS: Final = 64
WORD_MASK: Final = (1 << WORD_BITS) - 1


class WorkerImage(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One worker's state in the snapshot."""

    name: str
    """External worker id."""
    slot: int
    """Bit position of the worker in ``IndexSnapshot.masks``."""
    last_seq: int | None
    """Last applied event sequence number (``None``: no event seen since registration)."""
    last_event_at: float | None
    """Clock time of the worker's last event."""
    blocks: list[int]
    """Primary hashes the worker's bit was set on, in stored order; may repeat or include
    hashes whose bit has gone since (readers filter on ``masks``): copying the index's log
    as is keeps a snapshot O(1) per item in C."""
    count: int = -1
    """Exact number of entries with this worker's bit (-1: ``len(blocks)``)."""


class IndexSnapshot(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Columns of the index: entry ``i`` is ``primary[i] -> (masks[i], closed[i], check[i],
    buckets[i], kids[i])``, with ``branch_kids`` filling in the kid sets of branch points."""

    version: int = SNAPSHOT_VERSION
    """Layout version of this struct."""
    hash_scheme: int
    """``thunderagent.hashing.SCHEME_VERSION`` the hashes were made with."""
    bucket_s: float
    """TTL bucket width the ``buckets`` column is expressed in (0.0: TTL off)."""
    workers: list[WorkerImage]
    primary: list[int]
    check: list[int]
    mask_words: int = 1
    """64-bit words per mask in ``masks`` (1 while every slot is below 64)."""
    masks: list[int]
    """Bitmask of the workers holding each entry, ``mask_words`` little-endian words each."""
    closed: list[int] = []
    """Bitmask of the workers holding each entry's whole prefix, laid out like ``masks``."""
    buckets: list[int]
    """TTL bucket of each entry's last confirmation."""
    kids: list[int | None] = []
    """Each entry's single kid (None: none, or a branch point listed in ``branch_kids``)."""
    branch_kids: list[tuple[int, list[int]]] = []
    """``(primary, kids)`` of the entries with more than one kid."""
    ttl_queue: list[tuple[int, list[int]]] = []
    """The expiry queue, ``(bucket, primary hashes confirmed in it)`` in time order, items may be
    stale; restored as is so expiry resumes exactly (rebuilt from ``buckets`` if empty)."""


def split_masks(masks: list[int], words: int) -> list[int]:
    """Flatten masks wider than 64 bits into ``words`` uint64 words each (msgspec's int range)."""
    if words == 1:
        return masks
    return [(m >> (WORD_BITS * k)) & WORD_MASK for m in masks for k in range(words)]


def join_masks(flat: list[int], words: int) -> list[int]:
    """Inverse of ``split_masks``."""
    if words == 1:
        return flat
    out = []
    for i in range(0, len(flat), words):
        m = 0
        for k in range(words):
            m |= flat[i + k] << (WORD_BITS * k)
        out.append(m)
    return out


def to_snapshot(
    entries: dict,
    workers: list[WorkerImage],
    slots: int,
    bucket_s: float,
    ttl_queue: list[tuple[int, list[int]]],
) -> IndexSnapshot:
    """Columns from the index's ``primary -> Entry(held, closed, check, bucket, kids)`` dict."""
    words = max(1, -(-slots // WORD_BITS))
    values = list(entries.values())
    held, closed, check, buckets, kids = (
        list(map(attrgetter(f), values)) for f in ("held", "closed", "check", "bucket", "kids")
    )
    primary = list(entries)
    branches = []
    for i, k in enumerate(kids):  # the few branch points: sets become a separate column
        if k.__class__ not in _ONE:
            branches.append((primary[i], list(k)))
            kids[i] = None
    return IndexSnapshot(
        hash_scheme=SCHEME_VERSION,
        bucket_s=bucket_s,
        workers=workers,
        primary=primary,
        check=check,
        mask_words=words,
        masks=split_masks(held, words),
        closed=split_masks(closed, words),
        buckets=buckets,
        kids=kids,
        branch_kids=branches,
        ttl_queue=ttl_queue,
    )


_ONE: Final = (int, type(None))


def from_snapshot(
    snap: IndexSnapshot, bucket_s: float | None, now: float, entry: type, kid_set: type = set
) -> tuple[dict, list[tuple[int, list[int]]] | None]:
    """The index's entries dict and TTL queue from ``snap``, buckets converted to width
    ``bucket_s`` (``None``: TTL off). A snapshot without TTL counts as confirmed at ``now``;
    the queue is ``None`` when it must be rebuilt from the entries. Entries are ``entry``
    instances (held, closed, check, bucket, kids); branch points' kids ``kid_set`` ones."""
    if snap.version != SNAPSHOT_VERSION:
        raise ValueError(f"snapshot version {snap.version} != {SNAPSHOT_VERSION}")
    if snap.hash_scheme != SCHEME_VERSION:
        raise ValueError(f"snapshot hash scheme {snap.hash_scheme} != {SCHEME_VERSION}")
    buckets = snap.buckets
    queue: list[tuple[int, list[int]]] | None = snap.ttl_queue if snap.bucket_s else None
    if bucket_s is not None and snap.bucket_s != bucket_s:
        if snap.bucket_s:  # the same monotone map for entries and queue keeps them in step
            ratio = snap.bucket_s / bucket_s
            buckets = [int(b * ratio) for b in buckets]
            queue = [(int(b * ratio), hashes) for b, hashes in snap.ttl_queue]
        else:
            buckets = [int(now // bucket_s)] * len(buckets)
    masks = join_masks(snap.masks, snap.mask_words)
    closed = join_masks(snap.closed, snap.mask_words)
    columns = (snap.primary, masks, closed, snap.check, buckets, snap.kids)
    if len({len(c) for c in columns}) != 1:
        raise ValueError(f"snapshot columns differ in length: {[len(c) for c in columns]}")
    entries = dict(zip(snap.primary, map(entry, *columns[1:]), strict=True))
    for p, kids in snap.branch_kids:
        entries[p].kids = kid_set(kids)
    return entries, queue


def encode(snapshot: IndexSnapshot) -> bytes:
    """msgpack bytes of a snapshot."""
    return msgspec.msgpack.encode(snapshot)


def decode(data: bytes) -> IndexSnapshot:
    """Snapshot from ``encode``'s bytes (validated by msgspec)."""
    return msgspec.msgpack.decode(data, type=IndexSnapshot)
