"""smg_cache_aware: exact picks for SMG 1.13.0's cache_aware in constructed situations (tree
hits and misses, the spill gate, overload protection, the KV-spread trigger, expected wait, the
warm-up slice and divert, optimistic bookings, anti-hotspot decay, tree eviction)."""

import math
import random
from collections import Counter

import pytest

from thunderagent.routing import POLICIES, RouteQuery, WorkerView
from thunderagent.routing.cost import ParamError
from thunderagent.routing.smg_cache_aware import SmgCacheAware

BS = 4


def q(hashes: list[int], rid: str = "r", now: float = 0.0, **kw) -> RouteQuery:
    return RouteQuery(
        request_id=rid,
        prompt_tokens=len(hashes) * BS,
        block_size=BS,
        block_hashes=hashes,
        now=now,
        **kw,
    )


def policy(**params) -> SmgCacheAware:
    p = POLICIES.create("smg_cache_aware", **params)
    assert isinstance(p, SmgCacheAware)
    return p


def send(p: SmgCacheAware, worker: str, n: int, hashes: list[int] | None = None) -> None:
    """``n`` requests in flight on ``worker`` (empty prompts unless ``hashes``)."""
    for i in range(n):
        p.on_dispatched(q(hashes or [], f"{worker}-{i}-{p.inflight(worker)}"), worker)


def first(p: SmgCacheAware, query: RouteQuery, workers: list[WorkerView], seed: int = 0) -> str:
    return p.rank(query, workers, random.Random(seed))[0].worker_id


def firsts(p: SmgCacheAware, query: RouteQuery, workers: list[WorkerView]) -> set[str]:
    return {first(p, query, workers, s) for s in range(40)}


ABC = [WorkerView("a"), WorkerView("b"), WorkerView("c")]  # no reports: a dark fleet


def test_tree_hit_above_threshold_else_least_loaded() -> None:
    p = policy()
    p.on_dispatched(q(list(range(1, 11)), "r0"), "a")
    p.on_finished("r0", "a", 0.0)
    hit = p.rank(q([1, 2, 3, 4, 91, 92, 93, 94, 95, 96]), ABC, random.Random(0))
    assert hit[0].worker_id == "a"  # 4 / 10 > 0.3
    assert [c.overlap_blocks for c in hit if c.worker_id == "a"] == [4]
    # exactly 0.3 is a miss: expected wait over the fleet (dark: fewest in flight, all 0)
    assert firsts(p, q([1, 2, 3, 91, 92, 93, 94, 95, 96, 97]), ABC) == {"a", "b", "c"}
    send(p, "a", 1)
    assert firsts(p, q([1, 2, 3, 91, 92, 93, 94, 95, 96, 97]), ABC) == {"b", "c"}


@pytest.mark.parametrize(("a_load", "expected"), [(6, {"a"}), (7, {"b", "c"})])
def test_spill_gate_relative_and_swing_margin(a_load: int, expected: set[str]) -> None:
    # mean = a_load / 3; margin = min(64, max(ceil(2 sqrt(mean)), 4)) = 4. a = 6: 6 > 3 but not
    # > 2 + 4, a keeps the hit; a = 7: 7 > 3.5 and 7 > 6.33, the request spills.
    p = policy()
    send(p, "a", a_load, [1, 2, 3])
    assert firsts(p, q([1, 2, 3]), ABC) == expected


def test_gated_holder_loses_to_a_safe_one() -> None:
    p = policy()
    send(p, "a", 8, [1, 2, 3])
    p.on_dispatched(q([1, 2, 3], "rb"), "b")  # mean 3: a is over the gate, b is not
    assert firsts(p, q([1, 2, 3]), ABC) == {"b"}


@pytest.mark.parametrize(
    ("view_a", "expected"),
    [
        (WorkerView("a", queued=7), {"a"}),
        (WorkerView("a", queued=8), {"b"}),  # 8 waiting: left out
        (WorkerView("a", active_tokens=320, kv_total_blocks=100), {"b"}),  # usage 0.8
        (WorkerView("a", active_tokens=316, kv_total_blocks=100), {"a"}),  # 0.79
    ],
)
def test_worker_overload_protection(view_a: WorkerView, expected: set[str]) -> None:
    p = policy()
    p.on_dispatched(q([1, 2, 3], "r0"), "a")
    p.on_finished("r0", "a", 0.0)
    workers = [view_a, WorkerView("b", kv_total_blocks=100)]
    assert firsts(p, q([1, 2, 3]), workers) == expected


