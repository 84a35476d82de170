"""Admission credits: what the scheduler lends router replicas, and what a router may do with it."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from thunderagent.scheduling import SCHEDULERS, Dispatch, SchedRequest, WorkerRoom
from thunderagent.scheduling.credits import (
    CREDIT_LEASE_S,
    DEMAND_HALF_LIFE_S,
    REGRANT_SLACK,
    CreditIssuer,
    CreditWallet,
    StallGuard,
    may_dispatch_directly,
    split,
)


def test_room_is_split_between_live_routers_and_adds_up() -> None:
    issuer = CreditIssuer()
    issuer.hello("b", 0.0)
    issuer.hello("a", 0.0)
    grants = issuer.grants({"w0": 5, "w1": 1, "w2": 0})
    assert grants["a"].credits == {"w0": 3, "w1": 1}
    assert grants["b"].credits == {"w0": 2}
    assert issuer.grants({"w0": 5, "w1": 1, "w2": 0}) == {}  # nothing changed: no new grant
    assert set(issuer.grants({"w0": 5, "w1": 1}, force=True)) == {"a", "b"}
    issuer.expire(10.0)  # both silent past the TTL: no one to lend to
    assert issuer.grants({"w0": 5}) == {}


def test_a_grant_crossing_the_routers_own_dispatches_never_counts_room_twice() -> None:
    issuer, wallet = CreditIssuer(), CreditWallet()
    issuer.hello("r", 0.0)
    wallet.update(issuer.grants({"w0": 2})["r"])
    assert wallet.take("w0") and wallet.take("w0")
    assert not wallet.take("w0")  # the room is used up
    # a fresh grant issued before the scheduler booked those two still says 2 of room
    wallet.update(issuer.grants({"w0": 2}, force=True)["r"])
    assert wallet.available("w0") == 0
    issuer.book("r", "w0")
    issuer.book("r", "w0")  # now it has booked them; its new room (1) is lent anew
    wallet.update(issuer.grants({"w0": 1})["r"])
    assert wallet.available("w0") == 1
    assert wallet.take("w0")
    wallet.give_back("w0")  # the worker refused it: that dispatch never happened
    assert wallet.available("w0") == 1
    wallet.update(issuer.grants({"w0": 1}, force=True)["r"], now=0.0)
    assert wallet.available("w0", now=CREDIT_LEASE_S + 0.1) == 0  # no word from the scheduler


def test_a_booked_dispatch_sends_nothing_a_move_past_the_slack_does() -> None:
    issuer = CreditIssuer()
    issuer.hello("r", 0.0)
    assert issuer.grants({"w0": 12, "w1": 2})["r"].credits == {"w0": 12, "w1": 2}
    issuer.book("r", "w0")  # the router used one: its room and its booking move together
    assert issuer.in_hand("r", "w0") == 11
    assert issuer.grants({"w0": 11, "w1": 2}) == {}
    assert issuer.grants({"w0": 13, "w1": 2}) == {}  # two runs ended: within 11 // 4
    assert issuer.grants({"w0": 14, "w1": 2})["r"].credits == {"w0": 14, "w1": 2}  # three
    assert issuer.grants({"w0": 13, "w1": 2})["r"].credits["w0"] == 13  # less room: at once
    assert issuer.grants({"w0": 13, "w1": 3})["r"].credits["w1"] == 3  # little held: any growth
    assert issuer.grants({"w0": 13}) != {}  # to none
    assert issuer.grants({"w0": 13, "w1": 1}) != {}  # from none


@given(
    steps=st.lists(
        st.one_of(
            st.tuples(st.just("book"), st.sampled_from(["w0", "w1"])),
            st.tuples(st.just("room"), st.dictionaries(st.sampled_from(["w0", "w1"]),
                                                       st.integers(0, 40))),
        ),
        max_size=40,
    )
)  # fmt: skip
def test_after_every_grant_round_no_router_holds_more_than_its_share(steps) -> None:
    issuer = CreditIssuer()
    for r in ("a", "b"):
        issuer.hello(r, 0.0)
    rooms: dict[str, int] = {"w0": 8, "w1": 1}
    issuer.grants(rooms)
    for kind, arg in steps:
        if kind == "book":
            if issuer.in_hand("a", arg) > 0:  # a router dispatches only on credit it holds
                issuer.book("a", arg)
                rooms[arg] = max(0, rooms.get(arg, 0) - 2)  # its run took the room (both shares)
        else:
            rooms = dict(arg)
        sent = issuer.grants(rooms)
        for r, i in (("a", 0), ("b", 1)):
            for w in ("w0", "w1"):
                room = rooms.get(w, 0)
                share = room // 2 + (1 if i < room % 2 else 0)
                held = issuer.in_hand(r, w)
                if r in sent:
                    assert held == share
                else:  # never more than the room; less by at most the slack, never all of it
                    assert held <= share <= held + held // REGRANT_SLACK
                    assert (held == 0) == (share == 0)


def test_only_plain_requests_may_skip_the_queue() -> None:
    ok = {"deadline": None, "program_id": None, "confirmed_blocks": 10, "predicted_blocks": 10}
    assert may_dispatch_directly(**ok)
    assert not may_dispatch_directly(**{**ok, "deadline": 5.0})
    assert not may_dispatch_directly(**{**ok, "program_id": "agent-7"})
    # a follower: its hit rests on a prompt dispatched moments ago (the in-flight overlay)
    assert not may_dispatch_directly(**{**ok, "confirmed_blocks": 2, "predicted_blocks": 10})
    assert may_dispatch_directly(**{**ok, "confirmed_blocks": 7, "predicted_blocks": 10})


def request(rid: str, prompt: int = 160, cands=(("w0", 0), ("w1", 0))) -> SchedRequest:
    return SchedRequest(rid, 0.0, prompt, 64, list(cands), block_hashes=[1, 2, 3])


def thunder(**knobs):
    s = SCHEDULERS.create("thunder", window="none", max_running=3, **knobs)
    for w in ("w0", "w1"):
        s.update_worker(WorkerRoom(w, 0, 0, 0, 1000, 8), 0.0)
    return s


def test_thunder_lends_admissions_room_only_while_nothing_waits() -> None:
    s = thunder()
    assert s.rooms() == {"w0": 3, "w1": 3}  # the running cap bounds it
    s.admitted(request("d1"), "w0", 0.0)  # a router dispatched one on credit
    assert s.rooms()["w0"] == 2
    assert s.stats()["direct"] == 1 and s.stats()["running"] == 1
    for i in range(5):  # fill w0 and w1 through the queue, then one more waits
        s.submit(request(f"q{i}", cands=(("w0", 0),) if i < 2 else (("w1", 0),)), 0.0)
    out = s.poll(0.0)
    assert all(isinstance(a, Dispatch) for a in out) and s.waiting() == 0
    s.submit(request("late", cands=(("w0", 0),)), 0.0)
    assert s.poll(0.0) == [] and s.waiting() == 1
    assert s.rooms() == {}  # something waits: lend nothing, it must not be passed
    s.on_finished("d1", "w0", 1.0)
    assert s.poll(1.0) == [Dispatch("late", "w0")]


def test_pd_mode_lends_nothing() -> None:
    s = thunder(pd_mode="disaggregated")
    assert s.rooms() == {}


def test_direct_scheduler_lends_without_bound() -> None:
    s = SCHEDULERS.create("direct")
    s.update_worker(WorkerRoom("w0", 5, 5, 0, 10, 8), 0.0)
    assert s.rooms()["w0"] >= 1 << 20
    s.admitted(request("x"), "w0", 0.0)
    assert s.inflight["x"] == "w0"


@given(room=st.integers(0, 500), n=st.integers(1, 9))
def test_equal_weights_split_as_room_over_n_with_the_rest_to_the_first(room: int, n: int) -> None:
    assert split(room, [1.0] * n) == [room // n + (1 if i < room % n else 0) for i in range(n)]


@given(
    room=st.integers(0, 500),
    weights=st.lists(st.floats(0.01, 1e4, allow_nan=False), min_size=1, max_size=9),
)
def test_a_split_adds_up_and_a_heavier_router_never_gets_less(
    room: int, weights: list[float]
) -> None:
    units = split(room, weights)
    assert sum(units) == room
    assert all(u >= 0 for u in units)
    for i, wi in enumerate(weights):
        for j, wj in enumerate(weights):
            if wi > wj:
                assert units[i] >= units[j]
            # within one unit of its exact proportion
        assert abs(units[i] - room * wi / sum(weights)) < 1.0


def test_room_follows_demand_and_an_idle_router_keeps_a_sliver() -> None:
    """A gateway with the router inside takes all the traffic, a router service none: after
    the next reweigh the gateway holds nearly all the room instead of half."""
    issuer = CreditIssuer()
    issuer.hello("gateway", 0.0)
    issuer.hello("service", 0.0)
    assert issuer.grants({"w0": 20})["gateway"].credits == {"w0": 10}
    for i in range(100):
        issuer.routed("gateway", i / 100)
    issuer.routed("nobody", 0.5)  # no hello: counts for no one
    assert issuer.grants({"w0": 20}) == {}  # shares move at a reweigh, not per request
    issuer.reweigh(1.0)
    grants = issuer.grants({"w0": 20})
    assert grants["gateway"].credits == {"w0": 19}
    assert grants["service"].credits == {"w0": 1}
    # the gateway goes quiet, the service gets the traffic: within a few half-lives it flips
    for i in range(100):
        issuer.routed("service", 1.0 + 10 * DEMAND_HALF_LIFE_S + i / 100)
    issuer.reweigh(2.0 + 10 * DEMAND_HALF_LIFE_S)
    grants = issuer.grants({"w0": 20})
    assert grants["gateway"].credits == {"w0": 1}
    assert grants["service"].credits == {"w0": 19}


def test_demand_goes_with_an_expired_router() -> None:
    issuer = CreditIssuer()
    issuer.hello("a", 0.0)
    issuer.hello("b", 0.0)
    for _ in range(50):
        issuer.routed("a", 0.0)
    issuer.expire(10.0)
    assert issuer.demand == {} and issuer.weights == {}
    issuer.hello("a", 10.0)  # back, with no memory of before: the whole room
    assert issuer.grants({"w0": 6})["a"].credits == {"w0": 6}


def test_credit_is_a_lease_that_lapses_on_the_routers_clock() -> None:
    """A router that stalled (frozen, starved) past ``CREDIT_LEASE_S`` spends nothing of the
    room lent before: the requests it read meanwhile may have been resent elsewhere and run,
    and only the scheduler's queue checks an id against those that ran. Each scheduler's grant
    lapses on its own; a fresh grant lends again."""
    a, b = CreditIssuer(), CreditIssuer()
    a.hello("r", 0.0)
    b.hello("r", 0.0)
    wallet = CreditWallet()
    wallet.update(a.grants({"w0": 2})["r"], "a", now=10.0)
    wallet.update(b.grants({"w1": 2})["r"], "b", now=12.0)
    assert wallet.take("w0", now=10.0 + CREDIT_LEASE_S)
    assert not wallet.take("w0", now=10.1 + CREDIT_LEASE_S)  # a's grant is past its lease
    assert wallet.available("w0", now=14.0) == 0 and wallet.available("w0") == 1
    assert wallet.take("w1", now=14.0)  # b's is not
    wallet.update(a.grants({"w0": 2}, force=True)["r"], "a", now=14.5)
    assert wallet.take("w0", now=14.5)


def test_after_a_stall_the_credit_path_stays_closed_for_a_lease() -> None:
    """The router's tick beats every 0.25 s. A gap over ``stall_s`` (a frozen process waking)
    closes the credit path for ``hold_s`` from when it is seen, at the next use as well as at
    the next beat: the requests read on waking go through the scheduler's id check."""
    guard = StallGuard(stall_s=1.0, hold_s=3.0)
    assert guard.allows(0.0)  # never beaten (no tick yet): nothing to judge by
    for t in (0.0, 0.25, 0.5, 0.75):
        guard.beat(t)
        assert guard.allows(t + 0.1)
    assert not guard.allows(5.0)  # first use after a 4.25 s gap: closed until 8.0
    for k in range(12):  # the ticks go on as usual
        guard.beat(5.0 + 0.25 * k)
    assert not guard.allows(7.9)
    guard.beat(8.0)
    assert guard.allows(8.0)
    guard.beat(10.0)  # a late beat is a stall too
    assert not guard.allows(10.1)
    for k in range(13):
        guard.beat(10.0 + 0.25 * k)
    assert guard.allows(13.0)
