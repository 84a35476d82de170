"""dynamo_kv: hand-computed block costs, pending-prefill estimate, ties, softmax sampling."""

import math
import random
from collections import Counter

import pytest

from thunderagent.routing import POLICIES, RouteQuery, WorkerView
from thunderagent.routing.cost import ParamError
from thunderagent.routing.dynamo_kv import DynamoKv

BS = 4


def q(tokens: int = 16, **kw) -> RouteQuery:
    hashes = list(range(tokens // BS))
    return RouteQuery(
        request_id="r", prompt_tokens=tokens, block_size=BS, block_hashes=hashes, **kw
    )


def policy(**params) -> DynamoKv:
    p = POLICIES.create("dynamo_kv", **params)
    assert isinstance(p, DynamoKv)
    return p


WORKERS = [
    WorkerView("a", running=3, active_tokens=40),
    WorkerView("b", running=1, active_tokens=8),
    WorkerView("c"),
]
QUERY = q(16, overlaps={"a": 3, "c": 1}, host_overlaps={"a": 3, "b": 2, "c": 1})


@pytest.mark.parametrize(
    ("weight", "costs", "order"),
    [
        # prompt 4 blocks. a: prefill 4-3=1, decode 40/4+4=14. b: prefill 4-0.75*2=2.5,
        # decode 8/4+4=6. c: prefill 4-1=3, decode 0+4=4.
        (1.0, {"a": 15.0, "b": 8.5, "c": 7.0}, ["c", "b", "a"]),
        (2.0, {"a": 16.0, "b": 11.0, "c": 10.0}, ["c", "b", "a"]),
        (0.0, {"a": 14.0, "b": 6.0, "c": 4.0}, ["c", "b", "a"]),
    ],
)
def test_costs_hand_computed(weight: float, costs: dict, order: list[str]) -> None:
    p = policy(overlap_score_weight=weight)
    assert p.costs(QUERY, WORKERS) == costs
    ranked = p.rank(QUERY, WORKERS, random.Random(0))
    assert [c.worker_id for c in ranked] == order
    assert [c.score for c in ranked] == [-costs[w] for w in order]
    assert [c.overlap_blocks for c in ranked] == [QUERY.overlaps.get(w, 0) for w in order]


def test_queued_and_pending_work_is_estimated_from_routed_prompts() -> None:
    p = policy()
    p.on_dispatched(q(32, overlaps={"x": 2}), "x")  # first sample: prompt 32, uncached 24 tokens
    busy = WorkerView("w", queued=2, pending=1, active_tokens=4)
    # prefill = 3 waiting * 24/4 + 4 = 22; decode = (4 + 1 pending * 32)/4 + 4 = 13
    assert p.costs(q(16), [busy]) == {"w": 35.0}


def test_ties_broken_by_seeded_rng() -> None:
    p = policy()
    workers = [WorkerView("a"), WorkerView("b"), WorkerView("c", running=1, active_tokens=4)]
    firsts = {p.rank(q(), workers, random.Random(s))[0].worker_id for s in range(30)}
    assert firsts == {"a", "b"}
    assert p.rank(q(), workers, random.Random(7)) == p.rank(q(), workers, random.Random(7))
    assert all(p.rank(q(), workers, random.Random(s))[-1].worker_id == "c" for s in range(30))


def test_temperature_samples_softmax_of_normalized_costs() -> None:
    p = policy(temperature=0.5)
    workers = [WorkerView("a"), WorkerView("b", active_tokens=4), WorkerView("c", active_tokens=8)]
    assert p.costs(q(), workers) == {"a": 8.0, "b": 9.0, "c": 10.0}  # normalized 0, 0.5, 1
    weights = [math.exp(-x / 0.5) for x in (0.0, 0.5, 1.0)]
    expected = {w: x / sum(weights) for w, x in zip("abc", weights, strict=True)}
    rng = random.Random(1234)
    n = 20_000
    counts = Counter(p.rank(q(), workers, rng)[0].worker_id for _ in range(n))
    for w in "abc":
        assert counts[w] / n == pytest.approx(expected[w], abs=0.015)


def test_temperature_with_equal_costs_is_uniform() -> None:
    p = policy(temperature=1.0)
    workers = [WorkerView("a"), WorkerView("b")]
    rng = random.Random(5)
    counts = Counter(p.rank(q(), workers, rng)[0].worker_id for _ in range(4000))
    assert counts["a"] / 4000 == pytest.approx(0.5, abs=0.03)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"overlap_score_weight": -1.0}, "overlap_score_weight"),
        ({"overlap_score_weight": math.inf}, "overlap_score_weight"),
        ({"host_cache_hit_weight": 1.5}, "host_cache_hit_weight"),
        ({"temperature": -0.1}, "temperature"),
        ({"mean_alpha": 0.0}, "mean_alpha"),
    ],
)
def test_params_are_validated(params: dict, field: str) -> None:
    with pytest.raises(ParamError, match=f"dynamo_kv.{field}=") as err:
        policy(**params)
    assert err.value.field == field