def test_an_overloaded_deepest_holder_makes_a_miss_not_a_shallower_hit() -> None:
    p = policy()
    for rid, hashes, w in (("r1", [1, 2, 3, 4], "a"), ("r2", [1, 2], "b")):
        p.on_dispatched(q(hashes, rid), w)
        p.on_finished(rid, w, 0.0)
    workers = [WorkerView("a", queued=8), WorkerView("b"), WorkerView("c")]
    # the tree's deepest match (a, 4 blocks) is left out: no candidate, so expected wait over
    # b and c (equal), although b alone holds half the prompt
    assert firsts(p, q([1, 2, 3, 4]), workers) == {"b", "c"}
    assert firsts(p, q([1, 2, 3, 4]), [WorkerView("a", queued=7), *workers[1:]]) == {"a"}


def test_every_worker_overloaded_goes_to_the_least_in_flight() -> None:
    p = policy()
    send(p, "a", 1)
    workers = [WorkerView("a", queued=9), WorkerView("b", queued=30)]
    assert firsts(p, q([1]), workers) == {"b"}  # b: 0 in flight, whatever it reports


def test_kv_spread_trigger_abandons_affinity() -> None:
    views = [
        WorkerView("a", active_tokens=240, kv_total_blocks=100),  # usage 0.6
        WorkerView("b", active_tokens=40, kv_total_blocks=100),  # 0.1
    ]
    for threshold, expected in [(1.0, "a"), (0.3, "b")]:
        p = policy(balance_token_usage_threshold=threshold)
        p.on_dispatched(q([1, 2, 3], "r0"), "a")
        p.on_finished("r0", "a", 0.0)
        # spread 0.5 > 0.3: expected wait over the fleet, a 0.15*0.6/0.4 s vs b 0.15*0.1/0.9 s
        assert first(p, q([1, 2, 3]), views) == expected
    ceiling = policy(overload_token_usage_threshold=0.5)
    ceiling.on_dispatched(q([1, 2, 3], "r0"), "a")
    assert first(ceiling, q([1, 2, 3]), views) == "b"  # hottest 0.6 > 0.5


def test_expected_wait_hand_computed() -> None:
    p = policy()
    for i in range(3):
        p.on_dispatched(q([i], f"r{i}"), "b")  # 4 prompt tokens each
    a = WorkerView("a", running=2, queued=1, kv_total_blocks=100)
    b = WorkerView("b", pending=2, prefill_tokens=500, kv_total_blocks=100, active_tokens=200)
    # a: (1 queued + 2 running) * 1024 / 2000 = 1.536
    assert p.expected_wait(a, BS, reporting=True) == pytest.approx(1.536)
    # b: (500 backlog + 1 unaccounted * 1024 + 8 since-poll tokens) / 2000 + 0.15 * 0.5 / 0.5
    assert p.expected_wait(b, BS, reporting=True) == pytest.approx(1532 / 2000 + 0.15)
    ranked = p.rank(q([50]), [a, b], random.Random(0))
    assert [c.worker_id for c in ranked] == ["b", "a"]
    assert [c.score for c in ranked] == pytest.approx([-(1532 / 2000 + 0.15), -1.536])


WARM = [  # c holds nothing while the fleet's median holds 2000 blocks: c is thin
    WorkerView("a", kv_used_blocks=2000),
    WorkerView("b", kv_used_blocks=2000),
    WorkerView("c", kv_used_blocks=0),
]


def test_warm_up_slice_sends_thin_misses_to_the_thin_worker() -> None:
    p = policy(index="events", warmup_share=1.0)
    send(p, "c", 1)  # c is busier than a and b: expected wait alone never picks it
    assert firsts(p, q([1, 2, 3, 4]), WARM) == {"c"}
    off = policy(index="events", warmup_share=0.0)
    send(off, "c", 1)
    assert firsts(off, q([1, 2, 3, 4]), WARM) == {"a", "b"}
    shared = policy(index="events")  # the default share, 0.25: one thin miss in four
    send(shared, "c", 1)
    picks = Counter(first(shared, q([1, 2, 3, 4]), WARM, s) for s in range(2000))
    assert picks["c"] / 2000 == pytest.approx(0.25, abs=0.03)
    young = [WorkerView(w.worker_id, kv_used_blocks=500 * (w.worker_id != "c")) for w in WARM]
    assert firsts(p, q([1, 2, 3, 4]), young) == {"a", "b"}  # median 500 < 1024: nobody thin


