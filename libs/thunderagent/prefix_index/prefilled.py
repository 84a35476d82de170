"""What a router knows of a cache that publishes no events: the prompts it had prefilled there.

SGLang publishes KV events only when started with ``--kv-events-config`` (off by default). For
such an engine a router can only remember where it sent each prompt, as SGLang's own router and
Dynamo's with ``use_kv_events=false`` do; nothing says when the engine evicts a block, so a block
counts as held by a worker for ``ttl_s`` after its last prefill *there*. The expiry is per
worker, unlike the event-fed index's TTL (a coarse guard against lost removals, renewed by any
worker's store): a prefix one worker keeps prefilling says nothing of another worker's copy.
An engine also cannot hold more blocks than its KV pool: past the worker's capacity, the
prompts prefilled there longest ago go first, as the engine's LRU eviction would take them.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from thunderagent.prefix_index.index import PrefixIndex
from thunderagent.prefix_index.inflight import longer_matches

APPROXIMATE_TTL_S = 120.0
"""Dynamo 1.6.1's ``router_ttl_secs``, the default of its mode without KV events."""


class PrefilledPrefixes:
    """Per worker, the prompts prefilled there in the last ``ttl_s`` seconds."""

    def __init__(self, ttl_s: float = APPROXIMATE_TTL_S) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s!r}")
        self.ttl_s = ttl_s
        self.index = PrefixIndex(None)  # no TTL of its own: blocks leave it worker by worker
        self._last: dict[str, dict[int, float]] = {}
        """Per worker, each block's last prefill there."""
        self._queue: deque[tuple[float, str, Sequence[int]]] = deque()
        """Every prefill in time order: what may be due once it is ``ttl_s`` old."""
        self._by_worker: dict[str, deque[tuple[float, Sequence[int]]]] = {}
        """Per worker, its prefills in time order: what goes first past its capacity."""
        self._clock = -math.inf

    def record(
        self, worker: str, primary: Sequence[int], check: Sequence[int], now: float,
        capacity_blocks: int = 0,
    ) -> None:  # fmt: skip
        """``worker`` has prefilled this prompt (its first token is out); ``capacity_blocks``:
        its engine's KV pool (0: unknown, no bound)."""
        now = self._clock = max(now, self._clock)  # a clock stepped back keeps the queue sorted
        self.index.apply_stored(worker, self._next_seq(worker), (primary, check), None, now)
        self._last.setdefault(worker, {}).update(dict.fromkeys(primary, now))
        self._queue.append((now, worker, primary))
        mine = self._by_worker.setdefault(worker, deque())
        mine.append((now, primary))
        if capacity_blocks > 0:
            while mine and self.index.worker_block_count(worker) > capacity_blocks:
                self._drop(worker, *mine.popleft(), now)

    def _next_seq(self, worker: str) -> int:
        last = self.index.worker_seq(worker)
        return 0 if last is None else last + 1

    def expire(self, now: float) -> None:
        """Drop each block not prefilled again on its worker within ``ttl_s``. A prompt renews
        every block before its last, so what goes is always a prompt's tail."""
        queue, cutoff = self._queue, now - self.ttl_s
        while queue and queue[0][0] <= cutoff:
            at, worker, primary = queue.popleft()
            self._drop(worker, at, primary, now)
            mine = self._by_worker.get(worker)
            while mine and mine[0][0] <= cutoff:  # the same prefills, in the same order
                mine.popleft()

    def _drop(self, worker: str, at: float, primary: Sequence[int], now: float) -> None:
        """The blocks of the prefill at ``at`` that no later prefill there renewed."""
        last = self._last.get(worker)
        if last is None:  # forgotten since
            return
        gone = [h for h in primary if last.get(h, math.inf) <= at]
        if gone:
            for h in gone:
                del last[h]
            self.index.apply_removed(worker, self._next_seq(worker), gone, now)

    def merge(
        self, known: dict[str, int], primary: Sequence[int], check: Sequence[int], now: float
    ) -> dict[str, int]:
        """Per worker, the longer of ``known`` and the prefix prefilled there."""
        self.expire(now)
        return longer_matches(known, self.index.overlap(primary, check))

    def holds_any(self) -> bool:
        """Whether any worker has had a prompt recorded (and not been forgotten)."""
        return bool(self._last)

    def block_counts(self) -> dict[str, int]:
        return self.index.block_counts()

    def forget(self, worker: str) -> None:
        """The worker left, or publishes events now; its queued prefills are skipped."""
        self._last.pop(worker, None)
        self._by_worker.pop(worker, None)
        self.index.remove_worker(worker)
