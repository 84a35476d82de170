"""Prefixes this router replica has just sent somewhere, before the engine's KV events say so.

The event-fed index learns a prompt's blocks only after the engine prefilled them and the
events crossed ZMQ, the adapter and JetStream: tens of milliseconds in which a burst of requests
sharing a new prefix would scatter over the fleet, each paying the prefill. So every routed
prompt is also recorded here, per worker, for a short time; a query takes, per worker, the
longer of the confirmed and the in-flight prefix. A guess that turns out wrong (the request
failed, the blocks were evicted) costs one prefill and expires with the TTL; lazy verification
counts it like any other false hit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from thunderagent.prefix_index.index import PrefixIndex
from thunderagent.schemas import AllCleared, BlocksRemoved, KvEventBatch, Medium

INFLIGHT_TTL_S = 30.0
"""Long enough for a queued request's prefill to finish and its events to arrive; short enough
that a wrong guess stops attracting requests quickly."""


def longer_matches(known: dict[str, int], found: dict[str, int]) -> dict[str, int]:
    """Per worker, the longer of two matches (``known`` itself when ``found`` is empty)."""
    if not found:
        return known
    merged = dict(known)
    for worker, blocks in found.items():
        if blocks > merged.get(worker, 0):
            merged[worker] = blocks
    return merged


@dataclass
class InflightPrefixes:
    ttl_s: float = INFLIGHT_TTL_S
    index: PrefixIndex = field(init=False)

    def __post_init__(self) -> None:
        self.index = PrefixIndex(self.ttl_s)

    def record(self, worker: str, primary: Sequence[int], check: Sequence[int], now: float) -> None:
        """``worker`` is about to hold these blocks (the router just sent it the prompt).

        The prefix already recorded there (a conversation's earlier turns, a shared document)
        is only re-confirmed; the rest is stored after it. Storing the whole prompt again cost
        its every block a new entry built and a log item to compact later: with 32k-token prompts
        the router took 10.9-11.5 ms of CPU per request, 8.1-8.4 since (``bench profile
        --prompt-tokens 32768``, docs/benchmarks.md "Long prompts")."""
        held = self.index.overlap(primary, check).get(worker, 0) if primary else 0
        self.index.reconfirm(primary[:held], now)
        if held < len(primary):
            parent = primary[held - 1] if held else None
            rest = (primary[held:], check[held:])
            self.index.apply_stored(worker, self._next_seq(worker), rest, parent, now)

    def _next_seq(self, worker: str) -> int:
        last = self.index.worker_seq(worker)
        return 0 if last is None else last + 1

    def matches(self, primary: Sequence[int], check: Sequence[int], now: float) -> dict[str, int]:
        """Per worker, the prompt's prefix in flight there."""
        self.index.expire(now)
        return self.index.overlap(primary, check)

    def forget(self, worker: str) -> None:
        self.index.remove_worker(worker)

    def drop_removed(self, batch: KvEventBatch) -> None:
        """The worker evicted (or handed away) blocks, or cleared its cache: stop guessing it
        holds them."""
        worker = batch.worker_id
        if worker not in self.index.workers:
            return
        for ev in batch.events:
            if isinstance(ev, AllCleared):
                self.forget(worker)
                return
            if isinstance(ev, BlocksRemoved) and ev.medium == Medium.GPU:
                self.index.apply_removed(worker, self._next_seq(worker), ev.hashes, 0.0)