@pytest.mark.parametrize(
    ("overlap", "a_load", "expected"),
    [
        (12, 2, "c"),  # deep hit, the holder has more in flight than c: diverted
        (12, 0, "a"),  # deep hit, the holder is idle: recomputing it is not worth it
        (5, 0, "c"),  # shallow hit (5/12 <= 0.5): diverted whatever the holder's load
    ],
)
def test_warm_up_divert_of_hits(overlap: int, a_load: int, expected: str) -> None:
    p = policy(index="events", warmup_divert_every=1)
    send(p, "a", a_load)
    query = q(list(range(12)), overlaps={"a": overlap})
    assert firsts(p, query, WARM) == {expected}


def test_optimistic_booking_stands_in_for_unreported_overlap() -> None:
    p = policy(index="events", booking_ttl_s=1.0)
    prompt = list(range(1, 9))
    p.on_dispatched(q(prompt, "r0", now=0.0), "b")  # booked at prefix lengths 1, 2, 4, 8
    p.on_finished("r0", "b", 0.1)
    # the index has seen a hold 3 blocks and nothing of b yet: the booking says 8 on b
    assert firsts(p, q(prompt, now=0.5, overlaps={"a": 3}), ABC) == {"b"}
    assert firsts(p, q(prompt[:5], now=0.5, overlaps={"a": 3}), ABC) == {"b"}  # 4-block key
    assert firsts(p, q(prompt, now=1.5, overlaps={"a": 3}), ABC) == {"a"}  # expired
    assert firsts(policy(index="events"), q(prompt, overlaps={"a": 3}), ABC) == {"a"}


@pytest.mark.parametrize("index", ["events", "tree"])
def test_overlap_decay_splits_equal_holders_by_backlog(index: str) -> None:
    views = [
        WorkerView("a", prefill_tokens=32, kv_total_blocks=100),  # waits 32 / 2000 s
        WorkerView("b", running=1, kv_total_blocks=100),  # waits 1024 / 2000 s
    ]
    picks = {}
    for decay in (0.0, 1.0):
        p = policy(index=index, overlap_decay=decay)
        for w in "ab":
            p.on_dispatched(q([1, 2, 3, 4], f"r{w}"), w)
            p.on_finished(f"r{w}", w, 0.0)
        picks[decay] = first(p, q([1, 2, 3, 4], overlaps={"a": 4, "b": 4}), views)
    # no decay: a tie on overlap, expected wait picks a; decay: a's 32 tokens = 8 blocks of
    # backlog over b, per 4 request blocks = 2, so a scores 1/3 of b
    assert picks == {0.0: "a", 1.0: "b"}


def test_selection_temperature_samples_normalized_scores() -> None:
    p = policy(index="events", selection_temperature=1.0)
    query = q([1, 2, 3, 4], overlaps={"a": 4, "b": 2})
    counts = Counter(first(p, query, ABC, s) for s in range(4000))
    assert counts["a"] / 4000 == pytest.approx(1 / (1 + math.exp(-1)), abs=0.03)
    assert counts["c"] == 0  # no overlap: never in the draw


def test_tree_is_trimmed_tree_wide_every_eviction_interval() -> None:
    p = policy(max_tree_size=4 * BS)  # 4 blocks across every worker
    p.on_dispatched(q([1, 2, 3], "r1", now=0.0), "a")
    p.on_dispatched(q([7, 8], "r2", now=30.0), "b")
    assert p.tree_match("a", [1, 2, 3]) == 3  # 5 blocks: over until the next trim
    p.on_dispatched(q([], "r3", now=60.0), "c")
    assert p.tree_match("a", [1, 2, 3]) == 2  # the oldest leaf went
    assert p.tree_match("b", [7, 8]) == 2


def test_in_flight_follows_dispatch_finish_and_redispatch() -> None:
    p = policy()
    p.on_dispatched(q([1], "r1"), "a")
    p.on_dispatched(q([1], "r1"), "b")
    assert (p.inflight("a"), p.inflight("b")) == (0, 1)
    p.on_finished("r1", "b", 1.0)
    p.on_finished("r1", "b", 1.0)
    assert p.inflight("b") == 0


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"index": "radix"}, "index"),
        ({"cache_threshold": 1.5}, "cache_threshold"),
        ({"balance_rel_threshold": 0.5}, "balance_rel_threshold"),
        ({"worker_overload_waiting_requests": 0}, "worker_overload_waiting_requests"),
        ({"worker_overload_token_usage": 0.0}, "worker_overload_token_usage"),
        ({"balance_token_usage_threshold": 0.0}, "balance_token_usage_threshold"),
        ({"booking_ttl_s": -1.0}, "booking_ttl_s"),
        ({"max_tree_size": 0}, "max_tree_size"),
    ],
)
def test_params_are_validated(params: dict, field: str) -> None:
    with pytest.raises(ParamError, match=f"smg_cache_aware.{field}=") as err:
        policy(**params)
    assert err.value.field == field
