"""Dynamo's KV router in Dynamo's own simulator, beside the replay's model of it.

    thunderagent bench dynamo-sim --trace PATH [--speed X[,Y...]] [--workers 8]
        [--profile NAME] [--block-size 512] [--limit N] [--slo-ttft-p99-ms MS]
        [--kv-router-param FIELD=VALUE] [--repeats N] [--replay-json FILE] [--json FILE]

Dynamo 1.6.1 ships an offline replay (``run_mocker_trace_replay`` in the ``ai-dynamo-runtime``
wheel, the ``dynamo`` extra): its KV router in front of its mocker engines (the SGLang backend's
scheduler), in simulated time. This sends a Mooncake trace through it twice per speed, with the
KV router as Dynamo ships it (``KvRouterConfig()``'s defaults) and with round robin, on a fleet
shaped like ``bench replay``'s: as many workers, each with the profile's KV pool in pages of the
profile's size, as many running requests, and the mocker's timing scaled so that the trace's
prompts, each alone and uncached, take as long in all as the profile says, and one decode step
as long as the profile's. Nothing of ThunderAgent routes here: this is the peer as it ships, in
its authors' simulator. Given a ``bench replay`` JSON of the same trace (``--replay-json``), it
sets the replay's ``dynamo_kv`` and ``round_robin`` rows beside Dynamo's: where each router sent
the prompts (the prefix hit ratio) and the TTFT tails. The SLO and the capacity are
``bench replay``'s (the trace's p99 no-cache prefill under the profile + 3 s).
``--kv-router-param`` sets one of ``KvRouterConfig``'s keyword arguments away from its default
(``router_predicted_ttl_secs=30``: prediction on route); the JSON names every one set.
Dynamo's replay is not exactly repeatable (each request gets a random UUID, and ties among its
workers fall differently): ``--repeats N`` runs every cell N times and reports each figure's
mean, sample sd, min and max, and sets the replay beside the mean.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from importlib import metadata
from itertools import pairwise, product
from pathlib import Path
from statistics import median

from thunderagent.bench.cli import bench_parser
from thunderagent.bench.jsonfile import write_json
from thunderagent.bench.replay import capacity, default_slo_ms, load
from thunderagent.bench.replay_spread import stats
from thunderagent.engine import TimingModel, get_profile
from thunderagent.engine.profiles import PRESETS
from thunderagent.replay import TraceError, TraceRequest
from thunderagent.replay.summary import alone_ttft_s
from thunderagent.shell.argtypes import (
    at_least,
    output_file,
    param_value,
    positive,
    positive_list,
)
from thunderagent.stats import percentile

ROUTERS = ("kv_router", "round_robin")
"""Dynamo's names: its KV router, and its round robin as the floor."""
CALIBRATION_QUANTILES = (0, 10, 25, 50, 75, 90, 99, 100)
"""Prompt lengths (percentiles of the trace's) at which the mocker's prefill is measured; the
mocker's prefill is piecewise linear in the length between them."""
DECODE_PROBE_TOKENS = 32


def _dynamo():
    """Dynamo's runtime module, quiet: its router logs every decision at INFO."""
    os.environ.setdefault("DYN_LOG", "error")
    try:
        from dynamo import _core
    except ImportError:
        raise SystemExit(
            "bench dynamo-sim needs Dynamo's runtime: pip install 'thunderagent[dynamo]' "
            "(ai-dynamo-runtime==1.6.1)"
        ) from None
    return _core


def fleet(profile_name: str, block_size: int) -> dict:
    """The mocker's engine section for one worker shaped like the profile (trace blocks of
    ``block_size`` tokens set the pool's size in tokens, as in ``bench replay``)."""
    base = get_profile(profile_name)
    tokens = base.with_engine(block_size=block_size).capacity_blocks * block_size
    page = base.engine.block_size
    return {
        "backend": "sglang",
        "block_size": page,
        "num_gpu_blocks": tokens // page,
        "max_num_seqs": base.engine.max_running_requests,
        "max_num_batched_tokens": base.engine.chunked_prefill_size,
    }


