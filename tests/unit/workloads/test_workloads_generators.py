"""Trace generators: seeded, Mooncake invariants, the structure each kind promises."""

from __future__ import annotations

import itertools
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

import pytest

from thunderagent.engine import get_profile
from thunderagent.replay import load_trace
from thunderagent.replay.metrics import cache_bounds
from thunderagent.workloads.mooncake import TraceRow, est_service
from thunderagent.workloads.tracegen import KINDS, ParamError, generate

SMALL = {"agent": 0.15, "bursty": 0.25, "hotspot": 1.0, "coding": 0.25, "rag": 0.1}
"""Scales that keep each test fast (the hot spot needs its whole timeline)."""
HOTSPOT_SMALL = {
    "duration_s": 200.0,
    "hot_start_s": 60.0,
    "hot_duration_s": 40.0,
    "hot_clients": 60,
    "hot_think_s": 6.0,
}


def _gen(kind: str, seed: int = 0, **over):
    if kind == "hotspot":
        over = {**HOTSPOT_SMALL, **over}
    return generate(kind, seed, SMALL[kind], over)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_same_seed_same_trace_other_seed_other_trace(kind: str) -> None:
    a, b, c = _gen(kind, 3)[1], _gen(kind, 3)[1], _gen(kind, 4)[1]
    assert a.rows == b.rows and a.meta == b.meta
    assert a.rows != c.rows


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("block_size", [512, 64])
def test_mooncake_invariants(kind: str, block_size: int) -> None:
    params, trace = _gen(kind, 1, block_size=block_size)
    rows = trace.rows
    assert len(rows) > 50
    assert rows[0].timestamp_ms == 0
    assert all(a.timestamp_ms <= b.timestamp_ms for a, b in itertools.pairwise(rows))
    for r in rows:
        assert len(r.hash_ids) == math.ceil(r.input_length / block_size)
        assert r.input_length >= 1 and r.output_length >= 1
        assert r.input_length + r.output_length <= params.max_context_tokens
    # a partial last block is never shared: its id appears in exactly one row
    count = defaultdict(int)
    for r in rows:
        count.update({h: count[h] + 1 for h in r.hash_ids})
    tails = [r.hash_ids[-1] for r in rows if r.input_length % block_size]
    assert all(count[t] == 1 for t in tails)


def _programs(rows: list[TraceRow]) -> dict[str, list[TraceRow]]:
    out: dict[str, list[TraceRow]] = defaultdict(list)
    for r in rows:
        out[r.program_id].append(r)
    return out


def test_agent_steps_extend_the_previous_step_after_its_service_and_a_pause() -> None:
    params, trace = _gen("agent", 2)
    bs = params.block_size
    programs = _programs(trace.rows)
    assert len(programs) == params.programs
    tool = params.tool_prompt_tokens // bs
    first = next(iter(programs.values()))[0]
    for steps in programs.values():
        assert [r.step for r in steps] == list(range(len(steps)))
        assert steps[0].hash_ids[:tool] == first.hash_ids[:tool]  # one shared tool prompt
        for prev, cur in itertools.pairwise(steps):
            full = prev.input_length // bs
            assert cur.hash_ids[:full] == prev.hash_ids[:full]
            assert cur.input_length > prev.input_length + prev.output_length
            gap = (cur.timestamp_ms - prev.timestamp_ms) / 1000
            floor = est_service(
                0,
                prev.output_length,
                params.est_prefill_tokens_per_s,
                params.est_s_per_output_token,
            )
            assert gap >= floor - 0.001  # issue + service + a (positive) pause


def test_agent_default_shape_and_pooled_hit_ratio_near_0_9(tmp_path: Path) -> None:
    """The default: 400 programs, ~3.9k steps, pooled hit ratio in [0.88, 0.92] (8 x 8B/H100)."""
    params, trace = generate("agent", 0)
    out = tmp_path / "agent.jsonl"
    out.write_text("".join(json.dumps(r.as_json()) + "\n" for r in trace.rows))
    capacity = 8 * get_profile("llama-3.1-8b-h100").with_engine(block_size=512).capacity_blocks
    bounds = cache_bounds(load_trace(out, None, params.block_size), params.block_size, capacity)
    ideal, pooled = bounds["ideal"][0], bounds["pooled"][0]
    assert params.programs == 400 and len(_programs(trace.rows)) == 400
    assert 3600 <= len(trace.rows) <= 4200
    assert 0.88 <= pooled <= 0.92 and pooled <= ideal + 1e-9


def _cv(rows: list[TraceRow]) -> float:
    gaps = [b.timestamp_ms - a.timestamp_ms for a, b in itertools.pairwise(rows)]
    return statistics.pstdev(gaps) / statistics.mean(gaps)


def test_bursty_arrivals_are_bursty_and_bursts_share_documents() -> None:
    params, trace = generate("bursty", 0)
    assert _cv(trace.rows) > 2.0  # Poisson is 1
    calm = generate("bursty", 0, 1.0, {"burst_size_max": 1})[1]  # bursts of one: Poisson
    assert _cv(calm.rows) < 1.3
    # many requests within one second that share a prefix longer than the system prompt
    sys_blocks = params.system_prompt_tokens // params.block_size
    by_prefix: dict[tuple, list[int]] = defaultdict(list)
    for r in trace.rows:
        if len(r.hash_ids) > sys_blocks + 2:
            by_prefix[tuple(r.hash_ids[: sys_blocks + 2])].append(r.timestamp_ms)
    grouped = [ts for ts in by_prefix.values() if len(ts) >= 4 and max(ts) - min(ts) <= 1000]
    assert len(grouped) >= trace.meta["bursts"]


