"""Move a prefix's KV between two simulated engines with NIXL, through the running stack.

Starts the embedded stack (NATS, Redis, index, scheduler, router, the migration service, two
simulated engines whose KV pools hold real bytes in host memory registered with NIXL), prefills
a long prefix on the first engine, orders the migration service to move it to the second
(``thunderagent.migration.request``: export at the source, NIXL read by the target, a checksum
per block, insertion into the target's cache, the source freed), then sends a follow-up request
for the prefix through the router and reports what the target served from its cache.

    python -m thunderagent.bench.transfer [--blocks 512] [--json FILE]

With the default Llama-3.1-8B profile a block (16 tokens) is 2 MiB, so 512 blocks are 1 GiB.
``seconds`` and ``gbps`` time the NIXL copy alone; ``total_s`` is the whole move as the service
saw it (three request/replies, pinning, both sides' checksums, insertion).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import aiohttp

from thunderagent.bench.cli import bench_parser
from thunderagent.bench.jsonfile import dumps, write_json
from thunderagent.bus import Bus, connect
from thunderagent.client import ThunderClient
from thunderagent.engine import get_profile
from thunderagent.engine.profiles import PRESETS
from thunderagent.hashing import BlockHasher
from thunderagent.schemas import (
    GenerateRequest,
    MigrationMode,
    MigrationOrder,
    MigrationReport,
    subjects,
)
from thunderagent.shell.argtypes import at_least, output_dir, output_file, positive
from thunderagent.stack.up import Stack, StackConfig


def prompt(tokens: int, seed: int = 1) -> list[int]:
    return [(seed * 7919 + i * 31) % 50_000 + 4 for i in range(tokens)]


async def prefill_at(engine_url: str, tokens: list[int]) -> dict:
    """Straight to the source engine: the router never guesses the source holds it (its
    in-flight overlay would otherwise keep crediting the source after the move)."""
    body = {"rid": "bench-prefill", "input_ids": tokens, "sampling_params": {"max_new_tokens": 1}}
    async with aiohttp.ClientSession() as session:
        async with session.post(engine_url + "/generate", json=body) as resp:
            return (await resp.json())["meta_info"]


async def order_move(bus: Bus, move: MigrationOrder, wait_s: float) -> MigrationReport:
    """Order the move; retried while the source's adapter has not mirrored the prefix yet."""
    for _ in range(50):
        report = await bus.request(
            subjects.MIGRATION_REQUEST, move, MigrationReport, timeout=wait_s
        )
        if report.phase == "done" or "not in this worker's cache" not in report.reason:
            return report
        await asyncio.sleep(0.1)
    return report


async def run(stack: Stack, args: argparse.Namespace) -> dict:
    model = stack.config.model
    tokens = prompt(args.blocks * args.block_size)
    prefix = BlockHasher(args.block_size).hash_tokens(tokens).primary[-1]
    await prefill_at(stack.engine_urls[0], tokens)
    # let the prefill's aftermath settle (512-block KV events through the adapter, the index,
    # the router and the migration service's follower) so the copy is timed on its own
    await asyncio.sleep(args.quiet_s)
    nc = await connect(stack.nats_url, name="bench-transfer", identity="admin")  # orders moves
    client = await ThunderClient.connect(stack.nats_url, idle_timeout_s=120)
    bus = Bus(nc, service="bench")
    reports: list[MigrationReport] = []
    try:
        started = time.perf_counter()
        for i in range(args.moves):  # back and forth: the first move is cold, later ones warm
            source, target = ("w0", "w1") if i % 2 == 0 else ("w1", "w0")
            move = MigrationOrder(
                prefix_hash=prefix,
                blocks=args.blocks,
                source=source,
                target=target,
                mode=MigrationMode(args.mode),
                reason="bench transfer",
            )
            reports.append(await order_move(bus, move, args.timeout_s))
            if reports[-1].phase != "done":
                break
        ordered_s = time.perf_counter() - started
        await asyncio.sleep(args.settle_s)  # the router's index replica sees the new holder
        follow = await client.generate(
            GenerateRequest(model=model, token_ids=[*tokens, 7, 7, 7], max_tokens=4)
        )
    finally:
        await client.close()
        await nc.close()
    return summarize(args, tokens, reports, follow.final, ordered_s)


