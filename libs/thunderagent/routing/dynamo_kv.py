"""Dynamo 1.6.1's default KV-router cost, in blocks; lowest cost wins.

    cost = overlap_score_weight * prefill_blocks + decode_blocks
    prefill_blocks = pending prefill + prompt blocks
                     - (GPU overlap + host_cache_hit_weight * host-only overlap)
    decode_blocks  = active KV blocks + this prompt's blocks

Temperature 0: the minimum, ties at random; above 0: softmax over min-max normalized costs. See
README.md for the source this was checked against and the approximations.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from thunderagent.routing.cost import (
    RunningMean,
    cached_blocks,
    candidates,
    finite_at_least,
    in_unit_interval,
    queued_prefill_tokens,
    rank_by_cost,
    require,
)
from thunderagent.routing.policy import POLICIES, PolicyHooks, RouteQuery, WorkerView
from thunderagent.schemas import Candidate

_P = "dynamo_kv"


@POLICIES.register("dynamo_kv")
@dataclass
class DynamoKv(PolicyHooks):
    name: ClassVar[str] = _P

    overlap_score_weight: float = 1.0
    """Dynamo default (1.6.1 calls it ``prefill_load_scale``; ``overlap_score_weight`` is its
    alias): one uncached prompt block costs as much as one block of decode load."""
    host_cache_hit_weight: float = 0.75
    """Dynamo 1.6.1 default: a block only in host memory is credited 75% of a GPU hit (it must be
    copied back, which is cheaper than recompute but not free)."""
    temperature: float = 0.0
    """Dynamo default: deterministic minimum. Above 0, softmax sampling spreads near-ties."""
    mean_alpha: float = 0.05
    """EMA weight for the prompt sizes used to estimate work the load report cannot show yet
    (requests queued or just routed): ~20 requests of memory, steady yet quick to follow a shift."""

    _prompt: RunningMean = field(init=False, repr=False)
    _uncached: RunningMean = field(init=False, repr=False)

    def __post_init__(self) -> None:
        finite_at_least(_P, "overlap_score_weight", self.overlap_score_weight, 0.0)
        in_unit_interval(_P, "host_cache_hit_weight", self.host_cache_hit_weight)
        finite_at_least(_P, "temperature", self.temperature, 0.0)
        require(_P, "mean_alpha", self.mean_alpha, 0 < self.mean_alpha <= 1, "must lie in (0, 1]")
        self._prompt = RunningMean(self.mean_alpha)
        self._uncached = RunningMean(self.mean_alpha)

    def costs(self, query: RouteQuery, workers: Sequence[WorkerView]) -> dict[str, float]:
        bs = query.block_size
        prompt = query.prompt_tokens / bs
        out: dict[str, float] = {}
        for w in workers:
            gpu, host_only = cached_blocks(query, w.worker_id)
            # Dynamo books every routed request's prefill until its first token; a reported
            # backlog is the same quantity
            waiting_prefill = queued_prefill_tokens(w, self._uncached.get()) / bs
            credit = gpu + self.host_cache_hit_weight * host_only
            prefill = max(0.0, waiting_prefill + prompt - credit)
            decode = (w.active_tokens + w.pending * self._prompt.get()) / bs + prompt
            out[w.worker_id] = self.overlap_score_weight * prefill + decode
        return out

    def rank(
        self, query: RouteQuery, workers: Sequence[WorkerView], rng: random.Random
    ) -> list[Candidate]:
        cost = self.costs(query, workers)
        ordered = rank_by_cost(workers, cost, lambda w: w.worker_id, self.temperature, rng)
        return candidates(ordered, cost, query)

    def on_dispatched(self, query: RouteQuery, worker_id: str) -> None:
        cached = min(query.overlaps.get(worker_id, 0), query.prompt_blocks) * query.block_size
        self._prompt.add(query.prompt_tokens)
        self._uncached.add(max(0, query.prompt_tokens - cached))
