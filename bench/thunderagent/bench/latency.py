"""Round-trip latency of one request through the whole stack vs straight to an engine.

Starts the embedded stack (real NATS, Redis and service processes, simulated engines with their
clock sped up so the modelled GPU time is negligible), then sends N sequential requests through
the control plane (client -> router -> scheduler -> adapter -> engine -> client) and N straight
to one engine's ``/generate`` over HTTP, and prints both distributions and their difference:
the latency the control plane adds.

    python -m thunderagent.bench.latency [--requests 1000] [--workers 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import aiohttp

from thunderagent import stats
from thunderagent.client import ThunderClient
from thunderagent.schemas import GenerateRequest
from thunderagent.stack.up import Stack, StackConfig


def summary(values: list[float]) -> dict:
    return stats.summary(values, digits=3)


async def through_stack(nats_url: str, model: str, n: int, prompt: list[int]) -> list[float]:
    client = await ThunderClient.connect(nats_url, idle_timeout_s=30)
    for _ in range(20):  # warm up connections, caches and the router's fleet view
        await client.generate(GenerateRequest(model=model, token_ids=prompt, max_tokens=1))
    out = []
    for _ in range(n):
        started = time.perf_counter()
        await client.generate(GenerateRequest(model=model, token_ids=prompt, max_tokens=1))
        out.append((time.perf_counter() - started) * 1e3)
    await client.close()
    return out


async def straight_to_engine(engine_url: str, n: int, prompt: list[int]) -> list[float]:
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}, "stream": True}
    out = []
    async with aiohttp.ClientSession() as session:
        for i in range(n + 20):
            started = time.perf_counter()
            async with session.post(engine_url + "/generate", json=body) as resp:
                async for _ in resp.content:
                    pass
            if i >= 20:
                out.append((time.perf_counter() - started) * 1e3)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--speedup", type=float, default=1000.0)
    parser.add_argument("--policy", default="thunder")
    parser.add_argument("--json", dest="json_out", default=None)
    args = parser.parse_args(argv)
    config = StackConfig(workers=args.workers, speedup=args.speedup, policy=args.policy)
    prompt = [4 + (i * 31) % 250 for i in range(args.prompt_tokens)]
    stack = Stack.start(config)
    try:
        direct = asyncio.run(straight_to_engine(stack.engine_urls[0], args.requests, prompt))
        stacked = asyncio.run(through_stack(stack.nats_url, config.model, args.requests, prompt))
    finally:
        stack.stop()
    result = {
        "requests": args.requests,
        "workers": args.workers,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": 1,
        "engine_speedup": args.speedup,
        "policy": args.policy,
        "through_stack_ms": summary(stacked),
        "direct_to_engine_ms": summary(direct),
        "added_ms": {
            "p50": round(stats.percentile(stacked, 50) - stats.percentile(direct, 50), 3),
            "p99": round(stats.percentile(stacked, 99) - stats.percentile(direct, 99), 3),
        },
    }
    print(json.dumps(result, indent=2))
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
