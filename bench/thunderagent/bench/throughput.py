"""Throughput: open-loop rates stepped up against engines that answer at once, through the stack
and through HTTP routers (SMG 1.13, sglang-router 0.3.2) in front of the same engines, in one run.

Per rate: the added latency (TTFT p50 / p99 through the system minus the same through straight
HTTP calls to the engines at the same rate, measured right before) and the CPU µs per request of
every process (from the kernel's per-thread CPU time, less each process's idle rate), and the
highest rate held with added p99 within ``--bound-ms``. Stepping stops after a rate that is not
held (the system or the load generator fell behind, errors, or the p99 bound is missed by far).

The stack runs first (router, scheduler, adapters, index, migration, NATS, Redis, instant engines);
then its control plane stops and each baseline gets the engines and the machine to itself, on a
fresh router process, launched as ``bench live`` does (``--policy cache_aware``, its defaults).

    thunderagent bench throughput --json /tmp/throughput.json \
        [--rates 100,200,400,700,1000,1500] [--duration 3] [--baseline smg,sglang-router]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import uvloop

from thunderagent.bench import baseline_routers as routers
from thunderagent.bench import loadgen, profile
from thunderagent.bench.cli import bench_parser
from thunderagent.bench.jsonfile import dumps, write_json
from thunderagent.client import ThunderClient
from thunderagent.embedded import nats_gomaxprocs
from thunderagent.shell.argtypes import at_least, output_file, positive, positive_list
from thunderagent.stack.up import ENTRY_POINTS, Stack

DEFAULT_RATES = (100, 200, 400, 700, 1000, 1500)


def parse_rates(text: str) -> list[float]:
    """``--rates``: finite requests/s > 0, each once; stepped up from the lowest."""
    return sorted(positive_list(text))


def step(rate: float, system: profile.Measured, direct: profile.Measured) -> dict:
    """One rate's row: the brief's keys first, then the detail behind them."""
    added = profile.added(system.load, direct.load)
    return {
        "rate": rate,
        "added_p50_ms": added["p50"],
        "added_p99_ms": added["p99"],
        "cpu_us_per_req": system.cpu_us,
        "wakeups_per_req": system.wakeups,
        "system": system.load.summary(),
        "direct": direct.load.summary(),
        "direct_cpu_us_per_req": direct.cpu_us,
    }


def held(row: dict, bound_ms: float) -> bool:
    """Every request answered, the rate kept (by the system and by the load generator) and the
    added p99 within the bound, and the reference run undisturbed (``reference_disturbed``)."""
    s, p99 = row["system"], row["added_p99_ms"]
    return (
        s["errors"] == 0
        and s["achieved_rate"] >= 0.95 * row["rate"]
        and p99 is not None
        and p99 <= bound_ms
        and not reference_disturbed(row, bound_ms)
    )


def reference_disturbed(row: dict, bound_ms: float) -> bool:
    """The run straight to the engines, the reference the added latency is taken from, was
    slower at p99 than the whole system by more than the bound: a stall of the machine during
    it, not the system's speed. Such a row says nothing about the system (its added p99 is far
    below zero) and is not counted as held."""
    p99 = row["added_p99_ms"]
    return p99 is not None and p99 < -bound_ms


def keep_going(row: dict, bound_ms: float) -> bool:
    """Step on while the system keeps up; a rate missed by far ends the sweep (the next rates
    would only queue longer and take minutes to drain)."""
    s, p99 = row["system"], row["added_p99_ms"]
    return held(row, bound_ms) or (
        s["errors"] == 0 and s["achieved_rate"] >= 0.9 * row["rate"]
        and p99 is not None and p99 <= 3 * bound_ms
    )  # fmt: skip


def max_rate(rows: list[dict], bound_ms: float) -> float:
    return max((r["rate"] for r in rows if held(r, bound_ms)), default=0.0)


class Sweep:
    """What every rate of every system shares: prompts, the processes to meter, idle rates."""

    def __init__(self, args: argparse.Namespace, engine_urls: list[str]) -> None:
        self.args = args
        self.engine_urls = engine_urls
        self.pids: dict[str, int] = {}
        self.idle = profile.Idle({}, {})
        self._seed = 10

    def count(self, rate: float) -> int:
        return max(50, int(rate * self.args.duration))

    def bodies(self, n: int) -> list[list[int]]:
        """Fresh prompts for each run (their unique tail stores new blocks, as in real use)."""
        self._seed += 1
        return loadgen.prompts(n, self.args.prompt_tokens, self.args.unique_tokens, seed=self._seed)

    async def direct(self, rate: float) -> profile.Measured:
        n = self.count(rate)
        async with loadgen.http_session() as session:
            bodies = loadgen.http_bodies(self.bodies(n))
            send = loadgen.http_sender(session, self.engine_urls, bodies)
            return await profile.measured(self.pids, self.idle, rate, n, send)

    async def http(self, url: str, rate: float) -> profile.Measured:
        n = self.count(rate)
        fresh = self.args.baseline_connections == "fresh"
        async with loadgen.http_session(force_close=fresh) as session:
            send = loadgen.http_sender(session, [url], loadgen.http_bodies(self.bodies(n)))
            return await profile.measured(self.pids, self.idle, rate, n, send)

    async def sweep(self, run_system) -> list[dict]:
        rows = []
        for rate in self.args.rates:
            await asyncio.sleep(0.5)  # the previous rate's stragglers and KV events settle
            direct = await self.direct(rate)
            await asyncio.sleep(0.3)
            system = await run_system(rate)
            row = step(rate, system, direct)
            rows.append(row)
            print(_line(row, self.args.bound_ms), file=sys.stderr)
            if not keep_going(row, self.args.bound_ms):
                break
        return rows


def _line(row: dict, bound_ms: float) -> str:
    s = row["system"]
    cpu = sum(v for k, v in row["cpu_us_per_req"].items() if k != "loadgen")
    return (
        f"  {row['rate']:>6.0f}/s: added p50 {row['added_p50_ms']} p99 "
        f"{row['added_p99_ms']} ms, achieved {s['achieved_rate']}/s, errors {s['errors']}, "
        f"CPU {cpu:.0f} µs/req (+ load generator {row['cpu_us_per_req'].get('loadgen', 0)}), "
        f"load average {profile.load_average()[0]}"
        + (", reference run disturbed: not counted" if reference_disturbed(row, bound_ms) else "")
    )


async def run_stack(stack: Stack, sweep: Sweep) -> list[dict]:
    if stack.gateway_url:
        return await run_gateway(stack, sweep)
    model = stack.config.model
    client = await ThunderClient.connect(stack.nats_url, idle_timeout_s=15)
    try:
        warm = loadgen.prompts(300, sweep.args.prompt_tokens, sweep.args.unique_tokens, seed=1)
        await loadgen.open_loop(100, len(warm), loadgen.thunder_sender(client, model, warm))
        sweep.pids = profile.stack_pids(stack)
        sweep.idle = await profile.idle_rates(sweep.pids, 1.5)

        async def through_stack(rate: float) -> profile.Measured:
            n = sweep.count(rate)
            send = loadgen.thunder_sender(client, model, sweep.bodies(n))
            return await profile.measured(sweep.pids, sweep.idle, rate, n, send)

        return await sweep.sweep(through_stack)
    finally:
        await client.close()


async def run_gateway(stack: Stack, sweep: Sweep) -> list[dict]:
    """The same requests over HTTP through ``thunderagent gateway`` (OpenAI completions,
    streamed, keep-alive), as the HTTP routers get theirs; the gateway is metered with the
    services (with ``--via gateway-embedded`` it is the router too)."""
    model, url = stack.config.model, stack.gateway_url
    await routers.wait_http(url, openai=True)
    async with loadgen.http_session() as session:

        def sender(bodies: list[list[int]]) -> loadgen.Send:
            payloads = loadgen.completion_bodies(bodies, model)
            return loadgen.http_sender(session, [url], payloads, "/v1/completions")

        warm = loadgen.prompts(300, sweep.args.prompt_tokens, sweep.args.unique_tokens, seed=1)
        await loadgen.open_loop(100, len(warm), sender(warm))
        sweep.pids = profile.stack_pids(stack)
        sweep.idle = await profile.idle_rates(sweep.pids, 1.5)

        async def through_gateway(rate: float) -> profile.Measured:
            n = sweep.count(rate)
            return await profile.measured(sweep.pids, sweep.idle, rate, n, sender(sweep.bodies(n)))

        return await sweep.sweep(through_gateway)


def run_baseline(stack: Stack, sweep: Sweep, name: str) -> dict:
    """One HTTP router over the engines (the control plane already stopped)."""
    missing = routers.baseline_missing(name)
    if missing:
        print(missing, file=sys.stderr)
        return {"skipped": missing}
    print(f"{name} ...", file=sys.stderr)
    proc, url = routers.start_router(name, stack.engine_urls, stack.run_dir / f"{name}.log")
    try:
        asyncio.run(routers.wait_http(url))
        engines = {k: v for k, v in profile.stack_pids(stack).items() if k.startswith("engine-")}
        sweep.pids = {**engines, name: proc.pid}
        sweep.idle = uvloop.run(profile.idle_rates(sweep.pids, 1.5))

        async def through_router(rate: float) -> profile.Measured:
            return await sweep.http(url, rate)

        rows = uvloop.run(sweep.sweep(through_router))
        return {"rates": rows, "max_rate": max_rate(rows, sweep.args.bound_ms)}
    finally:
        routers.stop_router(proc)


def _parser() -> argparse.ArgumentParser:
    p = bench_parser("throughput", __doc__)
    p.add_argument(
        "--rates",
        type=parse_rates,
        default=list(DEFAULT_RATES),
        help="requests per second to step through, comma-separated",
    )
    p.add_argument("--duration", type=positive, default=3.0, help="seconds of arrivals per rate")
    p.add_argument(
        "--bound-ms",
        type=float,
        default=10.0,
        help="added p99 a rate must stay within to count as held",
    )
    p.add_argument(
        "--workers", type=at_least(1), default=2, help="instant engines (one adapter each)"
    )
    p.add_argument(
        "--routers", type=int, default=1, help="router replicas (one queue group; scale-out)"
    )
    p.add_argument(
        "--via",
        choices=ENTRY_POINTS,
        default="nats",
        help="our requests over NATS (ThunderClient), or over HTTP through the gateway (with "
        "the router inside it: gateway-embedded), as the HTTP routers get theirs",
    )
    p.add_argument("--prompt-tokens", type=at_least(1), default=64)
    p.add_argument(
        "--unique-tokens",
        type=int,
        default=16,
        help="tokens of each prompt no other prompt has (new KV blocks per request)",
    )
    p.add_argument(
        "--baseline",
        type=routers.parse_baselines,
        default=["smg", "sglang-router"],
        help=f"HTTP routers to measure after the stack: {', '.join(routers.BASELINES)}",
    )
    p.add_argument("--no-baseline", dest="baseline", action="store_const", const=[])
    p.add_argument(
        "--no-stack",
        dest="stack",
        action="store_false",
        help="measure only the baselines (the stack still starts, for its engines)",
    )
    p.add_argument(
        "--baseline-connections",
        choices=["keepalive", "fresh"],
        default="keepalive",
        help="HTTP routers: reuse client connections, or one per request (sglang-router "
        "0.3.2 leaves Nagle on: keep-alive answers wait ~40 ms for a delayed ACK)",
    )
    p.add_argument("--json", dest="json_out", type=output_file, default=None)
    return p  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    report: dict = {
        "settings": {k: v for k, v in vars(args).items() if k != "json_out"},
        "engine": "instant",
        "code_version": profile.code_version(),
        "nats_gomaxprocs": nats_gomaxprocs(),
        "cpus": os.cpu_count(),
        "load_average_before": profile.load_average(),
    }
    started = time.perf_counter()
    print(f"starting the stack ({args.workers} instant engines) ...", file=sys.stderr)
    stack = profile.start_stack(args.workers, "throughput", args.routers, via=args.via)
    try:
        sweep = Sweep(args, stack.engine_urls)
        if args.stack:
            print("thunderagent:", file=sys.stderr)
            rows = uvloop.run(run_stack(stack, sweep))
            report["rates"] = rows
            report["max_rate"] = max_rate(rows, args.bound_ms)
        for child in stack.children:  # the baselines get the engines and the machine
            if not child.name.startswith("engine-"):
                child.stop()
        report["baseline"] = {name: run_baseline(stack, sweep, name) for name in args.baseline}
    finally:
        stack.stop()
    report["load_average_after"] = profile.load_average()
    report["wall_s"] = round(time.perf_counter() - started, 1)
    print(summary(report), file=sys.stderr)
    print(dumps(report, indent=2))
    if args.json_out:
        write_json(args.json_out, report)


def summary(report: dict) -> str:
    lines = [f"held with added p99 <= bound: thunderagent {report.get('max_rate', '-')} req/s"]
    for name, result in report.get("baseline", {}).items():
        if "max_rate" in result:
            lines.append(f"  {name} {result['max_rate']} req/s")
    lines.append(
        f"load average {report['load_average_before']} -> {report['load_average_after']}, "
        f"{report['wall_s']} s"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
