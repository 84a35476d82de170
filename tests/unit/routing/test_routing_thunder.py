"""thunder: hand-computed seconds, load-decayed credit, host tier, KV overflow, load-scaled
recompute, no-hit ranking (all, or power of two choices), online tuning."""

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from thunderagent.prefill_model import (
    LLAMA_8B_ATTENTION_PARITY_TOKENS,
    prefill_work,
    queued_prefill_work,
)
from thunderagent.routing import POLICIES, RouteQuery, RoutingFeedback, WorkerView
from thunderagent.routing.cost import OnlineTuner, ParamError
from thunderagent.routing.thunder import Thunder

BS = 10


def q(blocks: int = 4, **kw) -> RouteQuery:
    return RouteQuery(
        request_id="r",
        prompt_tokens=blocks * BS,
        block_size=BS,
        block_hashes=list(range(blocks)),
        **kw,
    )


def unit(**params) -> Thunder:
    """Prefill costs 1 s per token (linear: no attention term unless a test sets one) and
    nothing else, so costs are easy to compute by hand."""
    base = dict(
        attention_parity_tokens=0.0,
        prefill_s_per_token=1.0,
        decode_s_per_kv_token=0.0,
        decode_s_per_seq=0.0,
        prior_prefill_tokens=0.0,
        load_scale=1.0,
        host_credit=0.5,
    )
    p = POLICIES.create("thunder", **(base | params))
    assert isinstance(p, Thunder)
    return p


def ids(ranked) -> list[str]:
    return [c.worker_id for c in ranked]


def test_costs_hand_computed_with_host_tier() -> None:
    query = q(4, overlaps={"a": 4, "b": 2}, host_overlaps={"a": 4, "b": 4})
    workers = [WorkerView("c"), WorkerView("b"), WorkerView("a")]
    ranked = unit().rank(query, workers, random.Random(0))
    # a: 40 - 40 = 0. b: 40 - (2 + 0.5 * 2) * 10 = 10. c: no credit, 40.
    assert ids(ranked) == ["a", "b", "c"]
    assert [c.score for c in ranked] == [0.0, -10.0, -40.0]
    assert [c.overlap_blocks for c in ranked] == [4, 2, 0]


def test_credit_decays_with_excess_load() -> None:
    query = q(4, overlaps={"a": 4, "b": 2}, host_overlaps={"b": 4})
    workers = [WorkerView("a", running=1), WorkerView("b"), WorkerView("c")]
    ranked = unit().rank(query, workers, random.Random(0))
    # a is 1 request above the least loaded: credit 40 * e^-1
    assert ids(ranked) == ["b", "a", "c"]
    assert ranked[1].score == pytest.approx(-(40 - 40 * math.exp(-1)))
    even = [WorkerView("a", running=1), WorkerView("b", running=1), WorkerView("c", running=1)]
    assert unit().rank(query, even, random.Random(0))[0].score == 0.0  # even load: full credit


def test_queue_decode_and_kv_overflow_terms() -> None:
    p = unit(decode_s_per_kv_token=0.01, decode_s_per_seq=0.5, decode_weight=0.1)
    p.on_dispatched(q(3), "x")  # uncached mean: 30 tokens
    w = WorkerView(
        "w", running=1, queued=2, active_tokens=910, kv_used_blocks=100, kv_total_blocks=100
    )
    query = q(4, expected_output_tokens=10)
    # own 40 + ahead 2 * 30 = 100; decode 0.1 * 10 * (0.01 * 910 + 0.5 * 3) = 10.6;
    # KV: running 910 + this prompt 40 + its output 10 = 960 past 90% of 1000 by 60 tokens,
    # each recomputed once after a retraction: 60
    assert p.cost(query, w, min_outstanding=3) == pytest.approx(170.6)
    # what was sent since the last report holds KV there too: 880 + 40 + 10 is 30 past 900;
    # own 40, ahead one request at the mean 30, decode 0.1 * 10 * 0.5 * 1
    sent = WorkerView("w", kv_total_blocks=100, pending=1, pending_kv_tokens=880)
    assert p.cost(query, sent, min_outstanding=0) == pytest.approx(40 + 30 + 0.5 + 30)
    # a pool full of cached (evictable) blocks alone is no pressure
    idle = WorkerView("w", kv_used_blocks=100, kv_total_blocks=100)
    assert p.cost(q(4), idle, min_outstanding=0) == pytest.approx(40.0)


