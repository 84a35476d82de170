"""dynamo_kv: Dynamo 1.6.1's default cost over its own slot tracker (book on dispatch, prefill
freed at the first token, the rest at the finish, blocks deduplicated by hash), hand-computed;
ties and softmax sampling."""

import math
import random
from collections import Counter

import pytest

from thunderagent.routing import POLICIES, RouteQuery, WorkerView
from thunderagent.routing.cost import ParamError
from thunderagent.routing.dynamo_kv import DynamoKv

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


def policy(**params) -> DynamoKv:
    p = POLICIES.create("dynamo_kv", **params)
    assert isinstance(p, DynamoKv)
    return p


ABC = [WorkerView("a"), WorkerView("b"), WorkerView("c")]


def test_fresh_costs_hand_computed() -> None:
    # 4 blocks. a: prefill 4 - 3 = 1, decode 4. b: 4 - 0.75 * 2 = 2.5, decode 4. c: 3 + 4.
    query = q([0, 1, 2, 3], overlaps={"a": 3, "c": 1}, host_overlaps={"a": 3, "b": 2, "c": 1})
    p = policy()
    assert p.costs(query, ABC) == {"a": 5.0, "b": 6.5, "c": 7.0}
    ranked = p.rank(query, ABC, random.Random(0))
    assert [c.worker_id for c in ranked] == ["a", "b", "c"]
    assert [c.score for c in ranked] == [-5.0, -6.5, -7.0]
    assert [c.overlap_blocks for c in ranked] == [3, 0, 1]


def test_dispatch_books_blocks_deduplicated_by_hash() -> None:
    p = policy()
    p.on_dispatched(q([0, 1, 2, 3], rid="r1"), "a")
    p.on_started("r1", "a", 0.5)
    assert p.active_blocks("a") == 4
    longer = q([0, 1, 2, 3, 4, 5], rid="r2")
    # a: 4 active + 2 new = 6 decode blocks; b: 0 + 6. Prefill 24/4 = 6 on both (r1 has its
    # first token, so its prefill is done).
    assert p.costs(longer, [WorkerView("a"), WorkerView("b")]) == {"a": 12.0, "b": 12.0}
    no_reuse = policy(assume_kv_reuse=False)
    no_reuse.on_dispatched(q([0, 1, 2, 3], rid="r1"), "a")
    no_reuse.on_started("r1", "a", 0.5)
    assert no_reuse.costs(longer, [WorkerView("a")]) == {"a": 6.0 + 4 + 6}


def test_finish_frees_blocks_and_refcounts_shared_ones() -> None:
    p = policy()
    p.on_dispatched(q([0, 1, 2], rid="r1"), "a")
    p.on_dispatched(q([0, 1, 9], rid="r2"), "a")
    assert p.active_blocks("a") == 4  # {0, 1, 2, 9}
    p.on_finished("r1", "a", 1.0)
    assert p.active_blocks("a") == 3  # 0 and 1 are still held by r2
    p.on_finished("r1", "a", 1.0)  # twice: ignored
    p.on_finished("unknown", "a", 1.0)
    assert p.active_blocks("a") == 3
    p.on_finished("r2", "a", 2.0)
    assert p.active_blocks("a") == 0
    assert p.costs(q([0, 1, 2]), [WorkerView("a")]) == {"a": 3.0 + 3}


@pytest.mark.parametrize(
    ("started", "prefill"),
    [
        ((), 24),  # neither has its first token: r1's 16 + r2's 8 uncached tokens
        (("r1",), 8),
        (("r2",), 16),
        (("r1", "r2"), 0),
        (("unknown",), 24),  # a start this policy did not book changes nothing
    ],
)
def test_active_prefill_is_booked_tokens_still_before_first_token(
    started: tuple[str, ...], prefill: int
) -> None:
    p = policy()
    p.on_dispatched(q([0, 1, 2, 3], rid="r1"), "a")  # 16 uncached tokens
    p.on_dispatched(q([0, 1, 7, 8], rid="r2", overlaps={"a": 2}), "a")  # 16 - 2 * 4 = 8
    for rid in started:
        p.on_started(rid, "a", 1.0)
    p.on_started("r1", "b", 1.0)  # a start reported by another worker is not r1's run on a
    assert p.active_prefill_tokens("a") == prefill
    # what the prefill side charges: (prefill + 16 prompt) / 4 - 0 credit, decode 6 + 4; the
    # blocks stay active after the first token
    other = [5, 6, 10, 11]
    assert p.costs(q(other), [WorkerView("a")]) == {"a": (prefill + 16) / BS + 6 + 4}


