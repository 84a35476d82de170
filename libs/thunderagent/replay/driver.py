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

Scheduler actions (``Dispatch``, ``Preempt``, ``Reject``) and the PD runs a ``Dispatch`` can
start are carried out by the ``SchedulerActions`` mixin (``actions.py``), as
``thunderagent/scheduling/README.md`` asks.
A fourth event source, timers, carries KV-transfer landings and closed-loop arrivals
(``follow_up``: the next step of an agent program, ``workload_driver.py``); with neither in use
the loop is exactly the three-source one above.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from thunderagent.engine import AllCleared, EngineCore, EngineLoad, Profile, Removed
from thunderagent.engine.core import StepOutcome
from thunderagent.hashing import BlockHasher
from thunderagent.prefix_index import PrefixIndex
from thunderagent.replay.actions import SchedulerActions
from thunderagent.replay.pd import TransferLinks
from thunderagent.replay.traces import TraceRequest
from thunderagent.routing import POLICIES, RouteQuery, RoutingFeedback, WorkerView
from thunderagent.scheduling import (
    SCHEDULERS,
    SchedRequest,
    WorkerRoom,
)

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
    scheduler_params: dict = field(default_factory=dict)
    """Knobs for the scheduler factory (``SchedParams`` fields)."""
    roles: Sequence[str] | None = None
    """Per-worker role, "prefill" / "decode" / "both" (PD disaggregation); None: all "both"."""
    link_bytes_per_s: float = 25e9
    """PD KV-transfer bandwidth out of each prefill worker (25 GB/s: one 200 Gb/s RDMA NIC)."""


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
    sched_preemptions: int = 0
    """Scheduler ``Preempt``s (also counted in ``preemptions`` with the engine's retractions)."""
    resume_prompt_tokens: int = 0
    """Prompt tokens (prompt + generated) of continuation runs after a preemption."""
    resume_cached_tokens: int = 0
    """Of those, tokens found cached when the continuation was admitted."""
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
    prefill_tokens: int = 0
    """Prompt tokens the engines computed (cache misses, re-prefills and retractions)."""
    transfers_s: list[float] = field(default_factory=list)
    """PD: each KV transfer's duration on the link, queueing behind earlier ones included."""
    sched_stats: dict = field(default_factory=dict)


def _outstanding(load: EngineLoad) -> int:
    return load.num_running + load.num_waiting


