"""Prompts handed to a worker whose answer has not come back yet.

On the credit path the router offers a request to its worker itself and waits for the ack; the
in-flight overlay (``inflight.py``) records the prompt there once the worker took it. A burst
is decided within that wait: before this record, a request sharing a new prefix with one
offered a moment earlier saw none of it and went wherever load sent it, prefilling the prefix
again. The replay, which hands over at once, never had that gap (at 20 ms per hand-off its
bursty trace lost 0.09 of its hit ratio). An offer is kept per request, so a refusal takes it
back exactly; offers in flight are few (the router bounds its hand-offs), so a query compares
itself with each, from the first block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from thunderagent.hashing import BlockHashes


def common_blocks(a: BlockHashes, b_primary: Sequence[int], b_check: Sequence[int]) -> int:
    """How many leading blocks two prompts share. The hashes are chained (each names its whole
    prefix), so a block equal in both means every block before it is too: a bisection."""
    low, high = 0, min(len(a.primary), len(b_primary))
    while low < high:
        mid = (low + high + 1) // 2
        if a.primary[mid - 1] == b_primary[mid - 1] and a.check[mid - 1] == b_check[mid - 1]:
            low = mid
        else:
            high = mid - 1
    return low


@dataclass(slots=True)
class OfferedPrompts:
    _offers: dict[str, tuple[str, BlockHashes]] = field(default_factory=dict)
    """request id -> (the worker it was offered to, its prompt's block hashes)."""

    def add(self, request_id: str, worker_id: str, hashes: BlockHashes) -> None:
        if hashes.primary:
            self._offers[request_id] = (worker_id, hashes)

    def remove(self, request_id: str) -> None:
        """Taken (the in-flight overlay has it now), refused or given up."""
        self._offers.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._offers)

    def matches(self, primary: Sequence[int], check: Sequence[int]) -> dict[str, int]:
        """Per worker, the longest prefix of the prompt offered there."""
        found: dict[str, int] = {}
        if not primary:
            return found
        first = primary[0]
        for worker, hashes in self._offers.values():
            if hashes.primary[0] != first:
                continue
            blocks = common_blocks(hashes, primary, check)
            if blocks > found.get(worker, 0):
                found[worker] = blocks
        return found
