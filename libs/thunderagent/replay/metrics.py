"""Metrics arithmetic: cache hit ratios (ideal, pooled LRU) and load imbalance (percentiles:
``thunderagent.stats``).

Hit ratios are token weighted and count a hit as the engine does: a request can reuse at most
``(prompt_len - 1) // block_size`` leading blocks (the last prompt token is always computed), and
only its full prompt blocks (``prompt_len // block_size``) are stored afterwards.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


def usable_blocks(prompt_len: int, block_size: int) -> int:
    """Leading blocks a request can take from a cache: never the one holding its last token."""
    return (prompt_len - 1) // block_size


def ideal_hit_ratio(requests: Iterable[tuple[Sequence[int], int]], block_size: int) -> float:
    """Prompt tokens one unlimited cache would serve / prompt tokens.

    ``requests``: ``(chained block keys, prompt_len)`` in arrival order.
    """
    seen: set[int] = set()
    hit = total = 0
    for keys, prompt_len in requests:
        total += prompt_len
        n = 0
        for k in keys[: usable_blocks(prompt_len, block_size)]:
            if k not in seen:
                break
            n += 1
        hit += n * block_size
        seen.update(keys[: prompt_len // block_size])
    return hit / total if total else 0.0


def pooled_hit_ratio(
    requests: Iterable[tuple[Sequence[int], int]], block_size: int, capacity_blocks: int
) -> float:
    """Prompt tokens one LRU cache of ``capacity_blocks`` would serve / prompt tokens.

    The whole cluster's KV room as one cache: what perfect routing could approach (it ignores
    the KV that running requests hold privately, so it is an upper bound). A request touches its
    blocks deepest first, so its root ends most recent and eviction takes leaves before parents.
    """
    lru: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    for keys, prompt_len in requests:
        total += prompt_len
        n = 0
        for k in keys[: usable_blocks(prompt_len, block_size)]:
            if k not in lru:
                break
            n += 1
        hit += n * block_size
        for k in reversed(keys[: prompt_len // block_size]):
            lru[k] = None
            lru.move_to_end(k)
        while len(lru) > capacity_blocks:
            lru.popitem(last=False)
    return hit / total if total else 0.0


def load_imbalance(busy: Sequence[float]) -> float:
    """max / mean of per-worker busy time (1.0 = perfectly even; 1.0 when nobody worked)."""
    if not busy:
        return 1.0
    mean = sum(busy) / len(busy)
    return max(busy) / mean if mean > 0 else 1.0
