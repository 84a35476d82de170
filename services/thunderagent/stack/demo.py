"""``thunderagent demo``: the embedded stack, a short conversational workload, a summary.

The workload is multi-turn chats about long documents, sent as text (so the router tokenizes
them): each conversation opens one of a few dozen documents, and each turn's prompt is the
previous prompt plus the previous answer plus a new question, the pattern where KV-aware routing
pays off. The same workload runs once per routing policy on a fresh stack, and the summary
shows side by side how much of the prompt traffic the engines served from cache.
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
from thunderagent.stats import percentile

WORDS = (
    "cache prefix router worker prefill decode batch token block hash index replica queue "
    "latency throughput memory eviction shard program session window priority transfer"
).split()


def document(k: int, words: int = 600) -> str:
    """A deterministic ~4k-character document (one byte = one token in simulated models)."""
    rng = random.Random(k)
    return f"Document {k}. " + " ".join(rng.choice(WORDS) for _ in range(words)) + "\n"


DOCUMENTS = 32
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
    history = document(rng.randrange(DOCUMENTS)) + f"User {rng.randrange(10**6)} asks: "
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


def conversation_turns(requests: int, turns: int = 4) -> list[int]:
    """Turns per conversation: ``turns`` each, the last one shorter, ``requests`` in all."""
    return [min(turns, requests - start) for start in range(0, requests, turns)]


async def run_workload(
    nats_url: str, model: str, requests: int, concurrency: int, seed: int = 0
) -> DemoResult:
    client = await ThunderClient.connect(nats_url, idle_timeout_s=60)
    rng = random.Random(seed)
    result = DemoResult()
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, turns: int) -> None:
        async with gate:
            await _conversation(client, model, random.Random(rng.random() + i), turns, result)

    started = time.perf_counter()
    await asyncio.gather(*(one(i, n) for i, n in enumerate(conversation_turns(requests))))
    result.wall_s = time.perf_counter() - started
    await client.close()
    return result


def summarize(result: DemoResult) -> dict:
    done = [c for c in result.completions if c.final is not None]
    prompt = sum(c.final.usage.prompt_tokens for c in done)
    cached = sum(c.final.usage.cached_tokens for c in done)
    ttfts = [c.client_ttft_ms for c in done]

    return {
        "requests": len(done),
        "errors": len(result.errors),
        "wall_s": round(result.wall_s, 2),
        "requests_per_s": round(len(done) / result.wall_s, 1) if result.wall_s else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cache_reuse": round(cached / prompt, 3) if prompt else 0.0,
        "ttft_ms": {"p50": round(percentile(ttfts, 50), 1), "p99": round(percentile(ttfts, 99), 1)},
        "e2e_ms_mean": round(statistics.fmean(c.client_e2e_ms for c in done), 1) if done else 0.0,
        "per_worker": dict(sorted(Counter(c.final.worker_id for c in done).items())),
        "first_errors": result.errors[:3],
    }


def print_summary(summaries: dict[str, dict]) -> None:
    """One column per routing policy, same workload."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="ThunderAgent demo: the same chat workload per routing policy")
    table.add_column("metric")
    for policy in summaries:
        table.add_column(policy, justify="right")

    def row(label: str, fmt) -> None:
        table.add_row(label, *(fmt(s) for s in summaries.values()))

    row("requests / errors", lambda s: f"{s['requests']} / {s['errors']}")
    row("requests per second", lambda s: str(s["requests_per_s"]))
    row("prompt tokens", lambda s: str(s["prompt_tokens"]))
    row("served from cache", lambda s: f"{s['cached_tokens']} ({s['cache_reuse']:.1%})")
    row("TTFT p50 / p99 (client, ms)", lambda s: f"{s['ttft_ms']['p50']} / {s['ttft_ms']['p99']}")
    row("mean end to end (ms)", lambda s: str(s["e2e_ms_mean"]))
    row("requests per worker", lambda s: " ".join(f"{w}:{n}" for w, n in s["per_worker"].items()))
    Console().print(table)


def run_once(args: argparse.Namespace, policy: str) -> dict:
    config = StackConfig.from_args(args)
    config.policy = policy
    print(f"[{policy}] starting NATS, Redis, index, scheduler, router, {config.workers} workers")
    stack = Stack.start(config)
    try:
        print(
            f"[{policy}] up (NATS {stack.nats_url}, logs {stack.run_dir}); {args.requests} requests"
        )
        result = asyncio.run(
            run_workload(stack.nats_url, config.model, args.requests, args.concurrency)
        )
    finally:
        stack.stop()
    return summarize(result)


def run_demo(args: argparse.Namespace) -> int:
    policies = [args.policy, *(p for p in args.compare.split(",") if p and p != args.policy)]
    summaries = {policy: run_once(args, policy) for policy in policies}
    print_summary(summaries)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(summaries, indent=2) + "\n")
    failed = {
        p: s["first_errors"] for p, s in summaries.items() if s["errors"] or not s["requests"]
    }
    if failed:
        print(f"errors: {failed}", file=sys.stderr)
        return 1
    return 0
