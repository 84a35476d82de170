"""Requests per prefix over a sliding window, from routing decisions.

A prefix is named by the hash of its deepest block, which a router decision carries when the
chosen worker had a hit. A request sent to a worker *without* the hit while another candidate
held part of its prompt is demand that holder could not take (the router judged it too busy):
it is credited to the prefix last seen hit on that holder at that depth, which is exact for a
shared prefix (a system prompt, a document) and a guess otherwise (an approximation the planner
tolerates, like the index's).

A deque of hit times per prefix, not a per-slice counter ring: the planner asks for one prefix's
rate at a time and the window is short, so the deques stay small (``max_hits`` caps them).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from thunderagent.migration.model import RouteSeen


@dataclass(slots=True)
class PrefixDemand:
    blocks: int
    model: str
    lora_name: str | None = None
    hits: deque[float] = field(default_factory=deque)


class DemandTracker:
    def __init__(self, window_s: float, max_tracked: int, max_hits: int = 10_000) -> None:
        self.window_s = window_s
        self.max_tracked = max_tracked
        self.max_hits = max_hits
        self._prefixes: OrderedDict[int, PrefixDemand] = OrderedDict()
        self._last_at: dict[tuple[str, int], int] = {}
        """(holder, depth) -> prefix last hit there, to credit spilled requests."""

    def __contains__(self, prefix: int) -> bool:
        return prefix in self._prefixes

    def __len__(self) -> int:
        return len(self._prefixes)

    def get(self, prefix: int) -> PrefixDemand | None:
        return self._prefixes.get(prefix)

    def observe(self, route: RouteSeen, now: float) -> int | None:
        """Count one routed request; returns the prefix it was credited to (None: none)."""
        prefix, blocks = route.prefix_hash, route.blocks
        if prefix is not None and blocks > 0:
            self._last_at[(route.worker_id, blocks)] = prefix
        else:
            prefix, blocks = self._spilled(route)
            if prefix is None:
                return None
        self._hit(prefix, blocks, route.model, route.lora_name, now)
        return prefix

    def _spilled(self, route: RouteSeen) -> tuple[int | None, int]:
        best = max(
            (c for c in route.candidates if c[0] != route.worker_id and c[1] > 0),
            key=lambda c: c[1],
            default=None,
        )
        if best is None:
            return None, 0
        return self._last_at.get(best), best[1]

    def track(self, prefix: int, blocks: int, model: str = "") -> PrefixDemand:
        """Follow a prefix without counting a request (an ordered move names it)."""
        demand = self._prefixes.get(prefix)
        if demand is None:
            demand = self._prefixes[prefix] = PrefixDemand(blocks, model)
        return demand

    def _hit(self, prefix: int, blocks: int, model: str, lora_name: str | None, now: float) -> None:
        demand = self._prefixes.get(prefix)
        if demand is None:
            demand = self._prefixes[prefix] = PrefixDemand(blocks, model, lora_name)
            while len(self._prefixes) > self.max_tracked:
                self.forget(next(iter(self._prefixes)))
        else:
            self._prefixes.move_to_end(prefix)
        demand.hits.append(now)
        if len(demand.hits) > self.max_hits:
            demand.hits.popleft()

    def rate(self, prefix: int, now: float) -> float:
        """Hits per second over the last ``window_s``."""
        return self.hits(prefix, now) / self.window_s

    def hits(self, prefix: int, now: float) -> int:
        demand = self._prefixes.get(prefix)
        if demand is None:
            return 0
        cutoff = now - self.window_s
        while demand.hits and demand.hits[0] <= cutoff:
            demand.hits.popleft()
        return len(demand.hits)

    def prefixes(self) -> list[int]:
        return list(self._prefixes)

    def forget(self, prefix: int) -> None:
        self._prefixes.pop(prefix, None)
        for key in [k for k, p in self._last_at.items() if p == prefix]:
            del self._last_at[key]
