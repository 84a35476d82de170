"""Every policy: each worker ranked exactly once, finite scores, seeded determinism, purity."""

import ast
import inspect
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from thunderagent.routing import POLICIES, RouteQuery, WorkerView
from thunderagent.routing import cost as cost_module

NAMES = [
    "round_robin",
    "sglang_cache_aware",
    "smg_cache_aware",
    "dynamo_kv",
    "thunder",
    "least_loaded",
    "llm_d",
]
PARAMS = {
    "round_robin": [{}],
    "sglang_cache_aware": [{}, {"max_tree_tokens": 64, "balance_abs_threshold": 2}],
    "smg_cache_aware": [{}, {"index": "events", "booking_ttl_s": 1.0, "overlap_decay": 1.0}],
    "dynamo_kv": [{}, {"temperature": 0.7}, {"predict_on_route": True}],
    "thunder": [{}, {"temperature": 0.3}],
    "least_loaded": [{}],
    "llm_d": [
        {},
        {"prefix": "precise"},
        {"lru_capacity_blocks": 3, "max_prefix_blocks_to_match": 2},
    ],
}

worker = st.builds(
    WorkerView,
    worker_id=st.sampled_from([f"w{i}" for i in range(8)]),
    running=st.integers(0, 300),
    queued=st.integers(0, 300),
    kv_used_blocks=st.integers(0, 5000),
    kv_total_blocks=st.integers(0, 5000),
    active_tokens=st.integers(0, 2_000_000),
    pending=st.integers(0, 50),
)
fleet = st.lists(worker, min_size=1, max_size=8, unique_by=lambda w: w.worker_id)


@st.composite
def query(draw: st.DrawFn) -> RouteQuery:
    bs = draw(st.sampled_from([1, 16, 512]))
    blocks = draw(st.integers(0, 40))
    tokens = blocks * bs + draw(st.integers(0, bs - 1))  # a partial last block is not hashed
    hashes = draw(st.lists(st.integers(0, 30), min_size=blocks, max_size=blocks))
    ids = [f"w{i}" for i in range(10)]
    gpu = draw(st.dictionaries(st.sampled_from(ids), st.integers(0, blocks)))
    host = {w: max(n, draw(st.integers(0, blocks))) for w, n in gpu.items()}
    host |= draw(st.dictionaries(st.sampled_from(ids), st.integers(0, blocks)))
    host = {w: max(n, gpu.get(w, 0)) for w, n in host.items()}
    return RouteQuery(
        request_id="r",
        prompt_tokens=tokens,
        block_size=bs,
        block_hashes=hashes,
        overlaps=gpu,
        host_overlaps=host,
        expected_output_tokens=draw(st.integers(0, 4096)),
    )


@pytest.mark.parametrize(("name", "params"), [(n, p) for n in NAMES for p in PARAMS[n]], ids=str)
@settings(max_examples=60, deadline=None)
@given(rounds=st.lists(st.tuples(query(), fleet), min_size=1, max_size=6), seed=st.integers(0, 99))
def test_ranks_every_worker_once_with_finite_scores(
    name: str, params: dict, rounds: list, seed: int
) -> None:
    policy = POLICIES.create(name, **params)
    twin = POLICIES.create(name, **params)
    for q, workers in rounds:
        ranked = policy.rank(q, workers, random.Random(seed))
        assert sorted(c.worker_id for c in ranked) == sorted(w.worker_id for w in workers)
        assert all(math.isfinite(c.score) for c in ranked)
        assert all(c.overlap_blocks >= 0 for c in ranked)
        assert twin.rank(q, workers, random.Random(seed)) == ranked  # same state + seed: same
        policy.on_dispatched(q, ranked[0].worker_id)
        twin.on_dispatched(q, ranked[0].worker_id)


def test_registry_knows_every_policy_with_defaults() -> None:
    assert set(NAMES) == set(POLICIES.names())
    for name in NAMES:
        assert POLICIES.create(name).name == name


@pytest.mark.parametrize("name", ["cost", *NAMES])
def test_modules_are_pure(name: str) -> None:
    """No I/O, clock or global randomness: only the rng handed in."""
    module = (
        cost_module
        if name == "cost"
        else __import__(f"thunderagent.routing.{name}", fromlist=["_"])
    )
    tree = ast.parse(inspect.getsource(module))
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in (
            node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")]
        )
    }
    assert imported <= {
        "__future__",
        "math",
        "operator",
        "random",
        "collections",
        "dataclasses",
        "typing",
        "thunderagent",
    }
    source = inspect.getsource(module)
    assert "random.random(" not in source and "random.choice(" not in source


@pytest.mark.parametrize("temperature", [0.1, 1.0, 10.0])
def test_softmax_index_prefers_lower_cost(temperature: float) -> None:
    rng = random.Random(3)
    picks = [cost_module.softmax_index([5.0, 1.0, 9.0], temperature, rng) for _ in range(3000)]
    counts = [picks.count(i) for i in range(3)]
    assert counts[1] > counts[0] > counts[2]
