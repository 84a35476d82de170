"""round_robin: id-sorted cycle, advanced once per routed request, blind to cache."""

import random

from thunderagent.routing import POLICIES, RouteQuery, WorkerView


def q(request_id: str = "r", **kw) -> RouteQuery:
    return RouteQuery(
        request_id=request_id, prompt_tokens=32, block_size=16, block_hashes=[1, 2], **kw
    )


def test_cycles_in_id_order_regardless_of_input_order() -> None:
    policy = POLICIES.create("round_robin")
    workers = [WorkerView("c"), WorkerView("a"), WorkerView("b")]
    firsts = []
    for k in range(5):
        ranked = policy.rank(q(overlaps={"c": 2}), workers, random.Random(0))
        assert [c.score for c in ranked] == [0.0, -1.0, -2.0]
        firsts.append(ranked[0].worker_id)
        policy.on_dispatched(q(f"r{k}"), ranked[0].worker_id)
    assert firsts == ["a", "b", "c", "a", "b"]


def test_rank_is_a_query_and_rotation_keeps_the_cycle() -> None:
    policy = POLICIES.create("round_robin")
    workers = [WorkerView("a"), WorkerView("b"), WorkerView("c")]
    policy.on_dispatched(q(), "a")
    first = policy.rank(q(), workers, random.Random(0))
    again = policy.rank(q(), workers, random.Random(1))
    assert [c.worker_id for c in first] == [c.worker_id for c in again] == ["b", "c", "a"]


def test_a_request_moved_to_another_worker_turns_the_cycle_once() -> None:
    """The router calls ``on_dispatched`` at the decision and again when the scheduler places
    the request elsewhere: the next request still gets the next worker. Once a request ended,
    its id may come again as a new request (SGLang's rid once finished) and turns it again."""
    policy = POLICIES.create("round_robin")
    workers = [WorkerView("a"), WorkerView("b"), WorkerView("c")]
    policy.on_dispatched(q("r0"), "a")
    policy.on_dispatched(q("r0"), "c")  # the scheduler moved it
    assert policy.rank(q("r1"), workers, random.Random(0))[0].worker_id == "b"
    policy.on_finished("r0", "c", 1.0)
    policy.on_dispatched(q("r0"), "b")
    assert policy.rank(q("r2"), workers, random.Random(0))[0].worker_id == "c"
