"""The index service's holder queries over real NATS: answers in the query's order, long lists
split into several queries, and an answer that does not match its query refused."""

from __future__ import annotations

import time

import msgspec
import pytest

from tests.integration.inproc import inproc_stack
from tests.integration.migration_stack import start_index
from thunderagent.bus import Bus, BusError, connect
from thunderagent.hashing import BlockHasher
from thunderagent.migrator.holders import IndexHolders
from thunderagent.schemas import BlocksStored, HoldersReply, KvEventBatch, subjects
from thunderagent.schemas.kv import MAX_HOLDERS_QUERY

pytestmark = pytest.mark.integration


def stored(worker: str, tokens: list[int]) -> tuple[KvEventBatch, list[int]]:
    """A batch storing ``tokens``' blocks on ``worker``, and their primary hashes."""
    primary, check = BlockHasher(16).hash_tokens(tokens)
    event = BlocksStored(hashes=list(primary), check_hashes=list(check))
    return KvEventBatch(worker_id=worker, seq=0, ts=time.time(), events=[event]), list(primary)


async def test_holders_come_back_in_order_and_long_lists_in_several_queries(nats_server):
    async with inproc_stack(nats_server.url) as stack:
        index = await start_index(stack)
        shared, on_both = stored("w0", list(range(64)))
        index.follower.feeder.apply(shared, time.time())
        index.follower.feeder.apply(stored("w1", list(range(64)))[0], time.time())
        only_w0, alone = stored("w0", list(range(1000, 1032)))
        index.follower.feeder.apply(msgspec.structs.replace(only_w0, seq=1), time.time())
        nc = await connect(nats_server.url, name="test-holders")
        try:
            unknown = list(range(1, MAX_HOLDERS_QUERY + 10))  # more than one query holds
            asked = [on_both[-1], *unknown, alone[0], on_both[0]]
            before = index.bus.stats[subjects.INDEX_HOLDERS].delivered
            held = await IndexHolders(Bus(nc, service="test")).of(asked)
            assert index.bus.stats[subjects.INDEX_HOLDERS].delivered - before == 2
            assert held[on_both[-1]] == held[on_both[0]] == ["w0", "w1"]
            assert held[alone[0]] == ["w0"]
            assert all(held[h] == [] for h in unknown)
            assert len(held) == len(asked)
        finally:
            await nc.close()


async def test_an_answer_that_does_not_match_its_query_is_refused(nats_server):
    nc = await connect(nats_server.url, name="test-short-answer")
    try:

        async def short(msg) -> None:  # a broken responder: one answer, whatever was asked
            await nc.publish(msg.reply, msgspec.json.encode(HoldersReply(holders=[["w0"]])))

        await nc.subscribe(subjects.INDEX_HOLDERS, cb=short)
        await nc.flush()
        with pytest.raises(BusError, match="1 answers to 3 prefixes"):
            await IndexHolders(Bus(nc, service="test"), timeout_s=2).of([1, 2, 3])
    finally:
        await nc.close()