def _alone(core, engine: dict, prompt: int, output: int) -> dict:
    """One request alone on one mocker engine: its summary."""
    result = core.run_mocker_synthetic_trace_replay(
        prompt, output, 1, extra_engine_args={"engine": engine}, replay_concurrency=1
    )
    return result.summary


def _interpolate(points: list[tuple[int, float]], x: int) -> float:
    """``x`` on the polyline through ``points`` (sorted by x; held flat past the last)."""
    for (x0, y0), (x1, y1) in pairwise(points):
        if x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


def calibrate(core, engine: dict, trace: list[TraceRequest], profile_name: str) -> dict:
    """The mocker's ``speedup_ratio`` (prefill) and ``decode_speedup_ratio`` that match the
    profile: the trace's prompts, each alone and uncached, take as long in all, and one decode
    step at batch 1 with the median prompt's context takes as long."""
    profile = get_profile(profile_name)
    timing, chunk = TimingModel(profile), profile.engine.chunked_prefill_size
    lengths = sorted(r.prompt_len for r in trace)
    probes = sorted({max(1, int(percentile(lengths, q))) for q in CALIBRATION_QUANTILES})
    mocker = [(n, _alone(core, engine, n, 2)["mean_ttft_ms"]) for n in probes]
    mocker_ms = sum(_interpolate(mocker, n) for n in lengths)
    ours_ms = 1000.0 * sum(alone_ttft_s(timing, n, 0, chunk) for n in lengths)
    prefill = mocker_ms / ours_ms
    middle = int(median(lengths))
    mocker_step = _alone(core, engine, middle, DECODE_PROBE_TOKENS)["mean_itl_ms"]
    ours_step = 1000.0 * timing.decode_time(1, middle)
    return {
        "speedup_ratio": prefill,
        "decode_speedup_ratio": mocker_step / (prefill * ours_step),
        "prefill_probes": [{"prompt": n, "mocker_ms": round(ms, 2)} for n, ms in mocker],
        "prefill_total_s": {"mocker": mocker_ms / 1000.0, "profile": ours_ms / 1000.0},
        "decode_step_ms": {"mocker": mocker_step, "profile": ours_step, "context": middle},
    }


def _entry(router: str, speed: float, trace_len: int, result, slo_ms: float) -> dict:
    """One run as ``bench replay`` writes one; every request accounted for."""
    rows = result.per_request or []
    summary = result.summary
    if len(rows) != trace_len or summary["num_requests"] != trace_len:
        raise SystemExit(
            f"Dynamo's replay read {summary['num_requests']} requests ({len(rows)} reported) "
            f"of the trace's {trace_len}: it parsed the file otherwise"
        )
    status = Counter(r["terminal_status"] for r in rows)
    done = [r for r in rows if r["terminal_status"] == "completed"]
    ttft = [r["ttft_ms"] if r["ttft_ms"] is not None else float("inf") for r in rows]
    ttft_done = [r["ttft_ms"] for r in done]
    in_flight = trace_len - len(done)  # a request Dynamo did not complete is counted, not lost
    span_s = summary["duration_ms"] / 1000.0
    return {
        "policy": router,
        "speed": speed,
        "requests": trace_len,
        "completed": len(done),
        "rejected": 0,
        "in_flight": in_flight,
        "terminal_status": dict(status),
        "prefix_hit_ratio": summary["prefix_cache_reused_ratio"],
        "ttft_p50_ms": percentile(ttft_done, 50) if done else None,
        "ttft_p99_all_ms": percentile(ttft, 99),
        "slo_met": percentile(ttft, 99) <= slo_ms and not in_flight,
        "goodput_rps": sum(t <= slo_ms for t in ttft) / span_s if span_s > 0 else 0.0,
    }


