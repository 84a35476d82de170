"""Dynamo's approximate cache (workers without KV events): per worker, what was prefilled there
within the TTL, whatever other workers did with the same blocks."""

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


def test_a_renewed_trunk_outlives_the_branch_it_was_first_prefilled_with() -> None:
    cache = PrefilledPrefixes(100.0)
    k1, k2 = KEYS[1], KEYS[2]  # the trunk's 2 blocks + 3, + 1
    cache.record("w", k1.primary, k1.check, 1.0)
    cache.record("w", k2.primary, k2.check, 50.0)
    assert cache.merge({}, k1.primary, k1.check, 120.0) == {"w": 2}, "the trunk was renewed"
    assert cache.merge({}, k2.primary, k2.check, 120.0) == {"w": 3}
    assert cache.merge({"w": 4}, k2.primary, k2.check, 120.0) == {"w": 4}, "the longer one"
    assert cache.merge({}, k2.primary, k2.check, 150.0) == {}


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
)
def test_answers_as_a_model_of_a_ttl_per_worker(prefills) -> None:
    """Model: per worker, each block's last prefill; a block whose last prefill there is
    ``ttl`` old is gone. Every prompt's overlap on every worker is its leading blocks the
    model holds."""
    ttl = 100.0
    cache, now = PrefilledPrefixes(ttl), 0.0
    last: dict[str, dict[int, float]] = {"w0": {}, "w1": {}}
    for worker, p, gap in prefills:
        now += gap
        cache.record(worker, KEYS[p].primary, KEYS[p].check, now)
        last[worker].update(dict.fromkeys(KEYS[p].primary, now))
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
