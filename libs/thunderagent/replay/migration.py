"""KV migration in the replay: the live migration service's planner, fed in virtual time, its
actions carried out on the simulated engines.

``ReplayMigration.attach(replay, mode)`` hooks one ``MigrationPlanner``
(``thunderagent.migration``, the object ``services/thunderagent/migrator`` runs) into a
``Replay``; the driver calls it at five points, each fed what the live service is fed:

* ``routed``: every routing decision becomes a ``RouteSeen`` (the prefix hash of the deepest
  block cached on the chosen worker, its depth, the ranked candidates' overlaps);
* ``load``: every load report the router gets becomes a ``WorkerSeen``;
* ``tick``: ``plan(now, holders)`` every ``interval_s`` (the live service's 0.5 s), holders
  being the workers the router core's GPU index names for the prefix's deepest block;
* ``landed``: a move's bytes arrived (a timer of kind ``TIMER``);
* ``on_step``: an engine step ended (a warm-up finished; cache events made between steps go out).

And, in the ``nixl`` mode, at every first run handed to a worker (``pull``): the sender's
``PullHint`` (``thunderagent.migration.pull``, as the scheduler service computes it), then what
the target's adapter does with it (join a copy already crossing, or copy the prefix before the
run starts); ``pull_landed`` when the bytes arrive (a timer of kind ``PULL_TIMER``).

Two ways to carry a move out, as live:

* ``nixl``: the source pins the prefix (``pin_prefix``), the target reserves a block per missing
  block (``begin_import``: they are occupied while the bytes land), the bytes take
  ``missing blocks x block bytes / link_bytes_per_s`` (+ ``link_latency_s``) on the replay's
  link timeline (``pd.TransferLinks.occupy``: the source's and the target's links, FIFO, shared
  with PD transfers), then the target inserts them (``commit_import``, Stored events: the router
  learns the new holder from the normal event path) and the source unpins, freeing what nobody
  uses for a ``Migrate`` (``unpin_prefix(drop=True)``). A ``Drop`` frees a replica
  (``cache.discard``, as the simulated engine's ``/kv/release``).
* ``replicate`` (stock SGLang, no KV import): the target prefills the prefix, a request of its
  blocks with ``max_new_tokens=1`` that competes with real requests for prefill time; no link.
  The source is never touched (a ``Migrate`` leaves its copy to the LRU) and a ``Drop`` fails
  (SGLang cannot free a prefix selectively), as the live adapter reports them.

The planner's actions never touch a request: warm-ups are not trace requests (the driver skips
their ids) and every copy works on cached blocks only. Cache events made between steps
(reservation evictions, inserts, drops) go to the router at once when the engine is idle, else
right after its step in flight is delivered, so the index sees them in engine order.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from thunderagent.engine import Profile, Request
from thunderagent.engine.core import StepOutcome
from thunderagent.engine.events import Stored
from thunderagent.migration import (
    Action,
    Drop,
    Migrate,
    MigrationParams,
    MigrationPlanner,
    Move,
    RouteSeen,
    WorkerSeen,
)
from thunderagent.migration.pull import PullPlanner
from thunderagent.schemas import Candidate, LoadReport, PullHint, RouteDecision
from thunderagent.stats import percentile

if TYPE_CHECKING:
    from thunderagent.replay.driver import Replay

MODES = ("off", "replicate", "nixl")
PLAN_INTERVAL_S = 0.5
"""How often the planner is asked: the live service's default (``MigrationConfig.interval_s``)."""
TIMER = "migration"
"""The driver's timer kind for a move's landing."""
PULL_TIMER = "pull"
"""The driver's timer kind for a dispatch pull's landing."""
WARMUP_PREFIX = "migration-warmup-"


def planner_params(
    profile: Profile, link_bytes_per_s: float, overrides: dict | None = None
) -> MigrationParams:
    """The planner's defaults, with the simulated fleet's own facts (KV bytes per token, link
    speed: what the live service takes from its flags), then ``overrides``."""
    values = {
        "kv_bytes_per_token": profile.kv_bytes_per_token,
        "link_bytes_per_s": link_bytes_per_s,
        **(overrides or {}),
    }
    return MigrationParams.from_dict(values)


