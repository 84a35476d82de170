"""NATS messages per request through the running stack, by kind.

    thunderagent bench messages [--rates 50,400] [--requests 1600] [--json F]

The embedded stack (``thunderagent up`` minus the gateway) with instant engines (``--engine
instant``: one token at once; the prefix cache and its KV events stay real), the same open-loop
load as ``bench throughput`` (64-token prompts sharing 48 tokens: one new KV block per request,
streamed, ``max_tokens`` 1), and one more NATS client subscribed to ``>`` that counts every
message the server delivers, by subject kind. Its counts, less the stack's idle rate, divided by
the requests sent, are messages per request: what each Python service and the NATS server pay
for per message, independent of the machine's speed (the count itself loads the server a little;
CPU is measured by ``bench throughput`` and ``bench profile`` without it). A JetStream message
is counted once published and once per consumer it is delivered to.
"""

from __future__ import annotations

import asyncio
import collections
import sys
import time

import uvloop

from thunderagent.bench import loadgen, profile
from thunderagent.bench.cli import bench_parser
from thunderagent.bench.jsonfile import write_json
from thunderagent.bench.throughput import parse_rates
from thunderagent.bus import connect
from thunderagent.client import ThunderClient
from thunderagent.schemas import subjects
from thunderagent.shell.argtypes import at_least, output_file

MODEL = "sim/llama-3.1-8b"
PREFIX = subjects.PREFIX + "."

KINDS = {
    "requests": "client -> router",
    "worker.generate": "router/scheduler -> adapter",
    "sched.direct": "router -> scheduler (a dispatch on credit)",
    "sched.submit": "router -> scheduler (through the queue)",
    "progress": "adapter -> scheduler, routers",
    "route.decisions": "router -> observers (migration)",
    "router.credits": "scheduler -> router",
    "router.dispatched": "scheduler -> router",
    "kv.events": "adapter -> JetStream, then once per consumer",
    "js.ack": "durable consumer acks (index)",
    "replies": "_INBOX: acks, JetStream publish acks, tokens, final replies",
}


def kind(subject: str) -> str:
    if subject.startswith("_INBOX."):
        return "replies"
    if subject.startswith("$JS.ACK."):
        return "js.ack"
    if subject.startswith("$"):
        return "jetstream api"
    if not subject.startswith(PREFIX):
        return "other"
    parts = subject[len(PREFIX) :].split(".")
    if parts[0] in ("worker", "router") and len(parts) >= 3:
        return f"{parts[0]}.{parts[-1]}"  # the id in between
    if parts[0] in ("sched", "route", "kv", "router"):
        return ".".join(parts[:2])
    return parts[0]


async def count(stack, rates: list[float], requests: int) -> list[dict]:
    client = await ThunderClient.connect(stack.nats_url, idle_timeout_s=30)
    spy = await connect(stack.nats_url, name="thunderagent-bench-messages", identity="admin")
    seen: collections.Counter = collections.Counter()

    async def on_message(msg) -> None:
        seen[kind(msg.subject)] += 1

    try:
        warm = loadgen.prompts(200, 64, 16, seed=1)
        await loadgen.open_loop(100, len(warm), loadgen.thunder_sender(client, MODEL, warm))
        await spy.subscribe(">", cb=on_message)
        await spy.flush()
        await asyncio.sleep(2.0)
        idle_s, idle = 2.0, collections.Counter(seen)
        rows = []
        for i, rate in enumerate(rates):
            seen.clear()
            bodies = loadgen.prompts(requests, 64, 16, seed=10 + i)
            started = time.monotonic()
            result = await loadgen.open_loop(
                rate, requests, loadgen.thunder_sender(client, MODEL, bodies)
            )
            await asyncio.sleep(0.5)  # the last batches' windows
            wall = time.monotonic() - started
            idle_rate = {k: v / idle_s for k, v in idle.items()}
            rows.append(row(rate, result, seen, idle_rate, wall))
        return rows
    finally:
        await spy.close()
        await client.close()


def row(rate: float, result: loadgen.LoadResult, seen, idle_rate: dict, wall: float) -> dict:
    """One rate's counts per request, less what the idle stack sends in as long."""
    n = len(result.samples)
    per = {k: (v - idle_rate.get(k, 0.0) * wall) / n for k, v in seen.items()}
    return {
        "rate": rate,
        "requests": n,
        "completed": len(result.ok),
        "rejected": sum(1 for s in result.samples if s.error),
        "in_flight": sum(1 for s in result.samples if not s.error and s.ttft_ms < 0),
        "per_request": {k: round(v, 3) for k, v in sorted(per.items())},
        "total_per_request": round(sum(per.values()), 2),
    }


def print_table(rows: list[dict]) -> None:
    kinds = sorted({k for r in rows for k in r["per_request"]},
                   key=lambda k: -max(r["per_request"].get(k, 0) for r in rows))  # fmt: skip
    head = " | ".join(f"{r['rate']:g} req/s" for r in rows)
    print(f"| messages per request | {head} | what |")
    print("|---|" + "---|" * len(rows) + "---|")
    for k in kinds:
        if all(abs(r["per_request"].get(k, 0)) < 0.005 for r in rows):
            continue  # idle traffic only (load reports, leases, hellos)
        cells = " | ".join(f"{r['per_request'].get(k, 0):.2f}" for r in rows)
        print(f"| {k} | {cells} | {KINDS.get(k, '')} |")
    print("| **total** | " + " | ".join(f"**{r['total_per_request']:.2f}**" for r in rows) + " | |")


def main(argv: list[str] | None = None) -> None:
    p = bench_parser("messages", __doc__)
    p.add_argument("--rates", type=parse_rates, default=[50.0, 400.0])
    p.add_argument("--requests", type=at_least(1), default=1600, help="requests per rate")
    p.add_argument("--workers", type=at_least(1), default=2)
    p.add_argument("--json", dest="json_out", type=output_file, default=None)
    args = p.parse_args(argv)
    if args.requests < 1:
        p.error("--requests must be at least 1")
    print(f"starting the stack ({args.workers} instant engines) ...", file=sys.stderr)
    stack = profile.start_stack(args.workers, "messages")
    try:
        rows = uvloop.run(count(stack, args.rates, args.requests))
    finally:
        stack.stop()
    for r in rows:
        if r["requests"] != r["completed"] + r["rejected"] + r["in_flight"]:
            raise SystemExit(f"requests not accounted for at {r['rate']} req/s: {r}")
    print_table(rows)
    if args.json_out:
        write_json(args.json_out, {"rates": rows})


if __name__ == "__main__":
    main()
