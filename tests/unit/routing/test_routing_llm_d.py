"""llm_d: the llm-d inference scheduler's default profile in constructed situations (the three
scorers' formulas and weights, the approximate prefix index's walk, window and LRU, the
precise scorer's normalisation, random ties), and a Hypothesis model of its prefix scores."""

import random
from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from thunderagent.routing import POLICIES, RouteQuery, WorkerView
from thunderagent.routing.cost import ParamError
from thunderagent.routing.llm_d import LlmD

BS = 16  # the router's block size here: llm-d's default block of 16 tokens, so windows align


def q(hashes: list[int], rid: str = "r", **kw) -> RouteQuery:
    return RouteQuery(
        request_id=rid, prompt_tokens=len(hashes) * BS, block_size=BS, block_hashes=hashes, **kw
    )


def policy(**params) -> LlmD:
    p = POLICIES.create("llm_d", **params)
    assert isinstance(p, LlmD)
    return p


def scores(p: LlmD, query: RouteQuery, workers: list[WorkerView]) -> dict[str, float]:
    return {c.worker_id: c.score for c in p.rank(query, workers, random.Random(0))}


def idle(wid: str, **kw) -> WorkerView:
    return WorkerView(wid, kv_total_blocks=100, **kw)


def test_weights_two_two_three_over_queue_kv_and_prefix() -> None:
    p = policy()
    p.on_dispatched(q([1, 2, 3, 4]), "a")
    # a: queue 3 (the longest: 0), KV half used (0.5), whole prompt recorded (1.0)
    # b: queue 1 (the shortest: 1), KV empty (1.0), nothing recorded (0)
    # c: queue 2 (halfway: 0.5), KV full (0.0), nothing recorded
    fleet = [
        idle("a", queued=3, active_tokens=50 * BS),
        idle("b", queued=1),
        idle("c", queued=2, active_tokens=100 * BS),
    ]
    got = scores(p, q([1, 2, 3, 4]), fleet)
    assert got == pytest.approx({"a": 2 * 0 + 2 * 0.5 + 3 * 1.0, "b": 2 + 2, "c": 2 * 0.5})
    # a and b both score 4.0: the tie goes at random, each first over some seeds
    firsts = {p.rank(q([1, 2, 3, 4]), fleet, random.Random(s))[0].worker_id for s in range(40)}
    assert firsts == {"a", "b"}


def test_equal_queues_score_one_each_and_the_prefix_holder_wins() -> None:
    p = policy()
    p.on_dispatched(q([7, 8]), "b")
    fleet = [idle("a", queued=5), idle("b", queued=5), idle("c", queued=5)]
    got = scores(p, q([7, 8, 9, 10]), fleet)
    assert got == pytest.approx({"a": 4.0, "b": 4.0 + 3 * 0.5, "c": 4.0})
    ranked = p.rank(q([7, 8, 9, 10]), fleet, random.Random(0))
    assert ranked[0].worker_id == "b" and ranked[0].overlap_blocks == 2


def test_kv_usage_counts_running_requests_kv_only_and_an_unknown_pool_scores_one() -> None:
    p = policy(queue_weight=0, prefix_weight=0)
    got = scores(p, q([1]), [idle("a", active_tokens=25 * BS, kv_used_blocks=100), WorkerView("b")])
    assert got == pytest.approx({"a": 2 * 0.75, "b": 2.0})  # cached but idle blocks are free


def test_the_walk_credits_every_holder_of_a_block_while_any_endpoint_holds_it() -> None:
    """A block counts for each endpoint that holds it, whether or not that endpoint holds the
    blocks before it; the walk stops at the first block nobody holds."""
    p = policy()
    p.on_dispatched(q([1, 2]), "a")
    p.on_dispatched(q([9, 2, 3]), "b")  # b holds 2 and 3 but not 1
    ranked = {
        c.worker_id: c for c in p.rank(q([1, 2, 3, 4, 5]), [idle("a"), idle("b")], random.Random(0))
    }
    assert ranked["a"].overlap_blocks == 2 and ranked["b"].overlap_blocks == 2
    assert ranked["a"].score == pytest.approx(4 + 3 * 2 / 5)
    p.on_dispatched(q([5]), "a")  # 5 is held, but 4 is not: the walk has stopped before it
    assert p.rank(q([1, 2, 3, 4, 5]), [idle("a")], random.Random(0))[0].overlap_blocks == 2


def test_only_the_first_4096_tokens_count() -> None:
    """256 blocks of 16 tokens: two prompts equal that far are the same prompt to it."""
    p = policy()
    window = 4096 // BS
    shared = list(range(1, window + 1))
    p.on_dispatched(q([*shared, 1001, 1002]), "a")
    assert len(p._lrus["a"]) == window  # the tail is never recorded
    (c,) = p.rank(q([*shared, 2001, 2002, 2003]), [idle("a")], random.Random(0))
    assert c.overlap_blocks == window and c.score == pytest.approx(4 + 3 * 1.0)
    # with our blocks of 512 tokens the window is 8 blocks
    big = RouteQuery("r", 20 * 512, 512, list(range(20)))
    assert list(p.window(big)) == list(range(8))


