"""A routed request counts as load on its first candidate from the decision on: a burst routed
before any of its hand-offs is answered spreads over the fleet instead of piling onto the
worker that looked idle."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from thunderagent.fleet.views import worker_view
from thunderagent.router_core import RouterCore, RouterParams
from thunderagent.schemas import LoadReport, WorkerRegistration

BS = 16
WORKERS = ("w0", "w1", "w2", "w3")


def core(*, reported: tuple[str, ...] = WORKERS, policy: str = "thunder", **params) -> RouterCore:
    """Four registered workers with empty pools; only ``reported`` have sent a load report
    (a stack that has just started hears some workers' reports before others')."""
    c = RouterCore(RouterParams(policy=policy, seed=1, **params))
    for w in WORKERS:
        reg = WorkerRegistration(
            worker_id=w, model="m", engine_url="", block_size=BS, kv_capacity_blocks=1000,
            lease_s=10.0, registered_at=1.0,
        )  # fmt: skip
        c.register(reg, 0.0)
    for w in reported:
        c.report(load(w), 0.0)
    return c


def load(worker_id: str, ts: float = 0.0) -> LoadReport:
    return LoadReport(worker_id=worker_id, ts=ts, running=0, queued=0, kv_used_blocks=0,
                      kv_total_blocks=1000, prefill_backlog_tokens=0)  # fmt: skip


def prompt(k: int) -> list[int]:
    """A prompt of 8 full blocks that shares nothing with ``prompt(j)``, j != k."""
    return [k * 1000 + i for i in range(8 * BS)] + [1]


def route(c: RouterCore, rid: str, tokens: list[int], now: float = 1.0):
    return c.route(
        request_id=rid, model="m", hashes=c.hash_tokens(tokens, BS), prompt_tokens=len(tokens),
        block_size=BS, expected_output_tokens=16, now=now,
    )  # fmt: skip


def booked(c: RouterCore) -> dict[str, int]:
    return {w: len(c.fleet.get(w).booked) for w in WORKERS if c.fleet.get(w).booked}


@pytest.mark.parametrize("reported", [WORKERS, ("w1",), ()])
def test_a_burst_routed_before_any_dispatch_spreads_over_the_fleet(reported) -> None:
    """Sixteen distinct prompts at once, none dispatched yet (at start-up no router holds
    credit, so every one waits for the scheduler's answer): four on each worker. Before the
    decision booked them, all sixteen went to one worker, the one whose load report had come
    (it alone showed free KV, the tie-break)."""
    c = core(reported=reported)
    places = Counter(route(c, f"r{k}", prompt(k)).decision.worker_id for k in range(16))
    assert places == {w: 4 for w in WORKERS}


def test_a_dispatch_moves_the_booking_to_the_worker_that_took_the_request() -> None:
    c = core()
    first = route(c, "a", prompt(0)).decision.worker_id
    assert booked(c) == {first: 1}
    other = next(w for w in WORKERS if w != first)
    c.on_dispatched("a", other, 1.0)  # the scheduler placed it elsewhere
    assert booked(c) == {}
    assert c.fleet.get(other).assigned_since_report == 1
    assert c.fleet.get(first).assigned_since_report == 0
    assert worker_view(c.fleet.get(first)).pending == 0


def test_a_booking_counts_its_expected_prefill_and_kv() -> None:
    c = core()
    tokens = prompt(0)
    w = route(c, "a", tokens).decision.worker_id
    view = worker_view(c.fleet.get(w))
    assert (view.pending, view.pending_prefill_tokens, view.pending_kv_tokens) == (
        1, len(tokens), len(tokens),
    )  # fmt: skip


def test_a_load_report_keeps_bookings_nothing_was_sent_yet() -> None:
    c = core()
    w = route(c, "a", prompt(0)).decision.worker_id
    c.report(load(w, ts=0.5), 0.5)
    assert booked(c) == {w: 1}
    assert worker_view(c.fleet.get(w)).pending == 1


def test_a_refused_request_and_a_forgotten_one_leave_no_booking() -> None:
    c = core()
    route(c, "a", prompt(0))
    c.forget("a")
    assert booked(c) == {}
    w = route(c, "b", prompt(1)).decision.worker_id
    c.on_finished("b", w, 1.2, cached_tokens=0, completion_tokens=1)  # its end came first
    assert booked(c) == {}


def test_a_booking_no_worker_takes_lapses_after_its_ttl() -> None:
    """The scheduler dropped it while it waited (deadline): no router hears of that."""
    c = core(booking_ttl_s=5.0, feedback_interval_s=1.0)
    route(c, "a", prompt(0), now=1.0)
    route(c, "b", prompt(1), now=4.0)
    c.tick(1.0)
    c.tick(5.5)
    assert sum(booked(c).values()) == 2, "not yet past the ttl"
    c.tick(6.6)
    assert sum(booked(c).values()) == 1, "a lapsed, b stays"
    c.tick(9.6)
    assert booked(c) == {}


def test_routing_again_books_once() -> None:
    """A resend is routed again under the same id: one booking, on the newer decision."""
    c = core()
    route(c, "a", prompt(0))
    route(c, "a", prompt(0))
    assert sum(booked(c).values()) == 1


def test_an_unreported_worker_shows_its_registered_pool() -> None:
    c = core(reported=())
    view = worker_view(c.fleet.get("w0"))
    assert (view.kv_total_blocks, view.free_blocks) == (1000, 1000)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["route", "dispatch", "start", "finish", "forget", "report", "tick"]),
            st.integers(0, 7),
            st.sampled_from(WORKERS),
        ),
        max_size=60,
    )
)
def test_bookings_are_exactly_the_routed_requests_no_worker_took(ops) -> None:
    """Any order of decisions, dispatches, starts, ends, refusals, reports and ticks: a worker's
    bookings are the requests last routed to it that no worker has taken, none has ended, none
    was forgotten and whose booking has not lapsed; their sums match their entries."""
    c = core(booking_ttl_s=3.0, feedback_interval_s=0.5)
    expected: dict[str, tuple[str, float]] = {}
    now = 1.0
    for op, k, w in ops:
        now += 0.25
        rid = f"r{k}"
        if op == "route":
            expected[rid] = (route(c, rid, prompt(k), now).decision.worker_id, now)
        elif op == "dispatch":
            c.on_dispatched(rid, w, now)
            expected.pop(rid, None)
        elif op == "start":
            c.on_started(rid, w, now)
            expected.pop(rid, None)
        elif op == "finish":
            c.on_finished(rid, w, now, cached_tokens=0, completion_tokens=1)
            expected.pop(rid, None)
        elif op == "forget":
            c.forget(rid)
            expected.pop(rid, None)
        elif op == "report":
            c.report(load(w, now), now)
        elif c.tick(now):
            expected = {r: (x, t) for r, (x, t) in expected.items() if now - t <= 3.0}
        for worker in WORKERS:
            state = c.fleet.get(worker)
            mine = {r for r, (x, _) in expected.items() if x == worker}
            assert set(state.booked) == mine, (worker, op, rid)
            assert state.booked_prefill == sum(p for p, _ in state.booked.values())
            assert state.booked_kv == sum(kv for _, kv in state.booked.values())


COUNTING = ["round_robin", "least_loaded", "sglang_cache_aware", "smg_cache_aware", "dynamo_kv"]


@pytest.mark.parametrize("policy", [*COUNTING, "thunder"])
def test_a_policy_that_counts_its_requests_spreads_a_burst_decided_before_any_dispatch(
    policy,
) -> None:
    """A peer's router counts a request at selection (SGLang's round robin turns its counter,
    its cache-aware policies raise the worker's load, Dynamo books the blocks): so does its model
    here. Counted at the hand-off's answer, round robin sent a whole burst to one worker. (llm-d
    reads only the engines' scraped queue and KV figures, and so does its model: not here.)"""
    c = core(policy=policy)
    places = Counter(route(c, f"r{k}", prompt(k)).decision.worker_id for k in range(8))
    assert sorted(places.values()) == [2, 2, 2, 2], places


def test_a_refused_request_leaves_nothing_in_a_peers_counts() -> None:
    """SGLang's cache-aware policy counts requests in flight per worker; one refused before any
    worker took it leaves that count, and one placed elsewhere moves there."""
    c = core(policy="sglang_cache_aware")
    first = route(c, "a", prompt(0)).decision.worker_id
    c.forget("a")
    assert set(c.policy._load.values()) <= {0}
    route(c, "b", prompt(1))
    other = next(w for w in WORKERS if w != first)
    c.on_dispatched("b", other, 1.1)
    assert {w: n for w, n in c.policy._load.items() if n} == {other: 1}
