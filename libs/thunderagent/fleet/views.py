"""The one translation between wire types and what the pure cores see.

Every quantity is defined here once: an engine's load figures (``/v1/loads``) plus the adapter's
run counts become a ``LoadReport``; a registration plus its latest report become the routing
policy's ``WorkerView`` and the scheduler's ``WorkerRoom``; a routed request becomes the
scheduler's ``SchedRequest``. The services and the virtual-time replay call the same functions.
"""

from __future__ import annotations

from collections.abc import Sequence

from thunderagent.fleet.runs import AcceptedRuns, Run
from thunderagent.fleet.workers import WorkerState
from thunderagent.routing import WorkerView
from thunderagent.scheduling import SchedRequest, WorkerRoom
from thunderagent.schemas import LoadReport, RouteDecision
from thunderagent.sglang.load import EngineLoadFigures

LOAD_REPORT_INTERVAL_S = 0.2
"""Seconds between a worker's load reports: the adapter polls its engine's ``/v1/loads`` this
often, and the replay builds its reports on the same beat. Each report costs the router, the
scheduler and the migration service a decode and an update; at 0.1 s that is 15-20 % more
control-plane CPU at 200 req/s for no latency gain (docs/benchmarks.md)."""


def load_report(
    worker_id: str, ts: float, engine: EngineLoadFigures, runs: AcceptedRuns, capacity_blocks: int
) -> LoadReport:
    """What a worker publishes: the engine's figures and the adapter's own run counts."""
    return LoadReport(
        worker_id=worker_id,
        ts=ts,
        running=engine.running,
        queued=engine.queued,
        kv_used_blocks=engine.kv_used_blocks,
        kv_total_blocks=engine.kv_total_blocks or capacity_blocks,
        num_tokens=engine.num_tokens,
        inflight=runs.inflight,
        prefill_backlog_tokens=runs.prefill_backlog_tokens,
    )


def worker_view(state: WorkerState, cached_blocks: int = -1) -> WorkerView:
    """What a routing policy sees of a worker; ``cached_blocks``: what the router's prefix
    index holds for it (-1: unknown). The view is kept on ``state`` until the state or
    ``cached_blocks`` changes (policies only read views)."""
    view = state.view
    if view is None or view.cached_blocks != cached_blocks:
        view = state.view = _build_view(state, cached_blocks)
    return view


def _build_view(state: WorkerState, cached_blocks: int) -> WorkerView:
    load = state.load
    if load is None:
        # Just registered, no report yet: an empty engine with its registered pool, plus what
        # this process sent or booked there. Unknown figures priced as estimates instead made
        # it look fuller or emptier than a reported worker, and a burst at start-up went
        # to one side.
        return WorkerView(
            worker_id=state.worker_id,
            kv_total_blocks=state.registration.kv_capacity_blocks,
            pending=state.assigned_since_report + len(state.booked),
            pending_prefill_tokens=state.assigned_prefill_since_report + state.booked_prefill,
            pending_kv_tokens=state.assigned_kv_since_report + state.booked_kv,
            prefill_tokens=0,
            cached_blocks=cached_blocks,
        )
    return WorkerView(
        worker_id=state.worker_id,
        running=load.running,
        # runs the adapter accepted that the engine does not report yet count as queued
        queued=max(load.queued, load.inflight - load.running),
        kv_used_blocks=load.kv_used_blocks,
        kv_total_blocks=load.kv_total_blocks or state.registration.kv_capacity_blocks,
        active_tokens=load.num_tokens,
        pending=state.assigned_since_report + len(state.booked),
        pending_prefill_tokens=state.assigned_prefill_since_report + state.booked_prefill,
        pending_kv_tokens=(
            state.assigned_kv_since_report + state.started_kv_since_report + state.booked_kv
        ),
        prefill_tokens=load.prefill_backlog_tokens,
        prefill_started_tokens=state.started_since_report,
        cached_blocks=cached_blocks,
    )


def worker_room(state: WorkerState) -> WorkerRoom:
    """What the scheduler's admission sees of a worker (its latest report; the scheduler adds
    what it dispatched since)."""
    reg, load = state.registration, state.load
    running = queued = used = tokens = 0
    total = reg.kv_capacity_blocks
    if load is not None:
        running, used, tokens = load.running, load.kv_used_blocks, load.num_tokens
        queued = max(load.queued, load.inflight - load.running)
        total = load.kv_total_blocks or total
    return WorkerRoom(
        worker_id=reg.worker_id,
        running=running,
        queued=queued,
        kv_used_blocks=used,
        kv_total_blocks=total,
        max_running=reg.max_running_requests,
        role=reg.role.value,
        active_blocks=tokens // max(reg.block_size, 1) if load is not None else None,
    )


def sched_request(
    *,
    request_id: str,
    arrival: float,
    run: Run,
    expected_output_tokens: int,
    decision: RouteDecision,
    block_size: int,
    block_hashes: Sequence[int],
    priority: int = 0,
    program_id: str | None = None,
    deadline: float | None = None,
) -> SchedRequest:
    """A routed run as the scheduler queues it (``arrival``: when the request first arrived, so
    a continuation keeps its age)."""
    return SchedRequest(
        request_id=request_id,
        arrival=arrival,
        prompt_tokens=run.context_tokens,
        expected_output_tokens=max(1, min(expected_output_tokens, run.remaining_tokens)),
        candidates=[(c.worker_id, c.overlap_blocks) for c in decision.candidates],
        block_size=block_size,
        block_hashes=block_hashes,
        priority=priority,
        program_id=program_id,
        deadline=deadline,
        generated_tokens=run.output_offset,
    )
