"""Live hot spot: a generated hot-spot trace's hot period through the running stack over NATS,
once with KV moves off and once with NIXL copies (the migration service's planner and the
pull at dispatch), each in a fresh stack on the same engines: the replay's ``--migration off``
and ``nixl`` cells, on the wall clock.

The engines keep real KV bytes (``--kv-pool``), divided by ``--kv-pool-scale`` so eight pools
fit in this machine's memory, and pace every copy so it takes as long as the full bytes would
on the link (``--link-gbps``, 25 GB/s: a 16,384-token Llama-3.1-8B prefix, 2 GiB, in ~86 ms).
The requests are the trace's rows arriving in ``--window`` (trace seconds; default: from the
first lead request for the hot prefix to the hot period's end, from the generator's sidecar),
sent open loop at their own times, prompts built from their block ids at 512 tokens a block,
outputs capped at ``--max-output`` (64: the simulated engines stream every token over HTTP, and
eight of them streaming the trace's ~360-token answers take most of this 2-core machine, which
would slow their own clock). The same requests are replayed in virtual time through the same
cores (``bench replay``, thunder, ``--migration off`` and ``nixl``), so each mode's live figures
sit beside the replay's. Reported per mode: every request's TTFT, the hot requests' (the
trace's ``hot`` rows), and the prompt tokens served from cache; ``requests == completed +
errors`` (a request that got no answer within the client's idle timeout is an error).

    thunderagent bench gen --kind hotspot --seed 1 --param hot_lead_s=60 --out hot.jsonl
    thunderagent bench live-hot --trace hot.jsonl --json live_hot.json     # ~8 min
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from collections import Counter
from dataclasses import replace
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from thunderagent.bench import replay
from thunderagent.bench.cli import bench_parser
from thunderagent.bench.jsonfile import dumps, write_json
from thunderagent.bench.live import LiveRequest, block_tokens, run_thunderagent
from thunderagent.engine.profiles import PRESETS
from thunderagent.replay.traces import TraceError, TraceRequest, load_trace
from thunderagent.shell.argtypes import at_least, output_file, positive
from thunderagent.stack.up import Stack, StackConfig
from thunderagent.stats import percentile

MODES = ("off", "nixl")
REPLAY_COPIES = ("pulls", "pulls_refused", "pulls_given_up", "replications",
                 "migrations", "failed_moves")  # fmt: skip
TRACE_BLOCK = 512


def window_arg(text: str) -> tuple[float, float]:
    """``--window S,E``: trace seconds, S < E."""
    try:
        start, end = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected S,E in seconds, got {text!r}") from None
    if not start < end:
        raise argparse.ArgumentTypeError(f"the window must start before it ends, got {text!r}")
    return start, end


def window_of(trace_path: Path, arg: tuple[float, float] | None) -> tuple[float, float]:
    """``--window``, else the sidecar's hot period less its lead time."""
    if arg is not None:
        return arg
    meta_path = trace_path.with_suffix(".meta.json")
    try:
        meta = json.loads(meta_path.read_text())
        lead = float(meta["params"].get("hot_lead_s", 0.0))
        return float(meta["hot_start_s"]) - lead - 1.0, float(meta["hot_end_s"])
    except (OSError, KeyError, ValueError) as err:
        raise SystemExit(f"no --window and no hot period in {meta_path}: {err}") from None


def rows_in(
    trace: list[TraceRequest], window: tuple[float, float], max_output: int
) -> list[TraceRequest]:
    """The rows arriving in ``window``, from its start, outputs capped."""
    start, end = window
    return [
        replace(t, arrival=t.arrival - start, output_len=max(1, min(t.output_len, max_output)))
        for t in trace
        if start <= t.arrival < end
    ]


