"""The cold prefill queue bound: a request with nothing cached on a worker is not sent there
while the prompts sent there and not started yet hold ``cold_prefill_queue_tokens`` uncached
tokens; it waits in the global queue, where shorter work goes first and any worker that frees
may take it."""

from __future__ import annotations

from thunderagent.scheduling import SCHEDULERS, Dispatch, SchedRequest, WorkerRoom


def req(rid, at=0.0, prompt=160, out=16, cands=(("w0", 0),), prio=0) -> SchedRequest:
    return SchedRequest(rid, at, prompt, out, list(cands), priority=prio)


def sent(actions) -> list[str]:
    return [a.request_id for a in actions if isinstance(a, Dispatch)]


def scheduler(workers=("w0",), bound=1000, name="priority_srpt", **kw):
    s = SCHEDULERS.create(name, cold_prefill_queue_tokens=bound, **kw)
    for w in workers:
        s.update_worker(WorkerRoom(w, 0, 0, 0, 0, 8), 0.0)  # 8 slots, no KV limit
    return s


def at_bound(s, at=0.0):
    """w0 gets 800 + 300 cold prompt tokens: over the 1,000-token bound."""
    s.submit(req("a", at, prompt=800), at)
    s.submit(req("b", at, prompt=300), at)
    assert sent(s.poll(at)) == ["b", "a"]  # shortest first; 300 < 1,000 let the second in


def test_a_cold_request_waits_for_the_queue_and_goes_at_a_first_token() -> None:
    s = scheduler()
    at_bound(s)
    s.submit(req("c", 0.1, prompt=100), 0.1)
    assert sent(s.poll(0.1)) == []
    assert s.rooms() == {}  # nothing lent while a request waits here
    s.on_started("a", "w0", 0.2)  # 300 tokens left to start
    assert sent(s.poll(0.2)) == ["c"]


def test_a_request_with_its_prefix_cached_there_is_not_held() -> None:
    s = scheduler()
    at_bound(s)
    s.submit(req("warm", 0.1, prompt=800, cands=[("w0", 40)]), 0.1)  # 640 of 800 cached
    assert sent(s.poll(0.1)) == ["warm"]


def test_the_held_requests_go_shortest_first() -> None:
    s = scheduler()
    at_bound(s)
    s.submit(req("big", 0.1, prompt=5000), 0.1)
    s.submit(req("small", 0.2, prompt=100), 0.2)
    assert sent(s.poll(0.2)) == []
    s.on_started("a", "w0", 0.3)
    assert sent(s.poll(0.3)) == ["small", "big"]  # 300 + 100 under the bound: big goes too


def test_a_held_request_spills_to_a_worker_whose_queue_is_short() -> None:
    s = scheduler(workers=("w0", "w1"))
    at_bound(s)
    s.submit(req("c", 0.0, cands=[("w0", 0), ("w1", 0)]), 0.0)
    assert s.poll(0.0) == []
    assert s.poll(0.5) == [Dispatch("c", "w1")]


def test_a_run_that_ends_before_its_start_frees_the_queue() -> None:
    s = scheduler()
    at_bound(s)
    s.submit(req("c", 0.1), 0.1)
    assert sent(s.poll(0.1)) == []
    assert not s.cancel("a", 0.2)  # it was running, not waiting: its run ends
    assert sent(s.poll(0.2)) == ["c"]


def test_no_credit_is_lent_for_a_worker_at_its_bound() -> None:
    s = scheduler(workers=("w0", "w1"))
    at_bound(s)
    rooms = s.rooms()
    assert rooms["w0"] == 0
    assert rooms["w1"] > 0


def test_off_by_zero() -> None:
    s = scheduler(bound=0)
    at_bound(s)
    s.submit(req("c", 0.1, prompt=100_000), 0.1)
    assert sent(s.poll(0.1)) == ["c"]


def test_no_run_is_preempted_for_a_request_the_queue_holds() -> None:
    """Ending a run frees a slot and KV, not the queue of prompts not started: a cold request
    held by that queue preempts nothing."""
    s = scheduler(name="preempt", bound=1000, preempt_min_remaining_tokens=1)
    s.update_worker(WorkerRoom("w0", 0, 0, 0, 0, 2), 0.0)  # 2 slots
    s.submit(req("long", 0.0, prompt=100, out=50_000, prio=1), 0.0)
    assert sent(s.poll(0.0)) == ["long"]
    s.on_started("long", "w0", 0.1)
    s.submit(req("a", 0.2, prompt=2000, out=50_000, prio=1), 0.2)
    assert sent(s.poll(0.2)) == ["a"]  # the queue: 2,000 tokens not started, over the bound
    s.submit(req("c", 0.3, prompt=100, prio=0), 0.3)
    assert s.poll(0.3) == []
    assert s.poll(5.0) == []
    assert s.counters["preempted"] == 0


def test_a_hit_every_candidate_holds_counts_as_cold_when_asked() -> None:
    """A system prompt cached everywhere is no reason to join this worker's queue: with
    ``cold_shared_hits`` the request waits here, then spills to the worker whose queue is
    short; without it, the one shared block lets it through."""
    shared = [("w0", 1), ("w1", 1)]
    on = scheduler(workers=("w0", "w1"), cold_shared_hits=True)
    at_bound(on)
    on.submit(req("c", 0.0, cands=shared), 0.0)
    assert on.poll(0.0) == []
    assert on.poll(0.5) == [Dispatch("c", "w1")]
    off = scheduler(workers=("w0", "w1"))
    at_bound(off)
    off.submit(req("c", 0.0, cands=shared), 0.0)
    assert off.poll(0.0) == [Dispatch("c", "w0")]


def test_a_hit_only_this_worker_holds_is_never_held() -> None:
    s = scheduler(workers=("w0", "w1"), cold_shared_hits=True)
    at_bound(s)
    s.submit(req("own", 0.0, cands=[("w0", 2), ("w1", 1)]), 0.0)  # one block more on w0
    s.submit(req("only", 0.0, cands=[("w0", 1)]), 0.0)  # w0 alone serves it
    assert sorted(sent(s.poll(0.0))) == ["only", "own"]