def sweep(core, path: Path, trace_len: int, engine: dict, args, slo_ms: float) -> list[dict]:
    """Every (router, speed) through Dynamo's replay, ``--repeats`` times (``run``: which)."""
    out = []
    for run, router, speed in product(range(args.repeats), ROUTERS, args.speed):
        result = core.run_mocker_trace_replay(
            [str(path)],
            extra_engine_args={"engine": engine},
            num_workers=args.workers,
            router_mode=router,
            router_config=core.KvRouterConfig(**args.kv_router_param)
            if router == "kv_router"
            else None,
            arrival_speedup_ratio=speed,
            trace_block_size=args.block_size,
            capture_per_request=True,
        )
        out.append(_entry(router, speed, trace_len, result, slo_ms) | {"run": run})
    return out


def spread(results: list[dict]) -> dict:
    """Each (router, speed) cell's hit ratio and TTFT p99 over the runs, and each run's
    capacity."""
    cells: dict[tuple[str, float], list[dict]] = {}
    runs: dict[int, list[dict]] = {}
    for e in results:
        cells.setdefault((e["policy"], e["speed"]), []).append(e)
        runs.setdefault(e["run"], []).append(e)
    rows = [
        {
            "policy": router,
            "speed": speed,
            "runs": len(entries),
            "prefix_hit_ratio": stats([e["prefix_hit_ratio"] for e in entries]),
            "ttft_p99_all_ms": stats([e["ttft_p99_all_ms"] for e in entries]),
            "slo_met_runs": sum(e["slo_met"] for e in entries),
        }
        for (router, speed), entries in cells.items()
    ]
    per_run = [capacity(entries, list(ROUTERS)) for entries in runs.values()]
    return {
        "cells": rows,
        "max_speed_meeting_slo": {
            r: [c[r]["max_speed_meeting_slo"] for c in per_run] for r in ROUTERS
        },
    }


PEERS = {"kv_router": "dynamo_kv", "round_robin": "round_robin"}
"""Dynamo's router -> the replay's model of it."""


def beside(results: list[dict], replay_doc: dict, trace: Path) -> list[dict]:
    """Each Dynamo run with the replay's run of its model at the same speed, where there is
    one; a replay of another trace is refused."""
    if Path(replay_doc.get("trace", "")).name != trace.name:
        raise SystemExit(f"--replay-json replayed {replay_doc.get('trace')}, not {trace}")
    ours = {(e["policy"], e["speed"]): e for e in replay_doc["results"]}
    rows = []
    for e in results:
        mine = ours.get((PEERS[e["policy"]], e["speed"]))
        if mine is None:
            continue
        rows.append(
            {
                "router": e["policy"],
                "speed": e["speed"],
                "hit": {"dynamo": e["prefix_hit_ratio"], "replay": mine["prefix_hit_ratio"]},
                "ttft_p99_ms": {"dynamo": e["ttft_p99_all_ms"], "replay": mine["ttft_p99_all_ms"]},
                "slo_met": {"dynamo": e["slo_met"], "replay": mine["slo_met"]},
            }
        )
    return rows


