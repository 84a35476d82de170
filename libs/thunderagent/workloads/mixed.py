"""Open-loop short/long mix: Poisson arrivals, a share of long requests, optional shared
prefixes (for the grouping benchmark). ``requests()`` returns every request, sorted by
``issue_at``; the driver submits each at its time whatever happens to the others.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from thunderagent.workloads.common import WorkRequest, noisy

PREFIX_BASE = 1 << 41
"""Shared-prefix block ids live above this (never collide with unique content)."""


@dataclass(slots=True, frozen=True, kw_only=True)
class MixedParams:
    requests: int = 1000
    rate_per_s: float = 20.0
    long_fraction: float = 0.2
    block_size: int = 16
    short_prompt_blocks: tuple[int, int] = (4, 32)
    short_output_tokens: tuple[int, int] = (16, 128)
    long_prompt_blocks: tuple[int, int] = (256, 1024)
    long_output_tokens: tuple[int, int] = (512, 2048)
    short_priority: int = 0
    long_priority: int = 1
    shared_prefix_fraction: float = 0.0
    """Share of requests that start with one of ``shared_prefixes`` common prefixes."""
    shared_prefixes: int = 4
    shared_prefix_blocks: int = 64
    estimate_noise: float = 0.0
    deadline_s: float | None = None
    """Short requests get ``issue_at + deadline_s`` as deadline (None: no deadlines)."""


@dataclass(slots=True)
class MixedWorkload:
    params: MixedParams
    seed: int = 0

    def requests(self) -> list[WorkRequest]:
        p, rng = self.params, random.Random(self.seed)
        t, next_block, out = 0.0, 0, []
        for i in range(p.requests):
            t += rng.expovariate(p.rate_per_s)
            long = rng.random() < p.long_fraction
            lo_hi = p.long_prompt_blocks if long else p.short_prompt_blocks
            n = rng.randint(*lo_hi)
            blocks: list[int] = []
            if rng.random() < p.shared_prefix_fraction:
                k = rng.randrange(p.shared_prefixes)
                base = PREFIX_BASE + k * p.shared_prefix_blocks
                blocks = list(range(base, base + p.shared_prefix_blocks))
            blocks.extend(range(next_block, next_block + n))
            next_block += n
            output = rng.randint(*(p.long_output_tokens if long else p.short_output_tokens))
            deadline = None if long or p.deadline_s is None else t + p.deadline_s
            out.append(
                WorkRequest(
                    request_id=f"{'long' if long else 'short'}-{i}",
                    issue_at=t,
                    blocks=tuple(blocks),
                    block_size=p.block_size,
                    output_tokens=output,
                    expected_output_tokens=noisy(rng, output, p.estimate_noise),
                    priority=p.long_priority if long else p.short_priority,
                    deadline=deadline,
                )
            )
        return out
