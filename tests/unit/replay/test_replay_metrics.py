"""Metrics arithmetic on hand-built cases."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from thunderagent.engine import TimingModel, get_profile
from thunderagent.replay import ideal_hit_ratio, load_imbalance, pooled_hit_ratio
from thunderagent.replay.metrics import (
    gpu_seconds_floor,
    ideal_hits,
    pooled_hits,
    work_ceiling_speed,
)
from thunderagent.replay.summary import alone_ttft_s
from thunderagent.stats import percentile, summary


@pytest.mark.parametrize(
    ("values", "q", "want"),
    [
        ([], 50, math.nan),
        ([7.0], 99, 7.0),
        ([1.0, 2.0, 3.0, 4.0], 50, 2.5),
        ([4.0, 1.0, 3.0, 2.0], 0, 1.0),
        ([4.0, 1.0, 3.0, 2.0], 100, 4.0),
        (list(range(101)), 90, 90.0),
        (list(range(11)), 99, 9.9),
    ],
)
def test_percentile_linear_between_ranks(values: list[float], q: float, want: float) -> None:
    got = percentile(values, q)
    assert (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want)


def test_summary_in_milliseconds() -> None:
    s = summary([0.1, 0.2, 0.3], 1000.0)
    assert s == pytest.approx({"p50": 200.0, "p90": 280.0, "p99": 298.0, "mean": 200.0})


def test_ideal_counts_usable_leading_blocks_only() -> None:
    bs = 4
    reqs = [
        ([1, 2, 3], 12),  # cold: stores 3 blocks
        ([1, 2, 3], 12),  # may reuse (12-1)//4 = 2 blocks (the last token is computed)
        ([1, 9, 3], 13),  # 1 leading block; stores [1, 9, 3]
        ([1, 9, 3, 4], 17),  # 3 blocks (16 tokens)
    ]
    assert ideal_hit_ratio(reqs, bs) == pytest.approx((0 + 8 + 4 + 12) / (12 + 12 + 13 + 17))


def test_pooled_lru_evicts_least_recent_leaves_first() -> None:
    bs = 1
    # capacity 3: after A=[1,2] and B=[3,4] the cache would hold 4; LRU drops A's leaf 2 first
    # (A's root 1 was touched after 2), then nothing else.
    reqs = [([1, 2], 3), ([3, 4], 3), ([1, 2], 3), ([3, 4], 3)]
    # req3: 1 cached, 2 evicted -> 1 block; stores 1,2 evicting 4 (oldest leaf of B)
    # req4: 3 cached, 4 evicted -> 1 block
    assert pooled_hit_ratio(reqs, bs, capacity_blocks=3) == pytest.approx(2 / 12)
    assert pooled_hit_ratio(reqs, bs, capacity_blocks=4) == pytest.approx(4 / 12)
    assert ideal_hit_ratio(reqs, bs) == pytest.approx(4 / 12)


def test_pooled_never_beats_ideal_and_grows_with_capacity() -> None:
    reqs = [([i % 5, 100 + i % 3], 9) for i in range(30)]
    ratios = [pooled_hit_ratio(reqs, 4, c) for c in (1, 2, 4, 8, 64)]
    assert ratios == sorted(ratios)
    assert ratios[-1] == pytest.approx(ideal_hit_ratio(reqs, 4))


def test_load_imbalance() -> None:
    assert load_imbalance([2.0, 2.0, 2.0]) == 1.0
    assert load_imbalance([3.0, 1.0, 2.0]) == pytest.approx(1.5)
    assert load_imbalance([0.0, 0.0]) == 1.0
    assert load_imbalance([]) == 1.0


def test_alone_ttft_chunks_the_uncached_part() -> None:
    timing = TimingModel(get_profile("tiny"))
    want = timing.prefill_time([(32, 8)]) + timing.prefill_time([(10, 40)])
    assert alone_ttft_s(timing, 50, 8, 32) == pytest.approx(want)
    assert alone_ttft_s(timing, 50, 50, 32) == 0.0


def test_per_request_hits_are_what_the_ratios_add_up() -> None:
    reqs = [([1, 2], 3), ([3, 4], 3), ([1, 2], 3), ([3, 4], 3)]
    assert pooled_hits(reqs, 1, capacity_blocks=3) == [0, 0, 1, 1]
    assert ideal_hits(reqs, 1) == [0, 0, 2, 2]


def test_gpu_seconds_floor_by_hand() -> None:
    timing = TimingModel(get_profile("llama-3.1-8b-h100"))
    prefill = timing.compute_seconds(timing.prefill_flops(1000, 24))
    # 4 output tokens: the prefill emits the first, decode steps read 1025, 1026, 1027 tokens
    decode = timing.kv_read_seconds(1025 + 1026 + 1027)
    assert gpu_seconds_floor(timing, [(1024, 4, 24)]) == pytest.approx(prefill + decode)
    assert gpu_seconds_floor(timing, [(1024, 1, 24)]) == pytest.approx(prefill)
    two = gpu_seconds_floor(timing, [(1024, 4, 24), (512, 1, 0)])
    assert two == pytest.approx(
        prefill + decode + timing.compute_seconds(timing.prefill_flops(512, 0))
    )
    assert gpu_seconds_floor(timing, [(1024, 4, 512)]) < gpu_seconds_floor(timing, [(1024, 4, 0)])


@given(
    cached=st.integers(0, 50_000),
    chunks=st.lists(st.integers(1, 8192), min_size=1, max_size=8),
)
def test_prefill_flops_do_not_depend_on_chunking(cached: int, chunks: list[int]) -> None:
    """What the floor rests on: the engine prefills in chunks, the floor in one piece."""
    timing = TimingModel(get_profile("llama-3.1-8b-h100"))
    done, total = cached, 0.0
    for n in chunks:
        total += timing.prefill_flops(n, done)
        done += n
    assert total == pytest.approx(timing.prefill_flops(sum(chunks), cached), rel=1e-9)


def test_work_ceiling_speed() -> None:
    # 8 engines, requests arriving over 100 s at 1x needing 400 engine seconds: past 2x the
    # cluster cannot keep up even busy all the time
    assert work_ceiling_speed(400.0, 8, 100.0) == pytest.approx(2.0)
    assert work_ceiling_speed(0.0, 8, 100.0) == math.inf
    assert work_ceiling_speed(400.0, 8, 0.0) == math.inf  # all at once: no rate to keep up with