def test_each_lru_is_sized_by_its_engines_pool_when_first_seen_and_evicts_the_oldest() -> None:
    p = policy()
    p.rank(q([1]), [WorkerView("a", kv_total_blocks=3)], random.Random(0))
    p.on_dispatched(q([1, 2, 3]), "a")
    p.on_dispatched(q([4, 5]), "a")
    assert list(p._lrus["a"]) == [3, 4, 5]  # 1 and 2 recorded earliest, dropped first
    p.rank(q([1]), [WorkerView("a", kv_total_blocks=50)], random.Random(0))
    p.on_dispatched(q([6]), "a")
    assert list(p._lrus["a"]) == [4, 5, 6]  # the size was fixed when the endpoint was first seen
    assert list(policy(lru_capacity_blocks=2)._lrus) == []
    two = policy(lru_capacity_blocks=2)
    two.on_dispatched(q([1, 2, 3]), "a")
    assert list(two._lrus["a"]) == [2, 3]


def test_an_endpoint_never_seen_with_a_pool_gets_the_fallback_size() -> None:
    p = policy()
    p.on_dispatched(q(list(range(5000))), "a")
    assert len(p._lrus["a"]) == 4096 // BS  # window-limited; the fallback is 31,250 x 16 tokens
    assert policy().load_poll_s() == 0.05


def test_precise_scores_min_max_over_endpoints_with_a_hit() -> None:
    p = policy(prefix="precise", queue_weight=0, kv_cache_weight=0)
    query = q([1, 2, 3, 4], overlaps={"a": 4, "b": 2, "c": 1}, host_overlaps={"c": 3})
    got = scores(p, query, [idle("a"), idle("b"), idle("c"), idle("d")])
    # raw: a 4, b 2, c 1 + 0.8 x 2 = 2.6, d no hit; (raw - 2) / (4 - 2) over the hits
    assert got == pytest.approx({"a": 3.0, "b": 0.0, "c": 3 * 0.3, "d": 0.0})
    same = scores(p, q([1, 2], overlaps={"a": 2, "b": 2}), [idle("a"), idle("b"), idle("c")])
    assert same == pytest.approx({"a": 3.0, "b": 3.0, "c": 0.0})
    p.on_dispatched(query, "a")
    assert p._lrus == {}  # the precise scorer keeps no record of its own
    share = policy(prefix="precise", precise_score="share", queue_weight=0, kv_cache_weight=0)
    got = scores(share, query, [idle("a"), idle("b"), idle("c"), idle("d")])
    assert got == pytest.approx({"a": 3.0, "b": 3 * 0.5, "c": 3 * 2.6 / 4, "d": 0.0})


@pytest.mark.parametrize(
    "params",
    [
        {"prefix": "exact"},
        {"queue_weight": -1.0},
        {"block_size_tokens": 0},
        {"max_prefix_blocks_to_match": 1.5},
        {"lru_capacity_blocks": -1},
        {"precise_score": "max"},
    ],
)
def test_bad_parameters_are_refused(params: dict) -> None:
    with pytest.raises(ParamError):
        policy(**params)


@settings(max_examples=150, deadline=None)
@given(
    sent=st.lists(
        st.tuples(st.sampled_from("abc"), st.lists(st.integers(0, 9), max_size=6)), max_size=12
    ),
    prompt=st.lists(st.integers(0, 9), max_size=8),
    cap=st.integers(1, 8),
)
def test_prefix_scores_match_a_model_of_per_endpoint_lrus(sent, prompt, cap) -> None:
    """Model: one insertion-ordered LRU per endpoint, ``cap`` blocks; match = the run of the
    prompt's leading blocks that some endpoint holds, credited to each holder."""
    p = policy(lru_capacity_blocks=cap, queue_weight=0, kv_cache_weight=0)
    model: dict[str, OrderedDict] = {}
    for i, (wid, hashes) in enumerate(sent):
        p.on_dispatched(q(hashes, f"r{i}"), wid)
        lru = model.setdefault(wid, OrderedDict())
        for h in hashes:
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > cap:
            lru.popitem(last=False)
    counts = dict.fromkeys("abc", 0)
    for h in prompt:
        holders = [w for w in "abc" if h in model.get(w, {})]
        if not holders:
            break
        for w in holders:
            counts[w] += 1
    got = {c.worker_id: c for c in p.rank(q(prompt), [idle(w) for w in "abc"], random.Random(1))}
    for w in "abc":
        assert got[w].overlap_blocks == counts[w]
        expected = 3 * counts[w] / len(prompt) if prompt else 0.0
        assert got[w].score == pytest.approx(expected)
