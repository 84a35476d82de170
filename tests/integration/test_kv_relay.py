"""The adapter's KV relay on a real JetStream: engine batches that arrive while a publish waits
for its ack go out together, in order, under one adapter sequence number; a quiet engine's
batch goes alone, at once."""

from __future__ import annotations

import asyncio

import pytest

from thunderagent.bus import Bus, connect
from thunderagent.schemas import AllCleared, BlocksStored, KvEventBatch, subjects
from thunderagent.sglang import kv_wire
from thunderagent.sglang.zmq_subscriber import Received
from thunderagent.worker.kv_relay import KvRelay

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