def test_prefill_work_counts_attention_over_the_context_before() -> None:
    # dense work n, attention n * (c + n / 2) / parity
    assert prefill_work(10, 0, 0.0) == 10, "parity 0: linear"
    assert prefill_work(10, 0, 100.0) == pytest.approx(10 * (1 + 5 / 100))
    assert prefill_work(10, 30, 100.0) == pytest.approx(10 * (1 + 35 / 100))
    # a queue of 120 tokens in 3 prompts is 3 prompts of 40; never more than one of 120
    assert queued_prefill_work(120, 3, 100.0) == pytest.approx(3 * 40 * (1 + 20 / 100))
    assert queued_prefill_work(120, 0, 100.0) == pytest.approx(prefill_work(120, 0, 100.0))
    assert queued_prefill_work(0, 2, 100.0) == 0
    # Llama-3.1-8B: 2 * 8.03e9 / (4 * 32 * 4096)
    assert LLAMA_8B_ATTENTION_PARITY_TOKENS == pytest.approx(30_632, abs=1)
    assert Thunder().attention_parity_tokens == LLAMA_8B_ATTENTION_PARITY_TOKENS


@settings(max_examples=300, deadline=None)
@given(
    a=st.integers(0, 200_000),
    b=st.integers(0, 200_000),
    c=st.integers(0, 200_000),
    k=st.integers(1, 64),
    parity=st.sampled_from([0.0, 1.0, 30_632.0, 1e9]),
)
def test_prefill_work_is_the_same_in_chunks_and_a_split_queue_is_a_floor(
    a: int, b: int, c: int, k: int, parity: float
) -> None:
    # prefilling a then b tokens after c is prefilling a + b tokens after c (chunked prefill)
    whole = prefill_work(a + b, c, parity)
    assert prefill_work(a, c, parity) + prefill_work(b, c + a, parity) == pytest.approx(whole)
    # a queue split over more prompts holds less attention, never less than its tokens
    one = queued_prefill_work(a, 1, parity)
    assert a - 1e-6 <= queued_prefill_work(a, k, parity) <= one + 1e-6 * max(1.0, one)


def test_costs_hand_computed_with_attention() -> None:
    p = unit(attention_parity_tokens=100.0, load_scale=2.0)
    query = q(4, overlaps={"a": 3})  # 40 tokens, 30 cached on a
    a = WorkerView("a", running=2, prefill_tokens=0, pending=2, pending_prefill_tokens=60)
    # own 10 after 30: 10 * (1 + 35/100) = 13.5, doubled by recompute 1; the credit lost to
    # load: 30 * (1 + 15/100) * (1 - e^-1); ahead 60 in 2 prompts of 30: 2 * 30 * 1.15 = 69
    lost = 34.5 * (1 - math.exp(-1))
    assert p.cost(query, a, min_outstanding=2, recompute=1.0) == pytest.approx(27 + lost + 69)


def test_a_turn_is_not_queued_behind_a_prefill_a_linear_cost_calls_short() -> None:
    """The conversation trace at 1x: a turn's prefix held on a worker that was just sent one
    very long prompt. Counted in tokens that prompt looks shorter than the turn's re-prefill
    elsewhere at the recompute weight; counted in prefill time it is longer."""
    query = q(4, overlaps={"a": 4})  # 40 tokens, all on a
    a = WorkerView("a", prefill_tokens=0, pending=1, pending_prefill_tokens=130)
    b = WorkerView("b", prefill_tokens=0)
    for parity, first in ((0.0, "a"), (100.0, "b")):
        p = unit(attention_parity_tokens=parity, load_scale=1e9)
        costs = {w.worker_id: p.cost(query, w, min_outstanding=0, recompute=3.0) for w in (a, b)}
        assert min(costs, key=costs.__getitem__) == first, (parity, costs)
    # linear: a 130 against b 4 * 40 = 160; with attention a 130 * 1.65 = 214.5 against 192