class Replay(SchedulerActions):
    """Runs one policy over one trace; build a new one per run (policies keep state)."""

    def __init__(self, config: ReplayConfig, block_size: int) -> None:
        self.cfg = config
        self.block_size = block_size
        if config.profile.engine.block_size != block_size:
            raise ValueError(
                f"profile block_size {config.profile.engine.block_size} != block size {block_size}"
            )
        self.scheduler = SCHEDULERS.create(config.scheduler, **config.scheduler_params)
        self.policy = POLICIES.create(config.policy, **config.policy_params)
        self.rng = random.Random(config.seed)
        n = config.workers
        self.ids = [f"w{i:02d}" for i in range(n)]
        self.slot = {w: i for i, w in enumerate(self.ids)}
        self.cores = [EngineCore(config.profile) for _ in range(n)]
        self.roles = list(config.roles) if config.roles is not None else ["both"] * n
        if len(self.roles) != n:
            raise ValueError(f"{len(self.roles)} roles for {n} workers")
        self.links = TransferLinks(config.profile.kv_bytes_per_token, config.link_bytes_per_s)
        self.timers: list[tuple[float, int, str, object]] = []
        self._timer_seq = 0
        self.follow_up: Callable[[str, float], TraceRequest | None] | None = None
        """Closed loop: called when a request ends; returns the next request to arrive."""
        self.extra: list[str] = []
        self.meta: dict[str, TraceRequest] = {}
        self.resuming: set[str] = set()
        self.prefill_tokens = 0
        self.stalled_wakeups = 0
        """Wakeups asked for the current instant and moved 1 µs later (see ``_poll``)."""
        self._stalls = 0
        self.index = PrefixIndex(config.index_ttl)
        self.hasher = BlockHasher(block_size=1)  # block ids are given directly (one per block)
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
        timers = self.timers
        while True:
            t_arr = times[i] if i < n else INF
            t_step = heap[0][0] if heap else INF
            t_timer = timers[0][0] if timers else INF
            t = min(t_arr, t_step, t_timer, self._wake)
            if self.dirty and t > self.now:
                self._start_steps(min(t_arr, t_timer))
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
            elif t_timer == t:
                _, _, kind, payload = heapq.heappop(timers)
                self._timer(kind, payload, t)
            else:
                self._wake = INF
                self._refresh_loads(t)
            self._poll(t)
        if progress is not None and n % 500:
            progress(n % 500)
        records = [self.records[r] for r in [*(r.request_id for r in trace), *self.extra]]
        last = max((r.finish for r in records if r.status == "completed"), default=0.0)
        stats = getattr(self.scheduler, "stats", None)
        return ReplayResult(
            records,
            self.busy,
            self.timeline,
            self.steps,
            last,
            prefill_tokens=self.prefill_tokens,
            transfers_s=self.links.durations,
            sched_stats={
                **(dict(stats()) if stats is not None else {}),
                "stalled_wakeups": self.stalled_wakeups,
            },
        )

    def _push_timer(self, t: float, kind: str, payload: object) -> None:
        self._timer_seq += 1
        heapq.heappush(self.timers, (t, self._timer_seq, kind, payload))

    def _timer(self, kind: str, payload: object, t: float) -> None:
        if kind == "arrive":
            assert isinstance(payload, TraceRequest)
            self.extra.append(payload.request_id)
            self._arrive(payload, t)
        else:
            self._transfer_landed(str(payload), t)

    def _ended(self, rec: Record, t: float) -> None:
        """A request is over (completed or rejected): the closed loop issues what follows."""
        if self.follow_up is None:
            return
        nxt = self.follow_up(rec.request_id, t)
        if nxt is not None:
            self._push_timer(max(nxt.arrival, t), "arrive", nxt)
            return
        session = self.session.get(rec.request_id)
        release = getattr(self.scheduler, "release_program", None)
        if session is not None and release is not None:
            release(session, t)

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
                role=self.roles[w],
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
        self.meta[rid] = req
        rec = Record(rid, t, req.prompt_len, req.output_len)
        self.records[rid] = rec
        self._refresh_loads(t)
        overlaps = self.index.overlap(hashes.primary, hashes.check)
        usable = (req.prompt_len - 1) // bs
        rec.best_overlap_tokens = min(max(overlaps.values(), default=0), usable) * bs
        self.scheduler.submit(self._sched_request(rec, overlaps, t), t)
        self.route_overlaps[rid] = overlaps  # the index's belief, read at first dispatch

    def _expected(self, rid: str) -> int:
        hint = self.meta[rid].expected_output
        if hint is not None:
            return hint
        return self._out_sum // self._out_n if self._out_n else self.cfg.prior_output_tokens

    def _sched_request(self, rec: Record, overlaps: dict[str, int], t: float) -> SchedRequest:
        """Route ``rec`` (a continuation carries its generated tokens) and wrap it."""
        rid, bs = rec.request_id, self.block_size
        primary = self.keys[rid][0]
        generated = rec.completion_tokens
        expected = self._expected(rid)
        query = RouteQuery(
            request_id=rid,
            prompt_tokens=rec.prompt_tokens + generated,
            block_size=bs,
            block_hashes=primary,
            overlaps=overlaps,
            expected_output_tokens=max(expected - generated, 1),
        )
        views = [self._view(w) for w in range(len(self.cores))]
        ranked = self.policy.rank(query, views, self.rng)
        self.policy.on_dispatched(query, ranked[0].worker_id)
        meta = self.meta[rid]
        return SchedRequest(
            request_id=rid,
            arrival=rec.arrival,
            prompt_tokens=rec.prompt_tokens + generated,
            expected_output_tokens=expected,
            candidates=[(c.worker_id, c.overlap_blocks) for c in ranked],
            block_size=bs,
            block_hashes=primary,
            priority=meta.priority,
            program_id=meta.session,
            deadline=meta.deadline,
            generated_tokens=generated,
        )

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
            prefill_tokens=load.prefill_backlog_tokens,
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
            self.prefill_tokens += outcome.prefill_tokens
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
            if rec.worker != w or rec.status != "running":
                continue
            if math.isnan(rec.first_token):
                rec.first_token = t
            if self.links.phase(rid) != "decode":  # each run starts once (continuations too)
                self.scheduler.on_started(rid, worker_id, t)
        for fin in outcome.finished:
            rec = records[fin.request_id]
            if rec.worker != w or rec.status != "running":
                continue
            if self.links.phase(fin.request_id) != "decode":
                self._account_run(rec, fin.cached_tokens, fin.prompt_tokens)
            rec.completion_tokens += fin.completion_tokens
            rec.preemptions += fin.preemptions
            if self.links.phase(fin.request_id) == "prefill":
                self._prefilled(rec, w, fin.prompt_tokens, t)
                continue
            self._completed(rec, worker_id, t)

    def _completed(self, rec: Record, worker_id: str, t: float) -> None:
        self.links.forget(rec.request_id)
        rec.status, rec.finish = "completed", t
        self._out_sum += rec.output_tokens
        self._out_n += 1
        self._win_pred += rec.predicted_tokens
        self._win_hit += min(rec.cached_tokens, rec.predicted_tokens)
        self.scheduler.on_finished(rec.request_id, worker_id, t)
        self._ended(rec, t)

    def _apply_events(self, w: int, outcome: StepOutcome, t: float) -> None:
        """Feed the index (and the scheduler) from the step's KV events, as the router would."""
        worker_id = self.ids[w]
        check = self.check
        for ev in outcome.events:
            if isinstance(ev, Removed):
                keys = [k for k in ev.block_hashes if k in check]
                if keys:
                    self.index.apply_removed(worker_id, self.seq[w], keys, t)
                    self.seq[w] += 1
            elif isinstance(ev, AllCleared):
                self.index.clear_worker(worker_id, self.seq[w], t)
                self.seq[w] += 1
            else:
                keys = [k for k in ev.block_hashes if k in check]
                if not keys:
                    continue  # output blocks only: no other request can ever match them
                parent = ev.parent_key if ev.parent_key in check else None
                checks = [check[k] for k in keys]
                self.index.apply_stored(worker_id, self.seq[w], (keys, checks), parent, t)
                self.seq[w] += 1
                self.scheduler.on_prefix_cached(worker_id, keys, t)