@dataclass(slots=True)
class _Move:
    action: Move
    keys: list[int]
    started: float
    present: int = 0
    """Leading blocks the target held already (nixl: pinned there, not sent)."""
    nbytes: int = 0


@dataclass(slots=True)
class _Pull:
    """A dispatched run waiting for its prefix to land (``ReplayMigration.pull``)."""

    hint: PullHint
    target: str
    keys: list[int]
    present: int
    nbytes: int
    started: float
    request: Request
    joined: list[Request] = field(default_factory=list)
    """Runs dispatched to the target for the same prefix while it crosses: they wait too."""
    given_up: bool = False
    """It would have landed after its budget: the run waits the budget out, then prefills."""


@dataclass(slots=True)
class MoveStats:
    replications: int = 0
    migrations: int = 0
    drops: int = 0
    failed: int = 0
    drops_refused: int = 0
    """Drops the engine refused (the replica in use or extended, or no selective free)."""
    bytes_moved: int = 0
    freed_blocks: int = 0
    """Blocks freed at a source (a Migrate) or at a replica (a Drop)."""
    warmup_prefill_tokens: int = 0
    """replicate: prompt tokens the targets computed to warm up."""
    durations: list[float] = field(default_factory=list)
    """Per finished copy, start to landing (link wait, or the warm-up's queueing, included)."""
    reasons: Counter = field(default_factory=Counter)
    pulls: int = 0
    """Dispatched runs that copied their prefix from another worker first."""
    pulled_blocks: int = 0
    pulled_bytes: int = 0
    pulls_refused: int = 0
    """Pulls planned but not started (the source held none of the prefix, no room at the
    target)."""
    pulls_given_up: int = 0
    """Pulls that would have landed after their budget (``PullHint.budget_s``): the run
    waited it out and prefilled, as the adapter does."""
    pull_waits: list[float] = field(default_factory=list)
    """Per pull, dispatch to landing (link wait included)."""