def test_recompute_weighs_more_as_prefill_queues_grow() -> None:
    p = unit(recompute_gain=1.0, max_recompute_weight=16.0)
    p.on_dispatched(q(2), "x")  # a typical prefill: 20 tokens
    idle = [WorkerView("a"), WorkerView("b")]
    assert p.recompute_weight(idle, BS) == 0.0
    queued = [
        WorkerView("a", prefill_tokens=100, pending_prefill_tokens=0),
        WorkerView("b", prefill_tokens=40, pending_prefill_tokens=0),
    ]
    # even the least loaded worker has two typical prefills queued: no idle capacity left
    assert p.recompute_weight(queued, BS) == pytest.approx(2.0)
    hot_spot = [WorkerView("a", prefill_tokens=600, pending_prefill_tokens=0), WorkerView("b")]
    assert p.recompute_weight(hot_spot, BS) == 0.0, "one busy worker among idle ones: no penalty"
    # with queues a miss adds work everyone waits for: the holder wins despite its queue
    query = q(4, overlaps={"a": 4})
    assert ids(p.rank(query, queued, random.Random(0)))[0] == "a"
    flat = unit(recompute_gain=0.0)
    flat.on_dispatched(q(2), "x")
    assert ids(flat.rank(query, queued, random.Random(0)))[0] == "b"  # own TTFT only: b


def test_recompute_weighs_more_once_every_worker_kv_is_held_by_running_requests() -> None:
    p = unit(recompute_gain=1.0, max_recompute_weight=16.0, busy_kv_share=0.7)
    p.on_dispatched(q(2), "x")  # a typical prefill: 20 tokens

    def busy(name: str, held: int, **kw) -> WorkerView:  # pools of 100 blocks = 1,000 tokens
        return WorkerView(name, active_tokens=held, kv_total_blocks=100, **kw)

    # no prefill queued anywhere, but even the least loaded pool is 85% held: (0.85 - 0.7) /
    # 0.3 of the way to the full weight
    full = [busy("a", 900, prefill_tokens=0), busy("b", 850, prefill_tokens=0)]
    assert p.recompute_weight(full, BS) == pytest.approx(8.0)
    # what was sent since the report holds KV too
    sent = [busy("a", 700, pending_kv_tokens=300), busy("b", 1000)]
    assert p.recompute_weight(sent, BS) == pytest.approx(16.0)
    # one worker with room: a miss there takes capacity from no one
    room = [busy("a", 1000), busy("b", 500)]
    assert p.recompute_weight(room, BS) == 0.0
    # unknown pool size or no block size: no evidence, the prefill queue alone decides
    assert p.recompute_weight([WorkerView("a", active_tokens=10**6)], BS) == 0.0
    assert p.recompute_weight(full, 0) == 0.0
    assert unit(busy_kv_share=1.0).recompute_weight(sent, BS) == 0.0, "1 turns it off"
    # the holder wins although its prefill queue is longer: a miss would wait for KV anyway
    # (a: 50 queued ahead, nothing of its own; b: its own 40, x (1 + 8) when busy; overflow off)
    query = q(4, overlaps={"a": 4})
    queued = [busy("a", 900, prefill_tokens=50), busy("b", 850, prefill_tokens=0)]
    aware = unit(recompute_gain=1.0, overflow_weight=0.0, busy_kv_share=0.7)
    blind = unit(recompute_gain=1.0, overflow_weight=0.0, busy_kv_share=1.0)
    for policy in (aware, blind):
        policy.on_dispatched(q(2), "x")
    assert [(c.worker_id, c.score) for c in aware.rank(query, queued, random.Random(0))] == [
        ("a", -50.0),
        ("b", -360.0),
    ]
    assert [(c.worker_id, c.score) for c in blind.rank(query, queued, random.Random(0))] == [
        ("b", -40.0),
        ("a", -50.0),
    ]
    with pytest.raises(ParamError, match="busy_kv_share"):
        unit(busy_kv_share=1.5)


def test_load_decay_is_not_weighted_as_recompute() -> None:
    """Under recompute pressure two holders of the whole prompt are told apart by their
    queues: the credit a worker's extra load takes away is a load penalty at the base rate,
    not a recompute that every request behind it would wait for."""
    p = unit(recompute_gain=1.0, max_recompute_weight=16.0, load_scale=8.0)
    p.on_dispatched(q(2), "x")  # a typical prefill: 20 tokens
    query = q(10, overlaps={"a": 10, "b": 10})  # 100 tokens held by both
    workers = [
        WorkerView("a", running=1, prefill_tokens=100, pending_prefill_tokens=0),
        WorkerView("b", running=0, prefill_tokens=130, pending_prefill_tokens=0),
    ]
    # weight 1 x 100 / 20 = 5; a: one request above b, its credit decays by e^(-1/8)
    assert p.recompute_weight(workers, BS) == pytest.approx(5.0)
    lost = 100 * (1 - math.exp(-1 / 8))  # 11.75 tokens of credit
    ranked = p.rank(query, workers, random.Random(0))
    assert [(c.worker_id, c.score) for c in ranked] == [
        ("a", pytest.approx(-(100 + lost))),
        ("b", pytest.approx(-130.0)),
    ]
    # x (1 + 5) the penalty would be 70.5 tokens and b's 30 more queued tokens would win
    assert 6 * lost > 30


