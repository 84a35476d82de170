"""Trace replay in virtual time: every routing policy, the scheduler in front, side by side.

    thunderagent bench replay --trace PATH [--workers 8] [--profile NAME] [--policies LIST]
        [--speed X[,Y...]] [--limit N] [--seed S] [--json FILE] [--report FILE.md] [--plot DIR]
        [--scheduler direct] [--load-interval 0.1] [--block-size 512] [--param P.FIELD=VALUE]
        [--migration off|replicate|nixl] [--migration-param FIELD=VALUE] [--hot-window S,E]
        [--repeats N] [--arrival-jitter-ms J] [--kv-events on|off]
        [--engine-pricing profile|dynamo-mocker]

Each (policy, speed) run replays the same arrivals through fresh engines, a fresh prefix index
and a fresh policy instance (``thunderagent.replay``). The JSON holds one entry per run plus the
trace, cluster, profile, seed and code version; ``--report`` writes a markdown table and
``--plot`` PNGs (matplotlib, the ``bench`` extra). ``--migration`` runs the live migration
service's planner in virtual time (``thunderagent.replay.migration``); with a hot window (the
option, the generator's sidecar ``.meta.json``, or the trace's ``hot`` rows) each entry gets the
TTFT of the hot requests and of the requests inside and outside the window, and, when the
trace marks hot rows, ``floor_p99_ms``: the hot TTFT p99 no router or planner copying whole
prefixes can beat, since nothing holds the hot prefix before a first prefill of it ends
(``hot_ttft_floor_ms``). ``--repeats N`` runs the sweep on N copies of the trace (seeds S to
S+N-1, each arrival moved by up to ``--arrival-jitter-ms``) and adds ``repeats``: each cell's
figures over the copies (``replay_spread``); the rest of the JSON is the first copy's.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from thunderagent.bench import replay_migration as migration_cli
from thunderagent.bench import replay_spread
from thunderagent.bench.jsonfile import dumps, write_json
from thunderagent.bench.replay_args import (
    ENGINE_PRICINGS,
    loads_seen_every,
    parse_args,
    report_interval,
    scheduler_for,
)
from thunderagent.bench.replay_plots import write_plots
from thunderagent.engine import TimingModel, get_profile
from thunderagent.replay import (
    Replay,
    ReplayConfig,
    TraceError,
    TraceRequest,
    load_trace,
)
from thunderagent.replay.metrics import cache_bounds, work_ceiling
from thunderagent.replay.migration import ReplayMigration, move_summary
from thunderagent.replay.summary import alone_ttft_s, summarize
from thunderagent.replay.traces import jitter_arrivals
from thunderagent.stats import percentile


def code_version() -> str:
    """``git describe`` of the checkout this runs from, else the installed package version."""
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--tags"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        return metadata.version("thunderagent")
    except metadata.PackageNotFoundError:
        return "unknown"


SLO_MARGIN_S = 3.0
"""The default SLO: the p99 of what the trace's prompts need with no cache and no queue, plus
this margin for queueing."""


def _sched_params(params: dict, policy: str, override: str | None) -> dict:
    """The scheduler knobs for a run; none for direct dispatch, which has no knobs."""
    return {} if scheduler_for(policy, override) == "direct" else dict(params)


def default_slo_ms(trace, timing: TimingModel, chunk: int) -> float:
    floor = [alone_ttft_s(timing, r.prompt_len, 0, chunk) for r in trace]
    return percentile(floor, 99) * 1000.0 + SLO_MARGIN_S * 1000.0


def load(args: argparse.Namespace) -> list[TraceRequest]:
    """The trace ``--trace`` names (``--limit``, ``--block-size``, ``--max-output``); exits when
    it is empty."""
    trace = load_trace(args.trace, args.limit, args.block_size)
    if not trace:
        raise SystemExit(f"{args.trace}: no requests")
    if args.max_output is not None:
        cap = args.max_output
        trace = [dataclasses.replace(r, output_len=min(r.output_len, cap)) for r in trace]
    return trace


def run(
    args: argparse.Namespace, seed: int | None = None, trace: list[TraceRequest] | None = None
) -> tuple[dict, dict]:
    """All runs with ``seed`` (default ``--seed``) on ``trace`` (default: ``load``), its
    arrivals jittered by the seed when ``--arrival-jitter-ms`` is set; returns (JSON document,
    {(policy, speed): ReplayResult})."""
    seed = args.seed if seed is None else seed
    trace = load(args) if trace is None else trace
    if args.arrival_jitter_ms:
        trace = jitter_arrivals(trace, args.arrival_jitter_ms / 1000.0, seed)
    profile = get_profile(args.profile).with_engine(block_size=args.block_size)
    bs = args.block_size
    timing = TimingModel(profile)
    bounds = cache_bounds(trace, bs, args.workers * profile.capacity_blocks)
    chunk = profile.engine.chunked_prefill_size
    slo_ms = args.slo_ttft_p99_ms or default_slo_ms(trace, timing, chunk)
    alone_s = lambda tokens: alone_ttft_s(timing, tokens, 0, chunk)  # noqa: E731
    hot = migration_cli.HotPeriod.of(args, trace, alone_s)
    doc = _document(args, profile, trace, slo_ms, hot.window, seed)
    doc["work_ceiling"] = work_ceiling(trace, timing, args.workers, bs, bounds)
    common = {"timing": timing, "chunk": chunk, "slo_ms": slo_ms}
    common.update(ideal=bounds["ideal"][0], pooled=bounds["pooled"][0])
    engines = priced(profile, args.engine_pricing)
    results: dict = {}
    runs = [(s, p) for s in args.speed for p in args.policy_list]
    with _progress(args.quiet) as bar:
        task = bar.add_task("replay", total=len(runs) * len(trace))
        for speed, policy in runs:
            bar.update(task, description=f"{policy} x{speed:g}")
            start = time.perf_counter()
            replay = Replay(_config(args, engines, policy, seed), bs)
            mig = ReplayMigration.attach(replay, args.migration, args.migration_params)
            result = results[(policy, speed)] = replay.run(
                trace, speed, lambda n: bar.advance(task, n)
            )
            wall = round(time.perf_counter() - start, 3)
            entry = summarize(result, policy=policy, speed=speed, wall_s=wall, **common)
            entry.update(mig.summary() if mig else move_summary(args.migration))
            if (hot_entry := hot.summary(result.records, speed)) is not None:
                entry["hot"] = hot_entry
            doc["results"].append(entry)
    doc["capacity"] = capacity(doc["results"], args.policy_list)
    return doc, results


REQUEST_FIELDS = (
    "request_id", "arrival", "prompt_tokens", "output_tokens", "routed_to", "dispatched",
    "worker", "first_token", "finish", "cached_tokens", "predicted_tokens", "best_overlap_tokens",
    "preemptions", "status", "reason",
)  # fmt: skip
"""What ``--requests-jsonl`` writes of each request (times in virtual seconds; workers by
index, 0 for ``w00``; -1: none)."""


def write_requests(path: Path, results: dict) -> None:
    """One line per request of every (policy, speed) run of the first copy: to read a run
    request by request (which waited where, behind what)."""
    with path.open("w") as out:
        for (policy, speed), result in results.items():
            for r in result.records:
                row = {f: getattr(r, f) for f in REQUEST_FIELDS}
                out.write(dumps({"policy": policy, "speed": speed, **row}, None) + "\n")


def priced(profile, pricing: str):
    """The replay's engines: the profile, its step prices changed as ``--engine-pricing`` says
    (the SLO, the work ceiling and every estimate of the router and the scheduler keep the
    profile's)."""
    eff = dataclasses.replace(profile.eff, **ENGINE_PRICINGS[pricing])
    return dataclasses.replace(profile, eff=eff)


def _config(args: argparse.Namespace, profile, policy: str, seed: int) -> ReplayConfig:
    return ReplayConfig(
        profile=profile,
        policy=policy,
        workers=args.workers,
        policy_params=args.params.get(policy, {}),
        scheduler=scheduler_for(policy, args.scheduler),
        seed=seed,
        load_interval=report_interval(policy, args.params.get(policy, {}), args.load_interval),
        index_ttl=args.index_ttl,
        kv_events=args.kv_events == "on",
        approximate_ttl=args.approximate_ttl,
        handoff_s=(args.handoff_ms or 0.0) / 1e3,
        scheduler_params=_sched_params(args.sched_params, policy, args.scheduler),
    )


def _document(args: argparse.Namespace, profile, trace, slo_ms: float, window, seed: int) -> dict:
    """The JSON document's header: what was replayed, on what, with which settings."""
    bs = args.block_size
    return {
        "trace": args.trace.name,
        "trace_requests": len(trace),
        "max_output": args.max_output,
        "cluster": {
            "workers": args.workers,
            "profile": profile.name,
            "kv_blocks_per_worker": profile.capacity_blocks,
            "block_size": bs,
        },
        "profile": profile.name,
        "scheduler": args.scheduler or "as deployed",
        "schedulers": {p: scheduler_for(p, args.scheduler) for p in args.policy_list},
        "slo_ttft_p99_ms": round(slo_ms, 1),
        "load_interval_s": {
            p: loads_seen_every(p, args.params.get(p, {}), args.load_interval)
            for p in args.policy_list
        },
        "index_ttl_s": args.index_ttl,
        "engine_pricing": args.engine_pricing,
        "kv_events": args.kv_events,
        "approximate_ttl_s": args.approximate_ttl if args.kv_events == "off" else None,
        "policy_params": args.params,
        "scheduler_params": args.sched_params,
        "migration": args.migration,
        "migration_params": args.migration_params,
        "hot_window_s": list(window) if window else None,
        "seed": seed,
        "arrival_jitter_ms": args.arrival_jitter_ms or 0.0,
        "handoff_ms": args.handoff_ms or 0.0,
        "code_version": code_version(),
        "results": [],
    }


def capacity(entries: list[dict], policies: list[str]) -> dict:
    """Per policy: the highest swept speed meeting the SLO with nothing lost; the highest below
    which every swept speed meets it too (``sustained``: a policy whose tail is at the mercy of
    where a burst lands can meet the SLO at one speed and miss it at the speeds around it); and
    goodput at every speed (requests/s whose TTFT met the SLO)."""
    out = {}
    for policy in policies:
        mine = sorted((e for e in entries if e["policy"] == policy), key=lambda e: e["speed"])
        met = [e["speed"] for e in mine if e["slo_met"]]
        first_miss = next((e["speed"] for e in mine if not e["slo_met"]), math.inf)
        sustained = [s for s in met if s < first_miss]
        out[policy] = {
            "max_speed_meeting_slo": max(met) if met else None,
            "sustained_speed": max(sustained) if sustained else None,
            "goodput_rps": {f"{e['speed']:g}": e["goodput_rps"] for e in mine},
            "ttft_p99_ms": {f"{e['speed']:g}": e["ttft_p99_all_ms"] for e in mine},
        }
    return out


class _progress:
    """A rich progress bar, or a silent stand-in with the same three methods."""

    def __init__(self, quiet: bool) -> None:
        self.bar = None
        if not quiet:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self.bar = Progress(
                TextColumn("{task.description:<24}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                transient=True,
            )

    def __enter__(self):
        if self.bar is None:
            return _Silent()
        return self.bar.__enter__()

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)


class _Silent:
    def add_task(self, *a, **k) -> int:
        return 0

    def update(self, *a, **k) -> None:
        pass

    def advance(self, *a, **k) -> None:
        pass


# ---- report ------------------------------------------------------------------------------
COLUMNS = (
    "| policy | sched | speed | done | rej | TTFT p50 | TTFT p90 | TTFT p99 | wait p99 | E2E p99 "
    "| goodput/s | SLO | hit | pooled | recompute | imbalance | preempt | wall s |"
)


def table(doc: dict) -> str:
    lines = [COLUMNS, _rule()]
    for e in doc["results"]:
        t, x, q = e["ttft_ms"], e["e2e_ms"], e["queue_ms"]
        sched = doc["schedulers"][e["policy"]]
        lines.append(
            f"| {e['policy']} | {sched} | {e['speed']:g} | {e['completed']} | {e['rejected']} "
            f"| {t['p50']:.0f} | {t['p90']:.0f} | {t['p99']:.0f} | {q['p99']:.0f} "
            f"| {x['p99']:.0f} | {e['goodput_rps']:.2f} | {'yes' if e['slo_met'] else 'no'} "
            f"| {e['prefix_hit_ratio']:.3f} | {e['pooled_hit_ratio']:.3f} "
            f"| {e['prefill_recompute_ratio']:.3f} "
            f"| {e['load_imbalance']:.3f} | {e['preemptions']} | {e['wall_s']:.1f} |"
        )
    return "\n".join(lines)


def capacity_table(doc: dict) -> str:
    """Capacity at the SLO: the highest swept speed each policy serves within it."""
    slo = doc["slo_ttft_p99_ms"]
    lines = [  # the ceiling first: the heading sits right above its table
        *ceiling_lines(doc.get("work_ceiling")),
        f"Capacity at TTFT p99 <= {slo / 1000:.2f} s (nothing lost, nothing rejected):",
        "",
        "| policy | scheduler | max speed meeting the SLO | every speed up to it meeting it |",
        "|---|---|---|---|",
    ]
    for policy, c in doc["capacity"].items():
        best, sustained = c["max_speed_meeting_slo"], c.get("sustained_speed")
        shown = [f"{s:g}" if s is not None else "none swept" for s in (best, sustained)]
        lines.append(f"| {policy} | {doc['schedulers'][policy]} | {shown[0]} | {shown[1]} |")
    return "\n".join(lines)


def ceiling_lines(ceiling: dict | None) -> list[str]:
    """The work ceiling in words (none for a document written before it existed)."""
    if not ceiling or ceiling["none"]["speed"] is None:
        return []
    return [
        f"Work ceiling (steady state, {ceiling['workers']} engines busy all the time, no decode "
        f"weight reads): {ceiling['pooled']['speed']:.2f}x with the cluster's KV as one LRU "
        f"cache, {ceiling['ideal']['speed']:.2f}x with an unlimited cache, "
        f"{ceiling['none']['speed']:.2f}x with none.",
        "",
    ]


def _rule() -> str:
    return "|" + "---|" * (COLUMNS.count("|") - 1)


def _intervals(by_policy: dict[str, float]) -> str:
    """'every 0.1 s' (the most shared interval, then the finest), with the policies that see
    loads on another schedule named."""
    values = list(by_policy.values())
    common = min(set(values), key=lambda v: (-values.count(v), v))
    others = [f"{p} every {v:g} s" for p, v in by_policy.items() if v != common]
    return f"every {common:g} s" + (f" ({', '.join(others)})" if others else "")


def write_report(doc: dict, path: Path, plots: list[Path], argv: list[str]) -> None:
    c = doc["cluster"]
    head = [
        f"# Replay: {doc['trace']}",
        "",
        f"`thunderagent bench replay {' '.join(argv)}`",
        "",
        f"{doc['trace_requests']} requests; {c['workers']} workers x {c['profile']} "
        f"({c['kv_blocks_per_worker']} KV blocks of {c['block_size']} tokens each); "
        f"schedulers {doc['scheduler']}; load reports {_intervals(doc['load_interval_s'])}; "
        f"seed {doc['seed']}; code {doc['code_version']}.",
        "",
        "Latencies in ms; `wait` = TTFT minus the request's prefill alone on an idle engine; "
        "`hit` = prompt tokens served from cache / prompt tokens; `goodput` = requests/s whose "
        f"TTFT met the SLO ({doc['slo_ttft_p99_ms'] / 1000:.2f} s).",
        "",
        table(doc),
        "",
        capacity_table(doc),
        "",
    ]
    if migration_cli.shown(doc):
        head += [f"Migration: {doc['migration']}; hot window {doc['hot_window_s']} s.", ""]
        head += [migration_cli.table(doc), ""]
    if "repeats" in doc:
        head += [replay_spread.table(doc["repeats"]), ""]
    head += [f"![{p.stem}]({_rel(p, path.parent)})" for p in plots]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(head) + "\n")


