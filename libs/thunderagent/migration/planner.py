"""The migration planner: observations in, actions out, the clock passed in.

Feed it routing decisions (``observe_route``), load reports (``observe_load``) and drain notices
(``set_draining``); call ``plan(now, holders)`` periodically and carry out what it returns; report
each move's end with ``on_transfer_done`` / ``on_transfer_failed``. ``holders(prefix)`` names the
workers caching a prefix (the shell asks its index replica; the replay asks its engines).

Rules, in order, for each tracked prefix (most requested first):

1. **Drain.** Every worker holding a prefix is leaving, and the prefix was requested in the
   window: migrate it to the least loaded worker that stays (it would be lost otherwise).
2. **Hot.** The prefix is requested at least ``min_rate``, there are fewer than
   ``replica_cap`` holders, a worker of the same model has room, the cost model says the copy
   pays (``cost.estimate``), and either gate is open:

   * *demand*: the requests per holder (copies in flight and copies just landed count as
     holders) reach ``min_rate_per_holder``: copies are started, several at once from different
     sources, until the rate per holder would fall below it (a burst fans out in rounds of one
     transfer time instead of one move per ``cooldown_s``);
   * *saturation* (``hot_for_s`` > 0): every holder has been saturated, queued requests or
     queued prefill, that long (behind a router that queues on holders): one copy at a time.

   Replicate, or migrate when the source's running requests are pressing on its KV (freeing the
   source is then worth it too).
3. **Cold.** A replica this planner made, of a prefix hit less than ``drop_rate`` per second for
   ``cold_for_s`` while another worker still holds it: drop it.

Hysteresis: saturation has two thresholds (``busy_s`` in, ``idle_s`` out) and must last
``hot_for_s`` when that is set; demand counts its own copies as holders the moment they are
ordered; a copy must pay ``benefit_margin`` times its cost; a prefix rests ``cooldown_s`` after
each move before the saturation gate or a drop acts on it again. Failures back off
exponentially per prefix and per target; after ``max_failures`` in a row a prefix is given up
until it goes cold and is forgotten.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from thunderagent.migration.cost import Estimate, LinkBook, estimate
from thunderagent.migration.demand import DemandTracker, PrefixDemand
from thunderagent.migration.model import (
    Action,
    Drop,
    Migrate,
    Move,
    PlannerStats,
    Replicate,
    RouteSeen,
    WorkerSeen,
)
from thunderagent.migration.params import MigrationParams
from thunderagent.prefill_model import queued_prefill_work

Holders = Callable[[int], Collection[str]]


@dataclass(slots=True)
class _Worker:
    load: WorkerSeen
    saturated_since: float | None = None
    """Set while the worker is saturated (hysteresis: busy_s in, idle_s out)."""
    draining: bool = False
    failures: int = 0
    blocked_until: float = 0.0


@dataclass(slots=True)
class _Prefix:
    cold_since: float | None = None
    cooldown_until: float = 0.0
    """After a move ended: the saturation gate and drops wait until then."""
    backoff_until: float = 0.0
    """After a failed move: nothing is tried on the prefix until then."""
    failures: int = 0
    abandoned: bool = False
    made: set[str] = field(default_factory=set)
    """Workers holding a replica this planner put there."""
    landed: dict[str, float] = field(default_factory=dict)
    """Targets of copies that ended in the last ``cooldown_s`` (worker -> when): holders the
    index may not show yet."""
    inflight: set[str] = field(default_factory=set)
    """Action ids of this prefix's moves in flight."""


@dataclass(slots=True)
class _Inflight:
    action: Action
    started: float