def test_free_kv_breaks_cost_ties() -> None:
    query = q(4, overlaps={"a": 2, "b": 2})
    workers = [
        WorkerView("a", kv_used_blocks=50, kv_total_blocks=100),
        WorkerView("b", kv_used_blocks=10, kv_total_blocks=100),
    ]
    for seed in range(10):
        assert ids(unit().rank(query, workers, random.Random(seed))) == ["b", "a"]


def test_new_blocks_that_evict_cached_ones_cost_evict_weight_each() -> None:
    """A full cache holding a shared first block loses the request to an empty cache once the
    prefix it would push out is worth more than the block it saves; free room evicts nothing."""
    query = q(4, overlaps={"full": 1})  # 30 new tokens on "full", 40 on "empty"
    workers = [
        WorkerView("full", kv_total_blocks=100, cached_blocks=100),
        WorkerView("empty", kv_total_blocks=100, cached_blocks=0),
    ]
    assert ids(unit().rank(query, workers, random.Random(0))) == ["full", "empty"]
    ranked = unit(evict_weight=0.5).rank(query, workers, random.Random(0))
    assert [(c.worker_id, c.score) for c in ranked] == [("empty", -40.0), ("full", -45.0)]
    # 98 of 100 blocks held, 1 more on its way (10 uncached tokens sent since the report): 10
    # tokens free, so 20 of the 30 new ones evict
    half = WorkerView("full", kv_total_blocks=100, cached_blocks=98, pending_prefill_tokens=10)
    ranked = unit(evict_weight=0.5).rank(query, [half, workers[1]], random.Random(0))
    assert {c.worker_id: c.score for c in ranked} == {"empty": -40.0, "full": -40.0}
    # the engine's used blocks count when they say more (its running requests' private ones)
    used = WorkerView("full", kv_total_blocks=100, cached_blocks=0, kv_used_blocks=100)
    ranked = unit(evict_weight=0.5).rank(query, [used, workers[1]], random.Random(0))
    assert {c.worker_id: c.score for c in ranked} == {"empty": -40.0, "full": -45.0}
    unknown = WorkerView("full", kv_total_blocks=100)  # cached_blocks -1: no index figure
    ranked = unit(evict_weight=0.5).rank(query, [unknown, workers[1]], random.Random(0))
    assert ids(ranked) == ["full", "empty"]


def test_no_hit_ranks_every_worker_by_cost() -> None:
    p = unit(decode_s_per_seq=1.0)
    workers = [WorkerView(f"w{i}", running=(i * 5) % 6) for i in range(6)]
    query = q(4, expected_output_tokens=1)
    for seed in range(10):
        ranked = [int(c.worker_id[1:]) for c in p.rank(query, workers, random.Random(seed))]
        assert [(i * 5) % 6 for i in ranked] == sorted((i * 5) % 6 for i in range(6))
        assert ranked[0] == 0  # the least loaded, whatever the draw


def test_no_hit_sample_must_be_all_or_a_real_choice() -> None:
    for bad in (1, -2, 2.5, True):
        with pytest.raises(ParamError):
            unit(no_hit_sample=bad)


def test_no_hit_sample_two_is_power_of_two_choices() -> None:
    p = unit(decode_s_per_seq=1.0, no_hit_sample=2)
    workers = [WorkerView(f"w{i}", running=i) for i in range(6)]
    query = q(4, expected_output_tokens=1)
    firsts = set()
    for seed in range(40):
        ranked = p.rank(query, workers, random.Random(seed))
        a, b = random.Random(seed).sample(range(6), 2)
        assert ranked[0].worker_id == f"w{min(a, b)}"  # the less loaded of the sampled two
        rest = [int(c.worker_id[1:]) for c in ranked[1:]]
        assert rest == sorted(rest)
        firsts.add(ranked[0].worker_id)
    assert "w5" not in firsts  # the most loaded never wins a pair
    assert len(firsts) > 1  # and the least loaded is not always picked


