"""Prefix grouping (request merging): N requests that share an uncached prefix cost one prefill.

Per worker, the blocks a dispatched request will store there (``leaders``: block hash -> the
request prefilling it) and the blocks KV events have reported cached (``cached``). A request
whose first uncached block on its target is being prefilled by a leader, with at least
``group_min_blocks`` shared, is *held* until that block is cached (``on_prefix_cached`` from KV
events, or the leader's first token: it then re-enters the queue and hits the cache), the
leader ends, or ``group_timeout_s`` passes.
Hashes are chained, so one hash names a whole prefix and the first shared block decides.

A request's candidates carry the router's predicted overlap, which already counts its own
in-flight prompts (the overlay) as cached; so a follower of a leader from the same router
starts past the leader's blocks and is not held (``credits.may_dispatch_directly``): holds
come from leaders the router did not see, another replica's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from thunderagent.scheduling.api import SchedRequest

CACHED_BLOCKS_PER_WORKER = 1 << 20
"""Known-cached hashes kept per worker (oldest dropped first): ~50 MB at most, and a forgotten
hash only costs a missed grouping, never a wrong decision."""


@dataclass(slots=True)
class Held:
    request_id: str
    worker_id: str
    block_hash: int
    shared_tokens: int
    since: float


@dataclass(slots=True)
class PrefixGroups:
    min_blocks: int = 4
    cached: dict[str, dict[int, None]] = field(default_factory=dict)
    """worker -> hashes reported cached (a dict as an insertion-ordered set: cheap trim)."""
    leaders: dict[str, dict[int, str]] = field(default_factory=dict)
    """worker -> block hash -> request id prefilling it."""
    led: dict[str, tuple[str, list[int]]] = field(default_factory=dict)
    """leader request id -> (worker, hashes it claimed): cleared when it ends."""
    held: dict[str, Held] = field(default_factory=dict)
    versions: dict[str, int] = field(default_factory=dict)
    """worker -> count of changes to its ``cached`` or ``leaders``: what ``first_uncached``,
    ``shared_run`` and ``try_hold`` answer for it is the same while this is."""
    waiters: dict[tuple[str, int], list[str]] = field(default_factory=dict)
    """(worker, block hash) -> held request ids, in hold order."""
    grouped_requests: int = 0
    released_cached: int = 0
    released_timeout: int = 0
    released_leader_gone: int = 0
    prefill_tokens_saved: int = 0

    def _changed(self, worker_id: str) -> None:
        self.versions[worker_id] = self.versions.get(worker_id, 0) + 1

    def first_uncached(self, worker_id: str, hashes: Sequence[int], cached_blocks: int) -> int:
        known = self.cached.get(worker_id, {})
        i = cached_blocks
        while i < len(hashes) and hashes[i] in known:
            i += 1
        return i

    def shared_run(self, worker_id: str, hashes: Sequence[int], start: int) -> int:
        lead = self.leaders.get(worker_id, {})
        if start >= len(hashes) or hashes[start] not in lead:
            return 0
        owner = lead[hashes[start]]
        n = 0
        while start + n < len(hashes) and lead.get(hashes[start + n]) == owner:
            n += 1
        return n

    def try_hold(self, req: SchedRequest, worker_id: str, start: int, now: float) -> bool:
        """Hold ``req`` behind a leader if it shares enough of its uncached prefix, which
        begins at block ``start`` (``first_uncached``)."""
        rid, hashes = req.request_id, req.block_hashes
        run = self.shared_run(worker_id, hashes, start)
        if run == 0 or run < self.min_blocks:
            return False
        h = hashes[start]
        self.held[rid] = Held(rid, worker_id, h, run * req.block_size, now)
        self.waiters.setdefault((worker_id, h), []).append(rid)
        self.grouped_requests += 1
        return True

    def lead(self, rid: str, worker_id: str, hashes: Sequence[int], cached: int) -> None:
        """``rid`` was dispatched: its uncached blocks are being prefilled on ``worker_id``."""
        self._changed(worker_id)
        lead = self.leaders.setdefault(worker_id, {})
        claimed = hashes[self.first_uncached(worker_id, hashes, cached) :]
        claimed = [h for h in claimed if lead.setdefault(h, rid) == rid]
        if claimed:
            self.led[rid] = (worker_id, claimed)

    def on_cached(self, worker_id: str, hashes: Sequence[int]) -> list[str]:
        """Record cached blocks; return held requests to release, in hold order."""
        self._changed(worker_id)
        known = self.cached.setdefault(worker_id, {})
        lead = self.leaders.get(worker_id, {})
        released: list[str] = []
        for h in hashes:
            known[h] = None
            lead.pop(h, None)
            for rid in self.waiters.pop((worker_id, h), ()):
                held = self.held.pop(rid, None)
                if held is not None:
                    released.append(rid)
                    self.released_cached += 1
                    self.prefill_tokens_saved += held.shared_tokens
        while len(known) > CACHED_BLOCKS_PER_WORKER:
            del known[next(iter(known))]
        return released

    def on_leader_prefilled(self, rid: str) -> list[str]:
        """The leader's first token is out: the engine has cached the blocks it claimed (what
        its KV events will say, and all a worker without events ever says)."""
        worker_id, claimed = self.led.pop(rid, ("", []))
        return self.on_cached(worker_id, claimed) if claimed else []

    def on_leader_done(self, rid: str) -> list[str]:
        """The leader finished or was preempted: release whoever waits on its blocks."""
        worker_id, claimed = self.led.pop(rid, ("", []))
        if claimed:
            self._changed(worker_id)
        lead = self.leaders.get(worker_id, {})
        released: list[str] = []
        for h in claimed:
            if lead.get(h) == rid:
                del lead[h]
            for waiter in self.waiters.pop((worker_id, h), ()):
                if self.held.pop(waiter, None) is not None:
                    released.append(waiter)
        self.released_leader_gone += len(released)
        return released

    def next_timeout(self, timeout_s: float) -> float | None:
        if not self.held:
            return None
        return min(h.since for h in self.held.values()) + timeout_s

    def expire(self, now: float, timeout_s: float) -> list[str]:
        # the same expression as ``next_timeout``: ``now - since >= timeout`` can be false at
        # ``now == since + timeout`` by rounding, and the driver would wake again at once
        late = [r for r, h in self.held.items() if now >= h.since + timeout_s]
        for rid in late:
            self.drop(rid)
        self.released_timeout += len(late)
        return late

    def drop(self, rid: str) -> None:
        held = self.held.pop(rid, None)
        if held is None:
            return
        key = (held.worker_id, held.block_hash)
        rest = [r for r in self.waiters.get(key, ()) if r != rid]
        if rest:
            self.waiters[key] = rest
        else:
            self.waiters.pop(key, None)
