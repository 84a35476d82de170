"""A hot spot: background conversations, then a sudden hot prefix for a while, then back.

* Background: chat sessions start at ``session_rate_per_s``; every session starts with a shared
  system prompt, then a first message (log-normal), then a log-normal number of turns; turn k+1's
  prompt extends turn k's with its answer and a new user message (modest reuse). A next turn
  arrives after the previous one's estimated service time (idle system, see
  ``thunderagent.workloads.mooncake.est_service``) plus a log-normal think time.
* Hot window ``[hot_start_s, hot_start_s + hot_duration_s)``: ``hot_clients`` clients start
  within ``hot_ramp_s`` of the start and each sends queries, exponential ``hot_think_s`` apart,
  until the window ends. Every query is the hot prefix (``hot_prefix_tokens`` of one long
  document or system prompt, no block shared with the background) plus a short unique
  question. Hot rows carry ``hot: true``; the first ``hot_prefix_tokens // block_size`` ids of
  every hot row are the same.
* Lead-in (``hot_lead_s`` > 0): before the window, one client already queries the hot prefix,
  exponential ``hot_lead_gap_s`` apart, so some worker holds it when the crowd arrives (a
  document that was read now and then before everyone wanted it). 0: the prefix is new when
  the window opens, and the window's first requests must prefill it cold. Lead-in rows are not
  ``hot``.
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
    chat_rows,
    in_order,
    lognormal,
    make_row,
    start_prompt,
)


@dataclass(slots=True, frozen=True, kw_only=True)
class HotspotParams:
    duration_s: float = 600.0
    system_prompt_tokens: int = 1024
    session_rate_per_s: float = 1.0
    turns_median: float = 2.0
    turns_sigma: float = 0.8
    turns_max: int = 30
    first_message_tokens_median: float = 2500.0
    first_message_tokens_sigma: float = 1.0
    message_tokens_median: float = 300.0
    message_tokens_sigma: float = 1.0
    output_tokens_median: float = 250.0
    output_tokens_sigma: float = 0.8
    output_tokens_max: int = 4096
    think_median_s: float = 20.0
    think_sigma: float = 0.8
    max_context_tokens: int = 32768
    hot_start_s: float = 240.0
    hot_duration_s: float = 120.0
    hot_prefix_tokens: int = 16384
    hot_clients: int = 100
    hot_ramp_s: float = 5.0
    hot_think_s: float = 12.0
    """Mean gap between one client's hot queries (exponential)."""
    hot_lead_s: float = 0.0
    """How long before the window the hot prefix is already being queried (0: not at all)."""
    hot_lead_gap_s: float = 10.0
    """Mean gap between the lead-in's queries (exponential)."""
    hot_question_tokens_median: float = 80.0
    hot_question_tokens_sigma: float = 0.7
    hot_output_tokens_median: float = 300.0
    est_prefill_tokens_per_s: float = 20000.0
    est_s_per_output_token: float = 0.025
    block_size: int = 512

    def scaled(self, scale: float) -> HotspotParams:
        """Every time ``scale`` times as long (the hot window keeps its place), same rates."""
        return replace(
            self,
            duration_s=self.duration_s * scale,
            hot_start_s=self.hot_start_s * scale,
            hot_duration_s=self.hot_duration_s * scale,
        )


def hotspot_trace(p: HotspotParams, seed: int) -> GeneratedTrace:
    """Background sessions over ``duration_s`` plus the hot window, in arrival order."""
    rng, ids = random.Random(seed), BlockIds()
    system = start_prompt(p.system_prompt_tokens, ids, p.block_size)
    rows: list[TraceRow] = []
    t = 0.0
    while t < p.duration_s:
        rows.extend(_session(p, rng, ids, system, t))
        t += rng.expovariate(p.session_rate_per_s)
    hot = start_prompt(p.hot_prefix_tokens, ids, p.block_size)
    rows.extend(_hot(p, rng, ids, hot))
    rows.extend(_lead_in(p, rng, ids, hot))
    shift_s = in_order(rows) / 1000.0
    meta = {
        "hot_start_s": p.hot_start_s - shift_s,
        "hot_end_s": p.hot_start_s + p.hot_duration_s - shift_s,
        "hot_prefix_blocks": len(hot.full),
        "hot_requests": sum(r.hot for r in rows),
    }
    return GeneratedTrace(rows, meta)


def _session(
    p: HotspotParams, rng: random.Random, ids: BlockIds, system: Prompt, at: float
) -> list[TraceRow]:
    bs = p.block_size
    turns = lognormal(rng, p.turns_median, p.turns_sigma, 1, p.turns_max)
    first = lognormal(
        rng, p.first_message_tokens_median, p.first_message_tokens_sigma, 1, p.max_context_tokens
    )
    return chat_rows(
        p, rng, ids, system.extend(first, ids, bs), len(system.full) * bs, at, turns,
        think=lambda: p.think_median_s * math.exp(p.think_sigma * rng.gauss(0.0, 1.0)),
        message=lambda: lognormal(rng, p.message_tokens_median, p.message_tokens_sigma, 1, 8192),
    )  # fmt: skip


def _hot(p: HotspotParams, rng: random.Random, ids: BlockIds, hot: Prompt) -> list[TraceRow]:
    end, out = p.hot_start_s + p.hot_duration_s, []
    for _ in range(p.hot_clients):
        t = p.hot_start_s + rng.uniform(0.0, p.hot_ramp_s)
        while t < end:
            q = lognormal(rng, p.hot_question_tokens_median, p.hot_question_tokens_sigma, 1, 2048)
            answer = lognormal(
                rng, p.hot_output_tokens_median, p.output_tokens_sigma, 1, p.output_tokens_max
            )
            prompt = hot.extend(q, ids, p.block_size)
            out.append(make_row(t, prompt, answer, ids, p.block_size, hot=True))
            t += rng.expovariate(1.0 / p.hot_think_s)
    return out


def _lead_in(p: HotspotParams, rng: random.Random, ids: BlockIds, hot: Prompt) -> list[TraceRow]:
    """One client's queries of the hot prefix over ``[hot_start_s - hot_lead_s, hot_start_s)``
    (drawn after the window's, so a trace without a lead-in is unchanged by the option)."""
    out: list[TraceRow] = []
    t = p.hot_start_s - p.hot_lead_s
    while p.hot_lead_s > 0 and t < p.hot_start_s:
        q = lognormal(rng, p.hot_question_tokens_median, p.hot_question_tokens_sigma, 1, 2048)
        answer = lognormal(
            rng, p.hot_output_tokens_median, p.output_tokens_sigma, 1, p.output_tokens_max
        )
        out.append(make_row(t, hot.extend(q, ids, p.block_size), answer, ids, p.block_size))
        t += rng.expovariate(1.0 / p.hot_lead_gap_s)
    return out
