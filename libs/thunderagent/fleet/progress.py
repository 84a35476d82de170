"""Which run-event batches a receiver may trust.

An adapter publishes its runs' events (``RequestProgress``) only on its own subjects,
``subjects.progress(worker_id, ended=...)``, which NATS auth lets no other worker publish on; the
batch must also speak only for that worker's runs, and say on its subject whether it ends one
(routers read only those), so a compromised or misconfigured adapter cannot
end or start another worker's runs in the scheduler's and the routers' books.
"""

from __future__ import annotations

from thunderagent.schemas import ProgressBatch, subjects


def progress_refusal(batch: ProgressBatch, subject: str) -> str:
    """Why a receiver must not act on ``batch`` ("" when it may): it came on another worker's
    subject, or an event names another worker (except a PD ``transferred`` event, which names
    the decode worker the sender handed its run to)."""
    if subject != subjects.progress(batch.worker_id, ended=batch.ends_runs):
        return f"progress batch of {batch.worker_id!r} arrived on {subject}"
    me = batch.worker_id
    for event in batch.events:
        if event.worker_id != me and not (event.phase == "transferred" and event.from_worker == me):
            return f"progress batch of {me!r} speaks for {event.worker_id!r} ({event.phase})"
    if not batch.events:
        return f"progress batch of {me!r} has no events"
    return ""
