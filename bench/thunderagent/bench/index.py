"""Prefix-index benchmark: ingest rate and overlap-query latency, beside Dynamo's RadixTree.

    python -m thunderagent.bench.index [--json FILE] [--events N] [--queries N] [--seed S]
                                       [--rounds R]

Workload (deterministic for a seed): 8 workers; conversations that start from one of a few
shared system prompts and grow turn by turn, each turn one stored-blocks event on the
conversation's worker (parent = its last block). A new conversation, or one that moves to
another worker, stores its whole prefix from the root (re-confirming shared blocks). Queries are
the first 64 blocks of a known conversation followed by a fresh, uncached turn, plus a few
prompts under an unknown system prompt. Every hash is computed before timing starts.

Our index runs with TTL, per-worker sequence tracking and the check hash all on; ``expire`` is
called every 1,000 events. When ``dynamo`` (ai-dynamo-runtime) is importable, the identical
events (as the JSON its binding takes) and queries go through ``dynamo.llm.RadixTree`` in the
same process, and the two indexes' answers are compared query by query.

Reported: ingest blocks/s (median of ``--rounds`` fresh ingests; best and all rounds in the
JSON), query p50/p99 over every query of every round (one ``perf_counter_ns`` pair per query,
index cold in cache for most queries since they hit random conversations), "hot" p50 (each of
500 queries repeated back to back: the CPU cost without cache misses), and the time to hash an
8k-token prompt. Dynamo is timed on ``apply_event(worker, json bytes)`` and
``find_matches(local hashes).scores``.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import sys
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

from thunderagent.hashing import BlockHasher
from thunderagent.prefix_index import PrefixIndex, encode

WORKERS = 8
QUERY_BLOCKS = 64
SYSTEM_PROMPTS = 24
MAX_CONVERSATION_BLOCKS = 160
EXPIRE_EVERY = 1_000
HOT_QUERIES = 500
HOT_REPEATS = 20
HASH_TOKENS = 8192
HASH_BLOCK_SIZE = 16
EVENT_DT_S = 0.001
"""Simulated clock step per event: 200k events span 200 s, inside the default TTL."""


@dataclass(slots=True)
class _Conversation:
    worker: int
    ids: list[int] = field(default_factory=list)
    primary: list[int] = field(default_factory=list)
    check: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Workload:
    # events: (worker, seq, primary, check, parent, local ids)
    events: list[tuple[int, int, list[int], list[int], int | None, list[int]]]
    queries: list[tuple[list[int], list[int], list[int]]]  # (primary, check, local ids)
    blocks: int
    unique_blocks: int


def _extend(hasher: BlockHasher, conv: _Conversation, ids: list[int]) -> tuple[list, list]:
    parent = (conv.primary[-1], conv.check[-1]) if conv.primary else None
    hashes = hasher.hash_block_ids(ids, parent)
    conv.ids += ids
    conv.primary += hashes.primary
    conv.check += hashes.check
    return hashes.primary, hashes.check


def build_workload(events: int, queries: int, seed: int) -> Workload:
    """Deterministic events and queries (see the module docstring)."""
    rng = random.Random(seed)
    hasher = BlockHasher(block_size=1)  # block ids given directly, as in Mooncake traces
    fresh = lambda n: [rng.getrandbits(63) for _ in range(n)]  # noqa: E731
    systems = [_Conversation(-1) for _ in range(SYSTEM_PROMPTS)]
    for sp in systems:
        _extend(hasher, sp, fresh(rng.randint(4, 40)))
    seqs = [0] * WORKERS
    convs: list[_Conversation] = []
    active: list[_Conversation] = []
    out: list = []
    total = 0

    def emit(conv: _Conversation, primary, check, parent, ids) -> None:
        nonlocal total
        out.append((conv.worker, seqs[conv.worker], primary, check, parent, ids))
        seqs[conv.worker] += 1
        total += len(primary)

    while len(out) < events:
        r = rng.random()
        if r < 0.06 or not active:  # a new conversation under a (skewed) shared system prompt
            sp = systems[min(int(rng.expovariate(0.25)), SYSTEM_PROMPTS - 1)]
            conv = _Conversation(
                rng.randrange(WORKERS), list(sp.ids), list(sp.primary), list(sp.check)
            )
            _extend(hasher, conv, fresh(rng.randint(1, 8)))
            emit(conv, list(conv.primary), list(conv.check), None, list(conv.ids))
            convs.append(conv)
            active.append(conv)
            if len(active) > 3_000:
                active.pop(rng.randrange(len(active)))
            continue
        conv = active[rng.randrange(len(active))]
        if r < 0.065:  # rebalanced to another worker: re-prefill and store the whole prefix
            conv.worker = (conv.worker + rng.randint(1, WORKERS - 1)) % WORKERS
            _extend(hasher, conv, fresh(rng.randint(1, 6)))
            emit(conv, list(conv.primary), list(conv.check), None, list(conv.ids))
        else:  # the next turn: new blocks under the conversation's last block
            parent = conv.primary[-1]
            ids = fresh(rng.randint(1, 7))
            primary, check = _extend(hasher, conv, ids)
            emit(conv, primary, check, parent, ids)
        if len(conv.ids) >= MAX_CONVERSATION_BLOCKS:
            active.remove(conv)

    qs = []
    for _ in range(queries):
        if rng.random() < 0.05:
            conv = _Conversation(-1)  # unknown system prompt: a miss at block 0
        else:
            conv = rng.choice(convs)
        keep = min(len(conv.ids), rng.randint(QUERY_BLOCKS // 2, QUERY_BLOCKS))
        q = _Conversation(-1, conv.ids[:keep], conv.primary[:keep], conv.check[:keep])
        _extend(hasher, q, fresh(QUERY_BLOCKS - keep))
        qs.append((q.primary, q.check, q.ids))
    unique = len({p for e in out for p in e[2]})
    return Workload(out, qs, total, unique)


def _percentile(sorted_ns: list[int], q: float) -> float:
    return sorted_ns[min(len(sorted_ns) - 1, int(q * len(sorted_ns)))] / 1_000


def _timed(
    w: Workload, rounds: int, build: Callable[[], Callable[[], object]], query: Callable
) -> tuple[dict, list]:
    """Ingest ``rounds`` times into a fresh index (median and best rate), then time every query
    ``rounds`` times over the last index, one ``perf_counter_ns`` pair per query."""
    rates = []
    for _ in range(rounds):
        ingest = build()
        gc.collect()
        t0 = time.perf_counter()
        ingest()
        rates.append(w.blocks / (time.perf_counter() - t0))
    clock = time.perf_counter_ns
    lat = []
    answers: list = []
    for r in range(rounds):
        for q in w.queries:
            t = clock()
            res = query(q)
            lat.append(clock() - t)
            if r == 0:
                answers.append(res)
    lat.sort()
    rates.sort()
    hot = []  # each query repeated back to back: its blocks are in cache, the CPU cost remains
    for q in w.queries[:HOT_QUERIES]:
        for _ in range(HOT_REPEATS):
            t = clock()
            query(q)
            hot.append(clock() - t)
    hot.sort()
    return {
        "ingest_blocks_per_s": rates[len(rates) // 2],
        "ingest_blocks_per_s_best": rates[-1],
        "ingest_blocks_per_s_rounds": rates,
        "query_p50_us": _percentile(lat, 0.50),
        "query_p99_us": _percentile(lat, 0.99),
        "query_mean_us": sum(lat) / len(lat) / 1_000,
        "query_hot_p50_us": _percentile(hot, 0.50),
    }, answers


def run_ours(w: Workload, rounds: int) -> tuple[dict, list[dict[int, int]]]:
    names = [f"worker-{i}" for i in range(WORKERS)]
    holder: list[PrefixIndex] = []

    def build() -> Callable[[], None]:
        holder.clear()
        index = PrefixIndex()  # default TTL on; sequence tracking and check hashes always on
        holder.append(index)
        apply = index.apply_stored
        expire = index.expire

        def ingest() -> None:
            for i, (wid, seq, primary, check, parent, _ids) in enumerate(w.events):
                now = i * EVENT_DT_S
                apply(names[wid], seq, (primary, check), parent, now)
                if i % EXPIRE_EVERY == 0:
                    expire(now)

        return ingest

    def query(q: tuple) -> dict[str, int]:
        return holder[0].overlap(q[0], q[1])

    stats, answers = _timed(w, rounds, build, query)
    index = holder[0]
    t = time.perf_counter()
    blob = encode(index.snapshot())
    stats["snapshot_encode_s"] = time.perf_counter() - t
    stats["snapshot_bytes"] = len(blob)
    stats["indexed_entries"] = len(index)
    stats["index_stats"] = {k: getattr(index.stats, k) for k in index.stats.__dataclass_fields__}
    return stats, [{int(k.rsplit("-", 1)[1]): v for k, v in a.items()} for a in answers]


def run_dynamo(w: Workload, rounds: int) -> tuple[dict, list[dict[int, int]]] | str:
    """Dynamo's RadixTree on the same workload, or the reason it could not run."""
    try:
        from dynamo.llm import RadixTree  # type: ignore[import-not-found]
    except Exception as exc:  # ImportError, or a broken native extension
        return f"dynamo not importable: {exc!r} (pip install ai-dynamo-runtime==1.6.1)"
    payloads = []
    for wid, seq, primary, _check, parent, ids in w.events:
        blocks = [{"block_hash": p, "tokens_hash": t} for p, t in zip(primary, ids, strict=True)]
        event = {
            "event_id": seq,
            "dp_rank": 0,
            "data": {"stored": {"parent_hash": parent, "blocks": blocks}},
        }
        payloads.append((wid, json.dumps(event).encode()))
    holder: list = []

    def build() -> Callable[[], None]:
        holder.clear()
        tree = RadixTree()
        holder.append(tree)
        apply = tree.apply_event

        def ingest() -> None:
            for wid, data in payloads:
                apply(wid, data)

        return ingest

    def query(q: tuple) -> dict[int, int]:
        scores = holder[0].find_matches(q[2]).scores
        return {wid: depth for (wid, _dp), depth in scores.items() if depth}

    stats, answers = _timed(w, rounds, build, query)
    stats["timed"] = "apply_event(worker, json bytes); find_matches(local hashes).scores"
    return stats, answers


