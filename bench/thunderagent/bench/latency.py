"""Round-trip latency of one request through the whole stack vs straight to an engine.

Starts the embedded stack (real NATS, Redis and service processes, simulated engines with their
clock sped up so the modelled GPU time is negligible), then sends N sequential requests through
the control plane (client -> router -> adapter -> engine -> client; the router holds scheduler
credit, so the scheduler hears of each request after) and N straight to one engine's
``/generate`` over HTTP, in alternating rounds, and prints both distributions and their
difference: the latency the control plane adds. Both clients run on uvloop, like the services;
each request is timed until its answer is complete (the final reply; straight to the engine, the
chunk that carries the finish reason).

``--embed-router`` adds a third path, alternated with the other two: a client with a router
replica in its own process (``RouterService(serve_requests=False)``, as ``thunderagent gateway
--embed-router`` runs it), which skips the hop to a router process: client -> adapter -> engine
-> client.

    python -m thunderagent.bench.latency [--requests 1000] [--rounds 10] [--embed-router]
        [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import time

import aiohttp
import uvloop

from thunderagent import stats
from thunderagent.bench.cli import bench_parser
from thunderagent.bench.jsonfile import dumps, write_json
from thunderagent.bus import Bus, connect
from thunderagent.client import ThunderClient
from thunderagent.embedded import nats_gomaxprocs
from thunderagent.router.service import RouterConfig, embedded_router
from thunderagent.router_core import RouterParams
from thunderagent.schemas import GenerateRequest
from thunderagent.shell import ServiceContext
from thunderagent.shell.argtypes import at_least, output_file, positive
from thunderagent.stack.up import Stack, StackConfig
from thunderagent.telemetry import Telemetry

WARM_UP = 20
FINISHED = re.compile(rb'"finish_reason":\s*\{')


def summary(values: list[float]) -> dict:
    return stats.summary(values, digits=3)


async def through_stack(
    client: ThunderClient, model: str, n: int, prompt: list[int]
) -> list[float]:
    out = []
    for _ in range(n):
        started = time.perf_counter()
        await client.generate(GenerateRequest(model=model, token_ids=prompt, max_tokens=1))
        out.append((time.perf_counter() - started) * 1e3)
    return out


async def straight_to_engine(
    session: aiohttp.ClientSession, engine_url: str, n: int, prompt: list[int]
) -> list[float]:
    """Timed to the chunk that carries the finish reason, where the adapter answers its client
    (the stream's ``[DONE]`` and end follow)."""
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}, "stream": True}
    out = []
    for _ in range(n):
        started = answered = time.perf_counter()
        async with session.post(engine_url + "/generate", json=body) as resp:
            async for line in resp.content:
                if answered == started and FINISHED.search(line):
                    answered = time.perf_counter()
        out.append((answered - started) * 1e3)
    return out


def embedded_context(nc, stop: asyncio.Event) -> ServiceContext:
    """The context of a router replica on the client's own connection ``nc``."""
    name = "bench-embedded-router"
    bus = Bus(nc, service=name)
    return ServiceContext(name=name, bus=bus, stop=stop, telemetry=Telemetry(service_name=name))


async def measure(
    nats_url: str,
    engine_url: str,
    model: str,
    n: int,
    rounds: int,
    prompt: list[int],
    embedded: dict | None = None,
) -> dict[str, list[float]]:
    """Every path in alternating rounds, so a drift in the machine's load hits them alike;
    ``embedded`` (``redis_url``, ``policy``): the third path too."""
    clients = {"stack": await ThunderClient.connect(nats_url, idle_timeout_s=30)}
    try:
        async with contextlib.AsyncExitStack() as stack:
            if embedded is not None:
                # a gateway's login: it may run a router replica (JetStream, KV events, credit)
                nc = await connect(nats_url, name="bench-embedded", identity="gateway")
                config = RouterConfig(
                    params=RouterParams(policy=embedded["policy"]), redis_url=embedded["redis_url"]
                )
                ctx = embedded_context(nc, asyncio.Event())
                router = await stack.enter_async_context(embedded_router(ctx, config))
                clients["embedded"] = ThunderClient(nc, idle_timeout_s=30, route=router.handle)
            return await _alternate(clients, engine_url, model, n, rounds, prompt)
    finally:  # after the replica stopped: the embedded client shares its connection
        for client in clients.values():
            await client.close()


async def _alternate(
    clients: dict[str, ThunderClient], engine_url: str, model: str, n: int, rounds: int,
    prompt: list[int],
) -> dict[str, list[float]]:  # fmt: skip
    times: dict[str, list[float]] = {"direct": [], **{name: [] for name in clients}}
    async with aiohttp.ClientSession() as session:
        await straight_to_engine(session, engine_url, WARM_UP, prompt)
        for client in clients.values():  # connections, caches, fleet view
            await through_stack(client, model, WARM_UP, prompt)
        per_round = max(1, n // rounds)
        for _ in range(rounds):
            times["direct"] += await straight_to_engine(session, engine_url, per_round, prompt)
            for name, client in clients.items():
                times[name] += await through_stack(client, model, per_round, prompt)
    return times


def added(path: list[float], direct: list[float]) -> dict:
    return {
        "p50": round(stats.percentile(path, 50) - stats.percentile(direct, 50), 3),
        "p99": round(stats.percentile(path, 99) - stats.percentile(direct, 99), 3),
    }


def report(args: argparse.Namespace, times: dict[str, list[float]]) -> dict:
    """The JSON: each path's distribution and what it adds over the direct one."""
    stacked, direct = times["stack"], times["direct"]
    result = {
        "requests": len(stacked),
        "rounds": args.rounds,
        "client_loop": "uvloop",
        "nats_gomaxprocs": nats_gomaxprocs(),
        "load_average": os.getloadavg(),
        "workers": args.workers,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": 1,
        "engine_speedup": args.speedup,
        "policy": args.policy,
        "through_stack_ms": summary(stacked),
        "direct_to_engine_ms": summary(direct),
        "added_ms": added(stacked, direct),
    }
    if "embedded" in times:
        result["embedded_router_ms"] = summary(times["embedded"])
        result["added_embedded_ms"] = added(times["embedded"], direct)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser("latency", __doc__)
    parser.add_argument("--requests", type=at_least(1), default=1000)
    parser.add_argument("--workers", type=at_least(1), default=2)
    parser.add_argument("--prompt-tokens", type=at_least(1), default=64)
    parser.add_argument("--speedup", type=positive, default=1000.0)
    parser.add_argument("--policy", default="thunder")
    parser.add_argument(
        "--rounds", type=at_least(1), default=10, help="alternations of the two paths"
    )
    parser.add_argument(
        "--embed-router", action="store_true",
        help="also time a client with a router replica in its own process (no router hop)",
    )  # fmt: skip
    parser.add_argument("--json", dest="json_out", type=output_file, default=None)
    args = parser.parse_args(argv)
    config = StackConfig(workers=args.workers, speedup=args.speedup, policy=args.policy)
    prompt = [4 + (i * 31) % 250 for i in range(args.prompt_tokens)]
    stack = Stack.start(config)
    embedded = {"redis_url": stack.redis_url or None, "policy": args.policy}
    try:
        times = uvloop.run(
            measure(stack.nats_url, stack.engine_urls[0], config.model, args.requests,
                    args.rounds, prompt, embedded if args.embed_router else None)
        )  # fmt: skip
    finally:
        stack.stop()
    result = report(args, times)
    print(dumps(result, indent=2))
    if args.json_out:
        write_json(args.json_out, result)


if __name__ == "__main__":
    main()