def test_temperature_puts_the_sampled_worker_first() -> None:
    p = unit(temperature=1.0)
    query = q(4, overlaps={"a": 4, "b": 2})
    workers = [WorkerView("a"), WorkerView("b"), WorkerView("c")]
    firsts = {ids(p.rank(query, workers, random.Random(s)))[0] for s in range(200)}
    assert firsts == {"a", "b", "c"}


@settings(max_examples=200, deadline=None)
@given(
    blocks=st.integers(1, 64),
    load=st.integers(0, 50),
    k=st.integers(0, 64),
    bs=st.sampled_from([16, 512]),
)
def test_cost_is_monotone_in_overlap_and_host_credit_is_between(
    blocks: int, load: int, k: int, bs: int
) -> None:
    p = POLICIES.create("thunder")
    k = min(k, blocks - 1)

    def cost(gpu: int, host: int) -> float:
        query = RouteQuery(
            request_id="r",
            prompt_tokens=blocks * bs,
            block_size=bs,
            block_hashes=list(range(blocks)),
            overlaps={"w": gpu},
            host_overlaps={"w": host},
        )
        return p.cost(query, WorkerView("w", running=load), min_outstanding=0)

    assert cost(k + 1, k + 1) <= cost(k, k)  # more GPU overlap never costs more
    assert cost(k + 1, k + 1) <= cost(k, k + 1) <= cost(k, k)  # host credit in [0, GPU credit]
    assert math.isfinite(cost(k, k))


@settings(max_examples=200, deadline=None)
@given(blocks=st.integers(1, 64), k=st.integers(1, 64), bs=st.sampled_from([16, 512]))
def test_loaded_hit_eventually_loses_to_idle_miss(blocks: int, k: int, bs: int) -> None:
    p = POLICIES.create("thunder")
    query = RouteQuery(
        request_id="r",
        prompt_tokens=blocks * bs,
        block_size=bs,
        block_hashes=list(range(blocks)),
        overlaps={"hot": min(k, blocks)},
    )
    winners = [
        p.rank(query, [WorkerView("hot", running=n), WorkerView("idle")], random.Random(0))[0]
        for n in range(0, 400, 5)
    ]
    flips = [c.worker_id for c in winners]
    assert flips[0] == "hot" and flips[-1] == "idle"
    assert flips == sorted(flips, key=lambda w: w == "idle")  # once it loses, it stays lost


@pytest.mark.parametrize(
    ("depths", "false_hits", "expected"),
    [
        # imbalance = spread / (3 sqrt(mean) + 1)
        ({"a": 0, "b": 0, "c": 0, "d": 8}, 0.0, 7.2),  # 8 / 5.24 = 1.53 > 1.5: decay faster
        ({"a": 2, "b": 2, "c": 2, "d": 2}, 0.0, 8.8),  # even, index trusted: decay slower
        ({"a": 2, "b": 2, "c": 2, "d": 2}, 0.2, 8.0),  # even but many false hits: hold
        ({"a": 0, "b": 0, "c": 0, "d": 5}, 0.0, 8.0),  # 5 / 4.35 = 1.15, in between: hold
        ({"a": 2, "b": 3, "c": 2, "d": 3}, 0.0, 8.8),  # within chance: trust the cache
        ({}, 0.0, 8.0),
    ],
)
def test_online_tuner_steps(depths: dict, false_hits: float, expected: float) -> None:
    p = POLICIES.create("thunder")
    p.observe(RoutingFeedback(queue_depths=depths, false_hit_rate=false_hits))
    assert p.load_scale == pytest.approx(expected)


