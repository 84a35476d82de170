"""Metrics arithmetic: cache hit ratios (ideal, pooled LRU), the engine-time floor and the speed
ceiling it sets, and load imbalance (percentiles: ``thunderagent.stats``).

Hit ratios are token weighted and count a hit as the engine does: a request can reuse at most
``(prompt_len - 1) // block_size`` leading blocks (the last prompt token is always computed), and
only its full prompt blocks (``prompt_len // block_size``) are stored afterwards.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from thunderagent.engine import TimingModel
from thunderagent.hashing import BlockHasher
from thunderagent.replay.traces import TraceRequest


def usable_blocks(prompt_len: int, block_size: int) -> int:
    """Leading blocks a request can take from a cache: never the one holding its last token."""
    return (prompt_len - 1) // block_size


def ideal_hits(requests: Iterable[tuple[Sequence[int], int]], block_size: int) -> list[int]:
    """Per request, the leading blocks one unlimited cache would serve.

    ``requests``: ``(chained block keys, prompt_len)`` in arrival order.
    """
    seen: set[int] = set()
    out = []
    for keys, prompt_len in requests:
        n = 0
        for k in keys[: usable_blocks(prompt_len, block_size)]:
            if k not in seen:
                break
            n += 1
        out.append(n)
        seen.update(keys[: prompt_len // block_size])
    return out


def pooled_hits(
    requests: Iterable[tuple[Sequence[int], int]], block_size: int, capacity_blocks: int
) -> list[int]:
    """Per request, the leading blocks one LRU cache of ``capacity_blocks`` would serve.

    The whole cluster's KV room as one cache: what perfect routing could approach (it ignores
    the KV that running requests hold privately, so it is an upper bound). A request touches its
    blocks deepest first, so its root ends most recent and eviction takes leaves before parents.
    """
    lru: OrderedDict[int, None] = OrderedDict()
    out = []
    for keys, prompt_len in requests:
        n = 0
        for k in keys[: usable_blocks(prompt_len, block_size)]:
            if k not in lru:
                break
            n += 1
        out.append(n)
        for k in reversed(keys[: prompt_len // block_size]):
            lru[k] = None
            lru.move_to_end(k)
        while len(lru) > capacity_blocks:
            lru.popitem(last=False)
    return out


def hit_ratio(prompt_lens: Sequence[int], hit_blocks: Sequence[int], block_size: int) -> float:
    """Prompt tokens served from cache / prompt tokens."""
    total = sum(prompt_lens)
    return sum(hit_blocks) * block_size / total if total else 0.0


def ideal_hit_ratio(requests: Sequence[tuple[Sequence[int], int]], block_size: int) -> float:
    """Prompt tokens one unlimited cache would serve / prompt tokens."""
    hits = ideal_hits(requests, block_size)
    return hit_ratio([n for _, n in requests], hits, block_size)


def pooled_hit_ratio(
    requests: Sequence[tuple[Sequence[int], int]], block_size: int, capacity_blocks: int
) -> float:
    """Prompt tokens one LRU cache of ``capacity_blocks`` would serve / prompt tokens."""
    hits = pooled_hits(requests, block_size, capacity_blocks)
    return hit_ratio([n for _, n in requests], hits, block_size)


def gpu_seconds_floor(timing: TimingModel, requests: Iterable[tuple[int, int, int]]) -> float:
    """Engine time no schedule can go below for ``(prompt_len, output_len, cached_tokens)``
    requests, in the engine model's terms: the prefill FLOPs of each uncached part at the
    profile's sustained rate (chunking does not change the sum: causal attention over ``c``
    cached and ``n`` new tokens costs the same in one chunk or many), and one read of the
    request's KV per decode step (the prefill emits the first token; decode step ``j`` reads
    ``prompt_len + j`` tokens). A decode step also reads the weights and every step has a fixed
    overhead; both are left out, so the floor is generous."""
    flops = 0.0
    kv_token_reads = 0.0
    for prompt_len, output_len, cached in requests:
        flops += timing.prefill_flops(prompt_len - cached, cached)
        steps = max(output_len - 1, 0)
        kv_token_reads += steps * prompt_len + steps * (steps + 1) / 2
    return timing.compute_seconds(flops) + timing.kv_read_seconds(kv_token_reads)


def work_ceiling_speed(floor_s: float, workers: int, span_s: float) -> float:
    """The replay speed past which ``workers`` engines busy all the time fall behind a trace
    that arrives over ``span_s`` seconds at 1x and needs ``floor_s`` engine seconds: at a
    higher speed the backlog grows for as long as requests arrive. A steady-state ceiling: a
    short trace can pass it on TTFT by leaving decodes to run after its last arrival. Infinite
    when nothing bounds it (no work, or every request arriving at once)."""
    return workers * span_s / floor_s if floor_s > 0 and span_s > 0 else math.inf


def load_imbalance(busy: Sequence[float]) -> float:
    """max / mean of per-worker busy time (1.0 = perfectly even; 1.0 when nobody worked)."""
    if not busy:
        return 1.0
    mean = sum(busy) / len(busy)
    return max(busy) / mean if mean > 0 else 1.0


def cache_bounds(
    trace: Sequence[TraceRequest], block_size: int, pool_blocks: int
) -> dict[str, tuple[float, list]]:
    """Per cache model (none, one unlimited cache, one shared LRU pool of the cluster's KV):
    its hit ratio over ``trace`` and each request's cached prompt tokens."""
    hasher = BlockHasher(block_size=1)
    keyed = [
        (hasher.hash_block_ids(r.block_ids[: r.prompt_len // block_size]).primary, r.prompt_len)
        for r in trace
    ]
    lens = [r.prompt_len for r in trace]
    out: dict[str, tuple[float, list]] = {"none": (0.0, [0] * len(trace))}
    for name, hits in (
        ("ideal", ideal_hits(keyed, block_size)),
        ("pooled", pooled_hits(keyed, block_size, pool_blocks)),
    ):
        out[name] = (hit_ratio(lens, hits, block_size), [n * block_size for n in hits])
    return out


def work_ceiling(
    trace: Sequence[TraceRequest], timing: TimingModel, workers: int, block_size: int, bounds: dict
) -> dict:
    """Per cache model, the engine seconds no schedule goes below (``gpu_seconds_floor``) and
    the speed past which the cluster, busy all the time, falls behind (``work_ceiling_speed``).
    With the pooled cache it bounds what any routing can sustain in steady state."""
    span = trace[-1].arrival - trace[0].arrival if trace else 0.0
    out: dict = {"workers": workers, "span_s": round(span, 3)}
    for name, (_, cached) in bounds.items():
        floor = gpu_seconds_floor(
            timing, ((r.prompt_len, r.output_len, c) for r, c in zip(trace, cached, strict=True))
        )
        speed = work_ceiling_speed(floor, workers, span)
        out[name] = {  # JSON has no infinity: null when nothing bounds the speed
            "engine_s": floor,
            "speed": round(speed, 3) if math.isfinite(speed) else None,
        }
    return out
