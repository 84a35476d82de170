"""Admission credits: what the scheduler lends router replicas, and what a router may do with it."""

from __future__ import annotations

from thunderagent.scheduling import SCHEDULERS, Dispatch, SchedRequest, WorkerRoom
from thunderagent.scheduling.credits import (
    CreditIssuer,
    CreditWallet,
    may_dispatch_directly,
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
    wallet.drop()
    assert wallet.available("w0") == 0


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
