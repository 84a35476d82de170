"""sglang_cache_aware: imbalance rule on its own in-flight counts, threshold rule, smallest-tree
fallback, LRU trees trimmed every eviction interval."""

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
    p.on_dispatched(q(list(range(1, 11))), "a")  # a: 10 blocks
    p.on_dispatched(q([50]), "b")  # b: 1 block; c: empty
    workers = [WorkerView("a"), WorkerView("b"), WorkerView("c")]
    hit = p.rank(q([1, 2, 3, 4, 91, 92, 93, 94, 95, 96]), workers, random.Random(0))
    assert ids(hit) == ["a", "c", "b"]  # 4/10 > 0.3: longest match; rest by smaller tree
    assert [c.score for c in hit] == [0.4, 0.0, 0.0]
    assert hit[0].overlap_blocks == 4
    miss = p.rank(q([1, 2, 3, 91, 92, 93, 94, 95, 96, 97]), workers, random.Random(0))
    assert ids(miss) == ["c", "b", "a"]  # 3/10 is not > 0.3: smallest tree first
    assert [c.score for c in miss] == [0.0, -1.0, -10.0]


def test_smallest_tree_fallback_and_seeded_ties() -> None:
    p = policy()
    p.on_dispatched(q([1, 2, 3, 4, 5]), "a")
    p.on_dispatched(q([6, 7]), "b")
    p.on_dispatched(q([8, 9, 10]), "c")
    workers = [WorkerView("a"), WorkerView("b"), WorkerView("c"), WorkerView("d", running=3)]
    fresh = q([100, 101])
    assert ids(p.rank(fresh, workers, random.Random(0))) == ["d", "b", "c", "a"]
    p.on_dispatched(q([11, 12]), "d")  # b and d tie at 2 blocks: seeded pick, b/d both reachable
    picks = {ids(p.rank(fresh, workers, random.Random(s)))[0] for s in range(20)}
    assert picks == {"b", "d"}
    for s in range(5):
        assert p.rank(fresh, workers, random.Random(s)) == p.rank(fresh, workers, random.Random(s))


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
