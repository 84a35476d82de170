"""Dynamo 1.6.1's KV router with its shipped defaults: the default selector's cost over its own
active-sequence tracker, in blocks; lowest cost wins.

    cost = prefill_load_scale * max(0, (active_prefill_tokens + prompt_tokens) / block_size
                                       - credit)
         + active_blocks_with_this_prompt + decode_active_request_weight * active_requests
    credit = overlap_score_credit * decay * GPU overlap + host_cache_hit_weight * host-only overlap

The tracker is this policy's own: ``on_dispatched`` books the prompt's blocks (deduplicated by
hash against blocks already active there, ``router_assume_kv_reuse``) and its uncached tokens as
active prefill; ``on_started`` (first token) frees the prefill, ``on_finished`` the rest. See
README.md for the sources and approximations.
"""

from __future__ import annotations

import math
import random
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from thunderagent.routing.cost import (
    cached_blocks,
    candidates,
    finite_at_least,
    finite_positive,
    in_unit_interval,
    rank_by_cost,
    require,
)
from thunderagent.routing.policy import POLICIES, PolicyHooks, RouteQuery, WorkerView
from thunderagent.schemas import Candidate

_P = "dynamo_kv"


@dataclass(slots=True)
class _Booking:
    """One routed request as Dynamo's slot tracker holds it."""

    worker_id: str
    blocks: tuple[int, ...]
    """Prompt block hashes booked as active (empty when ``assume_kv_reuse`` is off)."""
    block_count: int
    at: float


