"""Tenant isolation of the KV cache, end to end: ``GenerateRequest.cache_salt`` reaches the
engine (SGLang's ``/generate`` ``cache_salt``), the simulated engine keys its cache by salted block
hashes and names the salt on its ``BlockStored`` events, the adapter's mirror re-hashes salted
chains into the tenant's namespace, and the router hashes a salted prompt the same way.

So two tenants sending the same prompt share no cached tokens, and the router predicts none;
the same tenant does hit, and so do unsalted requests among themselves. LoRA adapters the same
way (``GenerateRequest.lora_name``, SGLang's ``lora_path`` and its events' ``lora_name``): an
adapter's KV is its own, apart from the base model's and every other adapter's.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.inproc import MODEL, inproc_stack, start_full_stack
from tests.integration.test_kv_routing import wait_for
from thunderagent.bus import Bus, connect
from thunderagent.client import RequestFailed, ThunderClient
from thunderagent.hashing import BlockHasher, kv_namespace
from thunderagent.schemas import BlocksStored, GenerateRequest, KvEventBatch, subjects
from thunderagent.sglang import kv_wire
from thunderagent.sglang.mirror import KvMirror
from thunderagent.simengine.salts import CacheNamespace, SaltBook
from thunderagent.worker.adapter import AdapterConfig
from thunderagent.worker.service import main as adapter_main

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
    book, cached, a = SaltBook(), {1, 2}, CacheNamespace("a", None)
    book.hold([1, 2, 3], a)
    book.hold([3], a)
    book.release([1, 2, 3], cached.__contains__)
    assert (book.salt_of(1), book.salt_of(3)) == (a, a)  # 3: still held by the second
    book.release([3], cached.__contains__)
    assert book.salt_of(3) is None and len(book) == 2
    cached.discard(1)
    book.forget([1, 2], cached.__contains__)
    assert book.keys() == [2]


# --- live: two tenants, one prompt --------------------------------------------------------


async def _run(client: ThunderClient, tokens: list[int], salt: str | None, lora: str | None = None):
    request = GenerateRequest(model=MODEL, token_ids=tokens, max_tokens=2, cache_salt=salt,
                              lora_name=lora)  # fmt: skip
    done = await client.generate(request)
    return done.final


async def _hit(
    client: ThunderClient, tokens: list[int], salt: str | None, expect_blocks: int,
    lora: str | None = None,
):  # fmt: skip
    """Repeat until the router has seen the events of the first run (a few ms)."""
    for _ in range(100):
        final = await _run(client, tokens, salt, lora)
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


@pytest.mark.integration
async def test_lora_adapters_share_no_cached_prefix_with_each_other_or_the_base_model(nats_server):
    tokens = prompt(8, seed=2) + [7]
    async with inproc_stack(nats_server.url) as stack:
        # a pool that holds every namespace's copy (the tiny profile's 32 blocks evict one)
        await start_full_stack(stack, workers=1, policy="thunder", speedup=100,
                               profile="llama-3.1-8b-h100",
                               lora_adapters=["sql-adapter", "chat-adapter"])  # fmt: skip
        client = await ThunderClient.connect(nats_server.url, idle_timeout_s=20)
        try:
            first = await _run(client, tokens, None, "sql-adapter")
            assert first.usage.cached_tokens == 0
            again = await _hit(client, tokens, None, 8, "sql-adapter")
            assert again.usage.cached_tokens >= 8 * BLOCK  # the same adapter hits
            for salt, lora in ((None, "chat-adapter"), (None, None), ("tenant-a", "sql-adapter")):
                other = await _run(client, tokens, salt, lora)
                assert other.predicted_cached_tokens == 0, f"router predicted a hit: {lora}"
                assert other.usage.cached_tokens == 0, f"engine served another's KV: {lora}"
            # each adapter's blocks reach the router's index in the adapter's namespace
            index = stack.services["router"].runtime.core.feeder.gpu_index
            for lora in ("sql-adapter", "chat-adapter"):
                mine = BlockHasher(BLOCK, kv_namespace(None, lora)).hash_tokens(tokens)
                await wait_for(lambda m=mine: index.overlap(m.primary, m.check) == {"w0": 8},
                               what=f"{lora}'s blocks in the router's index")  # fmt: skip
        finally:
            await client.close()


@pytest.mark.integration
async def test_a_request_for_an_adapter_goes_only_where_it_is_loaded(nats_server):
    """Workers list their loaded adapters (SGLang's ``/v1/models``); a request naming one goes
    to a worker that has it, and one naming an adapter no worker has is refused with why."""
    tokens = prompt(4, seed=3)
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=2, policy="thunder", speedup=100)
        await stack.stop_service("worker-w1")  # w1 again, with an adapter loaded
        await stack.start_engine("w1-lora", lora_adapters=["sql-adapter"])
        config = AdapterConfig(worker_id="w1", engine_url=stack.engine_urls["w1-lora"],
                               lease_s=2.0, load_interval_s=0.05)  # fmt: skip
        await stack.start_service("worker-w1", lambda ctx: adapter_main(ctx, config))
        router = stack.services["router"].runtime.core
        await wait_for(lambda: (w := router.fleet.get("w1")) is not None
                       and w.registration.lora_adapters == ["sql-adapter"],
                       what="w1's adapters in the router's fleet")  # fmt: skip
        client = await ThunderClient.connect(nats_server.url, idle_timeout_s=20)
        try:
            served = {(await _run(client, tokens + [i], None, "sql-adapter")).worker_id
                      for i in range(6)}  # fmt: skip
            assert served == {"w1"}
            with pytest.raises(RequestFailed) as refused:
                await _run(client, tokens, None, "chat-adapter")
            assert "no worker of model" in str(refused.value)
            assert "'chat-adapter'" in str(refused.value)
        finally:
            await client.close()
