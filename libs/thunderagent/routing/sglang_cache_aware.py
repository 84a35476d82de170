"""SGLang router 0.3.2 ``cache_aware``, on token blocks instead of characters.

One approximate tree per model of the block hashes this policy has *routed* (not what the engines
report): per block, the workers it was routed to, in the order they first took it; per worker,
an LRU trimmed to a size cap every ``eviction_interval_s``. The load is the policy's own count of
requests in flight (booked in ``on_dispatched``, released in ``on_finished``), as SGLang's router
counts its own; it never reads the engines' load reports. Per request: if that load is
imbalanced, the least loaded worker; else, if the tree's deepest match covers more than
``cache_threshold`` of the prompt, the one worker that has held the deepest matched block
longest (0.3.2's sticky ``last_tenant``); else the least loaded. Ties on load go to the first in
worker order (Rust's ``min_by_key``). See README.md for the source and the deviations.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from thunderagent.routing.cost import (
    finite_at_least,
    finite_positive,
    in_unit_interval,
    leading_blocks,
    require,
)
from thunderagent.routing.policy import POLICIES, PolicyHooks, RouteQuery, WorkerView
from thunderagent.schemas import Candidate

_P = "sglang_cache_aware"


@POLICIES.register("sglang_cache_aware")
@dataclass
class SglangCacheAware(PolicyHooks):
    name: ClassVar[str] = _P

    cache_threshold: float = 0.3
    """sglang-router 0.3.2 default: follow the cache only when the best match covers more than 30%
    of the prompt; a shorter match is not worth giving up the least loaded worker."""
    balance_abs_threshold: int = 64
    """0.3.2 default: load is imbalanced only if max - min requests in flight exceeds 64 ..."""
    balance_rel_threshold: float = 1.5
    """... and max > 1.5 x min (0.3.2 default); both must hold, so small fleets stay cache-led."""
    max_tree_tokens: int = 2**24
    """Per-worker cap of the approximate tree. 0.3.2 caps each tenant at 2**26 characters; at ~4
    characters per token that is 2**24 tokens (32768 blocks of 512). Deliberately far above a
    worker's real KV capacity, as in SGLang: the tree forgets much later than the engine does."""
    eviction_interval_s: float = 60.0
    """0.3.2 ``eviction_interval_secs`` (60): trees are trimmed to the cap this often (on the
    caller's clock, ``RouteQuery.now``), not at every insert; between trims they may exceed it."""

    _trees: dict[str, OrderedDict[int, None]] = field(default_factory=dict, init=False, repr=False)
    """worker -> its blocks, least recently routed first (the eviction order)."""
    _holders: dict[int, dict[str, None]] = field(default_factory=dict, init=False, repr=False)
    """block -> the workers holding it in the tree, in the order they first took it."""
    _load: dict[str, int] = field(default_factory=dict, init=False, repr=False)
    """worker -> requests this policy sent there that have not finished (SGLang's worker.load())."""
    _where: dict[str, str] = field(default_factory=dict, init=False, repr=False)
    _last_eviction: float | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        in_unit_interval(_P, "cache_threshold", self.cache_threshold)
        require(
            _P,
            "balance_abs_threshold",
            self.balance_abs_threshold,
            isinstance(self.balance_abs_threshold, int) and self.balance_abs_threshold >= 0,
            "must be an integer >= 0",
        )
        finite_at_least(_P, "balance_rel_threshold", self.balance_rel_threshold, 1.0)
        require(
            _P,
            "max_tree_tokens",
            self.max_tree_tokens,
            isinstance(self.max_tree_tokens, int) and self.max_tree_tokens > 0,
            "must be an integer > 0",
        )
        finite_positive(_P, "eviction_interval_s", self.eviction_interval_s)

    def load(self, worker_id: str) -> int:
        """Requests in flight on ``worker_id`` as this policy counts them."""
        return self._load.get(worker_id, 0)

    def matched_blocks(self, worker_id: str, block_hashes: Sequence[int]) -> int:
        """Leading prompt blocks this policy has routed to ``worker_id`` (and not evicted)."""
        return leading_blocks(self._trees.get(worker_id), block_hashes)

    def tree_blocks(self, worker_id: str) -> int:
        return len(self._trees.get(worker_id, ()))

    def sticky_match(
        self, block_hashes: Sequence[int], present: set[str]
    ) -> tuple[int, str | None]:
        """The tree's deepest match over the ``present`` workers, and the worker that has held its
        last block longest: 0.3.2's ``last_tenant`` of the deepest matched node (set by the
        node's creator, kept until that worker is evicted there, then the next holder)."""
        depth, tenant = 0, None
        for h in block_hashes:
            first = next((w for w in self._holders.get(h, ()) if w in present), None)
            if first is None:
                break
            depth, tenant = depth + 1, first
        return depth, tenant

    def rank(
        self, query: RouteQuery, workers: Sequence[WorkerView], rng: random.Random
    ) -> list[Candidate]:
        loads = [self.load(w.worker_id) for w in workers]
        hi, lo = max(loads), min(loads)
        imbalanced = hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold
        match = {w.worker_id: self.matched_blocks(w.worker_id, query.block_hashes) for w in workers}
        blocks = query.prompt_blocks
        depth, tenant = (
            (0, None) if imbalanced else self.sticky_match(query.block_hashes, set(match))
        )
        if tenant is not None and blocks and depth / blocks > self.cache_threshold:
            score = {wid: m / blocks for wid, m in match.items()}
            first = next(w for w in workers if w.worker_id == tenant)
        else:  # imbalanced or a low match: the fewest in flight, first in worker order
            score = {w.worker_id: float(-self.load(w.worker_id)) for w in workers}
            first = min(workers, key=lambda w: self.load(w.worker_id))
        # The rest by score, worker order within a tie (a stable sort), as SGLang lists workers.
        rest = sorted((w for w in workers if w is not first), key=lambda w: -score[w.worker_id])
        return [
            Candidate(
                worker_id=w.worker_id, score=score[w.worker_id], overlap_blocks=match[w.worker_id]
            )
            for w in [first, *rest]
        ]

    def on_dispatched(self, query: RouteQuery, worker_id: str) -> None:
        """Count the request in flight on ``worker_id`` and insert the prompt's blocks into the
        tree under it (in every mode, as SGLang does); trim each worker's blocks when an
        eviction interval passed."""
        previous = self._where.pop(query.request_id, None)
        if previous is not None:  # a re-dispatch: the earlier run no longer counts
            self._load[previous] -= 1
        self._where[query.request_id] = worker_id
        self._load[worker_id] = self.load(worker_id) + 1
        tree = self._trees.setdefault(worker_id, OrderedDict())
        # Deepest block first, so the prompt's root ends most recent: LRU then evicts from the
        # leaves up, as SGLang's leaf-LRU does, and a surviving block keeps its whole prefix.
        for h in reversed(query.block_hashes):
            tree[h] = None
            tree.move_to_end(h)
            self._holders.setdefault(h, {})[worker_id] = None  # a holder keeps its place
        if self._last_eviction is None:
            self._last_eviction = query.now
        elif query.now - self._last_eviction >= self.eviction_interval_s:
            self._last_eviction = query.now
            self._trim(max(1, self.max_tree_tokens // query.block_size))

    def _trim(self, cap: int) -> None:
        for wid, tree in self._trees.items():
            while len(tree) > cap:
                h, _ = tree.popitem(last=False)
                holders = self._holders[h]
                del holders[wid]
                if not holders:  # SGLang drops a node nobody holds; a later insert recreates it
                    del self._holders[h]

    def on_finished(self, request_id: str, worker_id: str, now: float) -> None:
        """The request left its worker: SGLang decrements that worker's load."""
        where = self._where.pop(request_id, None)
        if where is not None:
            self._load[where] -= 1
