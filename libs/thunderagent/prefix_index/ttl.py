"""The prefix index's TTL schedule (pure arithmetic): when a confirmation bucket ends, and how
many due items one ``expire`` call reads.

The index keeps its confirmations in one list per bucket of ``ttl_s / buckets`` seconds; a list
is due ``ttl_s`` after its bucket ends (``index.py``'s module docstring).
"""

from __future__ import annotations

import math
from typing import Final

EXPIRE_STEP: Final = 8192
"""Items of due TTL lists one ``expire`` call reads (~2 ms here), doubled for each bucket's
width the oldest due list has waited since it was due, so a backlog is caught up within a few
buckets. An adapter's periodic re-announcement puts its engine's whole cache in one list, read
600 s later: 28k-56k items in one call held the router's loop for up to 21 ms every few buckets
(8 workers of 28k blocks, a `/tmp` simulation), where a call every second reads it in steps."""


def first_time_after(bucket: int, width: float) -> float:
    """The smallest float ``t`` with ``t // width > bucket`` (exact, not off by an ulp)."""
    t = (bucket + 1) * width
    while t // width > bucket:
        t = math.nextafter(t, -math.inf)
    while t // width <= bucket:
        t = math.nextafter(t, math.inf)
    return t


def due(bucket: int, now: float, ttl: float, width: float) -> bool:
    """Whether the list of ``bucket`` is due at ``now``."""
    return (bucket + 1) * width + ttl <= now


def expire_budget(oldest_bucket: int, now: float, ttl: float, width: float) -> int:
    """Items one ``expire`` call at ``now`` reads: 0 while the oldest list is not due,
    ``EXPIRE_STEP`` doubled per bucket's width it has been due."""
    lag = (now - (oldest_bucket + 1) * width - ttl) // width
    return 0 if lag < 0 else EXPIRE_STEP << min(int(lag), 20)