def bench_hashing(seed: int, repeats: int = 300) -> dict:
    """Time ``BlockHasher.hash_tokens`` on an 8k-token prompt (list of ints and array('I'))."""
    rng = random.Random(seed)
    tokens = [rng.randrange(200_000) for _ in range(HASH_TOKENS)]
    hasher = BlockHasher(HASH_BLOCK_SIZE)
    out = {"tokens": HASH_TOKENS, "block_size": HASH_BLOCK_SIZE}
    for name, inp in (("list", tokens), ("array", array("I", tokens))):
        runs = []
        for _ in range(repeats):
            t = time.perf_counter_ns()
            hasher.hash_tokens(inp)
            runs.append(time.perf_counter_ns() - t)
        runs.sort()
        out[f"{name}_p50_us"] = _percentile(runs, 0.5)
    out["blocks_per_s"] = (HASH_TOKENS // HASH_BLOCK_SIZE) / (out["array_p50_us"] / 1e6)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results as JSON to this file")
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--queries", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3, help="ingest rounds / query passes")
    args = ap.parse_args(argv)

    t = time.perf_counter()
    w = build_workload(args.events, args.queries, args.seed)
    build_s = time.perf_counter() - t
    ours, our_answers = run_ours(w, args.rounds)
    depths = [max(a.values(), default=0) for a in our_answers]
    result = {
        "ingest_blocks_per_s": round(ours["ingest_blocks_per_s"]),
        "query_p50_us": round(ours["query_p50_us"], 2),
        "query_p99_us": round(ours["query_p99_us"], 2),
        "ours": ours,
        "workload": {
            "workers": WORKERS,
            "events": len(w.events),
            "blocks": w.blocks,
            "unique_blocks": w.unique_blocks,
            "queries": len(w.queries),
            "query_blocks": QUERY_BLOCKS,
            "mean_best_match_blocks": sum(depths) / len(depths),
            "seed": args.seed,
            "build_s": round(build_s, 2),
            "rounds": args.rounds,
        },
        "hashing": bench_hashing(args.seed),
        "machine": {"python": sys.version.split()[0], "platform": platform.platform()},
    }
    dyn = run_dynamo(w, args.rounds)
    if isinstance(dyn, str):
        result["dynamo"] = {"skipped": dyn}
    else:
        dstats, dyn_answers = dyn
        dstats["answers_differ"] = sum(
            a != b for a, b in zip(our_answers, dyn_answers, strict=True)
        )
        dstats["ingest_ratio_ours_over_dynamo"] = (
            ours["ingest_blocks_per_s"] / dstats["ingest_blocks_per_s"]
        )
        dstats["query_p50_ratio_dynamo_over_ours"] = dstats["query_p50_us"] / ours["query_p50_us"]
        result["dynamo"] = dstats
    _print(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def _print(r: dict) -> None:
    wl = r["workload"]
    print(
        f"workload: {wl['workers']} workers, {wl['events']:,} events, {wl['blocks']:,} blocks "
        f"({wl['unique_blocks']:,} unique), {wl['queries']:,} queries x {wl['query_blocks']} "
        f"blocks (mean best match {wl['mean_best_match_blocks']:.1f}), {wl['rounds']} rounds"
    )
    hs = r["hashing"]
    print(
        f"hashing {hs['tokens']} tokens (block {hs['block_size']}): {hs['list_p50_us']:.0f} us "
        f"from a list, {hs['array_p50_us']:.0f} us from array('I') "
        f"({hs['blocks_per_s'] / 1e6:.1f} M blocks/s, primary + check)"
    )
    dyn = r["dynamo"]
    o = r["ours"]
    rows = [
        ("ingest blocks/s", "ingest_blocks_per_s", True),
        ("query p50 us", "query_p50_us", False),
        ("query p99 us", "query_p99_us", False),
        ("query hot p50 us", "query_hot_p50_us", False),
    ]
    print(f"{'':22}{'thunderagent':>14}{'dynamo':>14}{'ours better by':>16}")
    for name, key, higher_better in rows:
        fmt = ",.0f" if higher_better else ".2f"
        if "skipped" in dyn:
            print(f"{name:22}{o[key]:>14{fmt}}")
            continue
        ratio = o[key] / dyn[key] if higher_better else dyn[key] / o[key]
        print(f"{name:22}{o[key]:>14{fmt}}{dyn[key]:>14{fmt}}{ratio:>15.2f}x")
    if "skipped" in dyn:
        print(f"dynamo SKIPPED: {dyn['skipped']}")
    else:
        print(f"answers differing from dynamo: {dyn['answers_differ']} of {wl['queries']}")


if __name__ == "__main__":
    raise SystemExit(main())
