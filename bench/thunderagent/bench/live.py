"""Live benchmark: a trace's requests through the running stack over NATS, and optionally the
same requests through HTTP routers in front of the same simulated engines, measured in one run on
one machine: SGLang's router (``sglang-router`` 0.3.2) and SMG (``smg`` 1.13.0), both
``--policy cache_aware`` with their shipped defaults, and Dynamo 1.6.1's KV router (``dynamo``:
its selection core with its defaults, behind a thin proxy of ours, ``bench.dynamo_router``).

Each trace block id becomes its own deterministic run of tokens, so equal ids mean equal
prefixes. Requests are sent open loop at ``--rate`` per second in trace order. For every request
the client records TTFT and end-to-end time; the engine reports its own receipt-to-first-token
time, so ``added_latency_ms = client TTFT - engine TTFT`` is what the system in front of the
engine added (routing, queueing outside the engine, every network hop).

The HTTP load generator reuses connections (keep-alive) or opens one per request (``fresh``):
sglang-router 0.3.2 leaves TCP_NODELAY off on the sockets it accepts, so on a reused connection
its response headers and first chunk meet Nagle's algorithm and the client's delayed ACK (~40 ms
on Linux). A fresh connection starts in quick-ACK mode and sees no such stall. Both are measured.

    thunderagent bench live --trace PATH --rate 200 --duration 30 \
        [--via nats|gateway|gateway-embedded] [--baseline sglang-router,smg,dynamo] \
        [--client-connections keepalive|fresh|both]

``--via gateway`` sends our requests over HTTP too (OpenAI ``/v1/completions`` through
``thunderagent gateway``, keep-alive), so the comparison is HTTP to HTTP; the gateway's final
usage chunk names the engine's own TTFT, so the added latency is measured the same way.
``--via gateway-embedded`` is the same with the router inside the gateway's process (and no
router service: nothing else sends requests).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from thunderagent.bench import procs, profile
from thunderagent.bench.baseline_routers import (
    BASELINES,
    baseline_missing,
    flush_all,
    parse_baselines,
    start_router,
    stop_router,
    system_name,
    wait_http,
)
from thunderagent.bench.cli import bench_parser
from thunderagent.bench.jsonfile import dumps, write_json
from thunderagent.bench.loadgen import error_codes
from thunderagent.bench.replay_args import sched_overrides
from thunderagent.client import ThunderClient
from thunderagent.embedded import nats_gomaxprocs
from thunderagent.engine.profiles import PRESETS
from thunderagent.replay.traces import TraceError, TraceRequest, load_trace
from thunderagent.schemas import ErrorReply, FinalReply, GenerateRequest, TokenChunk
from thunderagent.shell.argtypes import at_least, output_file, positive
from thunderagent.stack.up import ENTRY_POINTS, Stack, StackConfig, entry_point_settings
from thunderagent.stats import percentile

VOCAB = 32_000
CONNECTIONS = ("keepalive", "fresh")


def block_tokens(block_id: int, n: int) -> list[int]:
    """``n`` deterministic token ids for one trace block (splitmix64 stream seeded by the id)."""
    out = []
    x = (block_id * 0x9E3779B97F4A7C15 + 1) & 0xFFFFFFFFFFFFFFFF
    for _ in range(n):
        x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        z = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        out.append(4 + (z ^ (z >> 31)) % VOCAB)
    return out


@dataclass(slots=True)
class LiveRequest:
    index: int
    at: float
    token_ids: list[int]
    max_tokens: int


@dataclass
class Outcome:
    ttft_ms: float = -1.0
    e2e_ms: float = -1.0
    engine_ttft_ms: float = -1.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    token_messages: int = 0
    """Messages (stream chunks) that carried output tokens to the client."""
    error: str = ""


@dataclass
class SystemResult:
    name: str
    outcomes: list[Outcome] = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self) -> dict:
        ok = [o for o in self.outcomes if not o.error and o.ttft_ms >= 0]
        added = [o.ttft_ms - o.engine_ttft_ms for o in ok if o.engine_ttft_ms >= 0]
        prompt = sum(o.prompt_tokens for o in ok)

        def dist(values: list[float]) -> dict:
            if not values:
                return {}
            return {
                "p50": round(percentile(values, 50), 3),
                "p90": round(percentile(values, 90), 3),
                "p99": round(percentile(values, 99), 3),
                "mean": round(sum(values) / len(values), 3),
            }

        return {
            "requests": len(self.outcomes),
            "completed": len(ok),
            "errors": len(self.outcomes) - len(ok),
            "first_errors": sorted({o.error for o in self.outcomes if o.error})[:3],
            "error_codes": error_codes(o.error for o in self.outcomes),
            "achieved_rate": round(len(self.outcomes) / self.wall_s, 1) if self.wall_s else 0,
            "ttft_ms": dist([o.ttft_ms for o in ok]),
            "e2e_ms": dist([o.e2e_ms for o in ok]),
            "added_latency_ms": dist(added),
            # the engine's own receipt-to-first-token: the routing's share (queueing, prefill)
            "engine_ttft_ms": dist([o.engine_ttft_ms for o in ok if o.engine_ttft_ms >= 0]),
            "prefix_hit_ratio": round(sum(o.cached_tokens for o in ok) / prompt, 4)
            if prompt
            else 0,
            "token_messages_per_request": round(sum(o.token_messages for o in ok) / len(ok), 2)
            if ok
            else 0,
        }


def build_requests(
    trace: list[TraceRequest], rate: float, duration: float, tokens_per_block: int, max_out: int
) -> list[LiveRequest]:
    count = min(len(trace), int(rate * duration))
    cache: dict[int, list[int]] = {}
    out = []
    for i, t in enumerate(trace[:count]):
        tokens: list[int] = []
        for b in t.block_ids:
            if b not in cache:
                cache[b] = block_tokens(b, tokens_per_block)
            tokens.extend(cache[b])
        length = max(1, t.prompt_len * tokens_per_block // 512)
        out.append(LiveRequest(i, i / rate, tokens[:length], max(1, min(t.output_len, max_out))))
    return out


async def _open_loop(requests: list[LiveRequest], send) -> float:
    started = time.perf_counter()
    tasks = []
    for req in requests:
        delay = started + req.at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send(req)))
    await asyncio.gather(*tasks)
    return time.perf_counter() - started


async def run_thunderagent(nats_url: str, model: str, requests: list[LiveRequest]) -> SystemResult:
    client = await ThunderClient.connect(nats_url, idle_timeout_s=120)
    result = SystemResult("thunderagent", [Outcome() for _ in requests])

    async def send(req: LiveRequest) -> None:
        out = result.outcomes[req.index]
        t0 = time.perf_counter()
        request = GenerateRequest(model=model, token_ids=req.token_ids, max_tokens=req.max_tokens)
        async for reply in client.stream(request):
            now = time.perf_counter()
            if isinstance(reply, TokenChunk):
                out.token_messages += 1
                if out.ttft_ms < 0:
                    out.ttft_ms = (now - t0) * 1e3
            elif isinstance(reply, FinalReply):
                out.e2e_ms = (now - t0) * 1e3
                out.engine_ttft_ms = reply.engine_ttft_ms
                out.prompt_tokens = reply.usage.prompt_tokens
                out.cached_tokens = reply.usage.cached_tokens
            elif isinstance(reply, ErrorReply):
                out.error = f"{reply.code.value}: {reply.message[:120]}"

    result.wall_s = await _open_loop(requests, send)
    await client.close()
    return result


def _native_body(req: LiveRequest) -> dict:
    """SGLang's ``/generate``: what sglang-router and SMG route."""
    return {
        "input_ids": req.token_ids,
        "sampling_params": {"max_new_tokens": req.max_tokens, "ignore_eos": True},
        "stream": True,
    }


