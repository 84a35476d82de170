"""The adapter's KV relay on a real JetStream: engine batches that arrive while a publish waits
for its ack go out together, in order, under one adapter sequence number; a quiet engine's
batch goes alone, at once."""

from __future__ import annotations

import asyncio

import pytest

from thunderagent.bus import Bus, connect
from thunderagent.bus.bus import encode
from thunderagent.prefix_index import PrefixIndex
from thunderagent.prefix_index.feed import FeedOutcome, IndexFeeder
from thunderagent.schemas import AllCleared, BlocksStored, KvEventBatch, subjects
from thunderagent.sglang import kv_wire
from thunderagent.sglang.zmq_subscriber import Received
from thunderagent.worker.kv_relay import MAX_BATCH_BYTES, KvRelay

pytestmark = pytest.mark.integration

BLOCK = 4


def engine_batch(i: int) -> Received:
    """Engine step ``i`` stores one block of its own (a chain of one, from the root)."""
    tokens = [1000 + 4 * i + k for k in range(BLOCK)]
    stored = kv_wire.BlockStored(block_hashes=[i + 1], parent_block_hash=None, token_ids=tokens,
                                 block_size=BLOCK, lora_id=None)  # fmt: skip
    return Received(seq=i, batch=kv_wire.KvEventBatch(ts=0.0, events=[stored]))


async def test_batches_waiting_on_an_ack_share_the_next_message(nats_server):
    nc = await connect(nats_server.url, name="adapter")
    bus = Bus(nc, service="worker-w0")
    relay = KvRelay(bus, "w0", BLOCK)
    await relay.start()  # publishes AllCleared: the fresh epoch starts empty
    heard = []

    def broken(_notice) -> None:
        raise ValueError("a listener's bug")

    relay.listeners.append(broken)  # fails on every notice: the relay and the others go on
    relay.listeners.append(heard.append)  # the token tap's place: every notice, in order
    seen: list[KvEventBatch] = []

    async def on_batch(batch: KvEventBatch, _seq: int) -> None:
        seen.append(batch)

    await bus.consume(subjects.KV_EVENTS_STREAM, subjects.kv_events("w0"), KvEventBatch,
                      on_batch)  # fmt: skip
    await relay.handle(engine_batch(0))  # quiet: goes alone
    for _ in range(100):
        if len(seen) == 2:
            break
        await asyncio.sleep(0.01)
    for i in range(1, 9):  # a burst: the first is in flight while the rest arrive
        await relay.handle(engine_batch(i))
    for _ in range(200):
        if sum(len(b.events) for b in seen) == 1 + 9:
            break
        await asyncio.sleep(0.01)
    await relay.close()
    await nc.close()
    assert isinstance(seen[0].events[0], AllCleared)
    stored = [e for b in seen[1:] for e in b.events]
    assert all(isinstance(e, BlocksStored) for e in stored)
    assert [len(e.hashes) for e in stored] == [1] * 9
    assert [b.seq for b in seen] == list(range(len(seen))), "one sequence, no gaps"
    assert len(seen[1].events) == 1, "a quiet engine's batch is not held back"
    assert [n.seq for n in heard] == list(range(9))
    assert len(seen) <= 4, f"9 engine batches in {len(seen) - 1} messages"
    assert relay.published == len(seen)
    # the order of the engine's stores survives the merging (the mirror re-hashed each block)
    order = [relay.mirror.blocks[i + 1] for i in range(9)]
    assert [e.hashes[0] for e in stored] == [b.primary for b in order]


def stored_roots(first: int, n: int) -> list[kv_wire.BlockStored]:
    """``n`` engine blocks, each a prompt of one block (a chain of its own from the root)."""
    return [
        kv_wire.BlockStored(
            block_hashes=[first + i],
            parent_block_hash=None,
            token_ids=[BLOCK * (first + i) + k for k in range(BLOCK)],
            block_size=BLOCK,
            lora_id=None,
        )
        for i in range(n)
    ]


def stored_chain(first: int, n: int) -> kv_wire.BlockStored:
    """One engine event storing a chain of ``n`` blocks (a long prompt)."""
    return kv_wire.BlockStored(
        block_hashes=list(range(first, first + n)), parent_block_hash=None,
        token_ids=[10**7 + i for i in range(n * BLOCK)], block_size=BLOCK, lora_id=None,
    )  # fmt: skip


async def test_a_cache_dump_over_the_payload_limit_arrives_whole(nats_server):
    """The periodic re-announcement (and a resync) of a large cache goes out as several
    messages under NATS's payload limit (and 256 KiB), in sequence: none is refused, no block is
    lost, and a consumer applying them in order holds the engine's whole cache."""
    nc = await connect(nats_server.url, name="adapter")
    bus = Bus(nc, service="worker-w0")
    relay = KvRelay(bus, "w0", BLOCK)
    await relay.start()
    roots, chain = 70_000, 30_000  # single-block dump events: ~136 bytes each, 8 MB at ~61k
    relay.mirror.apply([*stored_roots(1, roots), stored_chain(10**6, chain)])
    seen: list[KvEventBatch] = []

    async def on_batch(batch: KvEventBatch, _seq: int) -> None:
        seen.append(batch)

    await bus.consume(subjects.KV_EVENTS_STREAM, subjects.kv_events("w0"), KvEventBatch,
                      on_batch)  # fmt: skip
    assert len(encode(KvEventBatch(worker_id="w0", seq=1, ts=0.0, events=relay.mirror.dump(),
                                   epoch=relay.epoch))) > nc.max_payload  # fmt: skip
    await relay.refresh()
    for _ in range(500):
        if sum(len(e.hashes) for b in seen for e in b.events if isinstance(e, BlocksStored)) >= (
            roots + chain
        ):
            break
        await asyncio.sleep(0.02)
    await relay.close()
    await nc.close()
    stored = [e for b in seen for e in b.events if isinstance(e, BlocksStored)]
    got = [h for e in stored for h in e.hashes]
    assert sorted(got) == sorted(b.primary for b in relay.mirror.blocks.values())
    assert [b.seq for b in seen] == list(range(len(seen))), "one sequence, no gaps"
    assert len(seen) > 2, "the dump went as several messages"
    assert all(len(encode(b)) <= MAX_BATCH_BYTES for b in seen), "each a consumer's short bite"
    feeder = IndexFeeder(PrefixIndex(ttl_s=None))  # as the index, routers and scheduler do
    outcomes = [feeder.apply(batch, 0.0) for batch in seen]
    assert outcomes == [FeedOutcome.NEW_EPOCH] + [FeedOutcome.APPLIED] * (len(seen) - 1)
    index = feeder.index
    tail = relay.mirror.blocks[10**6 + chain - 1]
    assert index.block_counts() == {"w0": roots + chain}
    chain_hashes = [relay.mirror.blocks[10**6 + i] for i in range(chain)]
    query = ([b.primary for b in chain_hashes], [b.check for b in chain_hashes])
    assert tail.primary == query[0][-1]
    assert index.overlap(*query) == {"w0": chain}, "the long chain is whole and closed"
