"""ThunderAgent's policy: predicted seconds per worker; the cache credit decays with load.

    cost = prefill_s * (prompt - credit)                  this request's own prefill
         + prefill_s * (queued + pending) * mean_prefill  prefills queued ahead of it
         + decode_weight * output * (kv_s * active_tokens + seq_s * outstanding)   its decode
         + pressure penalty              running requests' KV nearly full: its cache would go
    credit = (gpu_blocks + host_credit * host_only_blocks) * block_size * exp(-excess / load_scale)

``excess`` is the worker's outstanding requests above the least loaded candidate's, so an evenly
loaded fleet keeps full credit. Ties go to more free KV, then random. No hit on any worker:
power-of-two-choices on the same cost. ``observe`` tunes ``load_scale`` online (OnlineTuner).
"""

from __future__ import annotations

import math
import operator
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from thunderagent.routing.cost import (
    DECODE_S_PER_KV_TOKEN,
    PREFILL_S_PER_TOKEN,
    OnlineTuner,
    RunningMean,
    by_key,
    cached_blocks,
    candidates,
    finite_at_least,
    finite_positive,
    in_unit_interval,
    queued_prefill_tokens,
    rank_by_cost,
    require,
)
from thunderagent.routing.policy import (
    POLICIES,
    PolicyHooks,
    RouteQuery,
    RoutingFeedback,
    WorkerView,
)
from thunderagent.schemas import Candidate

_P = "thunder"
_ID = operator.attrgetter("worker_id")


