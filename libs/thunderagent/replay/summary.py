"""One run's JSON summary from its records (the per-policy, per-speed entry of the report)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from thunderagent.engine import TimingModel
from thunderagent.replay.metrics import load_imbalance
from thunderagent.replay.records import Record, ReplayResult
from thunderagent.stats import percentile, summary


def alone_ttft_s(timing: TimingModel, prompt_len: int, cached: int, chunk: int) -> float:
    """TTFT of a request alone on an idle engine that holds ``cached`` of its prompt tokens:
    its uncached prompt prefilled in ``chunk``-token steps. TTFT minus this is time spent
    waiting behind or beside other requests."""
    t, done = 0.0, cached
    while done < prompt_len:
        n = min(chunk, prompt_len - done)
        t += timing.prefill_time([(n, done)])
        done += n
    return t


def summarize(
    result: ReplayResult,
    *,
    policy: str,
    speed: float,
    timing: TimingModel,
    chunk: int,
    ideal: float,
    pooled: float,
    wall_s: float,
    slo_ms: float = math.inf,
) -> dict:
    """The JSON entry for one (policy, speed) run; latencies in ms. Every request is accounted
    for (``requests == completed + rejected + in_flight``); for the SLO, a request that never
    got a first token (rejected, or still waiting when a bounded run stopped) counts as one
    that missed it."""
    recs: Sequence[Record] = result.records
    done = [r for r in recs if r.status == "completed"]
    rejected = sum(r.status == "rejected" for r in recs)
    if len(done) + rejected + result.in_flight != len(recs):
        raise AssertionError(
            f"{policy} x{speed}: {len(recs)} requests != {len(done)} completed + "
            f"{rejected} rejected + {result.in_flight} in flight"
        )
    start = min((r.arrival for r in recs), default=0.0)
    span = result.makespan - start
    return {
        "policy": policy,
        "speed": speed,
        "requests": len(recs),
        "completed": len(done),
        "rejected": rejected,
        "in_flight": result.in_flight,
        "rejected_reasons": dict(Counter(r.reason for r in recs if r.status == "rejected")),
        **_latency_entries(result, done, span, rejected, timing, chunk, slo_ms),
        **_work_entries(result, done, span, ideal, pooled),
        "wall_s": wall_s,
    }


def _latency_entries(
    result: ReplayResult,
    done: list[Record],
    span: float,
    rejected: int,
    timing: TimingModel,
    chunk: int,
    slo_ms: float,
) -> dict:
    """TTFT, SLO and queueing entries; a request with no first token misses the SLO."""
    ttft_all = [
        (r.first_token - r.arrival) * 1000.0 if not math.isnan(r.first_token) else math.inf
        for r in result.records
    ]
    waits = [
        r.first_token - r.arrival - alone_ttft_s(timing, r.prompt_tokens, r.cached_tokens, chunk)
        for r in done
    ]
    return {
        "ttft_p99_all_ms": percentile(ttft_all, 99),
        "slo_met": percentile(ttft_all, 99) <= slo_ms and not rejected and not result.in_flight,
        "goodput_rps": sum(t <= slo_ms for t in ttft_all) / span if span > 0 else 0.0,
        "ttft_ms": summary([r.first_token - r.arrival for r in done], 1000.0),
        "e2e_ms": summary([r.finish - r.arrival for r in done], 1000.0),
        "queue_ms": summary(waits, 1000.0),
    }


def _work_entries(
    result: ReplayResult, done: list[Record], span: float, ideal: float, pooled: float
) -> dict:
    """Throughput, prefix-cache hits against the ideal, and how the engines' work was spread."""
    prompt = sum(r.prompt_tokens for r in done)
    cached = sum(r.cached_tokens for r in done)
    recompute = sum(max(0, r.best_overlap_tokens - r.cached_tokens) for r in done)
    out_tokens = sum(r.completion_tokens for r in done)
    return {
        "output_tok_s": out_tokens / span if span > 0 else 0.0,
        "prefix_hit_ratio": cached / prompt if prompt else 0.0,
        "ideal_hit_ratio": ideal,
        "pooled_hit_ratio": pooled,
        "prefill_recompute_ratio": recompute / prompt if prompt else 0.0,
        "load_imbalance": load_imbalance(result.busy_s),
        "busy_s": result.busy_s,
        "preemptions": sum(r.preemptions for r in result.records),
        "engine_steps": result.steps,
        "scheduler": dict(result.sched_stats),  # its counters: credit, holds, spills, pauses
        "makespan_s": result.makespan,
    }
