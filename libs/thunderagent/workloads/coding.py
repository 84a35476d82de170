"""Coding-assistant sessions: many chats over a few shared repository contexts.

* Repositories: ``repos`` contexts of ``repo_tokens_min``-``repo_tokens_max`` tokens (uniform,
  whole blocks: files packed into the prompt), chosen by a Zipf law (exponent
  ``repo_popularity``): a few repositories carry most sessions.
* Sessions start at ``session_rate_per_s`` (Poisson), each on one repository: the first prompt is
  the repository's context and a message; each next turn extends the previous prompt by its
  answer and a new message, and arrives after the previous turn's idle-system service time plus
  a think time (``think_min_s`` + exponential, mean ``think_mean_s``). Turns per session: 1 +
  exponential (mean ``turns_mean`` in all); a session ends at ``max_context_tokens``.

Every session on a repository shares its context's blocks, so sessions that open on one
repository within seconds of each other ask for the same long prefix while a worker may still be
prefilling it (docs/benchmarks.md, stop 67: the held-out shapes).
"""

from __future__ import annotations

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
    start_prompt,
    zipf_cum_weights,
)


@dataclass(slots=True, frozen=True, kw_only=True)
class CodingParams:
    duration_s: float = 900.0
    session_rate_per_s: float = 0.25
    repos: int = 60
    repo_popularity: float = 1.1
    repo_tokens_min: int = 16384
    repo_tokens_max: int = 65536
    turns_mean: float = 8.0
    message_tokens_median: float = 400.0
    message_tokens_sigma: float = 0.9
    output_tokens_median: float = 300.0
    output_tokens_sigma: float = 0.8
    output_tokens_max: int = 4096
    think_mean_s: float = 20.0
    think_min_s: float = 5.0
    max_context_tokens: int = 131072
    est_prefill_tokens_per_s: float = 20000.0
    est_s_per_output_token: float = 0.025
    block_size: int = 512

    def scaled(self, scale: float) -> CodingParams:
        """``scale`` times as long, same rates."""
        return replace(self, duration_s=self.duration_s * scale)


def coding_trace(p: CodingParams, seed: int) -> GeneratedTrace:
    """Sessions started over ``duration_s``, every turn in arrival order."""
    rng, ids, bs = random.Random(seed), BlockIds(), p.block_size
    lo, hi = max(1, p.repo_tokens_min // bs), max(1, p.repo_tokens_max // bs)
    repos = [start_prompt(rng.randint(lo, hi) * bs, ids, bs) for _ in range(p.repos)]
    popularity = zipf_cum_weights(p.repos, p.repo_popularity)
    rows: list[TraceRow] = []
    sessions = 0
    t = rng.expovariate(p.session_rate_per_s)
    while t < p.duration_s:
        repo = rng.choices(repos, cum_weights=popularity)[0]
        rows.extend(_session(p, rng, ids, repo, t))
        sessions += 1
        t += rng.expovariate(p.session_rate_per_s)
    in_order(rows)
    return GeneratedTrace(rows, {"sessions": sessions, "repo_blocks": [len(r.full) for r in repos]})


def _session(
    p: CodingParams, rng: random.Random, ids: BlockIds, repo: Prompt, at: float
) -> list[TraceRow]:
    bs = p.block_size
    more = p.turns_mean - 1.0
    turns = 1 + (int(rng.expovariate(1.0 / more)) if more > 0 else 0)
    return chat_rows(
        p, rng, ids, repo.extend(_message(p, rng), ids, bs), 0, at, turns,
        think=lambda: p.think_min_s + rng.expovariate(1.0 / p.think_mean_s),
        message=lambda: _message(p, rng),
    )  # fmt: skip


def _message(p: CodingParams, rng: random.Random) -> int:
    return lognormal(rng, p.message_tokens_median, p.message_tokens_sigma, 1, 16384)
