"""Virtual-time replay: routing policy + scheduler + prefix index in front of N engine cores.

One discrete-event loop over three sources, in time order: trace arrivals, engine step
completions (one in flight per busy engine) and the scheduler's wakeups. On a tie an arrival
goes first, then step completions, then the wakeup; engines are (re)started only after every
event of an instant is handled, so requests arriving together are batched together.

What the router sees is modelled on the live system, not on the simulator's true state:

* Load views are refreshed from ``EngineCore.load()`` at most every ``load_interval`` virtual
  seconds (the live adapters report a few times a second), plus ``pending`` = requests sent to
  that worker since its last report. The refresh is lazy: engine state only changes at events,
  so reading it at the first arrival or wakeup after a report boundary reads the state as of
  that boundary.
* Overlaps come from a ``PrefixIndex`` fed by the engines' KV events as each step completes,
  with a per-worker sequence number, as the router's index follows ``kv.events``.
* ``expected_output_tokens`` is the mean output length of the requests finished so far (the
  router cannot know a request's output length).
* Every ``feedback_interval`` the policy's ``observe`` (when it has one) gets the measured queue
  depths and the false-hit rate (1 - cached / predicted tokens of the requests that finished in
  the window), as the live router's tuner does.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from thunderagent.engine import AllCleared, EngineCore, EngineLoad, Profile, Removed, Request
from thunderagent.engine.core import StepOutcome
from thunderagent.hashing import BlockHasher
from thunderagent.prefix_index import PrefixIndex
from thunderagent.replay.traces import TraceRequest
from thunderagent.routing import RouteQuery, WorkerView, get_policy
from thunderagent.routing.cost import RoutingFeedback
from thunderagent.scheduling import (
    DirectScheduler,
    Dispatch,
    Preempt,
    Reject,
    SchedRequest,
    Scheduler,
    WorkerRoom,
)

SCHEDULERS: dict[str, Callable[[], Scheduler]] = {"direct": DirectScheduler}
"""Scheduler name -> factory; scheduling policies add their entry here."""

INF = math.inf


@dataclass(kw_only=True)
class ReplayConfig:
    profile: Profile
    policy: str
    workers: int = 8
    policy_params: dict = field(default_factory=dict)
    scheduler: str = "direct"
    seed: int = 0
    load_interval: float = 0.1
    """Virtual seconds between load reports (the live adapters publish every ~0.2 s)."""
    feedback_interval: float = 1.0
    """Virtual seconds between ``observe`` calls on the policy (and index TTL expiry)."""
    timeline_interval: float = 10.0
    """Virtual seconds between per-worker load samples kept for plots."""
    index_ttl: float | None = None
    """Prefix index TTL; None: off (events are lossless here, so TTL only loses hits)."""
    prior_output_tokens: int = 128
    """Expected output length before any request has finished."""


@dataclass(slots=True)
class Record:
    """One request's life in virtual seconds, and what the router believed about it."""

    request_id: str
    arrival: float
    prompt_tokens: int
    output_tokens: int
    worker: int = -1
    first_token: float = math.nan
    finish: float = math.nan
    cached_tokens: int = -1
    completion_tokens: int = 0
    preemptions: int = 0
    status: str = "queued"
    """"queued", "running", "completed" or "rejected"."""
    best_overlap_tokens: int = 0
    """Most prompt tokens any worker was indexed as holding at routing time (usable part)."""
    predicted_tokens: int = 0
    """Prompt tokens the chosen worker was indexed as holding at routing time (usable part)."""


@dataclass(slots=True)
class ReplayResult:
    records: list[Record]
    busy_s: list[float]
    """Per-worker time spent in engine steps."""
    timeline: list[tuple[float, list[int]]]
    """(virtual time, per-worker running + waiting requests)."""
    steps: int
    makespan: float


def _outstanding(load: EngineLoad) -> int:
    return load.num_running + load.num_waiting


