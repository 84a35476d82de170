"""Scheduler comparison in virtual time: priority/preemption, window, PD cap, agent programs.

    thunderagent bench sched [--json FILE] [--quick] [--workers 8] [--profile NAME]
        [--seed S] [--link-gbps 25] [--only priority,window,pd,programs]

Four scenarios, each replaying one seeded workload (``thunderagent.workloads``) through fresh
simulated engines, the same KV-aware routing policy (``thunder``) and each scheduler variant of
``thunderagent.scheduling.registry`` in turn. ``--quick`` shrinks every workload (CI smoke run).
Latencies in ms; the JSON keeps every figure printed and more.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from collections.abc import Callable, Sequence

from thunderagent.bench.jsonfile import dumps, write_json
from thunderagent.bench.replay import code_version
from thunderagent.engine import Profile, get_profile
from thunderagent.engine.profiles import PRESETS
from thunderagent.engine.timing import TimingModel
from thunderagent.replay import Record, ReplayConfig, ReplayResult
from thunderagent.replay.summary import alone_ttft_s
from thunderagent.replay.workload_driver import run_open, run_programs
from thunderagent.shell.argtypes import at_least, output_file
from thunderagent.stats import percentile
from thunderagent.workloads import AgentParams, AgentWorkload, MixedParams, MixedWorkload

ROUTING = "thunder"
"""One KV-aware routing policy for every run: only the scheduler changes."""


@dataclasses.dataclass(frozen=True, slots=True)
class Setup:
    profile: Profile
    workers: int
    seed: int
    quick: bool
    link_bytes_per_s: float
    programs: int | None = None
    """Agent programs in the programs scenario (None: 256 per 8 workers, 96 with --quick)."""


def _cfg(s: Setup, scheduler: str, **kw) -> ReplayConfig:
    return ReplayConfig(
        profile=s.profile, policy=ROUTING, workers=s.workers, scheduler=scheduler, seed=s.seed, **kw
    )


def _ms(values: Sequence[float], q: float) -> float:
    return round(percentile(values, q) * 1000.0, 1)


def _ttft(recs: Sequence[Record]) -> list[float]:
    return [r.first_token - r.arrival for r in recs if r.status == "completed"]


def _e2e(recs: Sequence[Record]) -> list[float]:
    return [r.finish - r.arrival for r in recs if r.status == "completed"]


def _common(result: ReplayResult, wall: float) -> dict:
    recs = result.records
    done = [r for r in recs if r.status == "completed"]
    span = result.makespan - min((r.arrival for r in recs), default=0.0)
    prompt = sum(r.prompt_tokens for r in done)
    return {
        "requests": len(recs),
        "completed": len(done),
        "rejected": sum(r.status == "rejected" for r in recs),
        "output_tok_s": round(sum(r.completion_tokens for r in done) / span, 1) if span else 0.0,
        "hit_ratio": round(sum(r.cached_tokens for r in done) / prompt, 4) if prompt else 0.0,
        "prefill_tokens": result.prefill_tokens,
        "engine_retractions": sum(r.preemptions - r.sched_preemptions for r in recs),
        "makespan_s": round(result.makespan, 2),
        "wall_s": round(wall, 2),
    }


def _timed(fn: Callable[[], ReplayResult]) -> tuple[ReplayResult, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


# ---- scenario 1: priority, SRPT, preemption -----------------------------------------------
def priority(s: Setup) -> dict:
    """Open-loop short/long mix at high load; shorts are class 0, longs class 1."""
    mix = MixedParams(
        requests=600 if s.quick else 3000,
        rate_per_s=50.0 * s.workers / 8,
        long_fraction=0.2,
        estimate_noise=0.5,
    )
    reqs = MixedWorkload(mix, seed=s.seed).requests()
    out = {}
    for name in ("fcfs", "priority_srpt", "preempt"):
        res, wall = _timed(lambda n=name: run_open(_cfg(s, n, scheduler_params=_CAP), reqs))
        short = [r for r in res.records if r.request_id.startswith("short")]
        long_ = [r for r in res.records if r.request_id.startswith("long")]
        resumed = sum(r.resume_prompt_tokens for r in res.records)
        out[name] = {
            "short_ttft_p50_ms": _ms(_ttft(short), 50),
            "short_ttft_p99_ms": _ms(_ttft(short), 99),
            "long_ttft_p50_ms": _ms(_ttft(long_), 50),
            "long_ttft_p99_ms": _ms(_ttft(long_), 99),
            "short_e2e_p50_ms": _ms(_e2e(short), 50),
            "long_e2e_p50_ms": _ms(_e2e(long_), 50),
            "long_e2e_p99_ms": _ms(_e2e(long_), 99),
            "preemptions": sum(r.sched_preemptions for r in res.records),
            "resume_hit_ratio": (
                round(sum(r.resume_cached_tokens for r in res.records) / resumed, 4)
                if resumed
                else None
            ),
            **_common(res, wall),
        }
    return out


_CAP = {"max_running": 32}
"""Running cap per worker for the priority scenario (all three variants alike): requests wait
in the scheduler, where their order is decided, instead of in the engines' FCFS queues."""


