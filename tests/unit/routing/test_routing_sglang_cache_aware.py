"""sglang_cache_aware: imbalance rule on its own in-flight counts, threshold rule with 0.3.2's
sticky tenant, least-loaded fallback in worker order, LRU trees trimmed every eviction interval."""

import random

import pytest

from thunderagent.routing import POLICIES, RouteQuery, WorkerView
from thunderagent.routing.cost import ParamError
from thunderagent.routing.sglang_cache_aware import SglangCacheAware

BS = 4


def q(hashes: list[int], rid: str = "r", now: float = 0.0) -> RouteQuery:
    return RouteQuery(
        request_id=rid,
        prompt_tokens=len(hashes) * BS,
        block_size=BS,
        block_hashes=hashes,
        now=now,
    )


def send(p: SglangCacheAware, worker: str, n: int) -> list[str]:
    """``n`` empty prompts in flight on ``worker`` (they change no tree)."""
    rids = [f"{worker}-{i}-{p.load(worker)}" for i in range(n)]
    for rid in rids:
        p.on_dispatched(q([], rid), worker)
    return rids


def ids(ranked) -> list[str]:
    return [c.worker_id for c in ranked]


def policy(**params) -> SglangCacheAware:
    p = POLICIES.create("sglang_cache_aware", **params)
    assert isinstance(p, SglangCacheAware)
    return p


@pytest.mark.parametrize(
    ("loads", "expected"),
    [
        # max-min = 90 > 64 and 100 > 1.5*10: imbalanced -> shortest queue, then by load
        ({"a": 100, "b": 10, "c": 50}, ["b", "c", "a"]),
        # max-min = 90 > 64 but 300 <= 1.5*210: balanced -> cache (a holds the whole prompt)
        ({"a": 300, "b": 210, "c": 250}, ["a", "b", "c"]),
        # 1.5x apart but only 60 apart: balanced
        ({"a": 180, "b": 120, "c": 150}, ["a", "b", "c"]),
    ],
)
def test_imbalance_rule_overrides_cache(loads: dict[str, int], expected: list[str]) -> None:
    p = policy()
    p.on_dispatched(q([1, 2, 3, 4], "ra"), "a")
    p.on_dispatched(q([9], "rc"), "c")  # c's tree (1 block) is bigger than b's (0)
    p.on_finished("ra", "a", 0.0)
    p.on_finished("rc", "c", 0.0)
    for w, n in loads.items():
        send(p, w, n)
    # the engines' own reports play no part: SGLang counts what it sent
    workers = [WorkerView(w, queued=500 if w == "b" else 0) for w in loads]
    assert ids(p.rank(q([1, 2, 3, 4]), workers, random.Random(0))) == expected


def test_in_flight_count_follows_dispatch_and_finish() -> None:
    p = policy(balance_abs_threshold=2)
    a = send(p, "a", 4)
    workers = [WorkerView("a"), WorkerView("b")]
    assert ids(p.rank(q([7]), workers, random.Random(0)))[0] == "b"  # 4 - 0 > 2, 4 > 0
    for rid in a[:2]:
        p.on_finished(rid, "a", 1.0)
    p.on_finished("never-sent", "a", 1.0)
    assert (p.load("a"), p.load("b")) == (2, 0)  # 2 - 0 is not > 2: balanced again
    p.on_dispatched(q([], a[2]), "b")  # a re-dispatch moves the request
    assert (p.load("a"), p.load("b")) == (1, 1)


def test_threshold_rule_match_rate_must_exceed() -> None:
    p = policy()
    p.on_dispatched(q(list(range(1, 11)), "ra"), "a")  # a: 10 blocks, 1 in flight
    p.on_dispatched(q([50], "rb"), "b")  # b: 1 block, 1 in flight; c: empty, idle
    workers = [WorkerView("a"), WorkerView("b"), WorkerView("c")]
    hit = p.rank(q([1, 2, 3, 4, 91, 92, 93, 94, 95, 96]), workers, random.Random(0))
    assert ids(hit) == ["a", "b", "c"]  # 4/10 > 0.3: the holder; the rest in worker order
    assert [c.score for c in hit] == [0.4, 0.0, 0.0]
    assert hit[0].overlap_blocks == 4
    miss = p.rank(q([1, 2, 3, 91, 92, 93, 94, 95, 96, 97]), workers, random.Random(0))
    assert ids(miss) == ["c", "a", "b"]  # 3/10 is not > 0.3: the fewest in flight first
    assert [c.score for c in miss] == [0.0, -1.0, -1.0]


