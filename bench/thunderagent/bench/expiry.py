"""How long one call of the prefix index's TTL expiry holds its caller, under the adapters'
periodic re-announcements (pure code, virtual time).

    thunderagent bench expiry [--workers 8] [--blocks 28000] [--duration 1800] [--json FILE]

Each of ``--workers`` workers holds ``--blocks`` blocks (chains of 64, as a cache of prompts) and
re-announces all of them every ``--refresh-s`` (the adapter's ``kv_refresh_s``, 120 s), each at
its own phase; the index (TTL 600 s, as the router's and the index service's) is asked to
``expire`` once per ``--tick-s`` (the router's feedback tick, 1 s) over ``--duration`` seconds of
virtual time. A re-announcement puts a worker's whole cache in one TTL list, read when it falls
due 600 s later. Prints the wall time of every ``expire`` call (max, p99, the calls over 1 ms)
and of each re-announcement's apply, for comparison.
"""

from __future__ import annotations

import random
import time

from thunderagent import stats
from thunderagent.bench.cli import bench_parser
from thunderagent.bench.jsonfile import dumps, write_json
from thunderagent.prefix_index import PrefixIndex
from thunderagent.shell.argtypes import at_least, output_file, positive

CHAIN = 64


def cache(worker: int, blocks: int) -> list[tuple[list[int], list[int]]]:
    """A worker's cache as chains of ``CHAIN`` blocks: (primary, check) hashes of each."""
    base = (worker + 1) << 40
    hashes = list(range(base, base + blocks))
    return [(hashes[i : i + CHAIN], [h ^ 0x5A5A for h in hashes[i : i + CHAIN]])
            for i in range(0, blocks, CHAIN)]  # fmt: skip


def measure(workers: int, blocks: int, duration_s: float, refresh_s: float, tick_s: float,
            seed: int = 0) -> dict:  # fmt: skip
    rng = random.Random(seed)
    index = PrefixIndex(600.0)
    chains = [cache(w, blocks) for w in range(workers)]
    seqs = [0] * workers
    phases = [rng.uniform(0, refresh_s) for _ in range(workers)]

    def announce(w: int, now: float) -> float:
        started = time.perf_counter()
        for primary, check in chains[w]:
            index.apply_stored(f"w{w}", seqs[w], (primary, check), None, now)
            seqs[w] += 1
        return time.perf_counter() - started

    for w in range(workers):
        announce(w, 0.0)
    expires, applies = [], []
    for tick in range(1, int(duration_s / tick_s) + 1):
        now = tick * tick_s
        applies += [announce(w, now) for w in range(workers)
                    if (now - phases[w]) % refresh_s < tick_s]  # fmt: skip
        started = time.perf_counter()
        index.expire(now)
        expires.append(time.perf_counter() - started)
    ms = [s * 1e3 for s in expires]
    return {
        "workers": workers,
        "blocks_per_worker": blocks,
        "duration_s": duration_s,
        "expire_calls": len(ms),
        "expire_max_ms": round(max(ms), 4),
        "expire_p99_ms": round(stats.percentile(ms, 99), 4),
        "expire_calls_over_1ms": sum(m > 1.0 for m in ms),
        "expired_blocks": index.stats.expired_blocks,
        "announce_apply_max_ms": round(max(applies) * 1e3, 2) if applies else 0.0,
        "announce_apply_p50_ms": round(stats.percentile([a * 1e3 for a in applies], 50), 2)
        if applies
        else 0.0,
    }


def main(argv: list[str] | None = None) -> None:
    p = bench_parser("expiry", __doc__)
    p.add_argument("--workers", type=at_least(1), default=8)
    p.add_argument("--blocks", type=at_least(CHAIN), default=28_000)
    p.add_argument("--duration", type=positive, default=1800.0, help="virtual seconds")
    p.add_argument("--refresh-s", type=positive, default=120.0)
    p.add_argument("--tick-s", type=positive, default=1.0)
    p.add_argument("--json", type=output_file, default=None)
    args = p.parse_args(argv)
    result = measure(args.workers, args.blocks, args.duration, args.refresh_s, args.tick_s)
    print(dumps(result, indent=None))
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
