"""The hot period of a hot-spot replay: TTFT of the hot requests, of those arriving in the hot
window and of the rest, and the floor no whole-prefix copy can beat (``bench replay``'s ``hot``
entry; the workload generator marks hot rows and writes the window)."""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

from thunderagent.stats import percentile

if TYPE_CHECKING:
    from thunderagent.replay.records import Record
    from thunderagent.replay.traces import TraceRequest


def hot_summary(
    records: Sequence[Record], hot_ids: Collection[str], window: tuple[float, float]
) -> dict:
    """TTFT p50/p99 (ms) of the hot requests, of every request arriving in ``window`` (virtual
    seconds, ``[start, end)``), and of every request arriving outside it. A request that never
    got a first token counts as infinitely late, as in ``ttft_p99_all_ms``."""
    start, end = window

    def part(recs: list[Record]) -> dict:
        ttft = [
            (r.first_token - r.arrival) * 1000.0 if not math.isnan(r.first_token) else math.inf
            for r in recs
        ]
        return {
            "requests": len(ttft),
            "ttft_p50_ms": percentile(ttft, 50),
            "ttft_p99_ms": percentile(ttft, 99),
        }

    inside = [r for r in records if start <= r.arrival < end]
    return {
        "window_s": [start, end],
        "hot": part([r for r in records if r.request_id in hot_ids]),
        "in_window": part(inside),
        "outside": part([r for r in records if not start <= r.arrival < end]),
    }


def shared_prefix_blocks(trace: Sequence[TraceRequest]) -> int:
    """Leading block ids every request of ``trace`` carries (the hot prefix of its hot rows)."""
    if not trace:
        return 0
    first = trace[0].block_ids
    n = len(first)
    for r in trace[1:]:
        ids = r.block_ids
        n = min(n, len(ids))
        for i in range(n):
            if ids[i] != first[i]:
                n = i
                break
    return n


def hot_ttft_floor_ms(arrivals: Sequence[float], prefix_prefill_s: float) -> float:
    """A lower bound on the hot requests' TTFT p99 for any router and any planner that copies
    whole prefixes: no worker holds the hot prefix, and no copy of it can leave, before a first
    prefill of it ends (``prefix_prefill_s`` after the first hot arrival), so a hot request
    arriving before then waits at least until then; every later one is taken as served at
    once. (A copy of the chunks already computed could leave earlier: docs/benchmarks.md,
    "a pull at dispatch".)"""
    if not arrivals:
        return 0.0
    ready = min(arrivals) + prefix_prefill_s
    return percentile([max(0.0, ready - t) * 1000.0 for t in arrivals], 99)