@POLICIES.register("dynamo_kv")
@dataclass
class DynamoKv(PolicyHooks):
    name: ClassVar[str] = _P

    prefill_load_scale: float = 1.0
    """KvRouterConfig ``prefill_load_scale`` (1.6.1 default 1.0): weight of the adjusted prompt-
    side blocks against decode blocks."""
    overlap_score_credit: float = 1.0
    """``overlap_score_credit`` (default 1.0): credit per GPU-resident prefix block."""
    overlap_score_credit_decay: float = 0.0
    """``overlap_score_credit_decay`` (default 0.0, off): the credit shrinks by 1 / (1 + decay *
    excess active-prefill blocks over the least loaded worker / request blocks)."""
    host_cache_hit_weight: float = 0.75
    """``host_cache_hit_weight`` (default 0.75): credit per block found only in host memory."""
    temperature: float = 0.0
    """``router_temperature`` (default 0.0): deterministic minimum; above 0 a softmax over
    min-max normalized costs."""
    decode_active_request_weight: float = 0.0
    """``decode_active_request_weight`` (default 0.0): block-equivalent cost per active request."""
    assume_kv_reuse: bool = True
    """``router_assume_kv_reuse`` (default True): a prompt block already active on a worker adds
    no decode load there. False: every request's blocks count separately."""
    track_prefill_tokens: bool = True
    """``router_track_prefill_tokens`` (default True): active prefill tokens count as load."""
    expiry_s: float = 3600.0
    """``EXPIRY_DURATION`` (lib/kv-router/src/sequences/single.rs, 3600 s): a booking this old is
    freed even if its completion never arrived."""
    predict_on_route: bool = False
    """``router_predicted_ttl_secs`` set (1.6.1 default None, off): a routed request's blocks
    count as cached on its worker before its KV events arrive, here through the router's
    in-flight overlay and its TTL (``inflight_ttl_s``, 30 s) in place of that setting's."""
    overlap_score_weight: float | None = None
    """Deprecated 1.6.1 alias of ``prefill_load_scale`` (wins when set; 0 also zeroes
    ``overlap_score_credit``), accepted so older configurations keep their meaning."""

    _bookings: OrderedDict[str, _Booking] = field(init=False, repr=False)
    _active: dict[str, Counter[int]] = field(init=False, repr=False)
    _counts: dict[str, int] = field(init=False, repr=False)
    """worker -> active blocks when ``assume_kv_reuse`` is off (no hashes to share)."""
    _prefill: dict[str, dict[str, int]] = field(init=False, repr=False)
    """worker -> booked request id -> its uncached prompt tokens (prompt minus the worker's GPU
    overlap), 0 once its first token is out."""

    def __post_init__(self) -> None:
        if self.overlap_score_weight is not None:
            finite_at_least(_P, "overlap_score_weight", self.overlap_score_weight, 0.0)
            self.prefill_load_scale = float(self.overlap_score_weight)
            if self.overlap_score_weight == 0:
                self.overlap_score_credit = 0.0
        finite_at_least(_P, "prefill_load_scale", self.prefill_load_scale, 0.0)
        finite_at_least(_P, "overlap_score_credit", self.overlap_score_credit, 0.0)
        finite_at_least(_P, "overlap_score_credit_decay", self.overlap_score_credit_decay, 0.0)
        in_unit_interval(_P, "host_cache_hit_weight", self.host_cache_hit_weight)
        finite_at_least(_P, "temperature", self.temperature, 0.0)
        finite_at_least(_P, "decode_active_request_weight", self.decode_active_request_weight, 0)
        for flag in ("assume_kv_reuse", "track_prefill_tokens", "predict_on_route"):
            value = getattr(self, flag)
            require(_P, flag, value, isinstance(value, bool), "must be true or false")
        finite_positive(_P, "expiry_s", self.expiry_s)
        self._bookings = OrderedDict()
        self._active, self._counts, self._prefill = {}, {}, {}

    # ---- the tracker's view ----------------------------------------------------------------
    def keeps_approximate_cache(self) -> bool:
        """``use_kv_events=false``: Dynamo's router records each request's blocks where it
        routed them, kept ``router_ttl_secs`` (``router_approximate_cache_policy="ttl"``)."""
        return True

    def reads_dispatch_overlay(self) -> bool:
        return self.predict_on_route

    def active_blocks(self, worker_id: str) -> int:
        if self.assume_kv_reuse:
            return len(self._active.get(worker_id, ()))
        return self._counts.get(worker_id, 0)

    def new_blocks(self, worker_id: str, block_hashes: Sequence[int]) -> int:
        """Prompt blocks not already active on the worker (all of them without kv reuse)."""
        active = self._active.get(worker_id) if self.assume_kv_reuse else None
        if not active:
            return len(block_hashes)
        return sum(1 for h in block_hashes if h not in active)

    def active_prefill_tokens(self, worker_id: str) -> int:
        """Booked prompt tokens still before their first token (Dynamo releases them there,
        ``mark_prefill_completed``)."""
        booked = self._prefill.get(worker_id)
        return sum(booked.values()) if booked else 0

    def costs(self, query: RouteQuery, workers: Sequence[WorkerView]) -> dict[str, float]:
        bs = query.block_size
        prefill = {
            w.worker_id: self.active_prefill_tokens(w.worker_id) if self.track_prefill_tokens else 0
            for w in workers
        }
        floor = min(prefill.values())
        request_blocks = max(1, math.ceil(query.prompt_tokens / bs))
        out: dict[str, float] = {}
        for w in workers:
            wid = w.worker_id
            gpu, host_only = cached_blocks(query, wid)
            decay = 1.0
            if self.track_prefill_tokens and self.overlap_score_credit_decay > 0:
                excess = (prefill[wid] - floor) / bs / request_blocks
                decay = 1.0 / (1.0 + self.overlap_score_credit_decay * excess)
            credit = (
                self.overlap_score_credit * decay * gpu + self.host_cache_hit_weight * host_only
            )
            raw = (prefill[wid] + query.prompt_tokens) / bs if self.track_prefill_tokens else 0.0
            decode = self.active_blocks(wid) + self.new_blocks(wid, query.block_hashes)
            requests = len(self._prefill.get(wid, ()))
            out[wid] = (
                self.prefill_load_scale * max(0.0, raw - credit)
                + decode
                + self.decode_active_request_weight * requests
            )
        return out

    def rank(
        self, query: RouteQuery, workers: Sequence[WorkerView], rng: random.Random
    ) -> list[Candidate]:
        cost = self.costs(query, workers)
        ordered = rank_by_cost(workers, cost, lambda w: w.worker_id, self.temperature, rng)
        return candidates(ordered, cost, query)

    # ---- booking -------------------------------------------------------------------------
    def on_dispatched(self, query: RouteQuery, worker_id: str) -> None:
        """Book the prompt on ``worker_id``: its blocks as active, its uncached tokens as
        active prefill. A request already booked (a re-dispatch) is freed first."""
        self._expire(query.now)
        self._free(query.request_id)
        cached = min(query.overlaps.get(worker_id, 0), query.prompt_blocks) * query.block_size
        hashes = tuple(query.block_hashes) if self.assume_kv_reuse else ()
        booking = _Booking(
            worker_id=worker_id,
            blocks=hashes,
            block_count=query.prompt_blocks,
            at=query.now,
        )
        self._bookings[query.request_id] = booking
        uncached = max(0, query.prompt_tokens - cached)
        self._prefill.setdefault(worker_id, {})[query.request_id] = uncached
        if self.assume_kv_reuse:
            self._active.setdefault(worker_id, Counter()).update(hashes)
        else:
            self._counts[worker_id] = self._counts.get(worker_id, 0) + booking.block_count

    def on_started(self, request_id: str, worker_id: str, now: float) -> None:
        """First token: the prompt no longer counts as active prefill; its blocks stay active
        until the end (``mark_prefill_completed``). Unknown ids are ignored."""
        booked = self._prefill.get(worker_id)
        if booked is not None and request_id in booked:
            booked[request_id] = 0

    def on_finished(self, request_id: str, worker_id: str, now: float) -> None:
        """Free the request's blocks and prefill (Dynamo's ``free``); unknown ids are ignored."""
        self._free(request_id)

    def _free(self, request_id: str) -> None:
        booking = self._bookings.pop(request_id, None)
        if booking is None:
            return
        wid = booking.worker_id
        self._prefill[wid].pop(request_id, None)
        if self.assume_kv_reuse:
            active = self._active[wid]
            active.subtract(booking.blocks)
            for h in booking.blocks:
                if active.get(h, 0) <= 0:
                    active.pop(h, None)
        else:
            self._counts[wid] -= booking.block_count

    def _expire(self, now: float) -> None:
        """Free bookings older than ``expiry_s`` (dispatch order, so the oldest come first)."""
        while self._bookings:
            rid, oldest = next(iter(self._bookings.items()))
            if now - oldest.at < self.expiry_s:
                return
            self._free(rid)