class MigrationPlanner:
    def __init__(self, params: MigrationParams | None = None, *, id_prefix: str = "m") -> None:
        self.params = (params or MigrationParams()).validate()
        self.demand = DemandTracker(self.params.window_s, self.params.max_tracked)
        self.workers: dict[str, _Worker] = {}
        self.prefixes: dict[int, _Prefix] = {}
        self.inflight: dict[str, _Inflight] = {}
        self.links = LinkBook()
        self.stats = PlannerStats()
        self.id_prefix = id_prefix
        self._next_id = 0

    # ---- observations --------------------------------------------------------------------
    def observe_route(self, route: RouteSeen, now: float) -> int | None:
        """Count one routed request; returns the prefix it was credited to."""
        return self.demand.observe(route, now)

    def observe_load(self, load: WorkerSeen, now: float) -> None:
        w = self.workers.get(load.worker_id)
        if w is None:
            w = self.workers[load.worker_id] = _Worker(load)
        w.load = load
        backlog = self.backlog_s(load)
        if w.saturated_since is None and (load.queued > 0 or backlog >= self.params.busy_s):
            w.saturated_since = now
        elif w.saturated_since is not None and load.queued == 0 and backlog <= self.params.idle_s:
            w.saturated_since = None

    def set_draining(self, worker_id: str, draining: bool = True) -> None:
        w = self.workers.get(worker_id)
        if w is None:
            w = self.workers[worker_id] = _Worker(WorkerSeen(worker_id))
        w.draining = draining

    def forget_worker(self, worker_id: str) -> None:
        """The worker is gone; moves in flight with it are the shell's to fail."""
        self.workers.pop(worker_id, None)
        for st in self.prefixes.values():
            st.made.discard(worker_id)

    # ---- derived load --------------------------------------------------------------------
    def backlog_s(self, load: WorkerSeen) -> float:
        """Seconds of prefill queued: the backlog's tokens split over the waiting requests."""
        tokens = max(load.prefill_backlog_tokens, 0)
        work = queued_prefill_work(tokens, load.queued, self.params.attention_parity_tokens)
        return work / self.params.prefill_tokens_per_s

    def _load(self, worker_id: str) -> WorkerSeen:
        w = self.workers.get(worker_id)
        return w.load if w is not None else WorkerSeen(worker_id)

    @staticmethod
    def live_fraction(load: WorkerSeen) -> float:
        total = load.kv_total_blocks * load.block_size
        return load.live_tokens / total if total > 0 else 0.0

    def saturated_for(self, worker_id: str, now: float) -> float:
        """Seconds the worker has been saturated (0: it is not)."""
        w = self.workers.get(worker_id)
        return 0.0 if w is None or w.saturated_since is None else now - w.saturated_since

    # ---- decisions -----------------------------------------------------------------------
    def plan(self, now: float, holders: Holders) -> list[Action]:
        """The actions to start now (each is in flight until reported done or failed)."""
        self.expire(now)
        actions: list[Action] = []
        budget = self.params.max_inflight - len(self.inflight)
        ranked = sorted(self.demand.prefixes(), key=lambda p: (-self.demand.rate(p, now), p))
        for prefix in ranked:
            if budget <= 0:
                break
            for action in self._consider(prefix, now, holders, budget):
                self._start(action, now)
                actions.append(action)
                budget -= 1
        self._forget_cold(now)
        return actions

    def _consider(self, prefix: int, now: float, holders: Holders, budget: int) -> list[Action]:
        st = self.prefixes.setdefault(prefix, _Prefix())
        rate = self.demand.rate(prefix, now)
        if rate < self.params.drop_rate:
            st.cold_since = now if st.cold_since is None else st.cold_since
        else:
            st.cold_since = None
        st.landed = {w: t for w, t in st.landed.items() if now - t < self.params.cooldown_s}
        if st.abandoned or now < st.backoff_until:
            return []
        live = sorted(w for w in holders(prefix) if w in self.workers)
        # a replica the engine evicted on its own is no longer ours (one that just landed may
        # not show in the index yet)
        st.made &= {*live, *st.landed}
        if st.inflight or now < st.cooldown_until:
            return self._fan_out(prefix, st, rate, live, now, budget)
        action = (
            self._drain_action(prefix, live, now)
            or self._saturated_action(prefix, rate, live, now)
            or self._drop_action(prefix, st, rate, live, now)
        )
        if action is not None:
            return [action]
        return self._fan_out(prefix, st, rate, live, now, budget)

    def _drain_action(self, prefix: int, live: list[str], now: float) -> Action | None:
        if not live or not all(self.workers[w].draining for w in live):
            return None
        if self.demand.hits(prefix, now) < self.params.drain_min_hits:
            return None
        demand = self.demand.get(prefix)
        source = live[0]
        target = self._pick_target(demand, set(live), now, strict=False)
        if target is None:
            return None
        est = self._estimate(prefix, source, target, 0.0, len(live), now)
        reason = f"drain: {source} is leaving and holds the only copy"
        return self._move(Migrate, prefix, source, target, est, reason)

    def _hot(self, prefix: int, rate: float, live: list[str]) -> bool:
        """The conditions both hot gates share."""
        p = self.params
        demand = self.demand.get(prefix)
        if demand.blocks < p.min_blocks or rate < p.min_rate or not live:
            return False
        return not any(self.workers[w].draining for w in live)

    def _saturated_action(
        self, prefix: int, rate: float, live: list[str], now: float
    ) -> Action | None:
        """The saturation gate: one copy once every holder has queued for ``hot_for_s``."""
        p = self.params
        if p.hot_for_s <= 0 or not self._hot(prefix, rate, live) or len(live) >= p.replica_cap:
            return None
        if min(self.saturated_for(w, now) for w in live) < p.hot_for_s:
            return None
        return self._copy(prefix, rate, live, set(live), now, "all saturated")

    def _fan_out(
        self, prefix: int, st: _Prefix, rate: float, live: list[str], now: float, budget: int
    ) -> list[Action]:
        """The demand gate: copies until the rate per holder (in flight and just landed
        included) falls under ``min_rate_per_holder``, from holders whose links are free."""
        p = self.params
        if p.min_rate_per_holder <= 0 or not self._hot(prefix, rate, live):
            return []
        coming = {self.inflight[a].action.target for a in st.inflight if a in self.inflight}
        have = {*live, *st.landed} | coming
        out: list[Action] = []
        while len(have) < p.replica_cap and len(out) < budget:
            if len(st.inflight) + len(out) >= p.max_moves_per_prefix:
                break
            if rate / len(have) < p.min_rate_per_holder:
                break
            sources = [w for w in live if w not in {a.source for a in out}]
            why = f"{len(have)} holder(s)"
            # more holders is the point: the source keeps its copy even under KV pressure
            action = self._copy(prefix, rate, sources, have, now, why, may_migrate=False)
            if action is None:
                break
            out.append(action)
            have.add(action.target)
        return out

    def _copy(
        self,
        prefix: int,
        rate: float,
        sources: list[str],
        have: set[str],
        now: float,
        why: str,
        *,
        may_migrate: bool = True,
    ) -> Move | None:
        """A copy of ``prefix`` to the best worker outside ``have``, if one has room and the
        copy pays; a ``Migrate`` when ``may_migrate`` and the source is pressed for KV."""
        p = self.params
        target = self._pick_target(self.demand.get(prefix), have, now, strict=True)
        source = self._pick_source(sources)
        if target is None or source is None:
            return None
        est = self._estimate(prefix, source, target, rate, len(have), now)
        if not est.pays(p.benefit_margin):
            return None
        pressed = may_migrate and self.live_fraction(self._load(source)) >= p.pressure_live
        reason = (
            f"hot: {rate:.1f} req/s on {why}; saves "
            f"{est.benefit_s:.2f}s of prefill for {est.transfer_s:.3f}s of transfer"
        )
        return self._move(Migrate if pressed else Replicate, prefix, source, target, est, reason)

    def _drop_action(
        self, prefix: int, st: _Prefix, rate: float, live: list[str], now: float
    ) -> Action | None:
        p = self.params
        if not st.made or len(live) <= 1 or st.cold_since is None:
            return None
        if now - st.cold_since < p.cold_for_s:
            return None
        worker = min(sorted(st.made), key=lambda w: (-self.live_fraction(self._load(w)), w))
        reason = f"cold: {rate:.2f} req/s for {now - st.cold_since:.0f}s, {len(live)} holders"
        return Drop(self._new_id(), prefix, self.demand.get(prefix).blocks, worker, reason)

    def _pick_source(self, live: Collection[str]) -> str | None:
        """The holder under the most KV pressure (a migration frees it), then by id."""
        free = [w for w in live if self.links.moves(w) < self.params.max_moves_per_worker]
        if not free:
            return None
        return min(free, key=lambda w: (-self.live_fraction(self._load(w)), w))

    def _pick_target(
        self, demand: PrefixDemand | None, exclude: set[str], now: float, *, strict: bool
    ) -> str | None:
        """Least loaded worker of the prefix's model (with its LoRA adapter loaded, if it is
        an adapter's) that could take a copy. ``strict``: it must have room (not saturated, KV
        mostly free of running requests); a drain takes any worker."""
        p = self.params
        model = demand.model if demand else ""
        lora = demand.lora_name if demand else None
        best = None
        for wid, w in self.workers.items():
            if wid in exclude or w.draining or now < w.blocked_until:
                continue
            if model and w.load.model and w.load.model != model:
                continue
            if lora and lora not in w.load.lora_adapters:
                continue
            if self.links.moves(wid) >= p.max_moves_per_worker:
                continue
            live = self.live_fraction(w.load)
            if strict and (w.saturated_since is not None or live > p.target_max_live):
                continue
            key = (self.backlog_s(w.load), live, w.load.queued + w.load.running, wid)
            if best is None or key < best[0]:
                best = (key, wid)
        return None if best is None else best[1]

    def _estimate(
        self, prefix: int, source: str, target: str, rate: float, holders: int, now: float
    ) -> Estimate:
        src = self.workers.get(source)
        return estimate(
            self.params,
            blocks=self.demand.get(prefix).blocks,
            block_size=src.load.block_size if src else 16,
            rate=rate,
            holders=holders,
            link_wait_s=self.links.wait(now, source, target),
        )

    def _move(self, cls, prefix, source, target, est: Estimate, reason: str) -> Move:
        blocks = self.demand.get(prefix).blocks
        return cls(self._new_id(), prefix, blocks, source, target, est.bytes, est.transfer_s,
                   est.benefit_s, reason)  # fmt: skip

    def _new_id(self) -> str:
        self._next_id += 1
        return f"{self.id_prefix}-{self._next_id}"

    def _start(self, action: Action, now: float) -> None:
        self.inflight[action.action_id] = _Inflight(action, now)
        self.prefixes.setdefault(action.prefix_hash, _Prefix()).inflight.add(action.action_id)
        kind = "drop" if isinstance(action, Drop) else type(action).__name__.lower()
        self.stats.ordered[kind] += 1
        if not isinstance(action, Drop):
            self.links.book(action.action_id, now, action.transfer_s, action.source, action.target)

    def _forget_cold(self, now: float) -> None:
        for prefix in self.demand.prefixes():
            st = self.prefixes.get(prefix)
            if self.demand.hits(prefix, now) or (st and (st.made or st.inflight)):
                continue
            self.demand.forget(prefix)
            self.prefixes.pop(prefix, None)

    # ---- manual orders -------------------------------------------------------------------
    def order(
        self,
        prefix: int,
        now: float,
        holders: Holders,
        *,
        blocks: int = 0,
        source: str = "",
        target: str = "",
        migrate: bool = False,
        reason: str = "ordered",
    ) -> Move:
        """A move someone asked for: checked, booked like the planner's own, not judged.
        Raises ``ValueError`` with the reason when it cannot start."""
        st = self.prefixes.setdefault(prefix, _Prefix())
        if st.inflight:
            raise ValueError(f"prefix {prefix:#x} already has move {min(st.inflight)} in flight")
        live = sorted(holders(prefix))
        if not source and not live:
            raise ValueError(f"no worker is known to hold prefix {prefix:#x}")
        source = source or self._pick_source(live) or ""
        if not source:
            raise ValueError(f"every holder of prefix {prefix:#x} is busy with another move")
        demand = self.demand.get(prefix)
        target = target or self._pick_target(demand, {*live, source}, now, strict=False) or ""
        if not target or target == source:
            raise ValueError(f"no target for prefix {prefix:#x} (source {source})")
        blocks = blocks or (demand.blocks if demand else 0)
        if demand is None:  # tracked for the move, not counted as demand
            self.demand.track(prefix, blocks)
        est = self._estimate(prefix, source, target, 0.0, len(live), now)
        move = self._move(Migrate if migrate else Replicate, prefix, source, target, est, reason)
        self._start(move, now)
        return move

    # ---- outcomes ------------------------------------------------------------------------
    def on_transfer_done(self, action_id: str, now: float, *, moved_bytes: int = 0) -> None:
        flight = self._end(action_id)
        if flight is None:
            return
        action = flight.action
        st = self.prefixes.setdefault(action.prefix_hash, _Prefix())
        st.failures = 0
        st.cooldown_until = now + self.params.cooldown_s
        if isinstance(action, Drop):
            st.made.discard(action.worker)
        else:
            if isinstance(action, Migrate):
                st.made.discard(action.source)
            st.made.add(action.target)
            st.landed[action.target] = now
            if action.target in self.workers:
                self.workers[action.target].failures = 0
        self.stats.done += 1
        self.stats.moved_bytes += moved_bytes

    def on_transfer_failed(self, action_id: str, now: float, reason: str = "") -> None:
        flight = self._end(action_id)
        if flight is None:
            return
        p = self.params
        action = flight.action
        st = self.prefixes.setdefault(action.prefix_hash, _Prefix())
        if isinstance(action, Drop):
            # the replica stays (in use, extended by other prompts, or the engine cannot free
            # it): it is no longer ours to drop, and that says nothing against copying later
            st.made.discard(action.worker)
            self.stats.drops_refused += 1
            return
        self.stats.failed += 1
        st.failures += 1
        st.backoff_until = now + p.cooldown_s * 2 ** (st.failures - 1)
        if st.failures >= p.max_failures and not st.abandoned:
            st.abandoned = True
            self.stats.abandoned_prefixes += 1
        target = getattr(action, "target", None)
        if target in self.workers:
            w = self.workers[target]
            w.failures += 1
            w.blocked_until = now + p.target_backoff_s * 2 ** (w.failures - 1)

    def expire(self, now: float) -> list[str]:
        """Moves older than ``transfer_timeout_s`` count as failed; returns their ids."""
        late = [
            aid
            for aid, f in self.inflight.items()
            if now - f.started >= self.params.transfer_timeout_s
        ]
        for aid in late:
            self.stats.timed_out += 1
            self.on_transfer_failed(aid, now, "timed out")
        return late

    def _end(self, action_id: str) -> _Inflight | None:
        flight = self.inflight.pop(action_id, None)
        if flight is None:
            return None
        self.links.free(action_id)
        st = self.prefixes.get(flight.action.prefix_hash)
        if st is not None:
            st.inflight.discard(action_id)
        return flight

    def replicated_prefixes(self) -> int:
        """Prefixes holding at least one replica this planner made."""
        return sum(1 for st in self.prefixes.values() if st.made)
