"""Deterministic event streams and queries for ``thunderagent.bench.index``, and the wire bytes
each index is fed (our ``KvEventBatch`` msgpack, Dynamo's JSON ``KvCacheEvent``).

Conversations start from one of a few shared system prompts and grow turn by turn, each turn one
stored-blocks event on the conversation's worker (parent = its last block). A new conversation,
or one that moves to another worker, stores its whole prefix from the root (re-confirming shared
blocks). Queries are the first 32-64 blocks of a known conversation followed by fresh, uncached
blocks (64 in all), plus a few prompts under an unknown system prompt. The bulk stream stores
long chains (``BULK_BLOCKS`` per event) to measure per-block cost with per-call costs amortised.
Every hash is computed before any timing starts.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

import msgspec

from thunderagent.hashing import BlockHasher
from thunderagent.schemas import BlocksStored, KvEventBatch

WORKERS = 8
QUERY_BLOCKS = 64
SYSTEM_PROMPTS = 24
MAX_CONVERSATION_BLOCKS = 160
BULK_BLOCKS = 100
EVENT_DT_S = 0.001
"""Simulated clock step per event: 250k events span 250 s, inside the default TTL."""

Event = tuple[int, int, list[int], list[int], int | None, list[int]]
"""(worker, seq, primary, check, parent, local block ids)."""


@dataclass(slots=True)
class _Conversation:
    worker: int
    ids: list[int] = field(default_factory=list)
    primary: list[int] = field(default_factory=list)
    check: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Workload:
    events: list[Event]
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
    out: list[Event] = []

    def emit(conv: _Conversation, primary, check, parent, ids) -> None:
        out.append((conv.worker, seqs[conv.worker], primary, check, parent, ids))
        seqs[conv.worker] += 1

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
            primary, check = _extend(hasher, conv, fresh(rng.randint(1, 7)))
            emit(conv, primary, check, parent, conv.ids[-len(primary) :])
        if len(conv.ids) >= MAX_CONVERSATION_BLOCKS:
            active.remove(conv)
    qs = [_query(hasher, rng, convs, fresh) for _ in range(queries)]
    total = sum(len(e[2]) for e in out)
    unique = len({p for e in out for p in e[2]})
    return Workload(out, qs, total, unique)


def _query(hasher: BlockHasher, rng: random.Random, convs: list, fresh) -> tuple:
    if rng.random() < 0.05:
        conv = _Conversation(-1)  # unknown system prompt: a miss at block 0
    else:
        conv = rng.choice(convs)
    keep = min(len(conv.ids), rng.randint(QUERY_BLOCKS // 2, QUERY_BLOCKS))
    q = _Conversation(-1, conv.ids[:keep], conv.primary[:keep], conv.check[:keep])
    _extend(hasher, q, fresh(QUERY_BLOCKS - keep))
    return (q.primary, q.check, q.ids)


def build_bulk(events: int, seed: int) -> list[Event]:
    """``events`` chains of ``BULK_BLOCKS`` fresh blocks from the root, round robin on workers."""
    rng = random.Random(seed + 1)
    hasher = BlockHasher(block_size=1)
    out: list[Event] = []
    for i in range(events):
        ids = [rng.getrandbits(63) for _ in range(BULK_BLOCKS)]
        h = hasher.hash_block_ids(ids)
        out.append((i % WORKERS, i // WORKERS, h.primary, h.check, None, ids))
    return out


def our_payloads(events: list[Event]) -> list[bytes]:
    """Each event as the ``KvEventBatch`` msgpack our index service receives (one per batch)."""
    enc = msgspec.msgpack.Encoder()
    return [
        enc.encode(
            KvEventBatch(
                worker_id=f"worker-{wid}",
                seq=seq,
                ts=i * EVENT_DT_S,
                events=[BlocksStored(hashes=p, check_hashes=c, parent_hash=parent)],
            )
        )
        for i, (wid, seq, p, c, parent, _ids) in enumerate(events)
    ]


def dynamo_payloads(events: list[Event]) -> list[tuple[int, bytes]]:
    """Each event as the JSON ``KvCacheEvent`` bytes ``dynamo.llm.RadixTree.apply_event`` takes
    (``tokens_hash`` = the block id, the local hash Dynamo's queries walk by)."""
    out = []
    for wid, seq, primary, _check, parent, ids in events:
        blocks = [{"block_hash": p, "tokens_hash": t} for p, t in zip(primary, ids, strict=True)]
        event = {
            "event_id": seq,
            "dp_rank": 0,
            "data": {"stored": {"parent_hash": parent, "blocks": blocks}},
        }
        out.append((wid, json.dumps(event).encode()))
    return out
