"""The scheduler service's metrics: each worker's queue depth (the requests waiting here for
it and in its engine's queue) and the scheduling core's decisions by kind."""

from __future__ import annotations

from typing import TYPE_CHECKING

from opentelemetry.metrics import Observation

from thunderagent.telemetry.setup import meter

if TYPE_CHECKING:
    from thunderagent.scheduler.service import SchedulerService


def register_metrics(service: SchedulerService) -> None:
    m = meter("thunderagent.scheduler")
    m.create_observable_gauge(
        "thunderagent_worker_queue_depth",
        [lambda _options: queue_depths(service)],
        description="Requests waiting for the worker: scheduler queue + engine waiting queue",
    )
    m.create_observable_counter(
        "thunderagent_scheduler_events",
        [lambda _options: events_by_kind(service)],
        description="The scheduler's decisions since start, by kind (dispatched, rejected, "
        "preempted, grouped, program pauses, ...)",
    )


def queue_depths(service: SchedulerService) -> list[Observation]:
    queued: dict[str, int] = {}
    for p in service.pending.values():
        if not p.worker_id and p.submit.decision.candidates:
            first = p.submit.decision.candidates[0].worker_id
            queued[first] = queued.get(first, 0) + 1
    out = []
    for state in service.registry.all():
        if not service.owns(state.worker_id):
            continue
        engine = state.load.queued if state.load else 0
        depth = queued.get(state.worker_id, 0) + engine
        out.append(Observation(depth, {"worker_id": state.worker_id}))
    return out


def events_by_kind(service: SchedulerService) -> list[Observation]:
    stats = getattr(service.core, "stats", None)  # the core's own counters, where it keeps them
    counts = stats() if stats is not None else {}
    skip = ("waiting", "running", "pd_inflight")  # levels, not counts
    out = [Observation(n, {"event": k}) for k, n in counts.items() if k not in skip]
    # the service's own: runs on credit of a request whose resend ran or runs (each stopped
    # where it still ran)
    out.append(Observation(service.second_runs, {"event": "second_runs"}))
    return out
