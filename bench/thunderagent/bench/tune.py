"""Choose a thunder default on generated workloads: capacity at the SLO for each candidate
setting, against every peer as it ships, on every workload given.

    thunderagent bench tune --traces A.jsonl,B.jsonl --speeds 1,2,3,4 \\
        --param thunder.recompute_gain=0.5,1,2,4 [--workers 8] [--json F]
        --param scheduler.kv_watermark=0.9,0.95,1          # a knob of thunder's scheduler
        --param thunder.recompute_gain=2,4 --param thunder.busy_kv_share=0.2,0.7   # a grid

For each workload it sweeps the speeds, runs thunder (router + its scheduler) once per value
of the parameter (per combination when ``--param`` is given more than once) and each peer
(direct dispatch), and reports each one's capacity (the highest
swept speed meeting the SLO with nothing lost), goodput, and its TTFT p99 misses: swept speeds
where some peer meets the SLO and thunder's TTFT p99 is more than 5% above the best such peer's.
The recommended value maximises the worst capacity ratio to the best peer across workloads, then
has the fewest p99 misses, then the larger capacity ratios over all workloads (the sum of their
logarithms: one workload where every candidate is level with the best peer makes the worst
ratio a tie, not the capacity everywhere else), then the larger sum of goodputs.
The real traces are for judging a default chosen here, not for choosing it.
"""

from __future__ import annotations

import argparse
import itertools
import math
import time
from pathlib import Path

from thunderagent.bench.cli import bench_parser
from thunderagent.bench.jsonfile import dumps, write_json
from thunderagent.bench.replay import default_slo_ms
from thunderagent.bench.replay_args import report_interval, scheduler_for
from thunderagent.engine import TimingModel, get_profile
from thunderagent.engine.profiles import PRESETS
from thunderagent.replay import Replay, ReplayConfig, TraceError, load_trace
from thunderagent.replay.summary import summarize
from thunderagent.routing import POLICIES
from thunderagent.scheduling import SCHEDULERS
from thunderagent.shell.argtypes import at_least, name_list, output_file, positive_list

PEERS = ("dynamo_kv", "sglang_cache_aware", "smg_cache_aware", "llm_d", "least_loaded")


