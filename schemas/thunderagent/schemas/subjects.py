"""Every NATS subject, stream, bucket and queue group name; spelled here and nowhere else.

Subject tokens are separated by '.', so a model name such as ``meta-llama/Llama-3.1-8B`` is escaped
into a single token by :func:`model_token` (``.``, ``*``, ``>``, ``%`` and white space become
``%XX``). Worker ids are restricted to subject-safe characters instead (see ``ids.py``).
"""

from __future__ import annotations

import functools
from typing import Final

PREFIX: Final = "thunderagent"

# client -> router: one subject per model, routers subscribe to all of them in one queue group.
REQUESTS_WILDCARD: Final = f"{PREFIX}.requests.>"
ROUTER_QUEUE: Final = "router"

# router -> scheduler: request/reply, the scheduler acks once the request is queued. One subject
# per model (``sched_submit``), like the request, the direct-dispatch and the run-failed
# subjects: schedulers may partition the fleet by model, each taking only its models' subjects.
SCHED_SUBMIT_WILDCARD: Final = f"{PREFIX}.sched.submit.*"
SCHEDULER_QUEUE: Final = "scheduler"

# adapters -> scheduler and routers: runs' lives, two subjects per adapter (``progress``).
PROGRESS_WILDCARD: Final = f"{PREFIX}.progress.*.*"

# adapters -> scheduler: a run its engine failed, to be resumed elsewhere (request/reply).
SCHED_RUN_FAILED_WILDCARD: Final = f"{PREFIX}.sched.run_failed.*"

# routers -> scheduler: requests a router dispatched on credit, and the routers' presence.
SCHED_DIRECT_WILDCARD: Final = f"{PREFIX}.sched.direct.*"
ROUTER_PRESENCE: Final = f"{PREFIX}.router.presence"

# clients / gateways -> scheduler: stop a request (client gone, timeout).
SCHED_CANCEL: Final = f"{PREFIX}.sched.cancel"

# clients -> scheduler: an agent program ended.
PROGRAM_RELEASE: Final = f"{PREFIX}.programs.release"

# router -> observers (benchmarks, dashboards, the migration service): RouteDecisionBatch.
ROUTE_DECISIONS: Final = f"{PREFIX}.route.decisions"

# adapters -> index/routers: KV events, captured by a JetStream stream so nothing is missed.
KV_EVENTS_WILDCARD: Final = f"{PREFIX}.kv.events.*"
KV_EVENTS_STREAM: Final = "THUNDERAGENT_KV"
INDEX_DURABLE: Final = "thunderagent-index"

# anyone -> index service (request/reply): the holders of prefixes (HoldersQuery).
INDEX_HOLDERS: Final = f"{PREFIX}.index.holders"
INDEX_QUEUE: Final = "index"
"""Queue group of the index service's queries (replicas share them)."""

# per-worker load reports (also the lease heartbeat) and the registration bucket.
WORKER_LOAD_WILDCARD: Final = f"{PREFIX}.worker.*.load"
WORKERS_BUCKET: Final = "thunderagent_workers"

DEAD_LETTER_WILDCARD: Final = f"{PREFIX}.deadletter.>"

# operators / benchmarks -> migration service (request/reply).
MIGRATION_REQUEST: Final = f"{PREFIX}.migration.request"
"""``MigrationOrder`` -> the final ``MigrationReport``: move this prefix now."""
MIGRATION_DRAIN: Final = f"{PREFIX}.migration.drain"
"""``DrainNotice`` -> ``Ack``: this worker is leaving; save the prefixes only it holds."""
MIGRATION_QUEUE: Final = "migration"
"""Queue group of the migration service (one instance per fleet)."""

# migration service -> observers: a MigrationReport when a move starts and when it ends.
MIGRATION_EVENTS: Final = f"{PREFIX}.migration.events"

_ESCAPED: Final = frozenset(".*>% \t\r\n")


@functools.lru_cache(maxsize=1024)  # every request's subjects name its model; a fleet has few
def model_token(model: str) -> str:
    """Escape a model name into one subject token; the inverse is :func:`model_from_token`."""
    return "".join(f"%{ord(ch):02X}" if ch in _ESCAPED else ch for ch in model)


def model_from_token(token: str) -> str:
    """Inverse of :func:`model_token`."""
    out: list[str] = []
    i = 0
    while i < len(token):
        if token[i] == "%" and i + 3 <= len(token):
            out.append(chr(int(token[i + 1 : i + 3], 16)))
            i += 3
        else:
            out.append(token[i])
            i += 1
    return "".join(out)


def requests(model: str) -> str:
    """Where clients publish a ``GenerateRequest`` for ``model`` (reply inbox: the stream)."""
    return f"{PREFIX}.requests.{model_token(model)}"


def sched_submit(model: str) -> str:
    """Router -> the scheduler owning ``model``: ``ScheduleRequest`` -> ``Ack``."""
    return f"{PREFIX}.sched.submit.{model_token(model)}"