def _native_chunk(chunk: dict, out: Outcome) -> bool:
    """Fold one ``/generate`` chunk into ``out``; True when it carried tokens."""
    meta = chunk.get("meta_info", {})
    out.engine_ttft_ms = float(meta.get("engine_ttft_s", -0.001)) * 1e3
    out.prompt_tokens = int(meta.get("prompt_tokens", out.prompt_tokens))
    out.cached_tokens = int(meta.get("cached_tokens", out.cached_tokens))
    return True


def _openai_body(model: str, req: LiveRequest) -> dict:
    """OpenAI ``/v1/completions`` with token ids, as our gateway takes it."""
    return {
        "model": model,
        "prompt": req.token_ids,
        "max_tokens": req.max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _openai_chunk(chunk: dict, out: Outcome) -> bool:
    usage = chunk.get("usage")
    if usage:
        out.prompt_tokens = int(usage["prompt_tokens"])
        out.cached_tokens = int(usage["prompt_tokens_details"]["cached_tokens"])
        out.engine_ttft_ms = float(chunk.get("x_thunderagent", {}).get("engine_ttft_ms", -1.0))
    return bool(chunk.get("choices"))


async def run_http(
    url: str,
    name: str,
    requests: list[LiveRequest],
    connections: str = "keepalive",
    *,
    openai_model: str | None = None,
) -> SystemResult:
    """Stream every request through ``url``: SGLang's ``/generate``, or with ``openai_model``
    OpenAI's ``/v1/completions`` (our gateway). aiohttp sets TCP_NODELAY on its sockets;
    ``connections="fresh"`` closes each connection after its request."""
    result = SystemResult(name, [Outcome() for _ in requests])
    connector = aiohttp.TCPConnector(limit=0, force_close=connections == "fresh")
    path, fold = (
        ("/v1/completions", _openai_chunk) if openai_model else ("/generate", _native_chunk)
    )
    async with aiohttp.ClientSession(connector=connector) as session:

        async def send(req: LiveRequest) -> None:
            out = result.outcomes[req.index]
            body = _openai_body(openai_model, req) if openai_model else _native_body(req)
            t0 = time.perf_counter()
            try:
                async with session.post(url + path, json=body) as resp:
                    if resp.status != 200:
                        out.error = f"HTTP {resp.status}: {(await resp.text())[:120]}"
                        return
                    async for raw in resp.content:
                        line = raw.strip()
                        if not line.startswith(b"data:") or line.endswith(b"[DONE]"):
                            continue
                        chunk = json.loads(line[5:])
                        if "error" in chunk:
                            out.error = f"stream error: {str(chunk['error'])[:120]}"
                            return
                        if fold(chunk, out):
                            out.token_messages += 1
                            if out.ttft_ms < 0:
                                out.ttft_ms = (time.perf_counter() - t0) * 1e3
                out.e2e_ms = (time.perf_counter() - t0) * 1e3
            except (aiohttp.ClientError, OSError) as err:
                out.error = f"{type(err).__name__}: {err}"

        result.wall_s = await _open_loop(requests, send)
    return result


def _parser() -> argparse.ArgumentParser:
    p = bench_parser("live", __doc__)
    p.add_argument("--trace", required=True)
    p.add_argument("--rate", type=positive, default=50.0, help="requests per second")
    p.add_argument("--duration", type=positive, default=20.0, help="seconds of arrivals")
    _fleet_arguments(p)
    p.add_argument(
        "--tokens-per-block",
        type=int,
        default=64,
        help="tokens per trace block (512 in the trace; fewer keeps JSON small)",
    )
    p.add_argument(
        "--max-output", type=at_least(1), default=16, help="cap on output tokens per request"
    )
    p.add_argument("--policy", default="thunder")
    p.add_argument("--sched-param", action="append", default=[], metavar="FIELD=VALUE",
                   help="a knob of the stack's scheduler (repeatable)")  # fmt: skip
    _entry_arguments(p)
    p.add_argument(
        "--baseline",
        type=parse_baselines,
        default=[],
        help=f"comma-separated HTTP routers to run after ours: {', '.join(BASELINES)}",
    )
    p.add_argument(
        "--client-connections",
        choices=[*CONNECTIONS, "both"],
        default="both",
        help="HTTP baselines: reuse client connections, open one per request, or run both",
    )
    p.add_argument("--json", dest="json_out", type=output_file, default=None)
    return p


def _entry_arguments(p: argparse.ArgumentParser) -> None:
    """Where our requests enter the stack, and how many routers take them."""
    p.add_argument(
        "--via",
        choices=ENTRY_POINTS,
        default="nats",
        help="send our requests over NATS (ThunderClient) or over HTTP through the OpenAI "
        "gateway (/v1/completions), as the baselines get theirs; gateway-embedded: the "
        "gateway routes in its own process (--embed-router)",
    )
    p.add_argument(
        "--routers", type=at_least(1), default=1,
        help="router replicas (one queue group; each keeps its own view of the requests it "
        "routed); none with --via gateway-embedded, whose gateway routes itself",
    )  # fmt: skip


def _fleet_arguments(p: argparse.ArgumentParser) -> None:
    """The simulated engines ours and the baselines route to."""
    p.add_argument("--workers", type=at_least(1), default=4)
    p.add_argument(
        "--dp-size", type=at_least(1), default=1,
        help="data-parallel ranks per simulated engine (each its own KV cache); compare "
        "--baseline smg (engine-level routing, SGLang's round robin over the ranks) with "
        "smg-dp-aware",
    )  # fmt: skip
    p.add_argument("--profile", default="llama-3.1-8b-h100", choices=sorted(PRESETS))
    p.add_argument("--speedup", type=positive, default=20.0, help="simulated engines' clock speed")
    p.add_argument(
        "--kv-events", choices=["on", "off"], default="on",
        help="off: the engines publish no KV events (SGLang's default); our adapters announce "
        "what each run leaves cached (the HTTP baselines keep their own trees either way)",
    )  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = _parser()
    args = parser.parse_args(argv)
    sched_overrides(args.sched_param, parser)  # a bad name or value: a usage error now
    return args


def stack_config(args: argparse.Namespace) -> StackConfig:
    """The stack ours runs on (the baselines route to its engines)."""
    return StackConfig(
        workers=args.workers, speedup=args.speedup, policy=args.policy, profile=args.profile,
        dp_size=args.dp_size, kv_events=args.kv_events == "on",
        scheduler_args=[f"--param={item}" for item in args.sched_param],
        **entry_point_settings(args.via, args.routers),
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)

    try:
        trace = load_trace(args.trace)
    except TraceError as err:
        raise SystemExit(f"bad trace: {err}") from None
    requests = build_requests(
        trace, args.rate, args.duration, args.tokens_per_block, args.max_output
    )
    config = stack_config(args)
    print(f"{len(requests)} requests at {args.rate}/s; starting the stack ...", file=sys.stderr)
    stack = Stack.start(config)
    systems: dict[str, dict] = {}
    try:
        if args.via != "nats":
            asyncio.run(wait_http(stack.gateway_url, openai=True))
        meter = procs.CpuMeter(profile.stack_pids(stack))
        meter.start()
        if args.via != "nats":
            ours = asyncio.run(run_http(stack.gateway_url, "thunderagent", requests,
                                        openai_model=config.model))  # fmt: skip
        else:
            ours = asyncio.run(run_thunderagent(stack.nats_url, config.model, requests))
        cpu = procs.per_request_us(meter.stop(), len(requests))
        systems["thunderagent"] = ours.summary()
        # over the run's wall time, idle work included (load reports, leases, ticks)
        systems["thunderagent"]["cpu_us_per_req"] = procs.group(cpu, profile.SERVICE_GROUPS)
        print(dumps(systems["thunderagent"], indent=None), file=sys.stderr)
        if args.baseline:
            connections = (
                CONNECTIONS if args.client_connections == "both" else [args.client_connections]
            )
            systems |= run_baselines(stack, requests, args.baseline, connections)
    finally:
        stack.stop()
    report = build_report(args, systems)
    print(dumps(report, indent=2))
    if args.json_out:
        write_json(args.json_out, report)


def build_report(args: argparse.Namespace, systems: dict[str, dict]) -> dict:
    """The JSON report: the run's settings, each system's summary, ours over each baseline."""
    report = {
        "trace": Path(args.trace).name,
        "rate": args.rate,
        "duration_s": args.duration,
        "workers": args.workers,
        "dp_size": args.dp_size,
        "profile": args.profile,
        "engine_speedup": args.speedup,
        "tokens_per_block": args.tokens_per_block,
        "max_output": args.max_output,
        "policy": args.policy,
        "sched_params": args.sched_param,
        "kv_events": args.kv_events,
        "via": args.via,
        "client": {"tcp_nodelay": True, "connections": args.client_connections},
        "nats_gomaxprocs": nats_gomaxprocs(),
        "systems": systems,
    }
    ratios = {
        name: _ratios(systems["thunderagent"], summary)
        for name, summary in systems.items()
        if name != "thunderagent" and "ttft_ms" in summary
    }
    if "sglang-router" in ratios:
        report["ratios_thunderagent_over_sglang_router"] = ratios["sglang-router"]
    if ratios:
        report["ratios_thunderagent_over"] = ratios
    return report


def run_baselines(
    stack: Stack, requests: list[LiveRequest], baselines: list[str], connections: list[str]
) -> dict[str, dict]:
    """Each baseline once per client-connection mode, each run on a freshly started router over
    flushed engines, with the control plane stopped so the baselines get the machine to
    themselves: only the engines keep running."""
    for child in stack.children:
        if not child.name.startswith("engine-"):
            child.stop()
    out: dict[str, dict] = {}
    for baseline in baselines:
        missing = baseline_missing(baseline)
        for mode in connections:
            name = system_name(baseline, mode)
            if missing:
                print(missing, file=sys.stderr)
                out[name] = {"skipped": missing}
                continue
            out[name] = _run_baseline(stack, requests, baseline, mode)
    return out


def _run_baseline(
    stack: Stack, requests: list[LiveRequest], baseline: str, connections: str
) -> dict:
    name = system_name(baseline, connections)
    asyncio.run(flush_all(stack.engine_urls))
    proc, url = start_router(baseline, stack.engine_urls, stack.run_dir / f"{baseline}.log")
    try:
        asyncio.run(wait_http(url))
        asyncio.run(flush_all(stack.engine_urls))
        result = asyncio.run(run_http(url, name, requests, connections)).summary()
        print(dumps({name: result}, indent=None), file=sys.stderr)
        return result
    finally:
        stop_router(proc)


def _ratios(ours: dict, base: dict) -> dict:
    out = {}
    for metric in ("ttft_ms", "e2e_ms", "added_latency_ms"):
        for q in ("p50", "p99"):
            b = base.get(metric, {}).get(q)
            if b:
                out[f"{metric}.{q}"] = round(ours[metric][q] / b, 3)
    if base.get("prefix_hit_ratio"):
        out["prefix_hit_ratio"] = round(ours["prefix_hit_ratio"] / base["prefix_hit_ratio"], 3)
    return out


if __name__ == "__main__":
    main()
