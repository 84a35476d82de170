"""Lazy verification: compare the cache hit the router predicted with what the engine reported.

The router remembers, for a bounded number of recent dispatches, the worker and what it
predicted. When the run finishes, a *false hit* (the engine had fewer blocks than predicted) or
a *missed hit* (more) is counted: the metrics and the tuner's false-hit rate read them.

Neither changes the index. A run that found predicted blocks missing prefilled them, and its
engine cached them: when it finishes, its worker holds them, and the KV events have said so. An
index that dropped them then (as this once did) hid what the engine held, and since removing a
block hides every prefix under it, a false hit on a shared first block hid the worker's whole
cache from the router. Such false hits are not rare: requests that arrive together and share a
prefix are predicted to hit what the first of them is about to compute, and an engine batches
them into one prefill (docs/benchmarks.md, "A false hit hid a worker's cache").
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(slots=True)
class Dispatch:
    """What the router predicted for one dispatched run."""

    worker_id: str
    predicted_blocks: int
    block_size: int
    best_blocks: int = 0
    """Longest prefix any worker held when the request was routed."""
    model: str = ""


@dataclass(slots=True)
class Verdict:
    false_hit: bool
    missed_hit: bool
    worker_id: str
    predicted_tokens: int
    actual_tokens: int
    recomputed_tokens: int
    """Prompt tokens prefilled although some worker had them cached at routing time."""
    model: str = ""


@dataclass
class Verifier:
    capacity: int = 50_000
    """Outstanding runs remembered; older ones are forgotten (counted as unverified)."""
    _dispatched: OrderedDict[str, Dispatch] = field(default_factory=OrderedDict)
    unverified: int = 0

    def remember(self, request_id: str, dispatch: Dispatch) -> None:
        self._dispatched[request_id] = dispatch
        self._dispatched.move_to_end(request_id)
        if len(self._dispatched) > self.capacity:
            self._dispatched.popitem(last=False)
            self.unverified += 1

    def forget(self, request_id: str) -> None:
        self._dispatched.pop(request_id, None)

    def verify(self, request_id: str, worker_id: str, cached_tokens: int) -> Verdict | None:
        d = self._dispatched.pop(request_id, None)
        if d is None or d.worker_id != worker_id:
            return None  # another replica routed it, or it was re-dispatched since
        actual_blocks = cached_tokens // d.block_size
        predicted = d.predicted_blocks
        return Verdict(
            false_hit=actual_blocks < predicted,
            missed_hit=actual_blocks > predicted,
            worker_id=worker_id,
            predicted_tokens=predicted * d.block_size,
            actual_tokens=cached_tokens,
            recomputed_tokens=max(0, d.best_blocks * d.block_size - cached_tokens),
            model=d.model,
        )
