"""CPU time of the adapter's mirror of its engine's cache (``KvMirror``, pure code): folding
SGLang's ``BlockStored`` / ``BlockRemoved`` events in (re-hashing their tokens into our chain),
the lookup an export makes, a copy's chain of our hashes resolved to the engine's, and the
periodic re-announcement of the whole cache (its dump, and what each consumer pays for it).

    thunderagent bench mirror [--blocks 50000,500000] [--chain 64]

The mirror holds ``--blocks`` blocks in chains of 64, stored one block per event and again 16
per event; half of them are then removed one per event. The export resolves a ``--chain``-block
chain held in the middle of the cache (``leading_run``, then ``chain_to`` from its deepest
block). The re-announcement: ``dump`` of the full mirror (and the longest of the pieces the
adapter makes it in, ``dump_pieces``), its size as one ``KvEventBatch``, the
batch decoded as a consumer decodes it, and applied by an ``IndexFeeder`` whose index already
holds those blocks (the steady case: a refresh re-confirms them). Prints the best of five
rounds of each.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

from thunderagent.bench.cli import bench_parser
from thunderagent.bench.jsonfile import dumps, write_json
from thunderagent.bus.bus import decoder_for, encode
from thunderagent.hashing import BlockHasher
from thunderagent.prefix_index import PrefixIndex
from thunderagent.prefix_index.feed import IndexFeeder
from thunderagent.schemas import KvEventBatch
from thunderagent.sglang import kv_wire
from thunderagent.sglang.mirror import KvMirror
from thunderagent.shell.argtypes import at_least, output_file, positive_list

PAGE = 16
CHAIN_LEN = 64
"""Blocks per stored chain (a prompt): each chain starts at the root."""
ENGINE_BASE = 10**12


def stored_events(blocks: int, per_event: int) -> list[kv_wire.BlockStored]:
    """``blocks`` blocks in root-started chains of ``CHAIN_LEN``, ``per_event`` per event."""
    out, i = [], 0
    while i < blocks:
        n = min(per_event, blocks - i, CHAIN_LEN - i % CHAIN_LEN)
        parent = ENGINE_BASE + i - 1 if i % CHAIN_LEN else None
        engine = list(range(ENGINE_BASE + i, ENGINE_BASE + i + n))
        out.append(kv_wire.BlockStored(
            block_hashes=engine, parent_block_hash=parent, block_size=PAGE, lora_id=None,
            token_ids=list(range(i * PAGE, (i + n) * PAGE)), medium="GPU",
        ))  # fmt: skip
        i += n
    return out


def best_of(rounds: int, fn: Callable[[], object], setup: Callable[[], object] = lambda: None
            ) -> float:  # fmt: skip
    best = float("inf")
    for _ in range(rounds):
        setup()
        gc.collect()
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def measure(blocks: int, chain_blocks: int) -> dict:
    singles, sixteens = stored_events(blocks, 1), stored_events(blocks, 16)
    removals = [kv_wire.BlockRemoved(block_hashes=[ENGINE_BASE + i], medium="GPU")
                for i in range(0, blocks, 2)]  # fmt: skip
    box: dict[str, KvMirror] = {}

    def fresh() -> None:
        box["m"] = KvMirror(PAGE)

    def full() -> None:
        box["m"] = KvMirror(PAGE)
        box["m"].apply(singles)

    store_1 = best_of(5, lambda: box["m"].apply(singles), fresh)
    store_16 = best_of(5, lambda: box["m"].apply(sixteens), fresh)
    remove = best_of(5, lambda: box["m"].apply(removals), full)
    full()
    mirror = box["m"]
    first = (blocks // 2) // CHAIN_LEN * CHAIN_LEN  # a chain in the middle of the cache
    length = min(chain_blocks, CHAIN_LEN, blocks - first)
    tokens = list(range(first * PAGE, (first + length) * PAGE))
    chain = BlockHasher(PAGE).hash_tokens(tokens).primary
    found = mirror.leading_run(chain)
    if len(found) != length or mirror.chain_to(chain[-1]) != found:
        raise SystemExit(f"the export found {len(found)} of {length} blocks: a bug, not a figure")
    run_s = best_of(5, lambda: [mirror.leading_run(chain) for _ in range(100)]) / 100
    chain_s = best_of(5, lambda: [mirror.chain_to(chain[-1]) for _ in range(100)]) / 100
    return {**figures(blocks, store_1, store_16, remove, len(removals), length, run_s, chain_s),
            **announce(mirror)}  # fmt: skip


def announce(mirror: KvMirror) -> dict:
    """The whole cache re-announced: the dump, and one consumer's decode and apply of it."""
    dump_s = best_of(5, mirror.dump)
    piece_s = min(_longest_piece(mirror) for _ in range(5))
    events = mirror.dump()
    if sum(len(e.hashes) for e in events) != len(mirror.blocks):
        raise SystemExit("the dump left blocks out: a bug, not a figure")
    payload = encode(KvEventBatch(worker_id="w0", seq=1, ts=0.0, events=events, epoch=1))
    decode = decoder_for(KvEventBatch).decode
    decode_s = best_of(5, lambda: decode(payload))
    box: dict[str, IndexFeeder] = {}

    def holding() -> None:  # an index that already holds the blocks (seq 0 stored them)
        feeder = box["f"] = IndexFeeder(PrefixIndex())
        feeder.apply(KvEventBatch(worker_id="w0", seq=0, ts=0.0, events=events, epoch=1), 0.0)

    apply_s = best_of(5, lambda: box["f"].apply(decode(payload), 1.0), holding) - decode_s
    return {
        "dump_events": len(events),
        "dump_bytes": len(payload),
        "dump_ms": round(dump_s * 1e3, 2),
        "dump_longest_piece_ms": round(piece_s * 1e3, 2),
        "dump_decode_ms": round(decode_s * 1e3, 2),
        "dump_apply_ms": round(max(apply_s, 0.0) * 1e3, 2),
    }


