"""The approximate cache of workers without KV events: per worker, what was prefilled there
within the TTL, at most the engine's capacity, the oldest prefills going first."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from thunderagent.hashing import BlockHasher
from thunderagent.prefix_index.prefilled import PrefilledPrefixes

BS = 4
HASHER = BlockHasher(BS)
TRUNK = list(range(100, 100 + 2 * BS))
PROMPTS = [TRUNK + list(range(1000 * i, 1000 * i + (i % 3 + 1) * BS)) for i in range(1, 5)] + [
    list(range(7000, 7000 + 3 * BS))
]
"""Four prompts forking after a two-block trunk, and one of their own."""
KEYS = [HASHER.hash_tokens(p) for p in PROMPTS]


def test_a_zero_or_negative_ttl_is_refused() -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        PrefilledPrefixes(0.0)


def test_past_its_capacity_a_worker_keeps_its_latest_prefills() -> None:
    cache = PrefilledPrefixes(100.0)
    k0, k4 = KEYS[0], KEYS[4]  # 4 and 3 blocks, none shared
    cache.record("w", k0.primary, k0.check, 1.0, capacity_blocks=5)
    cache.record("w", k4.primary, k4.check, 2.0, capacity_blocks=5)
    assert cache.merge({}, k4.primary, k4.check, 3.0) == {"w": 3}
    assert cache.merge({}, k0.primary, k0.check, 3.0) == {}, "the older prompt went whole"
    cache.record("w", k0.primary, k0.check, 4.0, capacity_blocks=0)  # unknown: no bound
    assert cache.block_counts() == {"w": 7}


def test_a_renewed_trunk_stays_while_the_branch_it_was_first_prefilled_with_goes() -> None:
    cache = PrefilledPrefixes(100.0)
    k1, k2 = KEYS[1], KEYS[2]  # the trunk's 2 blocks + 3, + 1
    cache.record("w", k1.primary, k1.check, 1.0, capacity_blocks=5)
    cache.record("w", k2.primary, k2.check, 2.0, capacity_blocks=5)  # 6 blocks: k1's go
    assert cache.merge({}, k1.primary, k1.check, 3.0) == {"w": 2}, "the trunk was renewed"
    assert cache.merge({}, k2.primary, k2.check, 3.0) == {"w": 3}


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["w0", "w1"]),
            st.integers(0, len(PROMPTS) - 1),
            st.floats(0.0, 60.0, allow_nan=False),
        ),
        max_size=30,
    ),
    st.integers(0, 12),
)
def test_answers_as_a_model_of_ttl_and_lru_per_worker(prefills, capacity) -> None:
    """Model: per worker, each block's last prefill and the prefills in order; past capacity
    the oldest prefill's blocks that no later one renewed go; at a query, blocks whose last
    prefill is ``ttl`` old are gone. Every prompt's overlap on every worker is its leading
    blocks the model holds."""
    ttl = 100.0
    cache, now = PrefilledPrefixes(ttl), 0.0
    last: dict[str, dict[int, float]] = {"w0": {}, "w1": {}}
    order: dict[str, list[tuple[float, list[int]]]] = {"w0": [], "w1": []}
    for worker, p, gap in prefills:
        now += gap
        keys = KEYS[p].primary
        cache.record(worker, keys, KEYS[p].check, now, capacity_blocks=capacity)
        last[worker].update(dict.fromkeys(keys, now))
        order[worker].append((now, keys))
        while capacity and len(last[worker]) > capacity:
            at, old = order[worker].pop(0)
            for h in old:
                if last[worker].get(h, float("inf")) <= at:
                    del last[worker][h]
    probe = now + 1.0
    for k in KEYS:
        expected = {}
        for worker, held in last.items():
            n = 0
            while n < len(k.primary) and probe - held.get(k.primary[n], -1e9) < ttl:
                n += 1
            if n:
                expected[worker] = n
        assert cache.merge({}, k.primary, k.check, probe) == expected
