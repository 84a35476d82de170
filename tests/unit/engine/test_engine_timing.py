"""Timing model against hand-computed values for a made-up profile."""

import dataclasses
import math

import pytest

from thunderagent.engine.profiles import (
    PRESETS,
    Efficiency,
    EngineSettings,
    GpuSpec,
    ModelSpec,
    Profile,
    get_profile,
)
from thunderagent.engine.timing import TimingModel

# P = 1e9 params, 2 layers, hidden 100, 1 KV head of dim 10, bf16:
# kv bytes/token = 2 * 2 * 1 * 10 * 2 = 80; weights = 2e9 bytes.
# Effective: 1e12 * 0.5 = 5e11 FLOP/s, 1e10 * 0.5 = 5e9 B/s, overhead 1 ms.
TOY = Profile(
    name="toy",
    model=ModelSpec(
        name="toy", params=1e9, layers=2, hidden=100, q_heads=10, kv_heads=1, head_dim=10
    ),
    gpu=GpuSpec(name="toy", flops=1e12, hbm_bw=1e10, mem_bytes=10e9, pcie_bw=1e9),
    eff=Efficiency(mfu=0.5, bw_eff=0.5, step_overhead_s=0.001),
    engine=EngineSettings(block_size=16, mem_fraction_static=0.9),
)


def test_kv_bytes_and_capacity() -> None:
    assert TOY.kv_bytes_per_token == 80
    assert TOY.kv_bytes_per_block == 1280
    # (10e9 * 0.9 - 2e9) / 1280 = 5_468_750
    assert TOY.capacity_blocks == 5_468_750


def test_prefill_time_hand_computed() -> None:
    t = TimingModel(TOY)
    # flops = 2*1e9*100 + 4*2*100*(100*0 + 100*100/2) = 2e11 + 4e6
    assert t.prefill_flops(100, 0) == pytest.approx(2.00004e11)
    # compute 2.00004e11/5e11 = 0.400008 s; memory (2e9 + 100*80)/5e9 = 0.4000016 s
    assert t.prefill_time([(100, 0)]) == pytest.approx(0.400008 + 0.001)
    # with 1000 cached: attention 4*2*100*(100*1000 + 5000) = 8.4e7 more FLOPs
    assert t.prefill_time([(100, 1000)]) == pytest.approx((2e11 + 8.4e7) / 5e11 + 0.001)


def test_prefill_memory_bound_and_host_load() -> None:
    t = TimingModel(TOY)
    # 1 token over 1e6 cached: compute (2e9 + 4*2*100*(1e6 + 0.5))/5e11 = 0.0056 s,
    # memory (2e9 + 1_000_001*80)/5e9 = 0.4160002 s -> memory bound
    assert t.prefill_time([(1, 1_000_000)]) == pytest.approx(0.4160002 + 0.001)
    # 10 host blocks * 1280 B / 1e9 B/s = 1.28e-5 s extra
    assert t.load_time(10) == pytest.approx(1.28e-5)
    base = t.prefill_time([(100, 0)])
    assert t.prefill_time([(100, 0)], host_load_blocks=10) == pytest.approx(base + 1.28e-5)


def test_decode_time_hand_computed() -> None:
    t = TimingModel(TOY)
    # memory (2e9 + 1000*80)/5e9 = 0.400016 > compute 2e9*4/5e11 = 0.016
    assert t.decode_time(4, 1000) == pytest.approx(0.400016 + 0.001)
    # batch 200: compute 2e9*200/5e11 = 0.8 > memory
    assert t.decode_time(200, 1000) == pytest.approx(0.8 + 0.001)


@pytest.mark.parametrize(
    ("batch", "context", "steps"),
    [(1, 10, 1), (4, 1000, 50), (200, 0, 7), (240, 10_000_000, 300), (250, 24_000_000, 100)],
)
def test_decode_run_time_matches_step_sum(batch: int, context: int, steps: int) -> None:
    t = TimingModel(TOY)
    looped = sum(t.decode_time(batch, context + i * batch) for i in range(steps))
    assert t.decode_run_time(batch, context, steps) == pytest.approx(looped, rel=1e-9)


def test_decode_steps_until_stops_at_first_boundary_after_budget() -> None:
    t = TimingModel(TOY)
    step = t.decode_time(4, 1000)
    k = t.decode_steps_until(4, 1000, budget_s=2.5 * step, max_steps=100)
    assert k == 3
    assert t.decode_steps_until(4, 1000, budget_s=1e9, max_steps=100) == 100
    assert t.decode_steps_until(4, 1000, budget_s=0.0, max_steps=100) == 1
    assert math.isclose(t.decode_run_time(4, 1000, 0), 0.0)


def test_presets_are_sane() -> None:
    assert set(PRESETS) >= {"tiny", "llama-3.1-8b-h100", "llama-3.1-70b-h200-tp2"}
    p8 = get_profile("llama-3.1-8b-h100")
    assert p8.kv_bytes_per_token == 131072  # 128 KiB per token for Llama-3.1-8B in bf16
    assert 400_000 < p8.capacity_tokens < 500_000
    p70 = get_profile("llama-3.1-70b-h200-tp2")
    assert p70.kv_bytes_per_token == 327680
    assert p70.capacity_tokens > 200_000
    assert get_profile("tiny").capacity_blocks == 32
    with pytest.raises(ValueError, match="unknown engine profile"):
        get_profile("nope")


def test_a_prefill_priced_by_its_new_tokens_alone_ignores_the_cached_prefix() -> None:
    profile = get_profile("llama-3.1-8b-h100")
    paid = TimingModel(profile)
    alone = TimingModel(
        dataclasses.replace(profile, eff=dataclasses.replace(profile.eff, prefix_attention=False))
    )
    assert paid.prefill_time([(512, 30_720)]) > 1.9 * paid.prefill_time([(512, 0)])
    assert alone.prefill_time([(512, 30_720)]) == alone.prefill_time([(512, 0)])
    assert alone.prefill_time([(512, 0)]) == paid.prefill_time([(512, 0)])
