"""Hits per prefix over a sliding window, kept as a ring of per-slice counters.

A ring of ``slices`` Counters rather than a timestamp per hit: memory is bounded by the number
of distinct prefixes per slice, and sliding the window drops a whole slice at once.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field


@dataclass
class HotPrefixCounter:
    window_s: float = 60.0
    slices: int = 6
    _ring: deque[tuple[int, Counter]] = field(default_factory=deque)
    _depth: dict[int, int] = field(default_factory=dict)

    def _slice(self, now: float) -> int:
        return int(now // (self.window_s / self.slices))

    def _trim(self, now: float) -> None:
        oldest = self._slice(now) - self.slices + 1
        while self._ring and self._ring[0][0] < oldest:
            _, dropped = self._ring.popleft()
            for prefix in dropped:
                if not any(prefix in c for _, c in self._ring):
                    self._depth.pop(prefix, None)

    def hit(self, prefix: int, depth_blocks: int, now: float) -> None:
        """A request reused ``prefix`` (the hash of its deepest cached block)."""
        current = self._slice(now)
        if not self._ring or self._ring[-1][0] != current:
            self._ring.append((current, Counter()))
            self._trim(now)
        self._ring[-1][1][prefix] += 1
        self._depth[prefix] = depth_blocks

    def top(self, n: int, now: float) -> list[dict]:
        """The ``n`` most hit prefixes in the window: ``{prefix, hits, depth_blocks}``."""
        self._trim(now)
        total: Counter = Counter()
        for _, c in self._ring:
            total.update(c)
        return [
            {"prefix": p, "hits": hits, "depth_blocks": self._depth.get(p, 0)}
            for p, hits in total.most_common(n)
        ]
