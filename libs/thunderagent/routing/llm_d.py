"""llm-d's inference scheduler as its inference-scheduling guide deploys it (the
``llm-d-inference-scheduler`` v0.7.0 image, its scheduling core from Gateway API Inference
Extension v1.4.0): a weighted sum of three scorers, highest total wins, ties at random.

    total = 2 * queue + 2 * kv_cache + 3 * prefix          (each scorer's score in [0, 1])
    queue    = (max_q - q) / (max_q - min_q) over the candidates, 1 when all are equal;
               q = the engine's waiting requests as last scraped
    kv_cache = 1 - KV in use by running requests / the engine's KV pool
    prefix   = blocks of the prompt matched / blocks of the prompt, over the prompt's first
               ``max_prefix_blocks_to_match`` blocks of ``block_size_tokens``

The prefix scorer is approximate: it never reads the engines' caches. At each pick it records
every block of the prompt under the picked endpoint, in a per-endpoint LRU as large as that
engine's KV pool; the match walks the prompt's blocks while *any* endpoint holds the block and
credits each holder, so an endpoint need not hold the blocks before the one it is credited for.
``prefix="precise"`` is the scheduler's KV-event scorer instead (not the guide's default). See
README.md for the sources and where this model deviates.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from thunderagent.routing.cost import finite_at_least, require
from thunderagent.routing.policy import POLICIES, PolicyHooks, RouteQuery, WorkerView
from thunderagent.schemas import Candidate

_P = "llm_d"
PREFIX_MODES = ("approximate", "precise")
PRECISE_SCORES = ("min_max", "share")


@POLICIES.register("llm_d")
@dataclass
class LlmD(PolicyHooks):
    name: ClassVar[str] = _P

    queue_weight: float = 2.0
    """``queue-scorer`` weight in the guide's ``inference-scheduling.values.yaml`` (2)."""
    kv_cache_weight: float = 2.0
    """``kv-cache-utilization-scorer`` weight there (2)."""
    prefix_weight: float = 3.0
    """``prefix-cache-scorer`` weight there (3)."""
    prefix: str = "approximate"
    """``approximate`` (``prefix-cache-scorer``, the guide's default) or ``precise`` (the
    ``precise-prefix-cache-scorer``: the engines' KV events, through the prefix index)."""
    block_size_tokens: int = 16
    """Tokens per prefix block: auto-tuned from the engine's KV block size (vLLM's default 16,
    also the scorer's fallback ``DefaultBlockSizeTokens``); the scorer hashes 4 characters per
    token of it."""
    max_prefix_blocks_to_match: int = 256
    """``maxPrefixBlocksToMatch`` (256): only the prompt's first 256 x 16 = 4,096 tokens count,
    for the match and for the prompt's length alike."""
    lru_capacity_blocks: int = 0
    """Our blocks each endpoint's LRU keeps. 0: auto-tuned to as many tokens as its engine's
    KV pool holds (``num_gpu_blocks``), else the fallback ``lruCapacityPerServer`` (31,250
    blocks of 16 tokens)."""
    metrics_poll_s: float = 0.05
    """``--refresh-metrics-interval`` (50 ms): how often it scrapes each engine's queue and KV."""
    host_weight: float = 0.8
    """``precise`` only: a block found in host memory counts 0.8 of one on the GPU."""
    precise_score: str = "min_max"
    """``precise`` only: ``min_max`` over the endpoints with a hit (v0.7.0-v0.8.0, the images
    the guides run), or ``share``, the hit over the prompt's blocks (the scheduler's main
    branch since May 2026)."""

    _lrus: dict[str, OrderedDict[int, None]] = field(default_factory=dict, init=False, repr=False)
    """endpoint -> the prompt blocks recorded there, least recently recorded first."""
    _capacity: dict[str, int] = field(default_factory=dict, init=False, repr=False)
    """endpoint -> its KV pool in our blocks when first seen: an LRU's size is fixed then."""

    def __post_init__(self) -> None:
        for name in ("queue_weight", "kv_cache_weight", "prefix_weight", "metrics_poll_s"):
            finite_at_least(_P, name, getattr(self, name), 0.0)
        modes = f"must be one of {', '.join(PREFIX_MODES)}"
        require(_P, "prefix", self.prefix, self.prefix in PREFIX_MODES, modes)
        scores = f"must be one of {', '.join(PRECISE_SCORES)}"
        ok = self.precise_score in PRECISE_SCORES
        require(_P, "precise_score", self.precise_score, ok, scores)
        counts = (("block_size_tokens", 1), ("max_prefix_blocks_to_match", 1),
                  ("lru_capacity_blocks", 0))  # fmt: skip
        for name, low in counts:
            value = getattr(self, name)
            ok = isinstance(value, int) and value >= low
            require(_P, name, value, ok, f"must be an integer >= {low}")
        finite_at_least(_P, "host_weight", self.host_weight, 0.0)

    def load_poll_s(self) -> float:
        return self.metrics_poll_s

    def window(self, query: RouteQuery) -> Sequence[int]:
        """The prompt's blocks the prefix scorer looks at: the approximate one its first
        4,096 tokens (at least one block of ours), the precise one all of them."""
        if self.prefix == "precise":
            return query.block_hashes
        tokens = self.block_size_tokens * self.max_prefix_blocks_to_match
        return query.block_hashes[: max(1, tokens // max(query.block_size, 1))]

    def rank(
        self, query: RouteQuery, workers: Sequence[WorkerView], rng: random.Random
    ) -> list[Candidate]:
        queue = _queue_scores(workers)
        matched = self._matched(query, workers)
        prefix = self._prefix_scores(query, matched)
        totals = {
            w.worker_id: self.queue_weight * queue[w.worker_id]
            + self.kv_cache_weight * _kv_cache_score(w, query.block_size)
            + self.prefix_weight * prefix.get(w.worker_id, 0.0)
            for w in workers
        }
        # the max-score picker: shuffled, then a stable sort by score, so ties fall at random
        order = list(workers)
        rng.shuffle(order)
        order.sort(key=lambda w: -totals[w.worker_id])
        return [
            Candidate(
                worker_id=w.worker_id,
                score=totals[w.worker_id],
                overlap_blocks=int(matched.get(w.worker_id, 0)),
            )
            for w in order
        ]

    def on_dispatched(self, query: RouteQuery, worker_id: str) -> None:
        """The pick's ``PreRequest``: every block of the prompt's window is recorded under the
        picked endpoint, in order (its first block becomes the least recent of them)."""
        if self.prefix != "approximate":
            return
        lru = self._lrus.setdefault(worker_id, OrderedDict())
        for h in self.window(query):
            lru[h] = None
            lru.move_to_end(h)
        cap = self.lru_capacity_blocks or _pool_blocks(query, self._capacity.get(worker_id, 0))
        while len(lru) > cap:
            lru.popitem(last=False)

    def _matched(self, query: RouteQuery, workers: Sequence[WorkerView]) -> dict[str, float]:
        """Per endpoint, the prompt blocks credited to it."""
        window = self.window(query)
        if self.prefix == "precise":
            out: dict[str, float] = {}
            for w in workers:
                wid = w.worker_id
                gpu = min(query.overlaps.get(wid, 0), len(window))
                host = max(min(query.host_overlaps.get(wid, 0), len(window)) - gpu, 0)
                if gpu or host:
                    out[wid] = gpu + self.host_weight * host
            return out
        for w in workers:  # an LRU is sized once, from the pool its engine first reported
            if w.worker_id not in self._capacity and w.kv_total_blocks > 0:
                self._capacity[w.worker_id] = w.kv_total_blocks
        counts: dict[str, float] = {}
        present = [(w.worker_id, self._lrus.get(w.worker_id)) for w in workers]
        for h in window:
            holders = [wid for wid, lru in present if lru is not None and h in lru]
            if not holders:
                break
            for wid in holders:
                counts[wid] = counts.get(wid, 0) + 1
        return counts

    def _prefix_scores(self, query: RouteQuery, matched: dict[str, float]) -> dict[str, float]:
        if self.prefix == "approximate":
            blocks = len(self.window(query))
            return {wid: n / blocks for wid, n in matched.items()} if blocks else {}
        if self.precise_score == "share":
            blocks = len(query.block_hashes)
            return {wid: min(n / blocks, 1.0) for wid, n in matched.items()} if blocks else {}
        # v0.7.0-v0.8.0: min-max over the endpoints with a hit, all equal -> 1
        if not matched:
            return {}
        lo, hi = min(matched.values()), max(matched.values())
        if hi == lo:
            return dict.fromkeys(matched, 1.0)
        return {wid: (n - lo) / (hi - lo) for wid, n in matched.items()}


def _queue_scores(workers: Sequence[WorkerView]) -> dict[str, float]:
    """``queue-scorer``: waiting requests, min-max normalised over the candidates."""
    lo = min(w.queued for w in workers)
    hi = max(w.queued for w in workers)
    if hi == lo:
        return {w.worker_id: 1.0 for w in workers}
    return {w.worker_id: (hi - w.queued) / (hi - lo) for w in workers}


def _kv_cache_score(w: WorkerView, block_size: int) -> float:
    """``kv-cache-utilization-scorer``: 1 - the engine's KV usage (the KV running requests
    hold, as vLLM's ``kv_cache_usage_perc`` and SGLang's ``num_used_tokens`` count it)."""
    pool = w.kv_total_blocks * max(block_size, 1)
    if pool <= 0:
        return 1.0
    return 1.0 - min(max(w.active_tokens / pool, 0.0), 1.0)


def _pool_blocks(query: RouteQuery, pool_blocks: int) -> int:
    """An endpoint's LRU size in our blocks: its engine's pool, else the scorer's fallback
    (31,250 blocks of 16 tokens)."""
    if pool_blocks > 0:
        return pool_blocks
    return max(1, 31_250 * 16 // max(query.block_size, 1))
