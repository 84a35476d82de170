"""Worker registry: leases, load reports, model filtering (pure, injected clock)."""

from __future__ import annotations

from thunderagent.fleet import WorkerRegistry, worker_room, worker_view
from thunderagent.schemas import LoadReport, WorkerRegistration


def reg(worker_id: str, model: str = "m", lease_s: float = 10.0, at: float = 0.0):
    return WorkerRegistration(
        worker_id=worker_id,
        model=model,
        engine_url="http://e",
        block_size=16,
        kv_capacity_blocks=100,
        lease_s=lease_s,
        registered_at=at,
    )


def load(worker_id: str, running: int = 0, queued: int = 0, inflight: int = 0):
    return LoadReport(
        worker_id=worker_id,
        ts=0.0,
        running=running,
        queued=queued,
        kv_used_blocks=10,
        kv_total_blocks=100,
        inflight=inflight,
    )


def test_lease_lapses_without_renewal_and_load_reports_renew_it():
    r = WorkerRegistry()
    r.register(reg("a", lease_s=5), now=0)
    r.register(reg("b", lease_s=5), now=0)
    assert r.report(load("a"), now=4)
    assert r.expire(now=5.5) == ["b"]
    assert "a" in r and "b" not in r
    assert r.expire(now=9.5) == ["a"]


def test_report_from_unknown_worker_is_refused():
    assert not WorkerRegistry().report(load("ghost"), now=0)


def test_reregistration_with_a_new_epoch_is_reported_as_new():
    r = WorkerRegistry()
    assert r.register(reg("a", at=1.0), now=0)
    assert not r.register(reg("a", at=1.0), now=1)
    assert r.register(reg("a", at=2.0), now=2)


def test_view_counts_requests_the_engine_has_not_reported_yet():
    r = WorkerRegistry()
    r.register(reg("a"), now=0)
    r.report(load("a", running=2, queued=0, inflight=5), now=0)
    state = r.get("a")
    state.assigned_since_report = 1
    view = worker_view(state)
    assert (view.running, view.queued, view.pending, view.outstanding) == (2, 3, 1, 6)
    room = worker_room(state)  # the scheduler sees the same running and queued counts
    assert (room.running, room.queued) == (2, 3)
    r.report(load("a", running=2), now=1)
    assert worker_view(r.get("a")).pending == 0


def test_for_model_filters():
    r = WorkerRegistry()
    r.register(reg("a", model="x"), now=0)
    r.register(reg("b", model="y"), now=0)
    assert [s.worker_id for s in r.for_model("y")] == ["b"]
    assert r.models() == {"x", "y"}
