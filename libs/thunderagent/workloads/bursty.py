"""Bursty open-loop traffic: a compound Poisson process over a Poisson background.

* Background: single requests at ``background_rate_per_s``; a shared system prompt, then a
  unique prompt whose length is Pareto (heavy tailed), capped at the max context.
* Bursts: start at ``burst_rate_per_s``; each holds a log-normal number of requests arriving
  uniformly within ``burst_spread_s`` (a batch job, a fan-out, a page of users at once). A burst's
  requests come in groups: each group shares one long document (log-normal length, capped), and
  each member adds its own question. With probability ``doc_reuse`` a group's document is one an
  earlier group used (chosen uniformly among the last ``doc_pool`` documents), so some bursts find
  their prefix cached and most must compute it: what prefix grouping and admission act on.
* Outputs are log-normal (chat-like: median ~200 tokens, long tail), capped.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

from thunderagent.workloads.mooncake import (
    BlockIds,
    GeneratedTrace,
    Prompt,
    TraceRow,
    in_order,
    lognormal,
    make_row,
    start_prompt,
)


@dataclass(slots=True, frozen=True, kw_only=True)
class BurstyParams:
    duration_s: float = 600.0
    system_prompt_tokens: int = 1024
    background_rate_per_s: float = 1.0
    background_tokens_min: float = 800.0
    """Pareto scale x_m of background prompt lengths (after the system prompt)."""
    background_tokens_alpha: float = 1.3
    """Pareto shape: 1.3 gives a mean ~4x the minimum and a heavy tail (capped)."""
    burst_rate_per_s: float = 1 / 30
    burst_size_median: float = 60.0
    burst_size_sigma: float = 0.6
    burst_size_max: int = 400
    burst_spread_s: float = 1.0
    group_size_mean: float = 8.0
    """Requests sharing one document within a burst (geometric, mean this)."""
    doc_tokens_median: float = 6000.0
    doc_tokens_sigma: float = 0.9
    doc_reuse: float = 0.2
    doc_pool: int = 50
    question_tokens_median: float = 200.0
    question_tokens_sigma: float = 0.8
    output_tokens_median: float = 200.0
    output_tokens_sigma: float = 0.9
    output_tokens_max: int = 4096
    max_context_tokens: int = 32768
    block_size: int = 512

    def scaled(self, scale: float) -> BurstyParams:
        """``scale`` times as long at the same rates."""
        return replace(self, duration_s=self.duration_s * scale)


def bursty_trace(p: BurstyParams, seed: int) -> GeneratedTrace:
    """Background and bursts over ``duration_s``, in arrival order."""
    rng, ids = random.Random(seed), BlockIds()
    system = start_prompt(p.system_prompt_tokens, ids, p.block_size)
    rows = _background(p, rng, ids, system)
    docs: list[Prompt] = []
    t, bursts = rng.expovariate(p.burst_rate_per_s), 0
    while t < p.duration_s:
        rows.extend(_burst(p, rng, ids, system, docs, t))
        bursts += 1
        t += rng.expovariate(p.burst_rate_per_s)
    in_order(rows)
    return GeneratedTrace(rows, {"bursts": bursts})


def _background(p: BurstyParams, rng: random.Random, ids: BlockIds, system: Prompt) -> list:
    rows, t = [], 0.0
    room = p.max_context_tokens - system.tokens - p.output_tokens_max
    while t < p.duration_s:
        n = min(room, round(p.background_tokens_min * rng.paretovariate(p.background_tokens_alpha)))
        rows.append(_row(p, rng, ids, t, system.extend(n, ids, p.block_size)))
        t += rng.expovariate(p.background_rate_per_s)
    return rows


def _burst(
    p: BurstyParams,
    rng: random.Random,
    ids: BlockIds,
    system: Prompt,
    docs: list[Prompt],
    start: float,
) -> list[TraceRow]:
    size = lognormal(rng, p.burst_size_median, p.burst_size_sigma, 1, p.burst_size_max)
    room = p.max_context_tokens - system.tokens - p.output_tokens_max
    rows: list[TraceRow] = []
    while len(rows) < size:
        doc = _document(p, rng, ids, system, docs, room)
        members = min(size - len(rows), _geometric(rng, p.group_size_mean))
        for _ in range(members):
            q = lognormal(rng, p.question_tokens_median, p.question_tokens_sigma, 1, 4096)
            q = min(q, p.max_context_tokens - p.output_tokens_max - doc.tokens)
            at = start + rng.uniform(0.0, p.burst_spread_s)
            rows.append(_row(p, rng, ids, at, doc.extend(max(1, q), ids, p.block_size)))
    return rows


def _document(
    p: BurstyParams, rng: random.Random, ids: BlockIds, system: Prompt, docs: list, room: int
) -> Prompt:
    """An earlier document (``doc_reuse``) or a new one, remembered in a bounded pool."""
    if docs and rng.random() < p.doc_reuse:
        return rng.choice(docs)
    n = lognormal(rng, p.doc_tokens_median, p.doc_tokens_sigma, p.block_size, room - 256)
    doc = system.extend(n, ids, p.block_size)
    docs.append(doc)
    del docs[: -p.doc_pool]
    return doc


def _geometric(rng: random.Random, mean: float) -> int:
    """A geometric draw on 1, 2, ... with the given mean."""
    if mean <= 1.0:
        return 1
    u = 1.0 - rng.random()
    return 1 + int(math.log(u) / math.log(1.0 - 1.0 / mean))


def _row(p: BurstyParams, rng: random.Random, ids: BlockIds, at: float, prompt: Prompt) -> TraceRow:
    out = lognormal(rng, p.output_tokens_median, p.output_tokens_sigma, 1, p.output_tokens_max)
    return make_row(at, prompt, out, ids, p.block_size)