class Replay:
    """Runs one policy over one trace; build a new one per run (policies keep state)."""

    def __init__(self, config: ReplayConfig, block_size: int) -> None:
        self.cfg = config
        self.block_size = block_size
        if config.profile.engine.page_size != block_size:
            raise ValueError(
                f"profile page_size {config.profile.engine.page_size} != block size {block_size}"
            )
        try:
            self.scheduler = SCHEDULERS[config.scheduler]()
        except KeyError:
            known = sorted(SCHEDULERS)
            raise ValueError(f"unknown scheduler {config.scheduler!r}; known: {known}") from None
        self.policy = get_policy(config.policy, **config.policy_params)
        self.rng = random.Random(config.seed)
        n = config.workers
        self.ids = [f"w{i:02d}" for i in range(n)]
        self.slot = {w: i for i, w in enumerate(self.ids)}
        self.cores = [EngineCore(config.profile) for _ in range(n)]
        self.index = PrefixIndex(config.index_ttl)
        self.hasher = BlockHasher(page_size=1)  # block ids are given directly (one per block)
        self.check: dict[int, int] = {}
        self.seq = [0] * n
        self.busy = [0.0] * n
        self.loads: list[EngineLoad] = [c.load() for c in self.cores]
        self.pending = [0] * n
        self.inflight: dict[int, tuple[float, StepOutcome]] = {}
        self.heap: list[tuple[float, int]] = []
        self.dirty: set[int] = set()
        self.records: dict[str, Record] = {}
        self.keys: dict[str, tuple[list[int], list[int]]] = {}
        self.session: dict[str, str | None] = {}
        self.route_overlaps: dict[str, dict[str, int]] = {}
        self.timeline: list[tuple[float, list[int]]] = []
        self.now = 0.0
        self.steps = 0
        self._next_load = 0.0
        self._next_feedback = config.feedback_interval
        self._next_timeline = 0.0
        self._next_arrival = INF
        self._wake = INF
        self._out_sum = 0
        self._out_n = 0
        self._win_pred = 0
        self._win_hit = 0

    # ---- main loop -----------------------------------------------------------------------
    def run(self, trace: Sequence[TraceRequest], speed: float = 1.0, progress=None) -> ReplayResult:
        """Replay ``trace`` (arrival order) with arrival times divided by ``speed``."""
        if not speed > 0:
            raise ValueError(f"speed must be > 0, got {speed!r}")
        times = [r.arrival / speed for r in trace]
        i, n = 0, len(trace)
        heap = self.heap
        while True:
            t_arr = times[i] if i < n else INF
            t_step = heap[0][0] if heap else INF
            t = min(t_arr, t_step, self._wake)
            if self.dirty and t > self.now:
                self._start_steps(t_arr)
                continue
            if t == INF:
                break
            self.now = t
            self._tick(t)
            if t_arr == t:
                i += 1
                self._next_arrival = times[i] if i < n else INF
                self._arrive(trace[i - 1], t)
                if progress is not None and i % 500 == 0:
                    progress(500)
            elif t_step == t:
                _, w = heapq.heappop(heap)
                self._complete(w, t)
            else:
                self._wake = INF
                self._refresh_loads(t)
            self._poll(t)
        if progress is not None and n % 500:
            progress(n % 500)
        records = [self.records[r.request_id] for r in trace]
        last = max((r.finish for r in records if r.status == "completed"), default=0.0)
        return ReplayResult(records, self.busy, self.timeline, self.steps, last)

    def _tick(self, t: float) -> None:
        """Periodic work, done lazily at the first event at or after its boundary."""
        if t >= self._next_timeline:
            self.timeline.append((t, [_outstanding(c.load()) for c in self.cores]))
            self._next_timeline = (math.floor(t / self.cfg.timeline_interval) + 1) * (
                self.cfg.timeline_interval
            )
        if t >= self._next_feedback:
            self._feedback(t)
            self._next_feedback = (math.floor(t / self.cfg.feedback_interval) + 1) * (
                self.cfg.feedback_interval
            )

    def _refresh_loads(self, t: float) -> None:
        if t < self._next_load:
            return
        for w, core in enumerate(self.cores):
            load = core.load()
            self.loads[w] = load
            self.pending[w] = 0
            room = WorkerRoom(
                worker_id=self.ids[w],
                running=load.num_running,
                queued=load.num_waiting,
                kv_used_blocks=load.kv_used_blocks,
                kv_total_blocks=load.kv_total_blocks,
                max_running=core.profile.engine.max_running_requests,
            )
            self.scheduler.update_worker(room, t)
        self._next_load = (math.floor(t / self.cfg.load_interval) + 1) * self.cfg.load_interval

    def _feedback(self, t: float) -> None:
        if self.cfg.index_ttl is not None:
            self.index.expire(t)
        observe = getattr(self.policy, "observe", None)
        if observe is None:
            return
        depths = {self.ids[w]: _outstanding(c.load()) for w, c in enumerate(self.cores)}
        false_hit = 1.0 - self._win_hit / self._win_pred if self._win_pred else 0.0
        observe(RoutingFeedback(queue_depths=depths, false_hit_rate=max(0.0, false_hit)))
        self._win_pred = self._win_hit = 0

    # ---- arrivals and routing ------------------------------------------------------------
    def _arrive(self, req: TraceRequest, t: float) -> None:
        bs = self.block_size
        full = req.prompt_len // bs
        hashes = self.hasher.hash_block_ids(req.block_ids[:full])
        self.check.update(zip(hashes.primary, hashes.check, strict=True))
        rid = req.request_id
        self.keys[rid] = (hashes.primary, hashes.check)
        self.session[rid] = req.session
        rec = Record(rid, t, req.prompt_len, req.output_len)
        self.records[rid] = rec
        self._refresh_loads(t)
        overlaps = self.index.overlap(hashes.primary, hashes.check)
        usable = (req.prompt_len - 1) // bs
        rec.best_overlap_tokens = min(max(overlaps.values(), default=0), usable) * bs
        expected = self._out_sum // self._out_n if self._out_n else self.cfg.prior_output_tokens
        query = RouteQuery(
            request_id=rid,
            prompt_tokens=req.prompt_len,
            block_size=bs,
            block_hashes=hashes.primary,
            overlaps=overlaps,
            expected_output_tokens=expected,
        )
        views = [self._view(w) for w in range(len(self.cores))]
        ranked = self.policy.rank(query, views, self.rng)
        self.policy.on_routed(query, ranked[0].worker_id)
        self.scheduler.submit(
            SchedRequest(
                request_id=rid,
                arrival=t,
                prompt_tokens=req.prompt_len,
                expected_output_tokens=expected,
                candidates=[(c.worker_id, c.overlap_blocks) for c in ranked],
                block_size=bs,
                block_hashes=hashes.primary,
                program_id=req.session,
            ),
            t,
        )
        self.route_overlaps[rid] = overlaps  # the index's belief, read at first dispatch

    def _view(self, w: int) -> WorkerView:
        load = self.loads[w]
        return WorkerView(
            worker_id=self.ids[w],
            running=load.num_running,
            queued=load.num_waiting,
            kv_used_blocks=load.kv_used_blocks,
            kv_total_blocks=load.kv_total_blocks,
            active_tokens=load.num_tokens,
            pending=self.pending[w],
        )

    # ---- scheduler actions ---------------------------------------------------------------
    def _poll(self, t: float) -> None:
        for action in self.scheduler.poll(t):
            if isinstance(action, Dispatch):
                self._dispatch(action, t)
            elif isinstance(action, Preempt):
                self._preempt(action, t)
            elif isinstance(action, Reject):
                rec = self.records[action.request_id]
                rec.status, rec.finish = "rejected", t
        wake = self.scheduler.next_wakeup(t)
        self._wake = INF if wake is None else max(wake, t)
        if self._wake == t:
            raise RuntimeError(f"scheduler {self.cfg.scheduler!r} asked to wake now ({t}) again")

    def _dispatch(self, action: Dispatch, t: float) -> None:
        rec = self.records[action.request_id]
        w = self.slot[action.worker_id]
        primary, _ = self.keys[rec.request_id]
        overlaps = self.route_overlaps.pop(rec.request_id, None)
        if overlaps is not None:  # first dispatch: what the index said about this worker
            usable = (rec.prompt_tokens - 1) // self.block_size
            rec.predicted_tokens = min(overlaps.get(action.worker_id, 0), usable) * self.block_size
        generated = rec.completion_tokens
        request = Request(
            request_id=rec.request_id,
            prompt_len=rec.prompt_tokens + generated,
            block_keys=primary,
            max_new_tokens=rec.output_tokens - generated,
        )
        rejected = self.cores[w].add(request, t)
        rec.worker = w
        self.pending[w] += 1
        if rejected is not None:
            rec.status, rec.finish = "rejected", t
            self.scheduler.on_finished(rec.request_id, action.worker_id, t)
            return
        rec.status = "running"
        if w not in self.inflight:
            self.dirty.add(w)

    def _preempt(self, action: Preempt, t: float) -> None:
        rec = self.records[action.request_id]
        w = self.slot[action.worker_id]
        fin = self.cores[w].abort(rec.request_id, t)
        if fin is None:
            return
        if rec.cached_tokens < 0:
            rec.cached_tokens = fin.cached_tokens
        rec.completion_tokens += fin.completion_tokens
        rec.preemptions += 1 + fin.preemptions
        rec.status, rec.worker = "queued", -1
        primary, _ = self.keys[rec.request_id]
        self.scheduler.submit(
            SchedRequest(
                request_id=rec.request_id,
                arrival=rec.arrival,
                prompt_tokens=rec.prompt_tokens,
                expected_output_tokens=rec.output_tokens - rec.completion_tokens,
                candidates=[(action.worker_id, 0)],
                block_size=self.block_size,
                block_hashes=primary,
                program_id=self.session[rec.request_id],
                generated_tokens=rec.completion_tokens,
            ),
            t,
        )

    # ---- engines -------------------------------------------------------------------------
    def _start_steps(self, t_arrival: float) -> None:
        until = min(t_arrival, self._wake)
        now = self.now
        for w in sorted(self.dirty):
            core = self.cores[w]
            if w in self.inflight or not core.has_work:
                continue
            outcome = core.step(now, until=until)
            if outcome.kind == "idle":
                raise RuntimeError(f"engine {w} has work but planned an idle step at {now}")
            self.steps += 1
            self.busy[w] += outcome.duration
            self.inflight[w] = (now, outcome)
            heapq.heappush(self.heap, (now + outcome.duration, w))
        self.dirty.clear()

    def _complete(self, w: int, t: float) -> None:
        _, outcome = self.inflight.pop(w)
        self.dirty.add(w)
        self._apply_events(w, outcome, t)
        worker_id = self.ids[w]
        records = self.records
        for rid in outcome.first_token:
            rec = records[rid]
            if rec.worker == w and math.isnan(rec.first_token):
                rec.first_token = t
                self.scheduler.on_started(rid, worker_id, t)
        for fin in outcome.finished:
            rec = records[fin.request_id]
            if rec.worker != w or rec.status != "running":
                continue
            if rec.cached_tokens < 0:
                rec.cached_tokens = fin.cached_tokens
            rec.completion_tokens += fin.completion_tokens
            rec.preemptions += fin.preemptions
            rec.status, rec.finish = "completed", t
            self._out_sum += rec.output_tokens
            self._out_n += 1
            self._win_pred += rec.predicted_tokens
            self._win_hit += min(rec.cached_tokens, rec.predicted_tokens)
            self.scheduler.on_finished(fin.request_id, worker_id, t)

    def _apply_events(self, w: int, outcome: StepOutcome, t: float) -> None:
        """Feed the index (and the scheduler) from the step's KV events, as the router would."""
        worker_id = self.ids[w]
        check = self.check
        for ev in outcome.events:
            if isinstance(ev, Removed):
                keys = [k for k in ev.block_keys if k in check]
                if keys:
                    self.index.apply_removed(worker_id, self.seq[w], keys, t)
                    self.seq[w] += 1
            elif isinstance(ev, AllCleared):
                self.index.clear_worker(worker_id, self.seq[w], t)
                self.seq[w] += 1
            else:
                keys = [k for k in ev.block_keys if k in check]
                if not keys:
                    continue  # output pages only: no other request can ever match them
                parent = ev.parent_key if ev.parent_key in check else None
                checks = [check[k] for k in keys]
                self.index.apply_stored(worker_id, self.seq[w], (keys, checks), parent, t)
                self.seq[w] += 1
                self.scheduler.on_prefix_cached(worker_id, keys, t)
