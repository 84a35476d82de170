"""Shared helpers for the routing policies: parameter checks, cost ordering, softmax picks,
running means and the online tuner. Pure: no I/O, no clock; randomness only through ``rng``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Container, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from thunderagent.routing.policy import RouteQuery, RoutingFeedback, WorkerView
from thunderagent.schemas import Candidate

T = TypeVar("T")

PREFILL_S_PER_TOKEN = 5e-5
"""Llama-3.1-8B on one H100: ~2 * 8e9 FLOP per prompt token at ~32% of 989 TFLOP/s dense BF16
(attention included), i.e. ~20k prompt tokens/s."""

DECODE_S_PER_KV_TOKEN = 4e-8
"""Llama-3.1-8B: 128 KiB of KV per token (32 layers x 8 KV heads x 128 x K,V x 2 B) read once per
decode step at ~3.3 TB/s of HBM bandwidth."""


def prefill_s_per_token(params: float, gpu_flops: float, mfu: float) -> float:
    """Seconds to prefill one token: ``2 * params`` FLOP at ``mfu`` of ``gpu_flops`` FLOP/s."""
    return 2.0 * params / (gpu_flops * mfu)


class ParamError(ValueError):
    """A policy parameter is out of range; names the policy, field, value and reason."""

    def __init__(self, policy: str, field: str, value: Any, reason: str) -> None:
        super().__init__(f"{policy}.{field}={value!r}: {reason}")
        self.policy = policy
        self.field = field
        self.value = value
        self.reason = reason


def require(policy: str, field: str, value: Any, ok: bool, reason: str) -> None:
    if not ok:
        raise ParamError(policy, field, value, reason)


def finite_at_least(policy: str, field: str, value: float, low: float) -> None:
    ok = isinstance(value, int | float) and math.isfinite(value) and value >= low
    require(policy, field, value, ok, f"must be a finite number >= {low}")


def finite_positive(policy: str, field: str, value: float) -> None:
    ok = isinstance(value, int | float) and math.isfinite(value) and value > 0
    require(policy, field, value, ok, "must be a finite number > 0")


def in_unit_interval(policy: str, field: str, value: float) -> None:
    ok = isinstance(value, int | float) and 0.0 <= value <= 1.0
    require(policy, field, value, ok, "must lie in [0, 1]")


def by_key(
    items: Sequence[T], key: Callable[[T], tuple[float, ...]], rng: random.Random
) -> list[T]:
    """``items`` sorted by ``key``; exact ties in random order (one draw per item, in order)."""
    draws = [rng.random() for _ in items]
    keys = [(*key(item), draw) for item, draw in zip(items, draws, strict=True)]
    order = sorted(range(len(items)), key=keys.__getitem__)
    return [items[i] for i in order]


def softmax_index(costs: Sequence[float], temperature: float, rng: random.Random) -> int:
    """Sample an index with probability ~ exp(-normalized cost / temperature).

    Costs are min-max normalized first (the best is 0, the worst 1), so ``temperature`` means the
    same whatever the costs' unit; all-equal costs sample uniformly. Lower cost, higher chance.
    """
    lo, hi = min(costs), max(costs)
    if hi == lo:
        weights = [1.0] * len(costs)
    else:
        weights = [math.exp(-(c - lo) / ((hi - lo) * temperature)) for c in costs]
    point = rng.random() * sum(weights)
    for i, weight in enumerate(weights):
        point -= weight
        if point < 0:
            return i
    return len(costs) - 1


def rank_by_cost(
    items: Sequence[T],
    cost: Mapping[Hashable, float],
    ident: Callable[[T], Hashable],
    temperature: float,
    rng: random.Random,
    secondary: Callable[[T], float] = lambda _: 0.0,
) -> list[T]:
    """Lowest cost first (``secondary``, then random, breaks ties); with ``temperature`` > 0 the
    first is sampled by ``softmax_index`` and the rest follow by cost."""
    if temperature > 0:
        k = softmax_index([cost[ident(i)] for i in items], temperature, rng)
        rest = [*items[:k], *items[k + 1 :]]
        return [items[k], *by_key(rest, lambda i: (cost[ident(i)], secondary(i)), rng)]
    return by_key(items, lambda i: (cost[ident(i)], secondary(i)), rng)


@dataclass(slots=True)
class RunningMean:
    """Exponentially weighted mean; ``value`` is ``prior`` until the first sample arrives."""

    alpha: float
    prior: float = 0.0
    value: float | None = None

    def add(self, sample: float) -> None:
        self.value = (
            sample if self.value is None else self.value + self.alpha * (sample - self.value)
        )

    def get(self) -> float:
        return self.prior if self.value is None else self.value


@dataclass(kw_only=True)
class OnlineTuner:
    """Nudges thunder's ``load_scale`` from measured queue-depth imbalance and false hits.

    Imbalance = (max depth - min depth) / (3 sqrt(mean depth) + 1): the spread relative to what
    random arrivals alone produce (Poisson: a standard deviation of sqrt(mean), a few workers span
    about three), so ordinary noise does not read as a hot spot; the ``+ 1`` covers idle fleets.
    Above ``high_imbalance`` the scale shrinks (the cache credit decays faster, so load spreads);
    below ``low_imbalance`` with few false hits it grows (the cache is trusted more). Every step
    is one bounded multiplicative move, clamped to the range.
    """

    step: float = 0.1
    """Fractional change per observation: ten steps move the scale ~2.6x, slow enough that one
    noisy window cannot swing routing, fast enough to follow load shifts within a minute."""
    high_imbalance: float = 1.5
    """Spread half again beyond chance: hot spots are forming; spread load."""
    low_imbalance: float = 0.75
    """Spread within chance: queues are as even as random arrivals allow; trust the cache more."""
    max_false_hit_rate: float = 0.05
    """Only grow while under 5% of predicted hits are false (a stale index should not attract)."""
    min_scale: float = 1.0
    """One outstanding request must never wipe out more than ~63% of a hit's credit."""
    max_scale: float = 64.0
    """Beyond ~64 outstanding requests per unit of decay the credit no longer decays in practice."""

    def __post_init__(self) -> None:
        p = "thunder.tuner"
        require(p, "step", self.step, 0 < self.step < 1, "must lie in (0, 1)")
        finite_at_least(p, "low_imbalance", self.low_imbalance, 0.0)
        require(
            p,
            "high_imbalance",
            self.high_imbalance,
            math.isfinite(self.high_imbalance) and self.high_imbalance > self.low_imbalance,
            "must be finite and > low_imbalance",
        )
        in_unit_interval(p, "max_false_hit_rate", self.max_false_hit_rate)
        finite_positive(p, "min_scale", self.min_scale)
        require(
            p,
            "max_scale",
            self.max_scale,
            math.isfinite(self.max_scale) and self.max_scale >= self.min_scale,
            "must be finite and >= min_scale",
        )

    def update(self, scale: float, feedback: RoutingFeedback) -> float:
        depths = list(feedback.queue_depths.values())
        if not depths:
            return scale
        mean = sum(depths) / len(depths)
        # Spread beyond chance: with random arrivals each depth varies by about sqrt(mean), and
        # a handful of workers spans about three of those; only more than that is a hot spot.
        imbalance = (max(depths) - min(depths)) / (3.0 * math.sqrt(mean) + 1.0)
        if imbalance > self.high_imbalance:
            scale *= 1.0 - self.step
        elif imbalance < self.low_imbalance and feedback.false_hit_rate < self.max_false_hit_rate:
            scale *= 1.0 + self.step
        return min(max(scale, self.min_scale), self.max_scale)


