"""The two PD paths through the running stack: SGLang's pairing against the workers' hand-off.

Starts the embedded stack (real NATS, Redis and service processes) with two simulated engines
and the scheduler pairing them (`up --prefill-workers 1`), once per path and round, alternated:

* `sglang`: the engines in SGLang's PD modes; the prefill worker sends the request to the decode
  worker with a bootstrap room and to its own engine at once, the decode engine takes the KV
  from the prefill engine and streams every token;
* `workers`: whole engines, workers with `--role prefill|decode`; the prefill worker streams
  the first token, moves the KV to the decode worker (`/import_kv`) and hands it the rest.

Then N sequential requests with prompts no other shares (the KV moves every time), timed at the
client to the first token and to the answer. Both paths model the same copy (the KV bytes of
the prompt at `--link-gbps`); on GPUs the transfer is SGLang's or NIXL's, not measured here.
Every request is accounted for: `requests == completed + rejected + in_flight`.

    thunderagent bench pd [--requests 60] [--rounds 2] [--prompt-tokens 640]
        [--max-tokens 12] [--speedup 20] [--json FILE]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter

import uvloop

from thunderagent import stats
from thunderagent.bench.cli import bench_parser
from thunderagent.bench.jsonfile import dumps, write_json
from thunderagent.client import RequestFailed, ThunderClient
from thunderagent.schemas import FinalReply, GenerateRequest, TokenChunk
from thunderagent.shell.argtypes import at_least, output_file, positive
from thunderagent.stack.up import Stack, StackConfig

PATHS = ("sglang", "workers")
DECODE_WORKER = "w1"


async def _one(client: ThunderClient, request: GenerateRequest) -> tuple[str, float, float, int]:
    """One request to its end: (outcome, ms to its first token, ms to its answer, its cached
    prompt tokens); the outcome is the worker that answered, ``rejected`` or ``in_flight``."""
    started = time.perf_counter()
    first: float | None = None
    final: FinalReply | None = None
    try:
        async for reply in client.stream(request):
            if first is None and isinstance(reply, TokenChunk) and reply.token_ids:
                first = time.perf_counter()
            if isinstance(reply, FinalReply):
                final = reply
    except RequestFailed:
        return "rejected", 0.0, 0.0, 0
    if final is None:  # the stream ended without an answer: still out there
        return "in_flight", 0.0, 0.0, 0
    done = time.perf_counter()
    ttft = ((first or done) - started) * 1e3
    return final.worker_id, ttft, (done - started) * 1e3, final.usage.cached_tokens


async def _measure(stack: Stack, args: argparse.Namespace, seed: int) -> dict:
    client = await ThunderClient.connect(stack.nats_url, idle_timeout_s=60)
    ttft, e2e, cached = [], [], []
    outcomes: Counter[str] = Counter()
    try:
        for i in range(args.requests):
            prompt = [(seed * 100_003 + i * 7_919 + j) % 30_000 + 4
                      for j in range(args.prompt_tokens)]  # fmt: skip
            request = GenerateRequest(model=stack.config.model, token_ids=prompt,
                                      max_tokens=args.max_tokens)  # fmt: skip
            outcome, first_ms, done_ms, hit = await _one(client, request)
            outcomes[outcome] += 1
            if outcome not in ("rejected", "in_flight"):
                ttft.append(first_ms)
                e2e.append(done_ms)
                cached.append(hit)
    finally:
        await client.close()
    rejected, in_flight = outcomes.pop("rejected", 0), outcomes.pop("in_flight", 0)
    return {
        "requests": args.requests,
        "completed": sum(outcomes.values()),
        "rejected": rejected,
        "in_flight": in_flight,
        "answered_by_decode_worker": outcomes[DECODE_WORKER],
        "ttft_ms": stats.summary(ttft, digits=2),
        "e2e_ms": stats.summary(e2e, digits=2),
        "cached_tokens_mean": round(sum(cached) / len(cached), 1) if cached else 0.0,
    }


def run(args: argparse.Namespace) -> dict:
    report: dict = {"settings": {k: v for k, v in vars(args).items() if k != "json_out"}}
    runs: dict[str, list[dict]] = {path: [] for path in PATHS}
    for rnd in range(args.rounds):
        for path in PATHS:
            print(f"round {rnd + 1}: {path}", file=sys.stderr)
            config = StackConfig(workers=2, speedup=args.speedup, prefill_workers=1, pd_via=path,
                                 run_dir_prefix=f"thunderagent-bench-pd-{path}-")  # fmt: skip
            stack = Stack.start(config)
            try:
                runs[path].append(uvloop.run(_measure(stack, args, seed=rnd)))
            finally:
                stack.stop()
    report["runs"] = runs
    for rows in runs.values():
        for row in rows:
            if row["requests"] != row["completed"] + row["rejected"] + row["in_flight"]:
                raise SystemExit(f"bench pd: requests not accounted for: {row}")
    return report


def render(report: dict) -> str:
    lines = ["path      round  TTFT p50 / p90 ms   e2e p50 / p90 ms   cached  decode-answered"]
    for path, rows in report["runs"].items():
        for i, r in enumerate(rows):
            t, e = r["ttft_ms"], r["e2e_ms"]
            lines.append(f"{path:9s} {i + 1:5d}  {t['p50']:7.2f} / {t['p90']:7.2f}   "
                         f"{e['p50']:7.2f} / {e['p90']:7.2f}   {r['cached_tokens_mean']:6.0f}  "
                         f"{r['answered_by_decode_worker']}/{r['requests']}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = bench_parser("pd", __doc__)
    p.add_argument("--requests", type=at_least(1), default=60)
    p.add_argument("--rounds", type=at_least(1), default=2, help="alternations of the two paths")
    p.add_argument("--prompt-tokens", type=at_least(16), default=640)
    p.add_argument("--max-tokens", type=at_least(2), default=12)
    p.add_argument("--speedup", type=positive, default=20.0,
                   help="simulated engines run this much faster")  # fmt: skip
    p.add_argument("--json", dest="json_out", type=output_file, default=None)
    args = p.parse_args(argv)
    report = run(args)
    print(render(report), file=sys.stderr)
    print(dumps(report, indent=2))
    if args.json_out:
        write_json(args.json_out, report)


if __name__ == "__main__":
    main()