class ReplayMigration:
    """One planner and its executor on one ``Replay`` (build one per run, like the replay)."""

    def __init__(
        self,
        replay: Replay,
        mode: str,
        params: MigrationParams,
        interval_s: float = PLAN_INTERVAL_S,
    ) -> None:
        if mode not in MODES[1:]:
            raise ValueError(f"migration mode {mode!r}: expected one of {MODES[1:]}")
        if not interval_s > 0:
            raise ValueError(f"migration interval must be > 0, got {interval_s!r}")
        self.replay = replay
        self.mode = mode
        self.interval_s = interval_s
        self.planner = MigrationPlanner(params, id_prefix="replay")
        self.stats = MoveStats()
        self._chains: dict[int, tuple[str, int]] = {}
        """Prefix hash -> (a request whose prompt has it, depth): its chain of block keys."""
        self._moves: dict[str, _Move] = {}
        self._pulls: dict[str, _Pull] = {}
        self.pulls = PullPlanner(params)
        """The sender's side of a pull at dispatch (the scheduler's, live)."""
        self._warmups: dict[str, _Move] = {}
        self._late_events: set[int] = set()
        self._next_plan = 0.0
        replay.migration = self

    @classmethod
    def attach(
        cls,
        replay: Replay,
        mode: str,
        overrides: dict | None = None,
        interval_s: float = PLAN_INTERVAL_S,
    ) -> ReplayMigration | None:
        """Hook migration into ``replay`` (None for ``off``). Raises ``ValueError`` (a
        ``ParamError`` for a bad override) before anything runs."""
        if mode == "off":
            return None
        cfg = replay.cfg
        params = planner_params(cfg.profile, cfg.link_bytes_per_s, overrides)
        return cls(replay, mode, params, interval_s)

    # ---- observations (driver hooks) -----------------------------------------------------
    def routed(self, request_id: str, decision: RouteDecision, t: float) -> None:
        if decision.prefix_hash is not None and decision.overlap_blocks > 0:
            self._chains.setdefault(decision.prefix_hash, (request_id, decision.overlap_blocks))
        self.planner.observe_route(RouteSeen.of(decision), t)

    def load(self, report: LoadReport, model: str, t: float) -> None:
        seen = WorkerSeen(
            worker_id=report.worker_id,
            model=model,
            running=report.running,
            queued=report.queued,
            prefill_backlog_tokens=report.prefill_backlog_tokens,
            live_tokens=report.num_tokens,
            kv_total_blocks=report.kv_total_blocks,
            block_size=self.replay.block_size,
        )
        self.planner.observe_load(seen, t)

    def tick(self, t: float) -> None:
        """Plan at every ``interval_s`` boundary (lazily, at the first event at or after it)."""
        if t < self._next_plan:
            return
        self._next_plan = (math.floor(t / self.interval_s) + 1) * self.interval_s
        for action in self.planner.plan(t, self.holders):
            self.execute(action, t)

    def holders(self, prefix: int) -> Collection[str]:
        """Workers the router core's GPU index names for the prefix (its deepest block)."""
        return self.replay.router.feeder.holders(prefix)

    # ---- execution -----------------------------------------------------------------------
    def execute(self, action: Action, t: float) -> None:
        """Carry out an action the planner returned (or a move ``planner.order`` booked)."""
        if isinstance(action, Drop):
            self._drop(action, t)
            return
        keys = self._chain(action.prefix_hash)
        if keys is None:
            self._fail(action, t, "the prefix's blocks are unknown")
        elif self.mode == "nixl":
            self._copy(action, keys, t)
        else:
            self._warm_up(action, keys, t)

    def _chain(self, prefix: int) -> list[int] | None:
        known = self._chains.get(prefix)
        if known is None:
            return None
        rid, depth = known
        return list(self.replay.keys[rid].primary[:depth])

    def _copy(self, action: Move, keys: list[int], t: float) -> None:
        reserved = self._reserve(action.source, action.target, keys, t)
        if isinstance(reserved, str):
            self._fail(action, t, reserved)
            return
        pinned, present, nbytes = reserved
        p = self.planner.params
        ends = self.replay.links.occupy(
            (action.source, action.target), nbytes / p.link_bytes_per_s, t
        )
        self._moves[action.action_id] = _Move(action, pinned, t, present, nbytes)
        self.replay._push_timer(ends + p.link_latency_s, TIMER, action.action_id)

    def landed(self, action_id: str, t: float) -> None:
        """The bytes are on the target: insert them there, release (or free) the source."""
        move = self._moves.pop(action_id)
        action = move.action
        drop = isinstance(action, Migrate)
        self.stats.freed_blocks += self._land(action.source, action.target, move, t, drop)
        self._done(action, t, move.nbytes, t - move.started)

    def _reserve(
        self, source: str, target: str, keys: list[int], t: float
    ) -> tuple[list[int], int, int] | str:
        """Start a copy of ``keys``: pin the leading run ``source`` holds, reserve the missing
        blocks at ``target``; (pinned keys, blocks the target had, bytes to send), or why not
        (nothing is left pinned or reserved then)."""
        r = self.replay
        src, dst = r.cores[r.slot[source]], r.cores[r.slot[target]]
        keys = self._computed(r.slot[source], keys)
        pinned, _ = src.pin_prefix(keys, need_tokens=False)
        if not pinned:
            return "the source no longer holds the prefix"
        present = dst.begin_import(pinned)
        if present is None:
            src.unpin_prefix(pinned)
            return "no room at the target"
        self._publish(r.slot[target], t)  # the reservation may have evicted blocks
        nbytes = (len(pinned) - present) * r.block_size * self.planner.params.kv_bytes_per_token
        return pinned, present, nbytes

    def _computed(self, w: int, keys: list[int]) -> list[int]:
        """The leading part of ``keys`` engine ``w`` has computed: its step in flight caches
        its blocks in the engine's state when it starts, but their bytes exist only once it
        ends (live, the source's adapter learns of them from that step's events)."""
        flight = self.replay.inflight.get(w)
        if flight is None:
            return keys
        computing = {h for e in flight[1].events if isinstance(e, Stored) for h in e.block_hashes}
        for i, key in enumerate(keys):
            if key in computing:
                return keys[:i]
        return keys

    def _unreserve(self, source: str, target: str, keys: list[int], present: int) -> None:
        """Give a copy up before it lands: the reservation back, the source unpinned."""
        r = self.replay
        r.cores[r.slot[target]].abort_import(keys, present)
        r.cores[r.slot[source]].unpin_prefix(keys)

    def _land(self, source: str, target: str, copy: _Move | _Pull, t: float, drop: bool) -> int:
        """A copy's bytes arrived: insert them at ``target``, release ``source`` (``drop``:
        free what nobody else uses there); returns the blocks freed."""
        r = self.replay
        src, dst = r.slot[source], r.slot[target]
        r.cores[dst].commit_import(copy.keys, copy.present, None)
        self._publish(dst, t)
        freed = r.cores[src].unpin_prefix(copy.keys, drop=drop)
        self._publish(src, t)
        return freed

    def pull(self, request: Request, target: str, candidates: list[Candidate], t: float) -> bool:
        """A first run handed to ``target``: the sender's ``PullHint`` (``PullPlanner``), then
        what the target's adapter does with the run: wait for a copy of its prefix already on
        its way there, or start the hinted copy of what the source holds of the prefix (the
        leading run: a prefix it is still prefilling gives the chunks already computed). True
        when the run now waits for ``pull_landed``."""
        if self.mode != "nixl":
            return False
        keys = request.block_hashes
        size = self.replay.block_size
        hint = self.pulls.hint(candidates, target, keys, request.prompt_len, size, t)
        if hint is not None:  # the sender books it as the worker takes the run, as live
            self.pulls.book(hint, target, t)
        for pull in self._pulls.values():
            n = pull.hint.blocks
            if pull.target == target and len(keys) >= n and keys[n - 1] == pull.hint.prefix_hash:
                pull.joined.append(request)
                return True
        if hint is None:
            return False
        reserved = self._reserve(hint.source_worker, target, list(keys[: hint.blocks]), t)
        if not isinstance(reserved, str) and reserved[1] >= len(reserved[0]):
            self._unreserve(hint.source_worker, target, reserved[0], reserved[1])
            reserved = "the target holds it already"
        if isinstance(reserved, str):
            self.stats.pulls_refused += 1
            return False
        self._start_pull(hint, target, request, reserved, t)
        return True

    def _start_pull(
        self,
        hint: PullHint,
        target: str,
        request: Request,
        reserved: tuple[list[int], int, int],
        t: float,
    ) -> None:
        """Put the copy on the link; or, when it would land after its budget, give it up as
        the adapter does then: the run waits the budget out and prefills."""
        r, p = self.replay, self.planner.params
        pinned, present, nbytes = reserved
        seconds = nbytes / p.link_bytes_per_s
        link = (hint.source_worker, target)
        rid = request.request_id
        pull = self._pulls[rid] = _Pull(hint, target, pinned, present, nbytes, t, request)
        budget = hint.budget_s or math.inf
        if r.links.begins(link, t) + seconds + p.link_latency_s - t > budget:
            self._unreserve(hint.source_worker, target, pinned, present)
            pull.given_up = True
            r._push_timer(t + budget, PULL_TIMER, rid)
            return
        ends = r.links.occupy(link, seconds, t)
        r._push_timer(ends + p.link_latency_s, PULL_TIMER, rid)

    def pull_landed(self, request_id: str, t: float) -> list[Request]:
        """A pull's bytes arrived: the blocks are cached at the target; returns the runs that
        waited for them."""
        pull = self._pulls.pop(request_id)
        s = self.stats
        if pull.given_up:
            s.pulls_given_up += 1
        else:
            self._land(pull.hint.source_worker, pull.target, pull, t, drop=False)
            s.pulls += 1
            s.pulled_blocks += len(pull.keys) - pull.present
            s.pulled_bytes += pull.nbytes
            s.pull_waits.append(t - pull.started)
        return [pull.request, *pull.joined]

    def _warm_up(self, action: Move, keys: list[int], t: float) -> None:
        r = self.replay
        dst = r.slot[action.target]
        rid = WARMUP_PREFIX + action.action_id
        request = Request(rid, len(keys) * r.block_size, list(keys), max_new_tokens=1)
        if r.cores[dst].add(request, t) is not None:
            self._fail(action, t, "the prefix does not fit the target's KV pool")
            return
        self._warmups[rid] = _Move(action, keys, t)
        if dst not in r.inflight:
            r.dirty.add(dst)

    def _drop(self, action: Drop, t: float) -> None:
        if self.mode == "replicate":
            self._fail(action, t, "this engine cannot free a prefix selectively")
            return
        keys = self._chain(action.prefix_hash)
        w = self.replay.slot[action.worker]
        cache = self.replay.cores[w].cache
        freed = cache.discard(keys, extensions=False) if keys is not None else 0
        if not freed:
            # ``discard`` stops at a block that is pinned or that other cached blocks extend
            self._fail(action, t, "dropped nothing: the blocks are in use or extended")
            return
        self.stats.freed_blocks += freed
        self._publish(w, t)
        self._done(action, t, 0, 0.0)

    def on_step(self, w: int, outcome: StepOutcome, t: float) -> None:
        """Engine ``w``'s step was delivered: warm-ups it finished are done; cache events made
        while it ran go out now (after the step's own)."""
        for fin in outcome.finished:
            move = self._warmups.pop(fin.request_id, None)
            if move is not None:
                self.stats.warmup_prefill_tokens += fin.prompt_tokens - fin.cached_tokens
                self._done(move.action, t, 0, t - move.started)
        if w in self._late_events:
            self._late_events.discard(w)
            self._publish(w, t)

    def _publish(self, w: int, t: float) -> None:
        """Cache events made outside a step go to the router now, or after the step in flight
        (whose events were drained when it was planned) is delivered."""
        r = self.replay
        if w in r.inflight:
            self._late_events.add(w)
            return
        events = r.cores[w].drain_events()
        if events:
            r._apply_events(w, StepOutcome(events=events), t)

    # ---- outcomes ------------------------------------------------------------------------
    def _done(self, action: Action, t: float, nbytes: int, seconds: float) -> None:
        s = self.stats
        if isinstance(action, Drop):
            s.drops += 1
        else:
            s.bytes_moved += nbytes
            s.durations.append(seconds)
            if isinstance(action, Migrate):
                s.migrations += 1
            else:
                s.replications += 1
        self.planner.on_transfer_done(action.action_id, t, moved_bytes=nbytes)

    def _fail(self, action: Action, t: float, reason: str) -> None:
        if isinstance(action, Drop):
            self.stats.drops_refused += 1
        else:
            self.stats.failed += 1
        self.stats.reasons[reason] += 1
        self.planner.on_transfer_failed(action.action_id, t, reason)

    def summary(self) -> dict:
        return move_summary(self.mode, self.stats, self.planner)


