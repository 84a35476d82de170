"""SMG 1.13.0's ``cache_aware`` as ``smg launch --policy cache_aware`` ships it, on blocks.

Per request (``model_gateway/src/policies/cache_aware.rs`` and ``least_load.rs`` of the
``smg==1.13.0`` sdist):

1. Worker overload protection: a worker reporting >= 8 waiting requests or >= 0.8 KV usage is
   left out; when every worker is, the least loaded (own in-flight count) takes the request.
2. KV pressure (off by default): hottest KV usage above a ceiling, or hottest minus coldest above
   a spread: expected wait over every eligible worker.
3. Affinity. ``index="tree"`` (HTTP workers, the default): the approximate token tree of what this
   policy routed; a match above ``cache_threshold`` of the prompt makes the deepest holders the
   group, else a miss. ``index="events"`` (gRPC workers with KV events): the event-fed overlaps;
   any positive overlap is a hit, the deepest holders the group; thin overlaps feed the warm-up
   slice, hits may be diverted to a thin worker; optimistic bookings may stand in for overlaps
   the engine has not reported yet.
4. The group's workers over the count-pressure gate (own in-flight > ``balance_rel_threshold`` x
   the fleet mean and > the mean + a swing-sized margin) are dropped; if none is left the request
   spills to the ungated fleet. LeastLoad's expected wait picks within what remains (a miss: the
   whole eligible fleet), ties within 1 us drawn uniformly.

Pure: the clock is ``RouteQuery.now``, randomness the ``rng`` given. See README.md for every
default's flag and the deviations.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from thunderagent.routing.cost import (
    finite_at_least,
    finite_positive,
    in_unit_interval,
    leading_blocks,
    require,
    softmax_index,
)
from thunderagent.routing.policy import POLICIES, PolicyHooks, RouteQuery, WorkerView
from thunderagent.schemas import Candidate

_P = "smg_cache_aware"
TIE_EPSILON_S = 1e-6
"""least_load.rs ``TIE_EPSILON_SECS``: expected waits this close are one tie."""
SINCE_POLL_KEPT = 8192
"""least_load.rs ``SINCE_POLL_DISPATCHES_KEPT``: dispatches remembered per worker."""
WARMUP_MISS_BLOCKS = 4.0
"""cache_aware.rs ``WARMUP_MISS_BLOCKS``: an overlap this short under half the prompt is thin."""
DIVERT_SHALLOW_SHARE = 0.5
"""cache_aware.rs ``DIVERT_SHALLOW_SHARE``: a hit covering at most this share is shallow."""
MAX_PLACEMENTS_PER_KEY = 4
"""cost/accounting.rs ``MAX_PLACEMENTS_PER_KEY``: predicted holders kept per prefix hash."""


@POLICIES.register("smg_cache_aware")
@dataclass
class SmgCacheAware(PolicyHooks):
    name: ClassVar[str] = _P

    index: str = "tree"
    """Affinity source. "tree": SMG's approximate token tree, what ``smg launch --worker-urls
    http://...`` uses (KvEventMonitor subscribes gRPC workers only). "events": the engines' KV
    events (``RouteQuery.overlaps``), SMG's event-driven mode for gRPC workers."""
    cache_threshold: float = 0.3
    """``--cache-threshold`` (0.3): a tree match must cover more than this share of the prompt;
    in event mode, the share at or below which an overlap is thin for the warm-up slice."""
    balance_abs_threshold: int = 64
    """``--balance-abs-threshold`` (64): cap on the spill gate's absolute margin above the mean."""
    balance_rel_threshold: float = 1.5
    """``--balance-rel-threshold`` (1.5): the gate's relative part, a multiple of the mean."""
    min_absolute_margin: float = 4.0
    """``MIN_ABSOLUTE_MARGIN`` (cache_aware.rs, 4): floor of the swing-sized margin
    ceil(2 sqrt(mean)) unless ``balance_abs_threshold`` is lower."""
    balance_token_usage_threshold: float = 1.0
    """``--balance-token-usage-threshold`` (1.0 = off): KV-usage spread that abandons affinity."""
    overload_token_usage_threshold: float = 1.0
    """``--overload-token-usage-threshold`` (1.0 = off): hottest KV usage that abandons it."""
    worker_overload_waiting_requests: int | None = 8
    """``--worker-overload-waiting-requests`` (8; None = protection off for it)."""
    worker_overload_token_usage: float | None = 0.8
    """``--worker-overload-token-usage`` (0.8; None = protection off for it)."""
    kv_pressure_weight: float = 0.15
    """``DEFAULT_KV_PRESSURE_WEIGHT`` (worker/expected_wait.rs, 0.15 s): cache_aware builds its
    LeastLoad scorer with ``LeastLoadPolicy::new()``, so the --least-load-* flags do not apply."""
    mean_prefill_tokens: int = 1024
    """``DEFAULT_MEAN_PREFILL_TOKENS`` (1024): tokens priced per queued or running request."""
    default_throughput: float = 2000.0
    """``DEFAULT_THROUGHPUT`` (2000 tokens/s): the drain rate without a reported one."""
    overlap_decay: float = 0.0
    """``--overlap-decay`` (0.0 = off): overlap scores divided by 1 + decay * excess waiting-
    prefill blocks over the candidates' minimum per request block."""
    selection_temperature: float = 0.0
    """``--selection-temperature`` (0.0): above 0, a softmax over min-max normalized scores picks
    the affinity group."""
    booking_ttl_s: float = 0.0
    """``--selection-accounting-ttl-ms`` / 1000 (0 = off): optimistic placement bookings (event
    mode) count as overlap for this long."""
    eviction_interval_s: float = 60.0
    """``--eviction-interval-secs`` (60): the tree is trimmed this often (caller's clock)."""
    load_monitor_interval_s: float = 10.0
    """``--load-monitor-interval`` (10 s): SMG polls an HTTP worker's ``/v1/loads`` this often
    (pushed loads exist for gRPC workers only); between polls it knows its own dispatches. The
    router core gives this policy one load report per poll (``load_poll_s``), live and in the
    replay alike; 0 reads every report."""
    max_tree_size: int = 2**26
    """``--max-tree-size`` (2**26 tokens, tree-wide: the sum over every worker)."""
    warmup_share: float = 0.25
    """``--worker-warmup-share`` (0.25): share of thin misses sliced to a thin worker."""
    warmup_blocks: int = 1024
    """``--worker-warmup-blocks`` (1024): nobody is thin until the fleet median holds this many."""
    warmup_thin_ratio: float = 0.5
    """``--worker-warmup-thin-ratio`` (0.5): thin = empty or under this share of the median."""
    warmup_divert_every: int = 8
    """``--worker-warmup-divert-every`` (8): one hit in this many diverted to a thin worker."""

    _inflight: dict[str, int] = field(default_factory=dict, init=False, repr=False)
    _where: dict[str, str] = field(default_factory=dict, init=False, repr=False)
    _since: dict[str, deque[int]] = field(default_factory=dict, init=False, repr=False)
    _trees: dict[str, set[int]] = field(default_factory=dict, init=False, repr=False)
    _lru: OrderedDict[tuple[str, int], None] = field(
        default_factory=OrderedDict, init=False, repr=False
    )
    _last_eviction: float | None = field(default=None, init=False, repr=False)
    _placed: dict[int, list[tuple[str, float]]] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        require(_P, "index", self.index, self.index in ("tree", "events"), "tree or events")
        for unit in ("cache_threshold", "warmup_share", "warmup_thin_ratio"):
            in_unit_interval(_P, unit, getattr(self, unit))
        for name in ("balance_abs_threshold", "warmup_blocks", "warmup_divert_every"):
            value = getattr(self, name)
            require(_P, name, value, isinstance(value, int) and value >= 0, "an integer >= 0")
        finite_at_least(_P, "balance_rel_threshold", self.balance_rel_threshold, 1.0)
        for name in ("min_absolute_margin", "kv_pressure_weight", "overlap_decay"):
            finite_at_least(_P, name, getattr(self, name), 0.0)
        for name in ("selection_temperature", "booking_ttl_s"):
            finite_at_least(_P, name, getattr(self, name), 0.0)
        for name in ("balance_token_usage_threshold", "overload_token_usage_threshold"):
            finite_positive(_P, name, getattr(self, name))
        w, u = self.worker_overload_waiting_requests, self.worker_overload_token_usage
        require(_P, "worker_overload_waiting_requests", w, w is None or w >= 1, "None or >= 1")
        require(_P, "worker_overload_token_usage", u, u is None or 0 < u <= 1, "None or (0, 1]")
        for name in ("default_throughput", "eviction_interval_s"):
            finite_positive(_P, name, getattr(self, name))
        finite_at_least(_P, "load_monitor_interval_s", self.load_monitor_interval_s, 0.0)
        require(
            _P,
            "mean_prefill_tokens",
            self.mean_prefill_tokens,
            self.mean_prefill_tokens >= 1,
            "must be >= 1",
        )
        require(_P, "max_tree_size", self.max_tree_size, self.max_tree_size >= 1, "must be >= 1")

    def load_poll_s(self) -> float:
        return self.load_monitor_interval_s

    # ---- what SMG reads of a worker ---------------------------------------------------------
    def inflight(self, worker_id: str) -> int:
        """``worker.load()``: requests this gateway sent there that have not completed."""
        return self._inflight.get(worker_id, 0)

    @staticmethod
    def usage(w: WorkerView, block_size: int) -> float:
        """KV pressure: tokens held by running requests over capacity (SGLang's non-evictable
        usage; ``kv_used_blocks`` counts the evictable prefix cache too)."""
        capacity = w.kv_total_blocks * block_size
        return w.active_tokens / capacity if capacity > 0 else 0.0

    def overloaded(self, w: WorkerView, block_size: int) -> bool:
        waiting, ceiling = self.worker_overload_waiting_requests, self.worker_overload_token_usage
        if waiting is not None and w.queued >= waiting:
            return True
        return ceiling is not None and self.usage(w, block_size) >= ceiling

    def expected_wait(self, w: WorkerView, block_size: int, reporting: bool) -> float:
        """LeastLoad's score in seconds. A worker with no report in a reporting fleet is not
        modelled apart (every view here carries one); a dark fleet is join-shortest-queue."""
        if not reporting:
            return float(self.inflight(w.worker_id))
        p = self.mean_prefill_tokens
        queued = w.prefill_tokens if w.prefill_tokens > 0 else w.queued * p
        since = self._since.get(w.worker_id, ())
        since_tokens = _sum_last(since, w.pending)
        unaccounted = max(0, self.inflight(w.worker_id) - w.running - w.queued - w.pending)
        work = queued + w.running * p + unaccounted * p + since_tokens
        k = min(max(self.usage(w, block_size), 0.0), 0.999)
        return work / self.default_throughput + self.kv_pressure_weight * k / (1.0 - k)

    def margin(self, mean: float) -> float:
        swing = max(math.ceil(2.0 * math.sqrt(mean)), self.min_absolute_margin)
        return min(float(self.balance_abs_threshold), swing)

    def over_gate(self, worker_id: str, mean: float) -> bool:
        load = self.inflight(worker_id)
        return load > mean * self.balance_rel_threshold and load > mean + self.margin(mean)

    def tree_match(self, worker_id: str, block_hashes: Sequence[int]) -> int:
        return leading_blocks(self._trees.get(worker_id), block_hashes)

    # ---- the decision -----------------------------------------------------------------------
    def rank(
        self, query: RouteQuery, workers: Sequence[WorkerView], rng: random.Random
    ) -> list[Candidate]:
        bs = query.block_size
        reporting = any(w.kv_total_blocks > 0 for w in workers)
        wait = {w.worker_id: self.expected_wait(w, bs, reporting) for w in workers}
        eligible = [w for w in workers if not self.overloaded(w, bs)]
        if not eligible:  # routers/common/overload.rs: least in-flight, uniform among ties
            first = _argmin(workers, lambda w: float(self.inflight(w.worker_id)), 0.0, rng)
        else:
            first = self._decide(query, workers, eligible, wait, rng)
        if self.index == "events":
            overlap = {
                w.worker_id: min(query.overlaps.get(w.worker_id, 0), query.prompt_blocks)
                for w in workers
            }
        else:
            overlap = {
                w.worker_id: self.tree_match(w.worker_id, query.block_hashes) for w in workers
            }
        rest = sorted(
            (w for w in workers if w.worker_id != first.worker_id),
            key=lambda w: (wait[w.worker_id], rng.random()),
        )
        return [
            Candidate(
                worker_id=w.worker_id, score=-wait[w.worker_id], overlap_blocks=overlap[w.worker_id]
            )
            for w in [first, *rest]
        ]

    def _decide(
        self,
        query: RouteQuery,
        workers: Sequence[WorkerView],
        eligible: list[WorkerView],
        wait: dict[str, float],
        rng: random.Random,
    ) -> WorkerView:
        mean = sum(self.inflight(w.worker_id) for w in eligible) / len(eligible)

        def by_wait(pool: Sequence[WorkerView]) -> WorkerView:
            return _argmin(pool, lambda w: wait[w.worker_id], TIE_EPSILON_S, rng)

        if self._kv_imbalanced(eligible, query.block_size):
            return by_wait(eligible)
        if self.index == "events":
            return self._events(query, eligible, mean, by_wait, rng)
        blocks = query.prompt_blocks
        # the tree is shared: its deepest match may belong to a worker left out (overloaded),
        # whose holders then leave no candidate and the request takes the miss path
        match = {w.worker_id: self.tree_match(w.worker_id, query.block_hashes) for w in workers}
        deepest = max(match.values())
        if not query.prompt_tokens or deepest * query.block_size / query.prompt_tokens <= (
            self.cache_threshold
        ):
            return by_wait(eligible)
        # every holder of the matched prefix scores 1.0 before decay (select_matched_candidate)
        scores = {w.worker_id: 1.0 for w in eligible if match[w.worker_id] == deepest}
        self._decay(scores, eligible, max(1, blocks), query.block_size)
        group = self._group(scores, rng)
        return self._final(group, eligible, mean, by_wait)

    def _kv_imbalanced(self, eligible: list[WorkerView], block_size: int) -> bool:
        if self.balance_token_usage_threshold >= 1 and self.overload_token_usage_threshold >= 1:
            return False
        usages = [self.usage(w, block_size) for w in eligible]
        return (
            max(usages) > self.overload_token_usage_threshold
            or max(usages) - min(usages) > self.balance_token_usage_threshold
        )

    def _events(
        self,
        query: RouteQuery,
        eligible: list[WorkerView],
        mean: float,
        by_wait: Callable[[Sequence[WorkerView]], WorkerView],
        rng: random.Random,
    ) -> WorkerView:
        blocks = max(1, query.prompt_blocks)
        raw = {
            w.worker_id: min(query.overlaps.get(w.worker_id, 0), query.prompt_blocks)
            for w in eligible
        }
        best = max(raw.values())
        scores = {wid: float(n) for wid, n in raw.items() if n > 0}
        exact = (
            self.selection_temperature <= 0
            and not self.booking_ttl_s
            and not (self.overlap_decay > 0)
        )
        if exact:  # only the deepest holders are gathered (Gather::TopGroup)
            scores = {wid: s for wid, s in scores.items() if s == best}
        self._decay(scores, eligible, blocks, query.block_size)
        for wid, predicted in self._predicted(query).items():
            if wid in raw and predicted > raw[wid]:  # a booking deeper than the index's view
                scores[wid] = predicted
        thin = best / blocks <= self.cache_threshold or (
            best <= WARMUP_MISS_BLOCKS and best * 2 < blocks
        )
        warm = self._warmup(eligible, raw, best, blocks, thin, mean, rng)
        if warm is not None:
            return warm
        return self._final(self._group(scores, rng), eligible, mean, by_wait)

    def _decay(
        self, scores: dict[str, float], eligible: list[WorkerView], blocks: int, bs: int
    ) -> None:
        """Anti-hotspot decay by waiting-prefill backlog; workers without a report are spared."""
        if self.overlap_decay <= 0 or not scores:
            return
        backlog = {
            w.worker_id: max(0, w.prefill_tokens)
            for w in eligible
            if w.worker_id in scores and w.kv_total_blocks > 0
        }
        if not backlog:
            return
        floor = min(backlog.values())
        for wid, b in backlog.items():
            scores[wid] /= 1.0 + self.overlap_decay * ((b - floor) / bs / blocks)

    def _group(self, scores: dict[str, float], rng: random.Random) -> list[str]:
        """The maximum-score group (a softmax-sampled score's group at temperature > 0)."""
        kept = {wid: s for wid, s in scores.items() if s > 0}
        if not kept:
            return []
        ids = sorted(kept)
        if self.selection_temperature > 0:
            k = softmax_index([-kept[i] for i in ids], self.selection_temperature, rng)
            chosen = kept[ids[k]]
        else:
            chosen = max(kept.values())
        return [i for i in ids if kept[i] == chosen]

    def _final(
        self,
        group: list[str],
        eligible: list[WorkerView],
        mean: float,
        by_wait: Callable[[Sequence[WorkerView]], WorkerView],
    ) -> WorkerView:
        """select_final_from_affinity: safe holders, else a spill to the ungated fleet."""
        if not group:
            return by_wait(eligible)
        safe = [
            w for w in eligible if w.worker_id in group and not self.over_gate(w.worker_id, mean)
        ]
        if safe:
            return by_wait(safe)
        ungated = [w for w in eligible if not self.over_gate(w.worker_id, mean)]
        return by_wait(ungated or eligible)

    def _warmup(
        self,
        eligible: list[WorkerView],
        raw: dict[str, int],
        best: int,
        blocks: int,
        thin_overlap: bool,
        mean: float,
        rng: random.Random,
    ) -> WorkerView | None:
        """The warm-up slice (thin misses) and divert (hits) toward thin workers: indexed blocks
        are the engine's reported ``kv_used_blocks``, the fleet level their upper median."""
        if self.warmup_share <= 0 or self.warmup_thin_ratio <= 0:
            return None
        sizes = sorted(w.kv_used_blocks for w in eligible)
        level = sizes[len(sizes) // 2]
        if level < self.warmup_blocks:
            return None
        thin = [
            w
            for w in eligible
            if w.kv_used_blocks == 0 or w.kv_used_blocks < level * self.warmup_thin_ratio
        ]
        if thin_overlap:
            pool = [w for w in thin if not self.over_gate(w.worker_id, mean)]
            period = max(1, round(1.0 / self.warmup_share))
        else:
            if not self.warmup_divert_every:
                return None
            pool = thin
            if best / blocks > DIVERT_SHALLOW_SHARE:  # deep: only away from a busier holder
                deepest = [wid for wid, n in raw.items() if n == best]
                holder = min(self.inflight(wid) for wid in deepest)
                pool = [
                    w for w in thin if w.worker_id in deepest or self.inflight(w.worker_id) < holder
                ]
            period = self.warmup_divert_every
        if not pool or rng.random() * period >= 1.0:
            return None
        return _argmin(pool, lambda w: float(self.inflight(w.worker_id)), 0.0, rng)

    def _predicted(self, query: RouteQuery) -> dict[str, float]:
        """Workers a live booking places the prompt's prefix on, with the blocks it covers."""
        if not self.booking_ttl_s or self.index != "events":
            return {}
        found: dict[str, float] = {}
        hashes = query.block_hashes
        for pos in reversed(_key_positions(len(hashes))):
            for wid, expires in self._placed.get(hashes[pos], ()):
                if expires > query.now and wid not in found:
                    found[wid] = float(pos + 1)
        return found

    # ---- what happened -----------------------------------------------------------------------
    def on_dispatched(self, query: RouteQuery, worker_id: str) -> None:
        """Count the request in flight, credit its prompt as since-poll work, insert it into the
        tree (tree mode) and book its placement (event mode, bookings on)."""
        previous = self._where.pop(query.request_id, None)
        if previous is not None:
            self._inflight[previous] -= 1
        self._where[query.request_id] = worker_id
        self._inflight[worker_id] = self.inflight(worker_id) + 1
        self._since.setdefault(worker_id, deque(maxlen=SINCE_POLL_KEPT)).append(query.prompt_tokens)
        if self.index == "tree":
            self._insert(query, worker_id)
        elif self.booking_ttl_s:
            self._book(query, worker_id)

    def on_finished(self, request_id: str, worker_id: str, now: float) -> None:
        where = self._where.pop(request_id, None)
        if where is not None:
            self._inflight[where] -= 1

    def _insert(self, query: RouteQuery, worker_id: str) -> None:
        tree = self._trees.setdefault(worker_id, set())
        for h in reversed(query.block_hashes):  # deepest first: LRU evicts leaves first
            tree.add(h)
            self._lru[(worker_id, h)] = None
            self._lru.move_to_end((worker_id, h))
        if self._last_eviction is None:
            self._last_eviction = query.now
        elif query.now - self._last_eviction >= self.eviction_interval_s:
            self._last_eviction = query.now
            cap = max(1, self.max_tree_size // query.block_size)
            while len(self._lru) > cap:
                (wid, h), _ = self._lru.popitem(last=False)
                self._trees[wid].discard(h)

    def _book(self, query: RouteQuery, worker_id: str) -> None:
        expires = query.now + self.booking_ttl_s
        hashes = query.block_hashes
        for pos in _key_positions(len(hashes)):
            live = [
                (w, e)
                for w, e in self._placed.get(hashes[pos], ())
                if e > query.now and w != worker_id
            ]
            self._placed[hashes[pos]] = [
                *live[-(MAX_PLACEMENTS_PER_KEY - 1) :],
                (worker_id, expires),
            ]
        if len(self._placed) > 1 << 16:  # MAX_PREDICTED_KEYS: drop what expired
            self._placed = {
                h: p for h, p in self._placed.items() if any(e > query.now for _, e in p)
            }


def _sum_last(values: deque[int] | tuple[()], n: int) -> int:
    """The sum of the last ``n`` values (the dispatches no report has reflected yet)."""
    total = 0
    for i, v in enumerate(reversed(values)):
        if i >= n:
            break
        total += v
    return total


def _key_positions(blocks: int) -> list[int]:
    """accounting.rs ``key_positions``: prefix lengths 1, 2, 4, ... then the whole prompt."""
    out, count = [], 1
    while count < blocks:
        out.append(count - 1)
        count *= 2
    if blocks:
        out.append(blocks - 1)
    return out


def _argmin(
    pool: Sequence[WorkerView],
    value: Callable[[WorkerView], float],
    epsilon: float,
    rng: random.Random,
) -> WorkerView:
    """The lowest ``value``, uniformly among those within ``epsilon`` of it."""
    low = min(value(w) for w in pool)
    return rng.choice([w for w in pool if value(w) <= low + epsilon])
