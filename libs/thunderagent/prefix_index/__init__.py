"""Block hash → workers prefix index with TTL, event sequencing and double-hash verification."""

from thunderagent.prefix_index.index import DEFAULT_TTL_BUCKETS, DEFAULT_TTL_S, PrefixIndex
from thunderagent.prefix_index.results import (
    APPLIED,
    Applied,
    EventResult,
    Gap,
    IndexStats,
    Stale,
)
from thunderagent.prefix_index.snapshot import IndexSnapshot, WorkerImage, decode, encode

__all__ = [
    "APPLIED",
    "DEFAULT_TTL_BUCKETS",
    "DEFAULT_TTL_S",
    "Applied",
    "EventResult",
    "Gap",
    "IndexSnapshot",
    "IndexStats",
    "PrefixIndex",
    "Stale",
    "WorkerImage",
    "decode",
    "encode",
]
