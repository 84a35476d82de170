"""Plain, msgspec-serialisable image of a ``PrefixIndex`` (the index service stores it in Redis).

Column lists rather than one record per block: msgspec encodes a list of ints in C at hundreds of
MB/s, and ``restore`` rebuilds the dict with one comprehension and each worker's set with one
``set(list)`` call, so neither side has a Python-level loop per (block, worker) pair.
"""

from __future__ import annotations

from typing import Final

import msgspec

from thunderagent.hashing import SCHEME_VERSION

SNAPSHOT_VERSION: Final = 1
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
    """Primary hashes of the worker's indexed blocks (any order)."""


class IndexSnapshot(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Columns of the index: entry ``i`` is ``(primary[i], check[i], mask, buckets[i])``."""

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
    """Worker bitmask per entry, ``mask_words`` little-endian words each."""
    buckets: list[int]
    """TTL bucket of each entry's last confirmation."""


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
    entries: dict[int, tuple[int, int, int]],
    workers: list[WorkerImage],
    slots: int,
    bucket_s: float,
) -> IndexSnapshot:
    """Columns from the index's ``primary -> (mask, check, bucket)`` dict."""
    values = list(entries.values())
    words = max(1, -(-slots // WORD_BITS))
    return IndexSnapshot(
        hash_scheme=SCHEME_VERSION,
        bucket_s=bucket_s,
        workers=workers,
        primary=list(entries),
        check=[v[1] for v in values],
        mask_words=words,
        masks=split_masks([v[0] for v in values], words),
        buckets=[v[2] for v in values],
    )


def from_snapshot(
    snap: IndexSnapshot, bucket_s: float | None, now: float
) -> dict[int, tuple[int, int, int]]:
    """The index's entries dict from ``snap``, TTL buckets converted to width ``bucket_s``
    (``None``: TTL off; a snapshot without TTL counts as confirmed at ``now``)."""
    if snap.hash_scheme != SCHEME_VERSION:
        raise ValueError(f"snapshot hash scheme {snap.hash_scheme} != {SCHEME_VERSION}")
    buckets = snap.buckets
    if bucket_s is not None and snap.bucket_s != bucket_s:
        if snap.bucket_s:
            ratio = snap.bucket_s / bucket_s
            buckets = [int(b * ratio) for b in buckets]
        else:
            buckets = [int(now // bucket_s)] * len(buckets)
    masks = join_masks(snap.masks, snap.mask_words)
    values = zip(masks, snap.check, buckets, strict=True)
    return dict(zip(snap.primary, values, strict=True))


def encode(snapshot: IndexSnapshot) -> bytes:
    """msgpack bytes of a snapshot."""
    return msgspec.msgpack.encode(snapshot)


def decode(data: bytes) -> IndexSnapshot:
    """Snapshot from ``encode``'s bytes (validated by msgspec)."""
    return msgspec.msgpack.decode(data, type=IndexSnapshot)