@POLICIES.register("thunder")
@dataclass
class Thunder(PolicyHooks):
    name: ClassVar[str] = _P

    temperature: float = 0.0
    """Deterministic best by default: the cost is already load-aware, so noise only loses hits."""
    prefill_s_per_token: float = PREFILL_S_PER_TOKEN
    """Llama-3.1-8B on H100 (~20k prompt tokens/s); only its ratio to the decode terms matters."""
    host_credit: float = 0.7
    """A block held only in host memory saves 70% of its recompute: the PCIe copy back is
    cheaper than prefill but not free."""
    load_scale: float = 8.0
    """Outstanding requests above the least loaded worker that shrink a hit's credit to 1/e:
    about one decode batch's worth of queueing, where a hot prefix starts to cost more in waiting
    than it saves in prefill. Tuned online by ``observe``."""
    decode_s_per_kv_token: float = DECODE_S_PER_KV_TOKEN
    """Decode step time per KV token held by the batch (bandwidth-bound: Llama-8B, H100)."""
    decode_s_per_seq: float = 3e-5
    """Decode step time per sequence in the batch (~16 GFLOP per token at ~50% of H100 peak)."""
    decode_weight: float = 0.1
    """Weight of the request's predicted decode time against its TTFT. The router mainly
    controls TTFT (prefill saved by a hit, prefill queued ahead); a worker's decode batch is
    transient and the credit decay already spreads it, so at full weight a few hundred output
    tokens at a slightly heavier batch would outvote every cache hit (measured on the
    Mooncake traces). A tenth keeps it a tie-breaker between similar TTFTs."""
    prior_prefill_tokens: float = 1024.0
    """Uncached prompt length assumed for each queued request before any has been routed."""
    mean_alpha: float = 0.05
    """EMA weight of the uncached prompt lengths routed: ~20 requests of memory."""
    pressure_threshold: float = 0.9
    """KV use above 90%: a new prompt's blocks will evict cached prefixes (the engine keeps a
    few percent free for decode growth, so evictions start near here)."""
    pressure_penalty_s: float = 1.0
    """Penalty at 100% KV use, linear from the threshold: about a long prompt's TTFT, so a full
    worker is avoided unless the others are that much worse."""
    tuner: OnlineTuner | Mapping[str, float] = field(default_factory=OnlineTuner)
    """Online tuning of ``load_scale``; a mapping (from YAML) is turned into an OnlineTuner."""

    _uncached: RunningMean = field(init=False, repr=False)

    def __post_init__(self) -> None:
        finite_at_least(_P, "temperature", self.temperature, 0.0)
        finite_positive(_P, "prefill_s_per_token", self.prefill_s_per_token)
        in_unit_interval(_P, "host_credit", self.host_credit)
        finite_positive(_P, "load_scale", self.load_scale)
        finite_at_least(_P, "decode_s_per_kv_token", self.decode_s_per_kv_token, 0.0)
        finite_at_least(_P, "decode_s_per_seq", self.decode_s_per_seq, 0.0)
        finite_at_least(_P, "decode_weight", self.decode_weight, 0.0)
        finite_at_least(_P, "prior_prefill_tokens", self.prior_prefill_tokens, 0.0)
        require(_P, "mean_alpha", self.mean_alpha, 0 < self.mean_alpha <= 1, "must lie in (0, 1]")
        ok = 0 <= self.pressure_threshold < 1
        require(_P, "pressure_threshold", self.pressure_threshold, ok, "must lie in [0, 1)")
        finite_at_least(_P, "pressure_penalty_s", self.pressure_penalty_s, 0.0)
        if isinstance(self.tuner, Mapping):
            self.tuner = OnlineTuner(**self.tuner)
        self._uncached = RunningMean(self.mean_alpha, prior=self.prior_prefill_tokens)

    def cost(self, query: RouteQuery, w: WorkerView, min_outstanding: int) -> float:
        """Predicted seconds until ``query`` would finish on ``w``."""
        gpu, host_only = cached_blocks(query, w.worker_id)
        decay = math.exp(-(w.outstanding - min_outstanding) / self.load_scale)
        credit = (gpu + self.host_credit * host_only) * query.block_size * decay
        own = max(0.0, query.prompt_tokens - credit)
        ahead = queued_prefill_tokens(w, self._uncached.get())
        step = self.decode_s_per_kv_token * w.active_tokens + self.decode_s_per_seq * w.outstanding
        # Pressure from KV that running requests hold, not from the cache: a warm worker's
        # pool is always "full" of evictable blocks.
        capacity = w.kv_total_blocks * query.block_size
        used = (w.active_tokens + query.prompt_tokens) / capacity if capacity > 0 else 0.0
        over = max(0.0, min(used, 1.0) - self.pressure_threshold) / (1 - self.pressure_threshold)
        return (
            self.prefill_s_per_token * (own + ahead)
            + self.decode_weight * query.expected_output_tokens * step
            + self.pressure_penalty_s * over
        )

    def rank(
        self, query: RouteQuery, workers: Sequence[WorkerView], rng: random.Random
    ) -> list[Candidate]:
        least = min(w.outstanding for w in workers)
        _more_free = lambda w: -float(w.free_blocks)  # noqa: E731
        cost = {w.worker_id: self.cost(query, w, least) for w in workers}
        hit = any(query.overlaps.get(i, 0) or query.host_overlaps.get(i, 0) for i in cost)
        if hit or len(workers) < 2:
            ordered = rank_by_cost(workers, cost, _ID, self.temperature, rng, secondary=_more_free)
        else:  # no hit anywhere: power of two choices, the less costly (then freer) of two
            a, b = rng.sample(range(len(workers)), 2)
            key = lambda w: (cost[w.worker_id], _more_free(w))  # noqa: E731
            first = by_key([workers[a], workers[b]], key, rng)[0]
            rest = [w for w in workers if w.worker_id != first.worker_id]
            ordered = [first, *by_key(rest, key, rng)]
        return candidates(ordered, cost, query)

    def on_dispatched(self, query: RouteQuery, worker_id: str) -> None:
        cached = min(query.overlaps.get(worker_id, 0), query.prompt_blocks) * query.block_size
        self._uncached.add(max(0, query.prompt_tokens - cached))

    def observe(self, feedback: RoutingFeedback) -> None:
        """Online tuning (DESIGN point 4): one bounded step of ``load_scale`` per window."""
        assert isinstance(self.tuner, OnlineTuner)
        self.load_scale = self.tuner.update(self.load_scale, feedback)
