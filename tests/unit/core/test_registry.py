"""Worker registry: leases, load reports, model filtering (pure, injected clock)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

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


@settings(max_examples=200, deadline=None)
@given(
    poll=st.sampled_from([0.5, 1.0, 8.0]),  # powers of two: window arithmetic is exact
    gaps=st.lists(st.floats(min_value=0.001, max_value=4.0), min_size=1, max_size=60),
)
def test_a_polling_registry_takes_the_first_report_after_each_boundary(poll, gaps):
    """With ``load_poll_s``, a report is taken iff no report was taken since the last poll
    boundary (``now // poll * poll``); every report renews the lease; what was sent since the
    taken report keeps counting until the next one is taken."""
    r = WorkerRegistry(load_poll_s=poll)
    r.register(reg("a", lease_s=1e9), now=0.0)
    now, taken_at, taken_queued, since = 0.0, None, None, 0
    times, taken = [], []
    for i, gap in enumerate(gaps):
        now += gap
        times.append(now)
        r.get("a").assign(f"q{i}", 10, 10)
        since += 1
        assert r.report(load("a", queued=i), now)
        if taken_at is None or taken_at < now // poll * poll:
            taken_at, taken_queued, since = now, i, 0
        if r.get("a").taken_at == now:
            taken.append(now)
        state = r.get("a")
        assert (state.taken_at, state.load.queued) == (taken_at, taken_queued)
        assert state.renewed_at == now
        assert state.assigned_since_report == since
    # the same, counted another way: the first report in each poll window, and no other
    firsts = [t for k, t in enumerate(times) if k == 0 or t // poll != times[k - 1] // poll]
    assert taken == firsts


def test_a_view_is_kept_until_its_worker_changes():
    r = WorkerRegistry()
    r.register(reg("a"), now=0)
    state = r.get("a")
    first = worker_view(state, 7)
    assert worker_view(state, 7) is first, "nothing changed: the same view"
    assert worker_view(state, 8).cached_blocks == 8, "the index's count is part of the view"
    state.assign("r1", 100, 120)
    assert worker_view(state, 8).pending == 1


_STEPS = st.lists(
    st.tuples(
        st.sampled_from(["assign", "started", "unassign", "report", "renew", "held"]),
        st.integers(0, 5),
        st.integers(0, 400),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(_STEPS)
def test_a_kept_view_always_equals_one_built_afresh(steps):
    """Every change to a worker's state (or to the index's count for it) shows in the next
    view: a kept view is never stale."""
    from thunderagent.fleet.views import _build_view

    r = WorkerRegistry()
    r.register(reg("a"), now=0)
    state, held = r.get("a"), 0
    for i, (op, k, n) in enumerate(steps):
        rid = f"r{k}"
        if op == "assign":
            state.assign(rid, n, n + 16)
        elif op == "started":
            state.started(rid)
        elif op == "unassign":
            state.unassign(rid)
        elif op == "report":  # a pool size of 0 (unknown) falls back to the registration's
            report = LoadReport(
                worker_id="a", ts=i, running=k, queued=n % 7, kv_used_blocks=k,
                kv_total_blocks=100 * (n % 2), inflight=k + 1,
            )  # fmt: skip
            r.report(report, now=i)
        elif op == "renew":  # same epoch, new figures
            r.register(
                WorkerRegistration(
                    worker_id="a", model="m", engine_url="http://e", block_size=16,
                    kv_capacity_blocks=100 + n, lease_s=10.0, registered_at=0.0,
                ),
                now=i,
            )  # fmt: skip
        else:
            held = n
        assert worker_view(state, held) == _build_view(state, held), (i, op)