def move_summary(
    mode: str, stats: MoveStats | None = None, planner: MigrationPlanner | None = None
) -> dict:
    """One run's migration figures for the JSON (zeros for ``off``); seconds, bytes."""
    s = stats or MoveStats()
    d = s.durations
    ps = planner.stats if planner is not None else None
    return {
        "migration": mode,
        "migrations": s.migrations,
        "replications": s.replications,
        "drops": s.drops,
        "drops_refused": s.drops_refused,
        "failed_moves": s.failed + (ps.timed_out if ps else 0),
        "bytes_moved": s.bytes_moved,
        "transfer_s": {
            "moves": len(d),
            "total": sum(d),
            "p50": percentile(d, 50) if d else 0.0,
            "p99": percentile(d, 99) if d else 0.0,
        },
        "freed_blocks": s.freed_blocks,
        "warmup_prefill_tokens": s.warmup_prefill_tokens,
        "ordered": dict(ps.ordered) if ps else {"replicate": 0, "migrate": 0, "drop": 0},
        "failure_reasons": dict(s.reasons),
        "pulls": s.pulls,
        "pulled_blocks": s.pulled_blocks,
        "pulled_bytes": s.pulled_bytes,
        "pulls_refused": s.pulls_refused,
        "pulls_given_up": s.pulls_given_up,
        "pull_wait_s": {
            "p50": percentile(s.pull_waits, 50) if s.pull_waits else 0.0,
            "p99": percentile(s.pull_waits, 99) if s.pull_waits else 0.0,
        },
    }