# ---- scenario 2: scheduling window and prefix grouping ------------------------------------
def window(s: Setup) -> dict:
    """Bursty arrivals sharing a few long uncached prefixes: grouping has material."""
    mix = MixedParams(
        requests=400 if s.quick else 1000,
        rate_per_s=60.0 * s.workers / 8,
        long_fraction=0.0,
        short_prompt_blocks=(4, 32),
        short_output_tokens=(16, 128),
        shared_prefix_fraction=0.8,
        shared_prefixes=200,
        shared_prefix_blocks=256,
    )
    reqs = MixedWorkload(mix, seed=s.seed + 1).requests()
    out = {}
    for key, name in (
        ("none", "window_none"),
        ("fixed_100ms", "window_fixed"),
        ("adaptive", "window_adaptive"),
    ):
        res, wall = _timed(lambda n=name: run_open(_cfg(s, n), reqs))
        st = res.sched_stats
        out[key] = {
            "ttft_p50_ms": _ms(_ttft(res.records), 50),
            "ttft_p99_ms": _ms(_ttft(res.records), 99),
            "prefill_tokens_saved": st.get("prefill_tokens_saved", 0),
            "grouped_requests": st.get("grouped_requests", 0),
            **_common(res, wall),
        }
    return out


# ---- scenario 3: PD disaggregation, in-flight transfer cap --------------------------------
def pd(s: Setup) -> dict:
    """Half the workers prefill, half decode; long prompts make transfers matter. Each scheduler
    with the workers' hand-off (the prefill's first token streams at once) and with SGLang's own
    PD (``sglang_*``: the decode engine reserves the prompt's pages before the prefill starts
    and streams every token; ``thunderagent.replay.pd``)."""
    n_prefill = max(1, s.workers // 2)
    roles = ["prefill"] * n_prefill + ["decode"] * (s.workers - n_prefill)
    mix = MixedParams(
        requests=400 if s.quick else 1500,
        rate_per_s=30.0 * s.workers / 8,
        long_fraction=0.3,
        long_prompt_blocks=(128, 512),
        long_output_tokens=(128, 512),
        long_priority=0,
    )
    reqs = MixedWorkload(mix, seed=s.seed + 2).requests()
    out = {}
    runs = (
        ("uncapped", "pd_uncapped", "workers"),
        ("capped", "pd_capped", "workers"),
        ("sglang_uncapped", "pd_uncapped", "sglang"),
        ("sglang_capped", "pd_capped", "sglang"),
    )
    for key, name, via in runs:
        cfg = _cfg(s, name, roles=roles, link_bytes_per_s=s.link_bytes_per_s, pd_via=via)
        out[key] = _pd_row(*_timed(lambda c=cfg: run_open(c, reqs)))
    out["roles"] = {"prefill": n_prefill, "decode": s.workers - n_prefill}
    out["link_gb_s"] = s.link_bytes_per_s / 1e9
    return out


def _pd_row(res: ReplayResult, wall: float) -> dict:
    waits = res.bootstrap_waits_s
    return {
        "ttft_p50_ms": _ms(_ttft(res.records), 50),
        "ttft_p99_ms": _ms(_ttft(res.records), 99),
        "e2e_p50_ms": _ms(_e2e(res.records), 50),
        "e2e_p99_ms": _ms(_e2e(res.records), 99),
        "transfer_p50_ms": _ms(res.transfers_s, 50),
        "transfer_p99_ms": _ms(res.transfers_s, 99),
        "pd_held_polls": res.sched_stats.get("pd_held_polls", 0),
        "bootstrap_waits": sum(w > 0 for w in waits),
        "bootstrap_wait_p99_ms": _ms(waits, 99) if waits else None,
        **_common(res, wall),
    }


# ---- scenario 4: agent programs -----------------------------------------------------------
def _rate_to_share(done: Sequence[Record], share: float) -> float:
    """Steps per minute until ``share`` of the steps had finished: the rate without the last
    few programs, whose chains of tool pauses set the makespan whatever the scheduler does."""
    if not done:
        return 0.0
    ends = sorted(r.finish for r in done)
    k = max(1, math.ceil(share * len(ends)))
    span = ends[k - 1] - min(r.arrival for r in done)
    return round(k / span * 60.0, 1) if span > 0 else 0.0


def programs(s: Setup) -> dict:
    """Many closed-loop programs at once: their contexts oversubscribe the cluster's KV."""
    params = AgentParams(
        programs=s.programs or (96 if s.quick else 256) * s.workers // 8,
        steps_range=(4, 8) if s.quick else (6, 14),
        start_gap_s=0.05,
        system_blocks=128,
        task_blocks_range=(256, 1024),
        observation_blocks_range=(32, 256),
        output_tokens_range=(128, 512),
        tool_pause_median_s=4.0,
    )
    out = {}
    runs = (
        ("unaware", "thunder", {"programs": False}),
        ("aware", "thunder", {}),
        ("direct", "direct", {}),
    )
    for key, name, knobs in runs:
        wl = AgentWorkload(params, seed=s.seed + 3)
        res, wall = _timed(
            lambda n=name, k=knobs, w=wl: run_programs(_cfg(s, n, scheduler_params=k), w)
        )
        done = [r for r in res.records if r.status == "completed"]
        span = res.makespan
        st = res.sched_stats
        out[key] = {
            "scheduler": name if not knobs else f"{name} (programs off)",
            "steps_per_min": round(len(done) / span * 60.0, 1) if span else 0.0,
            "steps_per_min_95": _rate_to_share(done, 0.95),
            "recomputed_tokens": _recomputed(res.records, params.block_size),
            "program_pauses": st.get("program_pauses", 0),
            "program_resumes": st.get("program_resumes", 0),
            "program_rescues": st.get("program_rescues", 0),
            "ttft_p50_ms": _ms(_ttft(res.records), 50),
            "ttft_p99_ms": _ms(_ttft(res.records), 99),
            **_common(res, wall),
        }
    kv = s.profile.capacity_tokens * s.workers
    out["programs"] = params.programs
    out["cluster_kv_tokens"] = kv
    out["makespan_floor_s"] = round(makespan_floor(params, s.seed + 3, s.profile), 2)
    return out


def makespan_floor(params: AgentParams, seed: int, profile: Profile) -> float:
    """The end no scheduler can bring forward: each program alone on an idle engine (its
    previous prompt, or the system prompt, cached; its prefill in the engine's chunks; its
    decode at batch 1), its own tool pauses between steps. A step in a batch takes at least
    as long as alone, and each program draws from its own stream, so these are the steps every
    variant runs: the makespan of the longest chain bounds steps/min from above."""
    timing, chunk = TimingModel(profile), profile.engine.chunked_prefill_size
    wl = AgentWorkload(params, seed=seed)
    todo, end = wl.start(), 0.0
    cached = dict.fromkeys((r.program_id for r in todo), params.system_blocks * params.block_size)
    while todo:
        r = todo.pop()
        have = min(cached[r.program_id], r.prompt_tokens - 1)
        t = r.issue_at + alone_ttft_s(timing, r.prompt_tokens, have, chunk)
        t += timing.decode_run_time(1, r.prompt_tokens, r.output_tokens - 1)
        cached[r.program_id] = r.prompt_tokens
        nxt = wl.on_step_done(r.request_id, t)
        if nxt is None:
            end = max(end, t)
        else:
            todo.append(nxt)
    return end


def _recomputed(recs: Sequence[Record], block_size: int) -> int:
    """Prompt tokens an earlier step of the same program had already computed (its prompt; the
    step's prompt extends it) that were not found cached: KV the engines had to redo."""
    last: dict[str, int] = {}
    total = 0
    for r in sorted(recs, key=lambda r: r.arrival):
        if r.status != "completed" or r.request_id.rsplit("-s", 1)[0] is None:
            continue
        prog = r.request_id.rsplit("-s", 1)[0]
        prev = last.get(prog)
        if prev is not None:
            usable = min(prev, (r.prompt_tokens - 1) // block_size * block_size)
            total += max(0, usable - r.cached_tokens)
        last[prog] = r.prompt_tokens // block_size * block_size
    return total


SCENARIOS: dict[str, Callable[[Setup], dict]] = {
    "priority": priority,
    "window": window,
    "pd": pd,
    "programs": programs,
}


# ---- output -------------------------------------------------------------------------------
TABLES = {
    "priority": (
        "short_ttft_p50_ms",
        "short_ttft_p99_ms",
        "long_ttft_p99_ms",
        "long_e2e_p50_ms",
        "preemptions",
        "resume_hit_ratio",
    ),
    "window": (
        "ttft_p50_ms",
        "ttft_p99_ms",
        "prefill_tokens_saved",
        "grouped_requests",
        "hit_ratio",
    ),
    "pd": (
        "output_tok_s",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "e2e_p50_ms",
        "transfer_p99_ms",
        "pd_held_polls",
        "bootstrap_waits",
    ),
    "programs": (
        "steps_per_min",
        "steps_per_min_95",
        "hit_ratio",
        "recomputed_tokens",
        "prefill_tokens",
        "program_pauses",
        "program_rescues",
        "engine_retractions",
    ),
}


def table(name: str, results: dict) -> str:
    cols = TABLES[name]
    lines = [f"### {name}", "", "| variant | " + " | ".join(cols) + " | wall s |"]
    lines.append("|" + "---|" * (len(cols) + 2))
    for variant, row in results.items():
        if not isinstance(row, dict) or "wall_s" not in row:
            continue
        cells = [_fmt(row.get(c)) for c in cols]
        lines.append(f"| {variant} | " + " | ".join(cells) + f" | {row['wall_s']:.1f} |")
    return "\n".join(lines)


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return "-" if math.isnan(v) else f"{v:.4g}" if abs(v) < 10 else f"{v:.0f}"
    return "-" if v is None else str(v)


def targets(doc: dict) -> dict:
    """The issue's targets, checked on this run's figures."""
    out: dict = {}
    pr = doc.get("priority")
    if pr:
        base, best = (
            pr["fcfs"],
            min(("priority_srpt", "preempt"), key=lambda k: pr[k]["short_ttft_p99_ms"]),
        )
        gain = base["short_ttft_p99_ms"] / max(pr[best]["short_ttft_p99_ms"], 1e-9)
        slow = pr[best]["long_e2e_p50_ms"] / max(base["long_e2e_p50_ms"], 1e-9) - 1
        out["short_ttft_p99_gain"] = {"variant": best, "x": round(gain, 2), "met": gain >= 3.0}
        out["long_e2e_p50_change"] = {
            "variant": best,
            "pct": round(100 * slow, 1),
            "met": slow <= 0.10,
        }
    pg = doc.get("programs")
    if pg:
        x = pg["aware"]["steps_per_min"] / max(pg["unaware"]["steps_per_min"], 1e-9)
        out["programs_steps_per_min_gain"] = {"x": round(x, 3), "met": x >= 1.5}
        x95 = pg["aware"]["steps_per_min_95"] / max(pg["unaware"]["steps_per_min_95"], 1e-9)
        out["programs_steps_per_min_95_gain"] = {"x": round(x95, 2)}
        ceiling = pg["aware"]["completed"] / pg["makespan_floor_s"] * 60.0
        out["programs_ceiling_gain"] = {
            "x": round(ceiling / max(pg["unaware"]["steps_per_min"], 1e-9), 2),
            "makespan_floor_s": pg["makespan_floor_s"],
        }
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="thunderagent bench sched", description=__doc__.split("\n")[0])
    p.add_argument("--json", type=output_file, default=None)
    p.add_argument("--quick", action="store_true", help="small workloads (CI smoke run)")
    p.add_argument("--workers", type=at_least(1), default=8)
    p.add_argument("--profile", default="llama-3.1-8b-h100", choices=sorted(PRESETS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--link-gbps",
        type=float,
        default=25.0,
        help="PD KV-transfer link, GB/s (gigaBYTES; 25 = one 200 Gb/s RDMA NIC)",
    )
    p.add_argument("--only", default=",".join(SCENARIOS), help="comma list of scenarios")
    p.add_argument(
        "--programs",
        type=at_least(1),
        default=None,
        help="agent programs (default: 256 per 8 workers)",
    )
    args = p.parse_args(argv)
    args.scenarios = args.only.split(",")
    bad = [x for x in args.scenarios if x not in SCENARIOS]
    if bad:
        p.error(f"unknown scenarios {bad}; known: {list(SCENARIOS)}")
    if args.workers < 2 or not args.link_gbps > 0:
        p.error("--workers must be >= 2 and --link-gbps > 0")
    return args


def run(args: argparse.Namespace) -> dict:
    setup = Setup(
        profile=get_profile(args.profile),
        workers=args.workers,
        seed=args.seed,
        quick=args.quick,
        link_bytes_per_s=args.link_gbps * 1e9,
        programs=args.programs,
    )
    doc: dict = {}
    for name in args.scenarios:
        doc[name] = SCENARIOS[name](setup)
    doc["targets"] = targets(doc)
    doc["config"] = {
        "workers": args.workers,
        "profile": args.profile,
        "routing": ROUTING,
        "seed": args.seed,
        "quick": args.quick,
        "link_gb_s": args.link_gbps,
        "code_version": code_version(),
    }
    return doc


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    doc = run(args)
    for name in args.scenarios:
        print(table(name, doc[name]), end="\n\n")
    print("targets:", dumps(doc["targets"], indent=None))
    if args.json is not None:
        write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