def test_credit_decay_and_active_request_weight() -> None:
    p = policy(overlap_score_credit_decay=1.0, decode_active_request_weight=2.0)
    p.on_dispatched(q([10, 11, 12, 13], rid="r1"), "a")  # 16 prefill tokens booked on a
    query = q([0, 1, 2, 3], overlaps={"a": 4, "b": 4})
    views = [WorkerView("a"), WorkerView("b")]
    # a: excess prefill 16 tokens = 4 blocks over b, / 4 request blocks = 1 -> credit 4 / 2 = 2;
    # prefill (16 + 16) / 4 - 2 = 6; decode 4 active + 4 new; one request * 2 -> 16.
    # b: prefill 4 - 4 = 0; decode 4 -> 4.
    assert p.costs(query, views) == {"a": 16.0, "b": 4.0}


def test_overlap_score_weight_alias() -> None:
    p = policy(overlap_score_weight=0.0)
    assert (p.prefill_load_scale, p.overlap_score_credit) == (0.0, 0.0)
    assert p.costs(q([0, 1], overlaps={"a": 2}), [WorkerView("a")]) == {"a": 2.0}
    assert policy(overlap_score_weight=2.0).prefill_load_scale == 2.0


def test_redispatch_moves_the_booking_and_stale_bookings_expire() -> None:
    p = policy()
    p.on_dispatched(q([0, 1], rid="r1", now=0.0), "a")
    p.on_dispatched(q([0, 1], rid="r1", now=1.0), "b")  # the same request, re-dispatched
    assert (p.active_blocks("a"), p.active_blocks("b")) == (0, 2)
    p.on_dispatched(q([5], rid="r2", now=3601.5), "c")  # r1 is older than EXPIRY_DURATION
    assert (p.active_blocks("b"), p.active_blocks("c")) == (0, 1)


def test_ties_broken_by_seeded_rng() -> None:
    p = policy()
    p.on_dispatched(q([20], rid="busy"), "c")
    firsts = {p.rank(q([0]), ABC, random.Random(s))[0].worker_id for s in range(30)}
    assert firsts == {"a", "b"}
    assert p.rank(q([0]), ABC, random.Random(7)) == p.rank(q([0]), ABC, random.Random(7))
    assert all(p.rank(q([0]), ABC, random.Random(s))[-1].worker_id == "c" for s in range(30))


def test_temperature_samples_softmax_of_normalized_costs() -> None:
    p = policy(temperature=0.5)
    p.on_dispatched(q([10, 11, 12, 13], rid="rb"), "b")
    p.on_dispatched(q(list(range(20, 28)), rid="rc"), "c")
    p.on_started("rb", "b", 0.5)
    p.on_started("rc", "c", 0.5)
    query = q([0, 1, 2, 3])
    assert p.costs(query, ABC) == {"a": 8.0, "b": 12.0, "c": 16.0}  # normalized 0, 0.5, 1
    weights = [math.exp(-x / 0.5) for x in (0.0, 0.5, 1.0)]
    expected = {w: x / sum(weights) for w, x in zip("abc", weights, strict=True)}
    rng = random.Random(1234)
    n = 20_000
    counts = Counter(p.rank(query, ABC, rng)[0].worker_id for _ in range(n))
    for w in "abc":
        assert counts[w] / n == pytest.approx(expected[w], abs=0.015)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"prefill_load_scale": -1.0}, "prefill_load_scale"),
        ({"overlap_score_weight": math.inf}, "overlap_score_weight"),
        ({"overlap_score_credit": -0.5}, "overlap_score_credit"),
        ({"host_cache_hit_weight": 1.5}, "host_cache_hit_weight"),
        ({"temperature": -0.1}, "temperature"),
        ({"assume_kv_reuse": "yes"}, "assume_kv_reuse"),
        ({"expiry_s": 0}, "expiry_s"),
    ],
)
def test_params_are_validated(params: dict, field: str) -> None:
    with pytest.raises(ParamError, match=f"dynamo_kv.{field}=") as err:
        policy(**params)
    assert err.value.field == field
