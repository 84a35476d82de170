"""The fleet as the control plane sees it (pure, clock injected): registrations with leases and
latest loads (``workers``), the run model (``runs``), the hand-offs a worker must not run
(``offers``), which run-event batches to trust (``progress``) and the one translation from wire
types to what the routing and scheduling cores see (``views``)."""

from thunderagent.fleet.limits import check_limits
from thunderagent.fleet.offers import HandledOffers, OfferIds
from thunderagent.fleet.progress import progress_refusal
from thunderagent.fleet.runs import (
    AcceptedRuns,
    Run,
    client_output,
    continuation,
    engine_request_id,
)
from thunderagent.fleet.views import (
    LOAD_REPORT_INTERVAL_S,
    load_report,
    sched_request,
    worker_room,
    worker_view,
)
from thunderagent.fleet.workers import WorkerRegistry, WorkerState

__all__ = [
    "LOAD_REPORT_INTERVAL_S",
    "AcceptedRuns",
    "HandledOffers",
    "OfferIds",
    "Run",
    "WorkerRegistry",
    "WorkerState",
    "check_limits",
    "client_output",
    "continuation",
    "engine_request_id",
    "load_report",
    "progress_refusal",
    "sched_request",
    "worker_room",
    "worker_view",
]
