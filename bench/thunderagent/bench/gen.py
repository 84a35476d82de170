"""Generate a Mooncake-format trace (agent programs, bursty traffic, a hot spot, coding-assistant
sessions or retrieval-augmented queries) for replay.

    thunderagent bench gen --kind agent|bursty|hotspot|coding|rag --out FILE.jsonl [--seed N]
        [--scale X]
        [--block-size 512] [--workers 8] [--profile NAME] [--param FIELD=VALUE ...]
        [kind options: --programs, --duration, --hot-start, ... (see --help)]

Writes FILE.jsonl (one request per line, the format ``thunderagent bench replay --trace`` reads)
and the sidecar FILE.meta.json: kind, seed, scale, every parameter, requests, span, mean lengths,
the ideal and pooled hit ratios (pooled: one LRU cache of ``--workers`` x the profile's KV room,
computed as ``bench replay`` does) and what the kind adds (the hot window...). The same
arguments always give the same files. Generators: ``thunderagent.workloads.tracegen``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from thunderagent.bench.jsonfile import write_json
from thunderagent.bench.replay import code_version
from thunderagent.engine import TimingModel, get_profile
from thunderagent.engine.profiles import PRESETS
from thunderagent.replay import load_trace
from thunderagent.replay.metrics import cache_bounds, work_ceiling
from thunderagent.shell.argtypes import at_least, output_file, positive
from thunderagent.workloads.mooncake import summary
from thunderagent.workloads.tracegen import KINDS, ParamError, generate

KIND_OPTIONS: dict[str, tuple[str, type, str]] = {
    "--programs": ("programs", int, "agent: programs"),
    "--program-rate": ("program_rate_per_s", float, "agent: program starts per second"),
    "--tool-prompts": ("tool_prompts", int, "agent: distinct shared tool prompts"),
    "--tool-prompt-tokens": ("tool_prompt_tokens", int, "agent: tokens per tool prompt"),
    "--pause-median": ("pause_median_s", float, "agent: median tool pause, s"),
    "--duration": ("duration_s", float, "bursty, hotspot, coding, rag: seconds of traffic"),
    "--background-rate": ("background_rate_per_s", float, "bursty: background requests/s"),
    "--burst-rate": ("burst_rate_per_s", float, "bursty: bursts per second"),
    "--burst-size": ("burst_size_median", float, "bursty: median requests per burst"),
    "--session-rate": (
        "session_rate_per_s",
        float,
        "hotspot: background sessions/s; coding: sessions/s",
    ),
    "--hot-start": ("hot_start_s", float, "hotspot: hot window start, s"),
    "--hot-duration": ("hot_duration_s", float, "hotspot: hot window length, s"),
    "--hot-prefix-tokens": ("hot_prefix_tokens", int, "hotspot: hot prefix length"),
    "--hot-clients": ("hot_clients", int, "hotspot: clients querying the hot prefix"),
}
"""Shortcuts for the parameters most often changed; ``--param`` reaches every other field."""


def meta_path(out: Path) -> Path:
    """``x.jsonl`` -> ``x.meta.json`` (any other name: ``name.meta.json``)."""
    stem = out.name[: -len(".jsonl")] if out.name.endswith(".jsonl") else out.name
    return out.with_name(stem + ".meta.json")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="thunderagent bench gen", description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", required=True, choices=sorted(KINDS))
    p.add_argument("--out", type=output_file, required=True, help="trace file to write (.jsonl)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scale", type=positive, default=1.0, help="size multiplier, same load")
    p.add_argument("--block-size", type=at_least(1), default=512, help="tokens per hash id")
    p.add_argument("--workers", type=at_least(1), default=8, help="pooled hit ratio: workers")
    p.add_argument(
        "--profile",
        default="llama-3.1-8b-h100",
        choices=sorted(PRESETS),
        help="pooled hit ratio: KV room",
    )
    p.add_argument(
        "--param", action="append", default=[], help="FIELD=VALUE (JSON value), repeatable"
    )
    for flag, (field, kind, text) in KIND_OPTIONS.items():
        p.add_argument(flag, dest=field, type=kind, default=None, help=text)
    args = p.parse_args(argv)
    try:
        args.overrides = _overrides(args)
    except ValueError as err:
        p.error(str(err))
    if args.workers < 1:
        p.error("--workers must be >= 1")
    return args


def _overrides(args: argparse.Namespace) -> dict:
    out: dict = {"block_size": args.block_size}
    for field, _, _ in KIND_OPTIONS.values():
        if getattr(args, field) is not None:
            out[field] = getattr(args, field)
    for item in args.param:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--param {item!r}: expected FIELD=VALUE")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            raise ValueError(f"--param {item!r}: VALUE must be JSON (a number)") from None
    return out


def run(args: argparse.Namespace) -> dict:
    """Generate, write both files; returns the meta document. The hit ratios and the work
    ceiling are computed from the written file by ``bench replay``'s own functions, so the
    sidecar says what a replay of that file reports."""
    params, trace = generate(args.kind, args.seed, args.scale, args.overrides)
    profile = get_profile(args.profile).with_engine(block_size=args.block_size)
    capacity = args.workers * profile.capacity_blocks
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as fh:
        for row in trace.rows:
            fh.write(json.dumps(row.as_json()) + "\n")
    requests = load_trace(args.out, None, args.block_size)
    bounds = cache_bounds(requests, args.block_size, capacity)
    ceiling = work_ceiling(requests, TimingModel(profile), args.workers, args.block_size, bounds)
    ideal, pooled = bounds["ideal"][0], bounds["pooled"][0]
    meta = {
        "kind": args.kind,
        "seed": args.seed,
        "scale": args.scale,
        "block_size": args.block_size,
        **summary(trace.rows),
        "ideal_hit_ratio": round(ideal, 4),
        "pooled_hit_ratio": round(pooled, 4),
        "pooled_capacity": {
            "workers": args.workers,
            "profile": profile.name,
            "blocks": capacity,
        },
        "work_ceiling": ceiling,
        **trace.meta,
        "params": dataclasses.asdict(params),
        "code_version": code_version(),
    }
    write_json(meta_path(args.out), meta)
    return meta


def summary_line(out: Path, meta: dict) -> str:
    extra = ""
    if meta["kind"] == "hotspot":
        extra = (
            f", hot {meta['hot_start_s']:.0f}-{meta['hot_end_s']:.0f} s"
            f" ({meta['hot_requests']} requests, {meta['hot_prefix_blocks']} prefix blocks)"
        )
    return (
        f"{out}: {meta['kind']} seed {meta['seed']}: {meta['requests']} requests, "
        f"span {meta['span_s']:.1f} s, mean input {meta['mean_input']:.0f} / output "
        f"{meta['mean_output']:.0f} tokens, ideal hit {meta['ideal_hit_ratio']:.3f}, pooled hit "
        f"{meta['pooled_hit_ratio']:.3f} ({meta['pooled_capacity']['blocks']} blocks), work "
        f"ceiling {_speed(meta['work_ceiling']['pooled']['speed'])} (pooled){extra}"
    )


def _speed(speed: float | None) -> str:
    return "none" if speed is None else f"{speed:.2f}x"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        meta = run(args)
    except ParamError as err:  # a usage error, as argparse's own (exit 2)
        print(f"thunderagent bench gen: error: bad parameter {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(summary_line(args.out, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