def _rel(p: Path, base: Path) -> str:
    try:
        return str(p.resolve().relative_to(base.resolve()))
    except ValueError:
        return str(p)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    seeds = [args.seed + k for k in range(args.repeats)]
    try:
        trace = load(args)  # once: each copy jitters its own
        doc, results = run(args, seeds[0], trace)
        copies = [doc] + [run(args, s, trace)[0] for s in seeds[1:]]
    except TraceError as err:
        raise SystemExit(f"bad trace: {err}") from None
    if args.repeats > 1:
        doc["repeats"] = replay_spread.spread(copies, seeds, args.arrival_jitter_ms)
    # the files first: a stdout closed early (``| head``) must not lose what the run measured
    plots = write_plots(doc, results, args.plot) if args.plot else []
    if args.json:
        write_json(args.json, doc)
    if args.requests_jsonl:
        write_requests(args.requests_jsonl, results)
    if args.report:
        write_report(doc, args.report, plots, argv)
    print(table(doc))
    print()
    print(capacity_table(doc))
    if migration_cli.shown(doc):
        print()
        print(migration_cli.table(doc))
    if "repeats" in doc:
        print()
        print(replay_spread.table(doc["repeats"]))
    runs = [e for copy in copies for e in copy["results"]]
    total = sum(e["wall_s"] for e in runs)
    print(f"\n{len(runs)} runs, {total:.1f} s wall in replays; code {doc['code_version']}")


if __name__ == "__main__":
    main()