def table(doc: dict) -> str:
    t = doc["timing"]
    lines = [
        f"Dynamo {doc['dynamo_version']}'s offline replay: {doc['workers']} mocker engines "
        f"(SGLang backend, {doc['engine']['num_gpu_blocks']:,} pages of "
        f"{doc['engine']['block_size']} tokens), prefill x{t['speedup_ratio']:.3f}, decode "
        f"x{t['decode_speedup_ratio']:.3f} (matched to {doc['profile']}); "
        f"SLO TTFT p99 <= {doc['slo_ttft_p99_ms'] / 1000:.2f} s; KV router "
        + (f"with {doc['kv_router_params']}" if doc["kv_router_params"] else "as shipped"),
        "| router | speed | requests | completed | in flight | hit | TTFT p50 ms | p99 ms | SLO |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for e in doc["results"]:
        p50 = "-" if e["ttft_p50_ms"] is None else f"{e['ttft_p50_ms']:.0f}"
        lines.append(
            f"| {e['policy']} | {e['speed']:g} | {e['requests']} | {e['completed']} "
            f"| {e['in_flight']} | {e['prefix_hit_ratio']:.3f} | {p50} "
            f"| {e['ttft_p99_all_ms']:.0f} | {'yes' if e['slo_met'] else 'no'} |"
        )
    for router, c in doc["capacity"].items():
        lines.append(f"capacity {router}: {c['max_speed_meeting_slo']}")
    return "\n".join(lines)


def _means(spread_doc: dict) -> list[dict]:
    """Each cell's mean over the runs, shaped as a run's entry (the SLO met in every run)."""
    return [
        {
            "policy": c["policy"],
            "speed": c["speed"],
            "prefix_hit_ratio": c["prefix_hit_ratio"]["mean"],
            "ttft_p99_all_ms": c["ttft_p99_all_ms"]["mean"],
            "slo_met": c["slo_met_runs"] == c["runs"],
        }
        for c in spread_doc["cells"]
    ]


def spread_table(spread_doc: dict) -> str:
    lines = [
        "Over the runs: mean ± sd (min-max); capacity in each run:",
        "| router | speed | runs | hit | TTFT p99 s | SLO met |",
        "|---|---|---|---|---|---|",
    ]
    for c in spread_doc["cells"]:
        h, t = c["prefix_hit_ratio"], c["ttft_p99_all_ms"]
        lines.append(
            f"| {c['policy']} | {c['speed']:g} | {c['runs']} | {h['mean']:.3f} ± {h['sd']:.3f} "
            f"({h['min']:.3f}-{h['max']:.3f}) | {t['mean'] / 1000:.2f} ± {t['sd'] / 1000:.2f} "
            f"({t['min'] / 1000:.2f}-{t['max'] / 1000:.2f}) | {c['slo_met_runs']} of {c['runs']} |"
        )
    for router, caps in spread_doc["max_speed_meeting_slo"].items():
        lines.append(f"capacity {router}: {caps}")
    return "\n".join(lines)


def beside_table(rows: list[dict]) -> str:
    lines = [
        "Dynamo's simulator beside the replay (hit ratio; TTFT p99 s; SLO met):",
        "| Dynamo's router | the replay's model | speed | hit: Dynamo | replay "
        "| p99: Dynamo | replay | SLO: Dynamo | replay |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    yes = {True: "yes", False: "no"}
    for r in rows:
        h, p, s = r["hit"], r["ttft_p99_ms"], r["slo_met"]
        lines.append(
            f"| {r['router']} | {PEERS[r['router']]} | {r['speed']:g} | {h['dynamo']:.3f} "
            f"| {h['replay']:.3f} | {p['dynamo'] / 1000:.2f} | {p['replay'] / 1000:.2f} "
            f"| {yes[s['dynamo']]} | {yes[s['replay']]} |"
        )
    return "\n".join(lines)


def _trace_file(args, trace: list[TraceRequest], scratch: Path) -> Path:
    """The file Dynamo reads: the trace itself, or its first ``--limit`` lines."""
    if args.limit is None:
        return args.trace
    head = scratch / args.trace.name
    with args.trace.open() as src, head.open("w") as out:
        for _, line in zip(range(len(trace)), src, strict=False):
            out.write(line)
    return head


def parse_args(argv: list[str] | None):
    p = bench_parser("dynamo-sim", __doc__)
    p.add_argument("--trace", type=Path, required=True, help="a Mooncake JSONL trace")
    p.add_argument("--speed", type=positive_list, default=[1.0])
    p.add_argument("--workers", type=at_least(1), default=8)
    p.add_argument("--profile", default="llama-3.1-8b-h100", choices=sorted(PRESETS))
    p.add_argument("--block-size", type=at_least(1), default=512)
    p.add_argument("--limit", type=at_least(1), default=None)
    p.set_defaults(max_output=None)  # bench replay's loader reads it: the trace's own lengths
    p.add_argument("--slo-ttft-p99-ms", type=positive, default=None)
    p.add_argument(
        "--repeats", type=at_least(1), default=1,
        help="run every cell N times (Dynamo's replay is not exactly repeatable): mean, sd, "
        "min and max of each figure; the replay is set beside the mean",
    )  # fmt: skip
    p.add_argument("--replay-json", type=Path, default=None)
    p.add_argument("--json", type=output_file, default=None)
    p.add_argument(
        "--kv-router-param", action="append", default=[], metavar="FIELD=VALUE",
        help="a KvRouterConfig keyword away from its default (VALUE as JSON), repeatable",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.trace.suffix.lower() == ".csv":
        p.error("Dynamo's replay reads Mooncake JSONL traces (hash_ids), not Azure CSV")
    args.kv_router_param = _router_params(args.kv_router_param, p)
    return args


def _router_params(items: list[str], p) -> dict:
    """``FIELD=VALUE`` items -> KvRouterConfig keywords, each tried on it now: a misspelled
    field or a bad value is a usage error before any run."""
    out = {}
    for item in items:
        name, sep, raw = item.partition("=")
        if not (sep and name):
            p.error(f"--kv-router-param {item!r}: expected FIELD=VALUE")
        out[name] = param_value(raw)
    try:
        _dynamo().KvRouterConfig(**out)
    except (TypeError, ValueError) as err:
        p.error(f"--kv-router-param: KvRouterConfig refused it: {err}")
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    core = _dynamo()
    try:
        trace = load(args)
    except TraceError as err:
        raise SystemExit(f"bad trace: {err}") from None
    profile = get_profile(args.profile).with_engine(block_size=args.block_size)
    chunk = profile.engine.chunked_prefill_size
    slo_ms = args.slo_ttft_p99_ms or default_slo_ms(trace, TimingModel(profile), chunk)
    engine = fleet(args.profile, args.block_size)
    timing = calibrate(core, engine, trace, args.profile)
    engine |= {k: timing[k] for k in ("speedup_ratio", "decode_speedup_ratio")}
    with tempfile.TemporaryDirectory() as scratch:
        path = _trace_file(args, trace, Path(scratch))
        results = sweep(core, path, len(trace), engine, args, slo_ms)
    doc = {
        "trace": str(args.trace),
        "trace_requests": len(trace),
        "dynamo_version": metadata.version("ai-dynamo-runtime"),
        "workers": args.workers,
        "profile": args.profile,
        "engine": engine,
        "kv_router_params": args.kv_router_param,
        "timing": timing,
        "slo_ttft_p99_ms": round(slo_ms, 1),
        "repeats": args.repeats,
        "results": results,
    }
    _summarize(doc, args)
    if args.json:
        write_json(args.json, doc)
    print(table(doc))
    if args.repeats > 1:
        print()
        print(spread_table(doc["spread"]))
    if args.replay_json:
        print()
        print(beside_table(doc["beside_replay"]))


def _summarize(doc: dict, args) -> None:
    """The capacity (the first run's), the spread over the runs, and the replay beside
    Dynamo's figures (the first run's, or the runs' means)."""
    results = doc["results"]
    first = [e for e in results if e["run"] == 0]
    doc["capacity"] = capacity(first, list(ROUTERS))
    compared = first
    if args.repeats > 1:
        doc["spread"] = spread(results)
        compared = _means(doc["spread"])
    if args.replay_json:
        doc["beside_replay"] = beside(compared, _read_json(args.replay_json), args.trace)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise SystemExit(f"--replay-json {path}: {err}") from None


if __name__ == "__main__":
    main()