def test_online_tuner_is_bounded() -> None:
    p = POLICIES.create("thunder", tuner={"min_scale": 2.0, "max_scale": 10.0})
    hot = RoutingFeedback(queue_depths={"a": 0, "b": 50})
    for _ in range(100):
        p.observe(hot)
    assert p.load_scale == 2.0
    calm = RoutingFeedback(queue_depths={"a": 1, "b": 1})
    for _ in range(100):
        p.observe(calm)
    assert p.load_scale == 10.0


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"prefill_s_per_token": 0.0}, "prefill_s_per_token"),
        ({"host_credit": 1.2}, "host_credit"),
        ({"load_scale": math.nan}, "load_scale"),
        ({"decode_s_per_kv_token": -1e-9}, "decode_s_per_kv_token"),
        ({"pressure_threshold": 1.0}, "pressure_threshold"),
        ({"overflow_weight": -1.0}, "overflow_weight"),
        ({"recompute_gain": -0.5}, "recompute_gain"),
        ({"evict_weight": -0.1}, "evict_weight"),
        ({"attention_parity_tokens": -1.0}, "attention_parity_tokens"),
        ({"attention_parity_tokens": math.inf}, "attention_parity_tokens"),
        ({"mean_alpha": 2.0}, "mean_alpha"),
    ],
)
def test_params_are_validated(params: dict, field: str) -> None:
    with pytest.raises(ParamError, match=f"thunder.{field}=") as err:
        POLICIES.create("thunder", **params)
    assert err.value.field == field


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"step": 1.0}, "step"),
        ({"high_imbalance": 0.1}, "high_imbalance"),
        ({"max_false_hit_rate": -0.1}, "max_false_hit_rate"),
        ({"min_scale": 0.0}, "min_scale"),
        ({"max_scale": 0.5}, "max_scale"),
    ],
)
def test_tuner_params_are_validated(params: dict, field: str) -> None:
    with pytest.raises(ParamError, match=f"thunder.tuner.{field}="):
        OnlineTuner(**params)


def test_reported_prefill_backlog_replaces_the_queue_estimate() -> None:
    p = unit()
    p.on_dispatched(q(3), "x")  # uncached mean: 30 tokens
    query = q(4)
    # no report: 2 queued requests at the mean; reported: the backlog itself (a long prompt)
    estimated = WorkerView("a", queued=2)
    reported = WorkerView("b", queued=2, prefill_tokens=500, pending=1)
    assert p.cost(query, estimated, min_outstanding=0) == pytest.approx(40 + 2 * 30)
    assert p.cost(query, reported, min_outstanding=0) == pytest.approx(40 + 500 + 1 * 30)


views = st.builds(
    WorkerView,
    worker_id=st.sampled_from(["a", "b", "c", "d", "e"]),
    running=st.integers(0, 40),
    queued=st.integers(0, 8),
    kv_used_blocks=st.integers(0, 5000),
    kv_total_blocks=st.sampled_from([0, 5000]),
    active_tokens=st.integers(0, 300_000),
    pending=st.integers(0, 4),
    pending_kv_tokens=st.integers(-1, 50_000),
    pending_prefill_tokens=st.integers(-1, 50_000),
    prefill_tokens=st.integers(-1, 90_000),
    cached_blocks=st.integers(-1, 6000),
)


@settings(max_examples=300, deadline=None)
@given(
    fleet=st.lists(views, min_size=1, max_size=5, unique_by=lambda w: w.worker_id),
    gpu=st.dictionaries(st.sampled_from("abcde"), st.integers(0, 40)),
    host=st.dictionaries(st.sampled_from("abcde"), st.integers(0, 40)),
    bs=st.sampled_from([16, 512]),
    seen=st.lists(st.integers(0, 20_000), max_size=4),
)
def test_rank_prices_every_worker_as_cost_alone_does(
    fleet: list, gpu: dict, host: dict, bs: int, seen: list
) -> None:
    """``rank`` prices the whole fleet at once: what no worker changes is worked out once, and
    the workers holding nothing of the prompt share one prefill price. Each score is exactly
    ``-cost`` of that worker alone, priced the long way (every worker listed in the overlaps,
    with 0 blocks where it holds nothing)."""
    p = POLICIES.create("thunder")
    for n in seen:
        p._uncached.add(n)
    host = {w: max(n, gpu.get(w, 0)) for w, n in host.items()}
    query = RouteQuery("r", 40 * bs + 3, bs, list(range(40)), gpu, host, 256)
    listed = {w.worker_id: 0 for w in fleet}
    long_way = RouteQuery("r", 40 * bs + 3, bs, list(range(40)), listed | gpu, listed | host, 256)
    least = min(w.outstanding for w in fleet)
    recompute = p.recompute_weight(fleet, bs)
    alone = {w.worker_id: -p.cost(long_way, w, least, recompute) for w in fleet}
    assert {c.worker_id: c.score for c in p.rank(query, fleet, random.Random(0))} == alone