def sched_direct(model: str) -> str:
    """Router -> the scheduler owning ``model``: a ``DirectDispatch`` it made on credit."""
    return f"{PREFIX}.sched.direct.{model_token(model)}"


def sched_run_failed(model: str) -> str:
    """Adapter -> the scheduler owning ``model``: ``RunFailed`` -> ``Ack``."""
    return f"{PREFIX}.sched.run_failed.{model_token(model)}"


def scheduler_inbound(model: str | None) -> tuple[str, str, str]:
    """What a scheduler owning ``model`` (None: every model) hears on: submissions, routers'
    dispatches on credit, failed runs."""
    if model is None:
        return SCHED_SUBMIT_WILDCARD, SCHED_DIRECT_WILDCARD, SCHED_RUN_FAILED_WILDCARD
    return sched_submit(model), sched_direct(model), sched_run_failed(model)


def progress(worker_id: str, *, ended: bool) -> str:
    """One adapter's ``ProgressBatch``es: ``ended`` for a batch that ends a run, else
    ``running`` (starts and PD hand-offs), so an observer that counts only ends reads less."""
    return f"{PREFIX}.progress.{worker_id}.{'ended' if ended else 'running'}"


def worker_progress(worker_id: str) -> str:
    """Both of one adapter's progress subjects (its publish permission)."""
    return f"{PREFIX}.progress.{worker_id}.*"


def router_credits(router_id: str) -> str:
    """Scheduler -> one router replica: ``CreditGrant``."""
    return f"{PREFIX}.router.{router_id}.credits"


def router_dispatched(router_id: str) -> str:
    """Scheduler -> the router replica that routed a request: ``Dispatched`` (where it went)."""
    return f"{PREFIX}.router.{router_id}.dispatched"


def router_dropped(router_id: str) -> str:
    """Scheduler -> the router replica that routed a request: ``Dropped`` (no worker will run
    it)."""
    return f"{PREFIX}.router.{router_id}.dropped"


def worker_generate(worker_id: str) -> str:
    """Scheduler -> adapter hand-off (``WorkerGenerate`` -> ``Ack``)."""
    return f"{PREFIX}.worker.{worker_id}.generate"


def worker_abort(worker_id: str) -> str:
    """Scheduler -> adapter preemption (``AbortRequest`` -> ``Preempted``)."""
    return f"{PREFIX}.worker.{worker_id}.abort"


def worker_kv_import(worker_id: str) -> str:
    """Prefill adapter -> decode adapter (``KvTransfer`` -> ``Ack``): import this KV (PD)."""
    return f"{PREFIX}.worker.{worker_id}.kv_import"


def worker_load(worker_id: str) -> str:
    """Adapter's ``LoadReport`` several times a second (also its lease heartbeat)."""
    return f"{PREFIX}.worker.{worker_id}.load"


def worker_resync(worker_id: str) -> str:
    """Index -> adapter (``ResyncRequest`` -> ``Ack``): republish the whole cache."""
    return f"{PREFIX}.worker.{worker_id}.resync"


def worker_kv_export(worker_id: str) -> str:
    """Migration service, or the adapter of a run's worker (a pull at dispatch) -> source
    adapter (``KvExportRequest`` -> ``KvExportOffer``)."""
    return f"{PREFIX}.worker.{worker_id}.kv_export"


def worker_kv_pull(worker_id: str) -> str:
    """Migration service -> target adapter (``KvPullRequest`` -> ``KvPullResult``)."""
    return f"{PREFIX}.worker.{worker_id}.kv_pull"


def worker_kv_release(worker_id: str) -> str:
    """Migration service, or the adapter of a run's worker (a pull at dispatch) -> source
    adapter (``KvRelease`` -> ``KvReleaseResult``)."""
    return f"{PREFIX}.worker.{worker_id}.kv_release"


def kv_events(worker_id: str) -> str:
    """The adapter's ``KvEventBatch`` stream (captured by ``KV_EVENTS_STREAM``)."""
    return f"{PREFIX}.kv.events.{worker_id}"


def dead_letter(service: str) -> str:
    """``DeadLetter`` records of messages ``service`` rejected."""
    return f"{PREFIX}.deadletter.{service}"


def worker_key(worker_id: str) -> str:
    """Key of a worker's registration in the ``WORKERS_BUCKET`` key-value bucket."""
    return worker_id


HEALTH_WILDCARD: Final = f"{PREFIX}.health.>"


def health(service: str) -> str:
    """Request/reply liveness probe answered by every service process with a ``Health``."""
    return f"{PREFIX}.health.{service}"


# Redis keys (Redis holds no message traffic, only state that lets replicas start warm).
REDIS_INDEX_SNAPSHOT: Final = f"{PREFIX}:index:snapshot"
"""Latest index snapshot with the KV-event stream sequence it covers."""
