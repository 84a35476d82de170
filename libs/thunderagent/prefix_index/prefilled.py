"""A router's own record of the prompts it had prefilled on workers that publish no KV events:
Dynamo's approximate mode (``use_kv_events=false``), for the ``dynamo_kv`` peer.

SGLang publishes KV events only when started with ``--kv-events-config`` (off by default). For
such an engine Dynamo's router remembers where it sent each request's blocks and counts them as
held there for ``router_ttl_secs`` (its ``ttl`` policy: no bound by the engine's pool). Here a
block counts from its run's first token for ``ttl_s`` after its last prefill *there*: the
expiry is per worker, unlike the event-fed index's TTL (a coarse guard against lost removals,
renewed by any worker's store). ThunderAgent's own routers need none of this: the adapters
announce what such an engine caches (``thunderagent.sglang.shadow``).
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
        self._clock = -math.inf

    def record(self, worker: str, primary: Sequence[int], check: Sequence[int], now: float) -> None:
        """``worker`` has prefilled this prompt (its first token is out)."""
        now = self._clock = max(now, self._clock)  # a clock stepped back keeps the queue sorted
        self.index.apply_stored(worker, self._next_seq(worker), (primary, check), None, now)
        self._last.setdefault(worker, {}).update(dict.fromkeys(primary, now))
        self._queue.append((now, worker, primary))

    def _next_seq(self, worker: str) -> int:
        last = self.index.worker_seq(worker)
        return 0 if last is None else last + 1

    def expire(self, now: float) -> None:
        """Drop each block not prefilled again on its worker within ``ttl_s``. A prompt renews
        every block before its last, so what goes is always a prompt's tail."""
        queue, cutoff = self._queue, now - self.ttl_s
        while queue and queue[0][0] <= cutoff:
            at, worker, primary = queue.popleft()
            last = self._last.get(worker)
            if last is None:  # forgotten since
                continue
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
        self.index.remove_worker(worker)