def summarize(args, tokens: list[int], reports: list[MigrationReport], final, ordered_s) -> dict:
    """The brief's keys first (the first, cold move), then every move and the context."""
    report = reports[0]
    moves = [
        {"source": r.source, "target": r.target, "phase": r.phase,
         "seconds": round(r.transfer_s, 4), "gbps": round(r.gbps, 3), "verified": r.verified}
        for r in reports
    ]  # fmt: skip
    return {
        "backend": report.transport or "none",
        "bytes": report.bytes,
        "blocks": report.moved_blocks,
        "seconds": round(report.transfer_s, 4),
        "gbps": round(report.gbps, 3),
        "verified": report.verified,
        "cached_tokens_after": final.usage.cached_tokens,
        "served_by": final.worker_id,
        "phase": report.phase,
        "reason": report.reason,
        "mode": args.mode,
        "source": report.source,
        "target": report.target,
        "total_s": round(report.total_s, 4),
        "orders_round_trip_s": round(ordered_s, 4),
        "moves": moves,
        "gbps_median": round(statistics.median(r.gbps for r in reports), 3),
        "all_verified": all(r.verified for r in reports),
        "prefix_tokens": len(tokens),
        "block_bytes": report.bytes // report.moved_blocks if report.moved_blocks else 0,
        "profile": args.profile,
    }


# fmt: off
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = bench_parser("transfer", __doc__)
    p.add_argument("--blocks", type=at_least(1), default=512, help="prefix length in blocks")
    p.add_argument("--profile", default="llama-3.1-8b-h100", choices=sorted(PRESETS))
    p.add_argument("--block-size", type=at_least(1), default=16)
    p.add_argument("--kv-pool-scale", type=at_least(1), default=1,
                   help="divide the profile's KV bytes per block by this")
    p.add_argument("--mode", default="migrate", choices=["migrate", "replicate"])
    p.add_argument("--moves", type=at_least(1), default=1,
                   help="move the prefix back and forth this many times (the JSON's top level "
                   "is the first, cold move; `moves` lists all)")
    p.add_argument("--speedup", type=positive, default=100.0)
    p.add_argument("--timeout-s", type=positive, default=120.0)
    p.add_argument("--settle-s", type=float, default=0.5,
                   help="wait after the moves before the follow-up request")
    p.add_argument("--quiet-s", type=float, default=1.0,
                   help="wait after the prefill before the first move")
    p.add_argument("--run-dir", type=output_dir, default=None,
                   help="folder for the stack's logs (default: a new temp folder)")
    p.add_argument("--json", dest="json_out", type=output_file, default=None)
    return p.parse_args(argv)
# fmt: on


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    profile = get_profile(args.profile).with_engine(block_size=args.block_size)
    block_bytes = profile.kv_bytes_per_block // args.kv_pool_scale
    print(
        f"moving {args.blocks} blocks x {block_bytes / 2**20:.2f} MiB "
        f"= {args.blocks * block_bytes / 2**30:.2f} GiB",
        flush=True,
    )
    config = StackConfig(
        workers=2,
        profile=args.profile,
        block_size=args.block_size,
        speedup=args.speedup,
        gateways=0,
        kv_pool=True,
        kv_pool_scale=args.kv_pool_scale,
        kv_blocks=args.blocks + 64,
        migration_args=["--orders-only"],
    )
    if args.run_dir:
        config.run_dir = args.run_dir
    stack = Stack.start(config)
    try:
        result = asyncio.run(run(stack, args))
    finally:
        stack.stop()
    print(dumps(result, indent=2))
    if args.json_out:
        write_json(args.json_out, result)


if __name__ == "__main__":
    main()