def _longest_piece(mirror: KvMirror) -> float:
    """The longest stretch between two pieces of the dump the adapter sends a piece at a time."""
    longest, last = 0.0, time.perf_counter()
    for _ in mirror.dump_pieces():
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    return longest


def figures(blocks: int, store_1: float, store_16: float, remove: float, removals: int,
            length: int, run_s: float, chain_s: float) -> dict:  # fmt: skip
    return {
        "blocks": blocks,
        "store_us_per_block_1_per_event": round(store_1 / blocks * 1e6, 3),
        "store_us_per_block_16_per_event": round(store_16 / blocks * 1e6, 3),
        "remove_us_per_block": round(remove / removals * 1e6, 3),
        "export_chain_blocks": length,
        "export_leading_run_us": round(run_s * 1e6, 2),
        "export_chain_to_us": round(chain_s * 1e6, 2),
    }


def main(argv: list[str] | None = None) -> None:
    p = bench_parser("mirror", __doc__)
    p.add_argument("--blocks", type=positive_list, default=[50_000, 500_000],
                   help="comma list: blocks in the mirror for each run")  # fmt: skip
    p.add_argument("--chain", type=at_least(1), default=64, help="blocks in the exported chain")
    p.add_argument("--json", type=output_file, default=None)
    args = p.parse_args(argv)
    # what was alive before (a test runner's heap, say) is kept out of the collector's sight:
    # each round's collection then scans only what this benchmark made (with six million objects
    # alive before it: 39.5 s -> 5.4 s for the test's two sizes)
    gc.freeze()
    try:
        rows = [measure(max(int(n), CHAIN_LEN), args.chain) for n in args.blocks]
    finally:
        gc.unfreeze()
    for row in rows:
        print(dumps(row, indent=None))
    if args.json:
        write_json(args.json, {"page_size": PAGE, "rows": rows})


if __name__ == "__main__":
    main()