def test_bursty_prompt_lengths_are_heavy_tailed_and_capped() -> None:
    params, trace = generate("bursty", 1)
    lengths = sorted(r.input_length for r in trace.rows)
    median, p99 = lengths[len(lengths) // 2], lengths[int(0.99 * len(lengths))]
    assert p99 > 5 * median
    assert lengths[-1] <= params.max_context_tokens


def test_hotspot_hot_requests_share_the_hot_prefix_inside_the_window() -> None:
    params, trace = _gen("hotspot", 5)
    meta, bs = trace.meta, params.block_size
    hot = [r for r in trace.rows if r.hot]
    cold = [r for r in trace.rows if not r.hot]
    n = meta["hot_prefix_blocks"]
    assert n == params.hot_prefix_tokens // bs and len(hot) == meta["hot_requests"] > 30
    prefix = hot[0].hash_ids[:n]
    assert all(r.hash_ids[:n] == prefix for r in hot)
    assert all(meta["hot_start_s"] * 1000 <= r.timestamp_ms < meta["hot_end_s"] * 1000 for r in hot)
    assert not set(prefix) & {h for r in cold for h in r.hash_ids}
    ramp = [r for r in hot if r.timestamp_ms < (meta["hot_start_s"] + params.hot_ramp_s) * 1000]
    assert len(ramp) >= params.hot_clients  # every client starts within the ramp
    window = meta["hot_end_s"] - meta["hot_start_s"]
    cold_rate = len(cold) / (trace.rows[-1].timestamp_ms / 1000)
    assert len(hot) / window > 3 * cold_rate


def test_hotspot_lead_in_queries_the_prefix_before_the_window_and_changes_nothing_else() -> None:
    _, plain = _gen("hotspot", 5)
    _, led = _gen("hotspot", 5, hot_lead_s=30.0, hot_lead_gap_s=3.0)
    n = plain.meta["hot_prefix_blocks"]
    start = led.meta["hot_start_s"] * 1000
    prefix = next(r for r in led.rows if r.hot).hash_ids[:n]
    lead = [r for r in led.rows if not r.hot and r.hash_ids[:n] == prefix]
    assert 3 <= len(lead) <= 30
    assert all(start - 30_000 <= r.timestamp_ms < start for r in lead)
    key = lambda r: (r.timestamp_ms, r.hash_ids)  # noqa: E731
    assert sorted(map(key, plain.rows)) == sorted(key(r) for r in led.rows if r not in lead)


def test_hotspot_background_conversations_grow() -> None:
    params, trace = _gen("hotspot", 6)
    bs = params.block_size
    grown = 0
    rows = [r for r in trace.rows if not r.hot]
    firsts = {tuple(r.hash_ids[: r.input_length // bs]): r for r in rows}
    for r in rows:
        for k in range(r.input_length // bs - 1, params.system_prompt_tokens // bs + 1, -1):
            if tuple(r.hash_ids[:k]) in firsts and firsts[tuple(r.hash_ids[:k])] is not r:
                grown += 1
                break
    assert grown > len(rows) // 5  # later turns extend earlier ones


@pytest.mark.parametrize(
    ("kind", "over", "field"),
    [
        ("agent", {"nope": 1}, "nope"),
        ("agent", {"programs": 0}, "programs"),
        ("bursty", {"doc_reuse": 1.5}, "doc_reuse"),
        ("hotspot", {"hot_prefix_tokens": 40000}, "hot_prefix_tokens"),
        ("agent", {"steps_min": 9, "steps_max": 3}, "steps_min"),
        ("bursty", {"duration_s": "long"}, "duration_s"),
        ("hotspot", {"duration_s": 5.0}, "hot_start_s"),  # the window ran to 360 s regardless
        ("hotspot", {"hot_start_s": 590.0}, "hot_start_s"),
        ("coding", {"repo_tokens_min": 70000}, "repo_tokens_min"),
        ("coding", {"repo_tokens_max": 130000}, "repo_tokens_max"),
        ("rag", {"question_tokens_min": 500}, "question_tokens_min"),
        ("rag", {"rate_swing": -0.5}, "rate_swing"),
        ("mystery", {}, "kind"),
    ],
)
def test_bad_parameters_name_the_field(kind: str, over: dict, field: str) -> None:
    with pytest.raises(ParamError) as err:
        generate(kind, 0, 1.0, over)
    assert err.value.field == field


def test_scale_grows_the_trace_at_the_same_rate() -> None:
    small = generate("bursty", 0, 0.5)[1].rows
    assert 280_000 < small[-1].timestamp_ms <= 301_000  # 300 s, the last burst may spill 1 s
    assert generate("agent", 0, 0.5)[0].programs == 200
    hot = generate("hotspot", 0, 2.0)[0]
    assert (hot.hot_start_s, hot.hot_duration_s, hot.duration_s) == (480.0, 240.0, 1200.0)
