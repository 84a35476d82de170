"""Tenant isolation of the KV cache, end to end: ``GenerateRequest.cache_salt`` reaches the
engine (SGLang's ``/generate`` ``cache_salt``), the simulated engine keys its cache by salted block
hashes and names the salt on its ``BlockStored`` events, the adapter's mirror re-hashes salted
chains into the tenant's namespace, and the router hashes a salted prompt the same way.

So two tenants sending the same prompt share no cached tokens, and the router predicts none;
the same tenant does hit, and so do unsalted requests among themselves.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.inproc import MODEL, inproc_stack, start_full_stack
from thunderagent.bus import Bus, connect
from thunderagent.client import ThunderClient
from thunderagent.hashing import BlockHasher
from thunderagent.schemas import BlocksStored, GenerateRequest, KvEventBatch, subjects
from thunderagent.sglang import kv_wire
from thunderagent.sglang.mirror import KvMirror
from thunderagent.simengine.salts import SaltBook

BLOCK = 16


def prompt(blocks: int, seed: int = 1) -> list[int]:
    return [(seed * 7919 + i) % 50_000 + 4 for i in range(blocks * BLOCK)]


# --- pure: the mirror's salted namespace is the router's ------------------------------------


def stored(tokens: list[int], salt: str | None, parent: bytes | None = None, parent_hash=None):
    seed = parent if parent is not None else (kv_wire.sglang_salt_parent(salt) if salt else None)
    digests = kv_wire.sglang_block_digests(tokens, BLOCK, seed)
    event = kv_wire.BlockStored(
        block_hashes=[kv_wire.digest_to_int64(d) for d in digests],
        parent_block_hash=parent_hash,
        token_ids=tokens,
        block_size=BLOCK,
        lora_id=None,
        cache_salt=salt,
    )
    return event, digests[-1]


def test_mirror_hashes_a_salted_chain_like_the_router():
    tokens = prompt(6)
    for salt in (None, "tenant-a", "tenant-b", "ünïcode ✓"):
        mirror = KvMirror(BLOCK)
        head, last = stored(tokens[: 4 * BLOCK], salt)
        tail, _ = stored(tokens[4 * BLOCK :], salt, last, head.block_hashes[-1])
        out = mirror.apply([head, tail])
        ours = [h for ev in out if isinstance(ev, BlocksStored) for h in ev.hashes]
        router = BlockHasher(BLOCK, salt if salt else 0).hash_tokens(tokens)
        assert ours == router.primary, salt
    a = BlockHasher(BLOCK, "tenant-a").hash_tokens(tokens).primary
    b = BlockHasher(BLOCK, "tenant-b").hash_tokens(tokens).primary
    shared = BlockHasher(BLOCK).hash_tokens(tokens).primary
    assert not set(a) & set(b) and not set(a) & set(shared)


def test_the_salt_book_forgets_what_nothing_holds():
    book, cached = SaltBook(), {1, 2}
    book.hold([1, 2, 3], "a")
    book.hold([3], "a")
    book.release([1, 2, 3], cached.__contains__)
    assert (book.salt_of(1), book.salt_of(3)) == ("a", "a")  # 3: still held by the second
    book.release([3], cached.__contains__)
    assert book.salt_of(3) is None and len(book) == 2
    cached.discard(1)
    book.forget([1, 2], cached.__contains__)
    assert book.keys() == [2]


# --- live: two tenants, one prompt --------------------------------------------------------


async def _run(client: ThunderClient, tokens: list[int], salt: str | None):
    request = GenerateRequest(model=MODEL, token_ids=tokens, max_tokens=2, cache_salt=salt)
    done = await client.generate(request)
    return done.final


async def _hit(client: ThunderClient, tokens: list[int], salt: str | None, expect_blocks: int):
    """Repeat until the router has seen the events of the first run (a few ms)."""
    for _ in range(100):
        final = await _run(client, tokens, salt)
        if final.predicted_cached_tokens >= expect_blocks * BLOCK:
            return final
        await asyncio.sleep(0.05)
    raise AssertionError(f"the router never predicted a hit for salt {salt!r}")


@pytest.mark.integration
async def test_tenants_share_no_cached_prefix_and_the_router_predicts_none(nats_server):
    tokens = prompt(8) + [7, 7, 7]  # 8 full blocks and a partial one
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=1, policy="thunder", speedup=100)
        nc = await connect(nats_server.url, name="test-events")
        events: list[KvEventBatch] = []
        bus = Bus(nc, service="test")
        await bus.consume(subjects.KV_EVENTS_STREAM, subjects.KV_EVENTS_WILDCARD, KvEventBatch,
                          lambda batch, _seq: _append(events, batch))  # fmt: skip
        client = await ThunderClient.connect(nats_server.url, idle_timeout_s=20)
        try:
            first = await _run(client, tokens, "tenant-a")
            assert first.usage.cached_tokens == 0
            again = await _hit(client, tokens, "tenant-a", 8)
            assert again.usage.cached_tokens >= 8 * BLOCK  # the same tenant hits
            other = await _run(client, tokens, "tenant-b")
            assert other.predicted_cached_tokens == 0, "router predicted a cross-tenant hit"
            assert other.usage.cached_tokens == 0, "engine served another tenant's KV"
            shared = await _run(client, tokens, None)
            assert (shared.predicted_cached_tokens, shared.usage.cached_tokens) == (0, 0)
            shared_again = await _hit(client, tokens, None, 8)
            assert shared_again.usage.cached_tokens >= 8 * BLOCK
        finally:
            await client.close()
            await nc.close()
        published = {h for b in events for e in b.events if isinstance(e, BlocksStored)
                     for h in e.hashes}  # fmt: skip
        for salt in ("tenant-a", "tenant-b", None):
            expected = BlockHasher(BLOCK, salt or 0).hash_tokens(tokens).primary
            assert set(expected) <= published, f"index never got {salt!r}'s blocks"


async def _append(events: list, batch: KvEventBatch) -> None:
    events.append(batch)