# ---- pieces every cost-based policy computes the same way ---------------------------------
def leading_blocks(held: Container[int] | None, block_hashes: Sequence[int]) -> int:
    """How many of ``block_hashes``, from the first on, ``held`` contains (a policy's own
    approximate tree of what it routed where)."""
    n = 0
    if held:
        for h in block_hashes:
            if h not in held:
                break
            n += 1
    return n


def cached_blocks(query: RouteQuery, worker_id: str) -> tuple[int, int]:
    """(blocks on the worker's GPU, further blocks only in its host tier) of the prompt."""
    gpu = min(query.overlaps.get(worker_id, 0), query.prompt_blocks)
    any_tier = min(query.host_overlaps.get(worker_id, 0), query.prompt_blocks)
    return gpu, max(0, any_tier - gpu)


def queued_prefill_tokens(w: WorkerView, mean_uncached_tokens: float) -> float:
    """Prefill work ahead of a new request on ``w``: the backlog the worker reports (the
    engine's, or the adapter's count of accepted prompts without a first token), less the
    prompts in it that have started since, plus what was routed since; without a report, its
    queue length times the mean uncached prompt."""
    if w.prefill_tokens >= 0:
        since = w.pending_prefill_tokens
        reported = max(0, w.prefill_tokens - w.prefill_started_tokens)
        return reported + (since if since >= 0 else w.pending * mean_uncached_tokens)
    return (w.queued + w.pending) * mean_uncached_tokens


def candidates(
    ordered: Sequence[WorkerView], cost: Mapping[str, float], query: RouteQuery
) -> list[Candidate]:
    """Ranked candidates, score = -cost, with the prefix each one holds."""
    return [
        Candidate(
            worker_id=w.worker_id,
            score=-cost[w.worker_id],
            overlap_blocks=query.overlaps.get(w.worker_id, 0),
        )
        for w in ordered
    ]
