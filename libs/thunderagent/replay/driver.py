"""Virtual-time replay: the router core and a scheduler in front of N engine cores.

One discrete-event loop over four sources, in time order: trace arrivals, engine step
completions (one in flight per busy engine), timers (KV-transfer landings, closed-loop
arrivals) and the scheduler's wakeups. On a tie an arrival goes first, then step completions,
then timers, then the wakeup; engines are (re)started only after every event of an instant is
handled, so requests arriving together are batched together.

The replay runs the code that serves, fed what the services are fed:

* routing is ``RouterCore`` (``thunderagent.router_core``), the object the router service runs:
  hashing, the event-fed index with its in-flight overlay and GPU/host tiers, the policy, lazy
  verification and the tuner's feedback, with ``on_dispatched`` called for the worker the
  scheduler actually chose, ``on_started`` at each run's first token and ``on_finished`` at its
  end, as the adapters' progress events tell the router service;
* load reports are built every ``load_interval`` virtual seconds the way the worker adapter
  builds them: the engine's ``/v1/loads`` answer (``thunderagent.sglang.load``) plus the runs
  accepted and not yet started (``thunderagent.fleet.AcceptedRuns``), translated into the
  router's and the scheduler's views by ``thunderagent.fleet.views``;
* each engine step's cache events become a ``KvEventBatch`` with the worker's own sequence and
  go through the same ``IndexFeeder.apply`` the router's index follower calls (engines without
  KV events: the events of the cache their adapters infer, ``sglang.shadow``);
* runs follow ``thunderagent.fleet.runs`` (continuations after a preemption carry the generated
  tokens); scheduler actions are carried out by ``actions.py``, PD transfers modelled in ``pd.py``.

Every request is accounted for: at the end each one is completed, rejected (with its reason) or
still in flight because the run was bounded (``until``); anything else is a lost request and the
replay fails loudly.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from thunderagent.engine import CacheEvent, EngineCore, Request
from thunderagent.engine.core import StepOutcome
from thunderagent.fleet import (
    AcceptedRuns,
    Run,
    load_report,
    sched_request,
    worker_room,
)
from thunderagent.hashing import BlockHasher, BlockHashes
from thunderagent.prefix_index.feed import stored_hashes
from thunderagent.replay.actions import SchedulerActions
from thunderagent.replay.kv_batches import kv_batch
from thunderagent.replay.pd import TransferLinks
from thunderagent.replay.records import LostRequests, Record, ReplayConfig, ReplayResult
from thunderagent.replay.shadows import ReplayShadows, found_tokens
from thunderagent.replay.traces import TraceRequest
from thunderagent.router_core import RouterCore
from thunderagent.scheduling import SCHEDULERS, Dispatch, SchedRequest
from thunderagent.scheduling.credits import CreditIssuer, CreditWallet
from thunderagent.schemas import (
    RouteDecision,
    WorkerRegistration,
    WorkerRole,
)
from thunderagent.sglang.load import parse_v1_loads, v1_loads_payload

if TYPE_CHECKING:
    from thunderagent.replay.migration import ReplayMigration

INF = math.inf
MODEL = "replay"
ROUTER_ID = "replay-router"
"""Every replayed worker serves this one model."""
TERMINAL = ("completed", "rejected")


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
        self.router = RouterCore(config.router_params())
        self.issuer = CreditIssuer()
        self.issuer.hello(ROUTER_ID, 0.0)
        self.wallet = CreditWallet()
        """The fast path as live: the scheduler lends the router room (no delay here)."""
        self.direct_dispatches = 0
        self._add_workers(config.workers)
        self.bootstrap_requests: dict[str, tuple[Request, int]] = {}
        """SGLang's PD: runs in a prealloc queue, with their prefill request and predicted hit."""
        self.migration: ReplayMigration | None = None
        """KV migration, when ``ReplayMigration.attach`` hooked it in (``migration.py``)."""
        self._init_loop(config.workers)
        self.follow_up: Callable[[str, float], TraceRequest | None] | None = None
        """Closed loop: called when a request ends; returns the next request to arrive."""
        self.extra: list[str] = []
        self.meta: dict[str, TraceRequest] = {}
        self.resuming: set[str] = set()
        self.hasher = BlockHasher(block_size=1)  # block ids are given directly (one per block)
        self.check: dict[int, int] = {}
        self.records: dict[str, Record] = {}
        self.keys: dict[str, BlockHashes] = {}
        self.route_overlaps: dict[str, dict[str, int]] = {}
        """Per request, the index's belief at its latest routing (what a dispatch is judged by)."""
        self.pulled_predicted: dict[str, int] = {}
        """Runs waiting for a pull: the cached tokens the index predicted on their worker."""
        self.decisions: dict[str, RouteDecision] = {}
        """Per request, its routing decision (a continuation is queued with it, as live)."""
        self.session: dict[str, str | None] = {}

    def _add_workers(self, n: int) -> None:
        """The fleet: n engine cores with their roles, registered with the router, and PD links."""
        self.ids = [f"w{i:02d}" for i in range(n)]
        self.slot = {w: i for i, w in enumerate(self.ids)}
        self.cores = [EngineCore(self.cfg.profile) for _ in range(n)]
        self.roles = list(self.cfg.roles) if self.cfg.roles is not None else ["both"] * n
        if len(self.roles) != n:
            raise ValueError(f"{len(self.roles)} roles for {n} workers")
        self.accepted = [AcceptedRuns() for _ in range(n)]
        self.shadows = self._shadows()
        for w in range(n):
            self.router.register(self._registration(w), 0.0)
        self.links = TransferLinks(
            self.cfg.profile.kv_bytes_per_token, self.cfg.link_bytes_per_s, via=self.cfg.pd_via
        )

    def _init_loop(self, n: int) -> None:
        """The event loop's state at virtual time 0: clock, step and timer heaps, counters."""
        self.timers: list[tuple[float, int, str, object]] = []
        self._timer_seq = 0
        self.prefill_tokens = 0
        self.stalled_wakeups = 0
        """Wakeups asked for the current instant and moved 1 µs later (see ``_poll``)."""
        self._stalls = 0
        self.kv_seq = [-1] * n
        self.busy = [0.0] * n
        self.inflight: dict[int, tuple[float, StepOutcome]] = {}
        self.heap: list[tuple[float, int]] = []
        self.dirty: set[int] = set()
        self.timeline: list[tuple[float, list[int]]] = []
        self.now = 0.0
        self.steps = 0
        self._next_load = 0.0
        self._next_timeline = 0.0
        self._wake = INF

    def _shadows(self) -> ReplayShadows | None:
        """Engines without KV events: each one's cache as its adapter infers and announces it
        (``replay.shadows``), unless the policy keeps its own record (a peer's approximate mode)."""
        if self.cfg.kv_events or self.router.policy.keeps_approximate_cache():
            return None
        return ReplayShadows([core.cache.capacity for core in self.cores])

    def _registration(self, w: int) -> WorkerRegistration:
        engine = self.cfg.profile.engine
        return WorkerRegistration(
            worker_id=self.ids[w],
            model=MODEL,
            engine_url=f"replay://{self.ids[w]}",
            block_size=self.block_size,
            kv_capacity_blocks=self.cores[w].cache.capacity,
            lease_s=INF,
            registered_at=0.0,
            role=WorkerRole(self.roles[w]),
            max_running_requests=engine.max_running_requests,
            kv_events=self.cfg.kv_events,
        )

    # ---- main loop -----------------------------------------------------------------------
    def run(
        self,
        trace: Sequence[TraceRequest],
        speed: float = 1.0,
        progress: Callable[[int], None] | None = None,
        until: float | None = None,
    ) -> ReplayResult:
        """Replay ``trace`` (arrival order) with arrival times divided by ``speed``; with
        ``until``, stop at that virtual time and count what is left as in flight."""
        if not speed > 0:
            raise ValueError(f"speed must be > 0, got {speed!r}")
        times = [r.arrival / speed for r in trace]
        i, n = 0, len(trace)
        heap, timers = self.heap, self.timers
        stop_at = INF if until is None else until
        while True:
            t_arr = times[i] if i < n else INF
            t_step = heap[0][0] if heap else INF
            t_timer = timers[0][0] if timers else INF
            t = min(t_arr, t_step, t_timer, self._wake)
            if self.dirty and t > self.now:
                self._start_steps(min(t_arr, t_timer))
                continue
            if t == INF or t > stop_at:
                break
            self.now = t
            self._tick(t)
            if t_arr == t:
                i += 1
                self._arrive(trace[i - 1], t)
                if progress is not None and i % 500 == 0:
                    progress(500)
            else:
                self._handle_due(t, t_step, t_timer)
            self._poll(t)
        if progress is not None and n % 500:
            progress(n % 500)
        return self._result([r.request_id for r in trace[:i]], bounded=until is not None)

    def _handle_due(self, t: float, t_step: float, t_timer: float) -> None:
        """The instant's next event after arrivals: a step completion, a timer, else the wakeup."""
        if t_step == t:
            _, w = heapq.heappop(self.heap)
            self._complete(w, t)
        elif t_timer == t:
            _, _, kind, payload = heapq.heappop(self.timers)
            self._timer(kind, payload, t)
        else:
            self._wake = INF
            self._refresh_loads(t)

    def _result(self, arrived: list[str], *, bounded: bool) -> ReplayResult:
        records = [self.records[r] for r in [*arrived, *self.extra]]
        open_ = [r for r in records if r.status not in TERMINAL]
        if open_ and not bounded:
            sample = ", ".join(f"{r.request_id} ({r.status})" for r in open_[:5])
            raise LostRequests(
                f"{len(open_)} of {len(records)} requests neither completed nor rejected "
                f"(policy {self.cfg.policy}, scheduler {self.cfg.scheduler}): {sample}"
            )
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
            bootstrap_waits_s=self.links.bootstrap_waits,
            sched_stats={
                **(dict(stats()) if stats is not None else {}),
                "stalled_wakeups": self.stalled_wakeups,
                "direct_dispatches": self.direct_dispatches,
            },
            in_flight=len(open_),
        )

    def _timer(self, kind: str, payload: object, t: float) -> None:
        if kind == "handoff":
            assert isinstance(payload, Dispatch)
            self._dispatch(payload, t)
        elif kind == "arrive":
            assert isinstance(payload, TraceRequest)
            self.extra.append(payload.request_id)
            self._arrive(payload, t)
        elif kind == "migration":
            self.migration.landed(str(payload), t)
        elif kind == "pull":
            self._pull_landed(str(payload), t)
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
            depths = [(load := c.load()).num_running + load.num_waiting for c in self.cores]
            self.timeline.append((t, depths))
            interval = self.cfg.timeline_interval
            self._next_timeline = (math.floor(t / interval) + 1) * interval
        self.router.tick(t)
        if self.migration is not None:
            self.migration.tick(t)

    def _refresh_loads(self, t: float) -> None:
        """Every worker's load report, as its adapter would publish it now."""
        if t < self._next_load:
            return
        bs = self.block_size
        for w, core in enumerate(self.cores):
            figures = parse_v1_loads(v1_loads_payload(core.load(), bs), bs)
            report = load_report(self.ids[w], t, figures, self.accepted[w], core.cache.capacity)
            self.router.report(report, t)
            if self.migration is not None:
                self.migration.load(report, MODEL, t)
            state = self.router.fleet.get(self.ids[w])
            if state is not None:
                self.scheduler.update_worker(worker_room(state), t)
        interval = self.cfg.load_interval
        self._next_load = (math.floor(t / interval) + 1) * interval
        self._grant()

    # ---- arrivals and routing ------------------------------------------------------------
    def _arrive(self, req: TraceRequest, t: float) -> None:
        full = req.prompt_len // self.block_size
        hashes = self.hasher.hash_block_ids(req.block_ids[:full])
        self.check.update(zip(hashes.primary, hashes.check, strict=True))
        rid = req.request_id
        self.keys[rid] = hashes
        self.session[rid] = req.session
        self.meta[rid] = req
        self.records[rid] = Record(rid, t, req.prompt_len, req.output_len)
        self._refresh_loads(t)
        self._submit(self.records[rid], t)

    def _submit(self, rec: Record, t: float) -> None:
        """Route a new request; dispatch it on credit (the fast path) or queue it."""
        rid, bs = rec.request_id, self.block_size
        meta = self.meta[rid]
        hashes = self.keys[rid]
        routed = self.router.route(
            request_id=rid,
            model=MODEL,
            hashes=hashes,
            prompt_tokens=rec.prompt_tokens,
            block_size=bs,
            expected_output_tokens=self._expected(rec),
            now=t,
            priority=meta.priority,
        )
        assert routed is not None  # every replayed worker serves MODEL
        usable = (rec.prompt_tokens - 1) // bs
        rec.best_overlap_tokens = min(max(routed.expected.values(), default=0), usable) * bs
        self.route_overlaps[rid] = dict(routed.expected)
        self.decisions[rid] = routed.decision
        if self.migration is not None:
            self.migration.routed(rid, routed.decision, t)
        request = self._sched_request(rec)
        first = routed.decision.worker_id
        if routed.may_dispatch_directly(meta.deadline, meta.session) and self.wallet.take(first):
            self.scheduler.admitted(request, first, t)
            self.issuer.book(ROUTER_ID, first)
            self.direct_dispatches += 1
            self.router.on_offered(rid, first)
            self._hand_off(Dispatch(rid, first), t)
        else:
            self.scheduler.submit(request, t)

    def _grant(self) -> None:
        """The scheduler lends the router its current room (live: a ``CreditGrant``)."""
        for grant in self.issuer.grants(self.scheduler.rooms()).values():
            self.wallet.update(grant)

    def _expected(self, rec: Record) -> int:
        meta = self.meta[rec.request_id]
        return self.router.expected_output(self._max_tokens(rec), meta.expected_output)

    def _max_tokens(self, rec: Record) -> int:
        return max(self.cfg.max_tokens, rec.output_tokens)

    def _sched_request(self, rec: Record) -> SchedRequest:
        """The request's current run for the scheduler, with its routing decision (a
        continuation reuses it, as the scheduler service does)."""
        rid = rec.request_id
        meta = self.meta[rid]
        return sched_request(
            request_id=rid,
            arrival=rec.arrival,
            run=Run(rec.prompt_tokens, self._max_tokens(rec), rec.completion_tokens),
            expected_output_tokens=self._expected(rec),
            decision=self.decisions[rid],
            block_size=self.block_size,
            block_hashes=self.keys[rid].primary,
            priority=meta.priority,
            program_id=meta.session,
            deadline=meta.deadline,
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
                if core.imports_pending or self.links.sending(self.ids[w]):
                    continue  # no room until KV in flight lands (a timer wakes it)
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
        if self.migration is not None:  # warm-ups it ran are not trace requests: skipped below
            self.migration.on_step(w, outcome, t)
        self._first_tokens(w, outcome, t)
        worker_id = self.ids[w]
        records = self.records
        for fin in outcome.finished:
            rec = records.get(fin.request_id)
            if rec is None or rec.worker != w or rec.status != "running":
                continue
            self.accepted[w].finished(fin.request_id)
            if self.links.phase(fin.request_id) != "decode":
                self._account_run(rec, fin.cached_tokens, fin.prompt_tokens)
            rec.completion_tokens += fin.completion_tokens
            rec.preemptions += fin.preemptions
            if self.links.phase(fin.request_id) == "prefill":
                self._prefilled(rec, w, fin.prompt_tokens, t)
                continue
            self.router.on_finished(
                rec.request_id,
                worker_id,
                t,
                cached_tokens=fin.cached_tokens,
                completion_tokens=rec.completion_tokens,
            )
            self._completed(rec, worker_id, t)
        if self.links.awaiting_room(worker_id):  # SGLang's PD: room freed for a reservation?
            self._preallocate(w, t)

    def _first_tokens(self, w: int, outcome: StepOutcome, t: float) -> None:
        """The step's first tokens on ``w``: each TTFT recorded, each run reported started."""
        for run_id in outcome.first_token:
            rec = self.records.get(run_id)
            if rec is None or rec.worker != w or rec.status != "running":
                continue
            self.accepted[w].started(run_id)
            phase = self.links.phase(run_id)
            late = phase == "prefill" and self.links.decode_streams_first_token
            if math.isnan(rec.first_token) and not late:
                rec.first_token = t
            if phase != "decode":  # each run starts once (continuations too)
                self._started(rec, w, t, outcome)

    def _started(self, rec: Record, w: int, t: float, outcome: StepOutcome) -> None:
        """The run's first token, as its adapter reports it (and, for an engine without KV
        events, announces, its shadow checked against what the engine reported found)."""
        rid, worker_id = rec.request_id, self.ids[w]
        self.router.on_started(rid, worker_id, t)
        self.scheduler.on_started(rid, worker_id, t)
        if self.shadows is not None:
            keys = self.keys[rid].primary[: rec.prompt_tokens // self.block_size]
            found = found_tokens(self.cores[w], outcome, rid)
            self._announce(w, self.shadows.started(w, rec, keys, self.block_size, found), t)

    def _completed(self, rec: Record, worker_id: str, t: float) -> None:
        self.links.forget(rec.request_id)
        rec.status, rec.finish = "completed", t
        self.scheduler.on_finished(rec.request_id, worker_id, t)
        self._ended(rec, t)

    def _apply_events(self, w: int, outcome: StepOutcome, t: float) -> None:
        """The step's cache events, as the worker's adapter publishes them, into the router's
        index; stored prefixes also go to the scheduler (prefix grouping). Engines without KV
        events publish nothing."""
        if self.cfg.kv_events:
            self._announce(w, outcome.events, t)

    def _announce(self, w: int, events: list[CacheEvent], t: float) -> None:
        batch = kv_batch(self.ids[w], self.kv_seq[w] + 1, events, self.check, t)
        if batch is None:
            return
        self.kv_seq[w] = batch.seq
        self.router.apply_kv(batch, t)
        for hashes in stored_hashes(batch):
            self.scheduler.on_prefix_cached(self.ids[w], hashes, t)
