"""Replay a Mooncake JSONL trace through N simulated engines, routed round-robin.

    python -m thunderagent.engine.replay_smoke --trace PATH --workers 8

Trace lines: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids`` (one id per
512-token block, naming the whole prefix), so the profile runs with ``page_size=512``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from thunderagent.engine.core import EngineCore, Request
from thunderagent.engine.profiles import get_profile
from thunderagent.engine.vtime import RequestRecord, Simulator, round_robin


def load_mooncake(path: Path, limit: int | None = None) -> list[tuple[float, Request]]:
    """Trace rows as ``(arrival seconds, Request)``."""
    arrivals = []
    with path.open() as fh:
        for i, line in enumerate(fh):
            if limit is not None and i >= limit:
                break
            row = json.loads(line)
            request = Request(
                request_id=str(i),
                prompt_len=int(row["input_length"]),
                block_keys=[int(h) for h in row["hash_ids"]],
                max_new_tokens=max(1, int(row["output_length"])),
            )
            arrivals.append((row["timestamp"] / 1000.0, request))
    return arrivals


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(q / 100.0 * len(ordered)))]


def summarize(records: list[RequestRecord], wall: float) -> str:
    ok = [r for r in records if r.finish_reason == "length"]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    ttft = [r.ttft for r in ok]
    lines = [
        f"requests            {len(records)} ({len(ok)} finished, "
        f"{len(records) - len(ok)} rejected/aborted)",
        f"wall seconds        {wall:.2f}",
        f"sim requests/wall s {len(records) / wall:.0f}",
        f"hit ratio           {cached / prompt if prompt else 0.0:.4f} (cached/prompt tokens)",
        f"TTFT p50 / p99      {percentile(ttft, 50) * 1000:.1f} ms / "
        f"{percentile(ttft, 99) * 1000:.1f} ms",
        f"preemptions         {sum(r.preemptions for r in records)}",
        f"virtual makespan    {max(r.finish_time for r in records):.1f} s",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, required=True)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--profile", default="llama-3.1-8b-h100")
    parser.add_argument("--page-size", type=int, default=512)
    parser.add_argument("--limit", type=int, default=None)
    args = parser.parse_args(argv)
    profile = get_profile(args.profile).with_engine(page_size=args.page_size)
    arrivals = load_mooncake(args.trace, args.limit)
    start = time.perf_counter()
    cores = [EngineCore(profile) for _ in range(args.workers)]
    sim = Simulator(cores, round_robin(args.workers))
    records = sim.run(arrivals)
    wall = time.perf_counter() - start
    print(
        f"profile {profile.name} page_size={args.page_size} workers={args.workers} "
        f"kv_blocks/worker={profile.capacity_blocks} steps={sim.steps}"
    )
    print(summarize(records, wall))


if __name__ == "__main__":
    main()
