"""``thunderagent demo``: the embedded stack, a short conversational workload, a summary.

The workload is multi-turn chats that share a few system prompts, sent as text (so the router
tokenizes them), each turn's prompt being the previous prompt plus the previous answer plus a
new question: the pattern where KV-aware routing pays off. The summary shows how much of the
prompt traffic the engines served from cache and where requests went.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

from thunderagent.client import Completion, RequestFailed, ThunderClient
from thunderagent.schemas import GenerateRequest
from thunderagent.stack.up import Stack, StackConfig

SYSTEM_PROMPTS = [
    "You are a meticulous code reviewer for a distributed systems team. " * 6,
    "You are a travel planner who answers with short, concrete itineraries. " * 6,
    "You are a patient math tutor; show each step and check the result. " * 6,
]
QUESTIONS = [
    "What should I look at first?",
    "Can you give an example?",
    "What are the trade-offs?",
    "How would you measure it?",
    "Summarise the answer in two sentences.",
]


@dataclass
class DemoResult:
    completions: list[Completion] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0


async def _conversation(client: ThunderClient, model: str, rng: random.Random, turns: int, result):
    history = rng.choice(SYSTEM_PROMPTS) + f"\nUser {rng.randrange(10**6)} asks: "
    for _ in range(turns):
        history += rng.choice(QUESTIONS) + "\n"
        request = GenerateRequest(model=model, text=history, max_tokens=rng.randint(16, 48))
        try:
            done = await client.generate(request)
        except RequestFailed as err:
            result.errors.append(str(err))
            return
        result.completions.append(done)
        history += done.text + "\n"


async def run_workload(
    nats_url: str, model: str, requests: int, concurrency: int, seed: int = 0
) -> DemoResult:
    client = await ThunderClient.connect(nats_url, idle_timeout_s=60)
    rng = random.Random(seed)
    result = DemoResult()
    turns = 4
    conversations = max(1, requests // turns)
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with gate:
            await _conversation(client, model, random.Random(rng.random() + i), turns, result)

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(conversations)))
    result.wall_s = time.perf_counter() - started
    await client.close()
    return result


def summarize(result: DemoResult) -> dict:
    done = [c for c in result.completions if c.final is not None]
    prompt = sum(c.final.usage.prompt_tokens for c in done)
    cached = sum(c.final.usage.cached_tokens for c in done)
    ttfts = sorted(c.client_ttft_ms for c in done)

    def pct(p: float) -> float:
        return ttfts[min(len(ttfts) - 1, int(p * len(ttfts)))] if ttfts else 0.0

    return {
        "requests": len(done),
        "errors": len(result.errors),
        "wall_s": round(result.wall_s, 2),
        "requests_per_s": round(len(done) / result.wall_s, 1) if result.wall_s else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cache_reuse": round(cached / prompt, 3) if prompt else 0.0,
        "ttft_ms": {"p50": round(pct(0.5), 1), "p99": round(pct(0.99), 1)},
        "e2e_ms_mean": round(statistics.fmean(c.client_e2e_ms for c in done), 1) if done else 0.0,
        "per_worker": dict(sorted(Counter(c.final.worker_id for c in done).items())),
        "first_errors": result.errors[:3],
    }


def print_summary(summary: dict, policy: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"ThunderAgent demo ({policy} routing)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in ("requests", "errors", "wall_s", "requests_per_s", "prompt_tokens", "cached_tokens"):
        table.add_row(key, str(summary[key]))
    table.add_row("cache reuse (cached / prompt tokens)", f"{summary['cache_reuse']:.1%}")
    table.add_row(
        "TTFT p50 / p99 (client)", f"{summary['ttft_ms']['p50']} / {summary['ttft_ms']['p99']} ms"
    )
    table.add_row(
        "requests per worker", ", ".join(f"{w}: {n}" for w, n in summary["per_worker"].items())
    )
    Console().print(table)


def run_demo(args: argparse.Namespace) -> int:
    config = StackConfig.from_args(args)
    print(
        f"starting the stack: NATS, Redis, index, scheduler, router, {config.workers} workers ..."
    )
    stack = Stack.start(config)
    try:
        print(f"up (NATS {stack.nats_url}, logs {stack.run_dir}); running {args.requests} requests")
        result = asyncio.run(
            run_workload(stack.nats_url, config.model, args.requests, args.concurrency)
        )
    finally:
        stack.stop()
    summary = summarize(result)
    print_summary(summary, config.policy)
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(summary, fh, indent=2)
    if summary["errors"] or not summary["requests"]:
        print(f"errors: {summary['first_errors']}", file=sys.stderr)
        return 1
    return 0