def live_requests(rows: list[TraceRequest]) -> list[LiveRequest]:
    blocks: dict[int, list[int]] = {}
    out = []
    for i, t in enumerate(rows):
        tokens: list[int] = []
        for b in t.block_ids:
            if b not in blocks:
                blocks[b] = block_tokens(b, TRACE_BLOCK)
            tokens.extend(blocks[b])
        out.append(LiveRequest(i, t.arrival, tokens[: t.prompt_len], t.output_len))
    return out


def replayed(rows: list[TraceRequest], workers: int, profile: str, mode: str) -> dict:
    """The same rows through ``bench replay`` (virtual time): thunder, migration ``mode``."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "window.jsonl"
        path.write_text("".join(json.dumps({
            "timestamp": round(t.arrival * 1000), "input_length": t.prompt_len,
            "output_length": t.output_len, "hash_ids": t.block_ids, "hot": t.hot,
        }) + "\n" for t in rows))  # fmt: skip
        argv = ["--trace", str(path), "--policies", "thunder", "--speed", "1", "--quiet",
                "--workers", str(workers), "--profile", profile, "--migration", mode]  # fmt: skip
        doc, _ = replay.run(replay.parse_args(argv))
    entry = doc["results"][0]
    assert entry["requests"] == entry["completed"] + entry["rejected"] + entry["in_flight"]
    return {
        "requests": entry["requests"],
        "completed": entry["completed"],
        "all": {"ttft_p50_ms": round(entry["ttft_ms"]["p50"], 1),
                "ttft_p99_ms": round(entry["ttft_ms"]["p99"], 1)},
        "hot": {"ttft_p50_ms": round(entry["hot"]["hot"]["ttft_p50_ms"], 1),
                "ttft_p99_ms": round(entry["hot"]["hot"]["ttft_p99_ms"], 1)},
        "hit_ratio": round(entry["prefix_hit_ratio"], 4),
        "copies": {k: entry.get(k, 0) for k in REPLAY_COPIES},
    }  # fmt: skip


def stack_config(args: argparse.Namespace, mode: str) -> StackConfig:
    pace = args.link_gbps / args.kv_pool_scale  # the pool's bytes, in the full bytes' time
    return StackConfig(
        workers=args.workers, profile=args.profile, kv_pool=True,
        kv_pool_scale=args.kv_pool_scale, engine_args=["--kv-pull-gbps", str(pace)],
        pull_min_tokens=None if mode == "nixl" else 0,
        migration_args=[] if mode == "nixl" else ["--orders-only"], metrics=True,
    )  # fmt: skip


def summarize(outcomes: list, hot: list[bool]) -> dict:
    def ttft(which: list) -> dict:
        done = [o.ttft_ms for o in which if not o.error and o.ttft_ms >= 0]
        if not done:
            return {"requests": len(which), "completed": 0}
        return {
            "requests": len(which),
            "completed": len(done),
            "ttft_p50_ms": round(percentile(done, 50), 1),
            "ttft_p99_ms": round(percentile(done, 99), 1),
        }

    ok = [o for o in outcomes if not o.error and o.ttft_ms >= 0]
    prompt = sum(o.prompt_tokens for o in ok)
    return {
        "requests": len(outcomes),
        "completed": len(ok),
        "errors": len(outcomes) - len(ok),
        "first_errors": sorted({o.error for o in outcomes if o.error})[:3],
        "all": ttft(outcomes),
        "hot": ttft([o for o, h in zip(outcomes, hot, strict=True) if h]),
        "hit_ratio": round(sum(o.cached_tokens for o in ok) / prompt, 4) if prompt else 0.0,
    }


async def copies_made(stack: Stack) -> dict:
    """The copies the services report on their Prometheus endpoints (``count_copies``); a
    service that cannot be read is named instead (the run's figures are kept either way)."""
    texts, unread = [], []
    async with aiohttp.ClientSession() as session:
        for name, port in stack.metrics_ports.items():
            try:
                async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
                    texts.append(await resp.text())
            except aiohttp.ClientError as err:
                unread.append(f"{name}: {err}")
    return {**count_copies(texts), **({"unread": unread} if unread else {})}


def count_copies(texts: list[str]) -> dict:
    """From Prometheus expositions: the adapters' pulls at dispatch by outcome, the migration
    service's moves by mode and outcome, summed over the services."""
    counts: dict[str, Counter] = {"pulls": Counter(), "moves": Counter()}
    for text in texts:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if not sample.name.endswith("_total"):
                    continue
                if family.name == "thunderagent_dispatch_pulls":
                    counts["pulls"][sample.labels.get("outcome", "")] += int(sample.value)
                elif family.name == "thunderagent_migrations":
                    key = f"{sample.labels.get('mode', '')} {sample.labels.get('outcome', '')}"
                    counts["moves"][key] += int(sample.value)
    return {k: dict(v) for k, v in counts.items()}


async def drive(stack: Stack, rows: list[TraceRequest]):
    result = await run_thunderagent(stack.nats_url, stack.config.model, live_requests(rows))
    await asyncio.sleep(1.0)  # the last counts reach the metrics
    return result, await copies_made(stack)


def run_mode(args: argparse.Namespace, mode: str, rows: list[TraceRequest]) -> dict:
    stack = Stack.start(stack_config(args, mode))
    try:
        result, copies = asyncio.run(drive(stack, rows))
    finally:
        stack.stop()
    live = {
        "wall_s": round(result.wall_s, 1),
        **summarize(result.outcomes, [t.hot for t in rows]),
        "copies": copies,
    }
    assert live["requests"] == live["completed"] + live["errors"]
    return {"mode": mode, "live": live,
            "replay": replayed(rows, args.workers, args.profile, mode)}  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    p = bench_parser("live-hot", __doc__)
    p.add_argument("--trace", type=Path, required=True, help="a `bench gen --kind hotspot` trace")
    p.add_argument("--window", type=window_arg, default=None, metavar="S,E",
                   help="trace seconds to send")  # fmt: skip
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated: off, nixl")
    p.add_argument("--workers", type=at_least(2), default=8)
    p.add_argument("--profile", choices=sorted(PRESETS), default="llama-3.1-8b-h100")
    p.add_argument("--kv-pool-scale", type=at_least(1), default=256,
                   help="divide each engine's KV bytes per block by this")  # fmt: skip
    p.add_argument("--link-gbps", type=positive, default=25.0,
                   help="the link a copy's full bytes cross, GB/s")  # fmt: skip
    p.add_argument("--max-output", type=at_least(1), default=64,
                   help="cap on each request's output tokens")  # fmt: skip
    p.add_argument("--json", dest="json_out", type=output_file, default=None)
    return p


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        raise SystemExit(f"--modes: expected some of {', '.join(MODES)}, got {args.modes!r}")
    try:
        trace = load_trace(args.trace)
    except TraceError as err:
        raise SystemExit(f"bad trace: {err}") from None
    window = window_of(args.trace, args.window)
    rows = rows_in(trace, window, args.max_output)
    hot = sum(t.hot for t in rows)
    if not hot:
        raise SystemExit(f"no hot request in the window {window} (not a hot-spot trace?)")
    print(f"{len(rows)} requests ({hot} hot) over {window[1] - window[0]:.0f} s", file=sys.stderr)
    runs = []
    for mode in modes:
        runs.append(run_mode(args, mode, rows))
        print(dumps(runs[-1], indent=None), file=sys.stderr)
    report = {
        "trace": str(args.trace), "window_s": list(window), "workers": args.workers,
        "kv_pool_scale": args.kv_pool_scale, "link_gbps": args.link_gbps,
        "max_output": args.max_output, "runs": runs,
    }  # fmt: skip
    print(dumps(report, indent=2))
    if args.json_out:
        write_json(args.json_out, report)


if __name__ == "__main__":
    main()