def test_low_match_goes_to_the_first_least_loaded_in_worker_order() -> None:
    p = policy()
    p.on_dispatched(q([1, 2, 3, 4, 5], "r1"), "a")  # tree sizes play no part (0.3.2)
    p.on_dispatched(q([6], "r2"), "c")
    workers = [WorkerView("a"), WorkerView("b"), WorkerView("c"), WorkerView("d", running=3)]
    fresh = q([100, 101])
    for s in range(10):  # no draw: b and d tie at 0 in flight, b comes first
        assert ids(p.rank(fresh, workers, random.Random(s))) == ["b", "d", "a", "c"]
    p.on_finished("r1", "a", 1.0)
    assert ids(p.rank(fresh, workers, random.Random(0)))[0] == "a"


def test_a_hit_sticks_to_the_worker_that_has_held_the_block_longest() -> None:
    p = policy()
    doc = [1, 2, 3, 4]
    p.on_dispatched(q(doc, "r0"), "b")  # b creates the prefix
    p.on_dispatched(q(doc, "r1"), "a")  # a holds it as deep, and holds it idle
    p.on_finished("r1", "a", 0.0)
    workers = [WorkerView("a"), WorkerView("b"), WorkerView("c")]
    for i in range(64):  # every hit to b, however many are in flight there, until 64 apart
        ranked = p.rank(q([*doc, 100 + i], f"h{i}"), workers, random.Random(i))
        assert ids(ranked)[0] == "b"
        assert ranked[1].worker_id == "a"  # a's match (4/5) ranks it next
        p.on_dispatched(q([*doc, 100 + i], f"h{i}"), "b")
    assert p.load("b") == 65
    assert ids(p.rank(q([*doc, 999]), workers, random.Random(0)))[0] == "a"  # 65 > 64: imbalanced


def test_the_sticky_tenant_passes_on_when_evicted_or_gone() -> None:
    p = policy(max_tree_tokens=2 * BS)  # 2 blocks per worker
    p.on_dispatched(q([1, 2], "r0", now=0.0), "a")
    p.on_dispatched(q([1, 2], "r1", now=1.0), "b")
    workers = [WorkerView("a"), WorkerView("b")]
    assert ids(p.rank(q([1, 2]), workers, random.Random(0)))[0] == "a"
    # without a: the next holder; a's blocks stay in the tree for when it comes back
    assert ids(p.rank(q([1, 2]), [WorkerView("b")], random.Random(0))) == ["b"]
    p.on_dispatched(q([7, 8], "r2", now=2.0), "a")
    p.on_dispatched(q([], "r3", now=61.0), "b")  # trim: a keeps [7, 8], b keeps [1, 2]
    assert p.matched_blocks("a", [1, 2]) == 0
    assert ids(p.rank(q([1, 2]), workers, random.Random(0)))[0] == "b"
    p.on_dispatched(q([1, 2], "r4", now=62.0), "a")  # a takes it again, behind b
    assert ids(p.rank(q([1, 2]), workers, random.Random(0)))[0] == "b"


def test_trees_evict_lru_from_the_leaves_every_interval() -> None:
    p = policy(max_tree_tokens=4 * BS)  # 4 blocks per worker
    p.on_dispatched(q([1, 2, 3], now=0.0), "a")
    p.on_dispatched(q([7, 8], now=30.0), "a")
    assert p.tree_blocks("a") == 5  # over the cap until the next eviction (60 s)
    p.on_dispatched(q([], now=60.0), "b")  # 5 > 4: the oldest leaf, block 3, goes
    assert p.tree_blocks("a") == 4
    assert p.matched_blocks("a", [1, 2, 3]) == 2
    assert p.matched_blocks("a", [7, 8]) == 2
    p.on_dispatched(q([1, 2], now=61.0), "a")  # touch 1, 2: now 8 is the oldest leaf
    p.on_dispatched(q([20], now=62.0), "a")
    p.on_dispatched(q([], now=120.0), "b")
    assert p.matched_blocks("a", [7, 8]) == 1
    assert p.matched_blocks("a", [1, 2]) == 2
    assert p.tree_blocks("b") == 0


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"cache_threshold": 1.5}, "cache_threshold"),
        ({"balance_abs_threshold": -1}, "balance_abs_threshold"),
        ({"balance_rel_threshold": 0.5}, "balance_rel_threshold"),
        ({"max_tree_tokens": 0}, "max_tree_tokens"),
        ({"eviction_interval_s": 0}, "eviction_interval_s"),
    ],
)
def test_params_are_validated(params: dict, field: str) -> None:
    with pytest.raises(ParamError, match=f"sglang_cache_aware.{field}=") as err:
        policy(**params)
    assert err.value.field == field
