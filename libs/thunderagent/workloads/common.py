"""What every generator produces: one request, with its prompt as block ids."""

from __future__ import annotations

import random
from dataclasses import dataclass

TOKEN_SPACE = 30000
"""Token ids stay below this (fits the small simulated tokenizers' vocabularies)."""


@dataclass(slots=True, frozen=True, kw_only=True)
class WorkRequest:
    request_id: str
    issue_at: float
    """When the client sends it (driver's virtual clock)."""
    blocks: tuple[int, ...]
    """Prompt content, one id per full block; equal prefixes of ids are equal prefixes."""
    block_size: int
    output_tokens: int
    """Tokens the engine must generate (the simulated engine stops there)."""
    expected_output_tokens: int
    """What the scheduler is told to expect (a noisy estimate of ``output_tokens``)."""
    priority: int = 0
    program_id: str | None = None
    step: int = 0
    last_step: bool = True
    """Closed loop: the program's final step (the driver then releases the program)."""
    deadline: float | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.blocks) * self.block_size


def block_tokens(block_id: int, block_size: int) -> list[int]:
    """Deterministic token ids for one block id (same id, same tokens)."""
    rng = random.Random(block_id)
    return [rng.randrange(TOKEN_SPACE) for _ in range(block_size)]


def request_tokens(req: WorkRequest) -> list[int]:
    return [t for b in req.blocks for t in block_tokens(b, req.block_size)]


def noisy(rng: random.Random, value: int, noise: float) -> int:
    """``value`` times a log-uniform factor in [1/(1+noise), 1+noise] (a predictor's error)."""
    if noise <= 0:
        return value
    lo, hi = 1 / (1 + noise), 1 + noise
    return max(1, round(value * lo * (hi / lo) ** rng.random()))