def _values(text: str) -> tuple[str, str, list[float]]:
    """``--param``: ``thunder.FIELD=V1,...`` or ``scheduler.FIELD=V1,...``, each value a finite
    number given once."""
    key, sep, raw = text.partition("=")
    policy, _, field = key.partition(".")
    if policy not in ("thunder", "scheduler") or not field or not sep:
        raise argparse.ArgumentTypeError(
            f"expected thunder.FIELD=V1,... or scheduler.FIELD=V1,..., got {text!r}"
        )
    try:
        values = [float(v) for v in raw.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: the values must be numbers") from None
    if not all(map(math.isfinite, values)) or len(set(values)) < len(values):
        raise argparse.ArgumentTypeError(f"{text!r}: finite numbers, each once")
    return policy, field, values


Candidate = tuple[str, dict, dict]
"""(name, thunder routing params, thunder scheduler params)."""


def candidates(params: list[tuple[str, str, list[float]]]) -> list[Candidate]:
    """Every combination of the parameters' values, named ``policy@value`` for one parameter
    and ``thunder.f=v,scheduler.g=w`` for several."""
    out: list[Candidate] = []
    for combo in itertools.product(*(values for _, _, values in params)):
        route: dict = {}
        sched: dict = {}
        for (policy, field, _), v in zip(params, combo, strict=True):
            (sched if policy == "scheduler" else route)[field] = v
        if len(params) == 1:
            name = f"{params[0][0]}@{combo[0]:g}"
        else:
            name = ",".join(f"{p}.{f}={v:g}" for (p, f, _), v in zip(params, combo, strict=True))
        out.append((name, route, sched))
    return out


def capacity(entries: list[dict]) -> float:
    met = [e["speed"] for e in entries if e["slo_met"]]
    return max(met) if met else 0.0


def p99_misses(workload: dict, name: str, peers: list[str], slack: float = 1.05) -> int:
    """Speeds where a peer meets the SLO and ``name``'s TTFT p99 is over ``slack`` x the best
    such peer's."""
    p99, slo = workload["ttft_p99_ms"], workload["slo_ms"]
    misses = 0
    for i, ours in enumerate(p99[name]):
        meeting = [p99[peer][i] for peer in peers if p99[peer][i] <= slo]
        if meeting and ours > slack * min(meeting):
            misses += 1
    return misses


def run_one(
    trace, profile, policy: str, params: dict, speed: float, slo_ms: float,
    sched: dict | None = None, workers: int = 8,
) -> dict:  # fmt: skip
    cfg = ReplayConfig(
        profile=profile, policy=policy, policy_params=params, workers=workers,
        scheduler=scheduler_for(policy, None), scheduler_params=sched or {},
        load_interval=report_interval(policy, params, None),
    )  # fmt: skip
    started = time.perf_counter()
    result = Replay(cfg, profile.engine.block_size).run(trace, speed)
    timing = TimingModel(profile)
    return summarize(
        result, policy=policy, speed=speed, timing=timing,
        chunk=profile.engine.chunked_prefill_size, ideal=0.0, pooled=0.0,
        wall_s=time.perf_counter() - started, slo_ms=slo_ms,
    )  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    p = bench_parser("tune", __doc__)
    p.add_argument("--traces", required=True, help="comma list of Mooncake traces")
    p.add_argument(
        "--speeds", type=positive_list, default="1,2,3,4",
        help="arrival-rate multipliers, comma list (default: 1,2,3,4)",
    )  # fmt: skip
    p.add_argument(
        "--param",
        required=True,
        action="append",
        type=_values,
        help="thunder.FIELD=V1,V2,... (routing) or scheduler.FIELD=V1,... (thunder's "
        "scheduler); repeat for a grid of every combination",
    )
    p.add_argument(
        "--peers", type=name_list(POLICIES.names()), default=",".join(PEERS),
        help=f"routing policies to compare with, comma list (default: {','.join(PEERS)})",
    )  # fmt: skip
    p.add_argument("--profile", default="llama-3.1-8b-h100", choices=sorted(PRESETS))
    p.add_argument("--block-size", type=at_least(1), default=512)
    p.add_argument(
        "--workers", type=at_least(1), default=8,
        help="simulated engines per run (default: 8, as bench replay); e.g. 4 for a workload "
        "whose caches should fill",
    )  # fmt: skip
    p.add_argument("--json", type=output_file, default=None, help="JSON report file")
    return p


def workload(path: str, profile, cands: list[Candidate], speeds, peers, workers: int = 8) -> dict:
    """One trace: thunder with every candidate setting and every peer, at every speed, on
    ``workers`` simulated engines."""
    try:
        trace = load_trace(path, block_size=profile.engine.block_size)
    except TraceError as err:
        raise SystemExit(f"bad trace: {err}") from None
    timing = TimingModel(profile)
    slo = default_slo_ms(trace, timing, profile.engine.chunked_prefill_size)
    runs: dict[str, list[dict]] = {}
    for name, route, sched in cands:
        runs[name] = [
            run_one(trace, profile, "thunder", route, s, slo, sched, workers=workers)
            for s in speeds
        ]
    for peer in peers:
        runs[peer] = [run_one(trace, profile, peer, {}, s, slo, workers=workers) for s in speeds]
    caps = {name: capacity(entries) for name, entries in runs.items()}
    return {
        "slo_ms": slo,
        "capacity": caps,
        "best_peer_capacity": max(caps[peer] for peer in peers),
        "goodput": {n: [round(e["goodput_rps"], 3) for e in es] for n, es in runs.items()},
        "ttft_p99_ms": {n: [round(e["ttft_p99_all_ms"]) for e in es] for n, es in runs.items()},
    }


def scores(workloads: dict, name: str, peers: list[str]) -> tuple[float, int, float, float]:
    """(worst capacity ratio to the best peer, -p99 misses, summed log capacity ratios, summed
    goodput): larger is better, compared in that order. A workload with no capacity (nothing
    met the SLO) counts as a ratio of 0: the worst possible, and -inf in the log sum."""
    ratios = [
        w["capacity"][name] / w["best_peer_capacity"] if w["best_peer_capacity"] else 0.0
        for w in workloads.values()
    ]
    logs = sum(math.log(r) if r > 0 else -math.inf for r in ratios)
    goodput = sum(sum(w["goodput"][name]) for w in workloads.values())
    misses = sum(p99_misses(w, name, peers) for w in workloads.values())
    return min(ratios), -misses, logs, goodput


def main(argv: list[str] | None = None) -> None:
    p = _parser()
    args = p.parse_args(argv)
    params = args.param
    cands = candidates(params)
    for name, route, sched in cands:  # built once now: a bad name is one line, before any run
        try:
            POLICIES.create("thunder", **route)
            SCHEDULERS.create("thunder", **sched)
        except (ValueError, TypeError) as err:
            p.error(f"--param ({name}): {err}")
    speeds, peers = args.speeds, args.peers
    profile = get_profile(args.profile).with_engine(block_size=args.block_size)
    names = [name for name, _, _ in cands]
    report: dict = {"params": [f"{p}.{f}" for p, f, _ in params], "candidates": names}
    report["workers"] = args.workers
    report["workloads"] = {}
    for path in args.traces.split(","):
        w = workload(path, profile, cands, speeds, peers, args.workers)
        report["workloads"][Path(path).stem] = w
        print(
            f"{Path(path).stem}: SLO {w['slo_ms'] / 1000:.2f} s, capacity {w['capacity']}",
            flush=True,
        )
    score = {name: scores(report["workloads"], name, peers) for name in names}
    best = max(names, key=lambda name: score[name])
    report["scores"] = {
        name: {"worst_ratio": s[0], "p99_misses": -s[1], "log_ratio_sum": s[2], "goodput": s[3]}
        for name, s in score.items()
    }
    report["recommended"] = best
    print(dumps({"scores": report["scores"], "recommended": best}, indent=2))
    if args.json:
        write_json(args.json, report)


if __name__ == "__main__":
    main()
