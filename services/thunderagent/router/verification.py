"""Lazy verification: compare the cache hit the router predicted with what the engine reported.

The router remembers, for a bounded number of recent requests it routed, the worker and block
hashes. When the final reply comes back (every adapter publishes a copy on the completions
subject) a *false hit* (the engine had fewer blocks than predicted) removes the blocks that were
not there from the local index, so the next request is not misrouted the same way; a *missed
hit* (more cached than predicted) is only counted: the KV events will teach the index.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(slots=True)
class Routed:
    worker_id: str
    hashes: list[int]
    predicted_blocks: int
    block_size: int
    best_blocks: int = 0
    """Longest prefix any worker held when the request was routed."""
    model: str = ""


@dataclass(slots=True)
class Verdict:
    false_hit: bool
    missed_hit: bool
    stale_hashes: list[int]
    worker_id: str
    predicted_tokens: int
    actual_tokens: int
    recomputed_tokens: int
    """Prompt tokens prefilled although some worker had them cached at routing time."""
    model: str = ""


@dataclass
class Verifier:
    capacity: int = 50_000
    """Outstanding requests remembered; older ones are forgotten (counted as unverified)."""
    _routed: OrderedDict[str, Routed] = field(default_factory=OrderedDict)
    unverified: int = 0

    def remember(self, request_id: str, routed: Routed) -> None:
        self._routed[request_id] = routed
        if len(self._routed) > self.capacity:
            self._routed.popitem(last=False)
            self.unverified += 1

    def verify(self, request_id: str, worker_id: str, cached_tokens: int) -> Verdict | None:
        routed = self._routed.pop(request_id, None)
        if routed is None or routed.worker_id != worker_id:
            return None  # another replica routed it, or the scheduler spilled it elsewhere
        actual_blocks = cached_tokens // routed.block_size
        predicted = routed.predicted_blocks
        stale = routed.hashes[actual_blocks:predicted] if actual_blocks < predicted else []
        return Verdict(
            false_hit=actual_blocks < predicted,
            missed_hit=actual_blocks > predicted,
            stale_hashes=stale,
            worker_id=worker_id,
            predicted_tokens=predicted * routed.block_size,
            actual_tokens=cached_tokens,
            recomputed_tokens=max(0, routed.best_blocks * routed.block_size - cached_tokens),
            model=routed.model,
        )
