"""The adapter's migration helpers: resolving our prefix hash to the engine's chain through the
mirror (``KvMirror.chain_to``, ``leading_run``), and the token tap that lets a warm-up name a
prefix to an engine without KV import."""

from __future__ import annotations

import asyncio

import msgspec

from thunderagent.hashing import BlockHasher, kv_namespace
from thunderagent.schemas import KvExportRequest
from thunderagent.sglang import kv_wire
from thunderagent.sglang.mirror import KvMirror
from thunderagent.sglang.zmq_subscriber import Gap, Received, Restarted
from thunderagent.worker.migration import TokenTap, WorkerMigration

BS = 4


def stored(hashes: list[int], parent: int | None, tokens: list[int]) -> kv_wire.BlockStored:
    return kv_wire.BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=BS,
        lora_id=None,
        medium="GPU",
    )


def test_chain_to_walks_from_our_deepest_hash_to_the_root() -> None:
    mirror = KvMirror(BS)
    tokens = list(range(100, 116))
    mirror.apply([stored([11, 12], None, tokens[:8]), stored([13, 14], 12, tokens[8:])])
    ours = BlockHasher(BS).hash_tokens(tokens).primary
    assert mirror.chain_to(ours[3]) == [11, 12, 13, 14]
    assert mirror.chain_to(ours[1]) == [11, 12]
    assert mirror.chain_to(12345) is None
    del mirror.blocks[12]  # a lost event broke the chain: nothing is moved
    assert mirror.chain_to(ours[3]) is None


def test_leading_run_is_the_longest_leading_run_the_mirror_holds() -> None:
    """A run's copy names the whole chain; the source offers what it holds of it from the root
    (a prompt still being prefilled there: its finished chunks)."""
    mirror = KvMirror(BS)
    tokens = list(range(200, 224))  # 6 blocks; the engine holds the first 4
    mirror.apply([stored([21, 22], None, tokens[:8]), stored([23, 24], 22, tokens[8:16])])
    chain = BlockHasher(BS).hash_tokens(tokens).primary
    assert mirror.leading_run(chain) == [21, 22, 23, 24]
    assert mirror.leading_run(chain[:2]) == [21, 22]
    assert mirror.leading_run(chain[1:]) == []  # not from the root: nothing
    assert mirror.leading_run([12345, *chain]) == []
    del mirror.blocks[22]  # a lost event: the run stops before the gap
    assert mirror.leading_run(chain) == [21]


def test_token_tap_follows_stores_removals_and_clears() -> None:
    tap = TokenTap(BS, max_blocks=3)
    tap.apply([stored([1, 2], None, list(range(8))), stored([3], 2, [8, 9, 10, 11])])
    assert tap.tokens([1, 2, 3]) == list(range(12))
    tap.apply([kv_wire.BlockRemoved(block_hashes=[3], medium="GPU")])
    assert tap.tokens([1, 2, 3]) is None and tap.tokens([1, 2]) == list(range(8))
    tap.apply([stored([5, 6], 2, list(range(20, 28)))])  # bounded: block 1 is the oldest
    assert 1 not in tap.blocks and tap.tokens([5, 6]) == list(range(20, 28))
    tap.apply([stored([7], None, [1, 2, 3])])  # a malformed store is skipped
    assert 7 not in tap.blocks
    tap.apply([stored([8], None, [1, 2, 3, -1])])  # so is one whose tokens cannot be packed
    assert 8 not in tap.blocks
    tap.apply([kv_wire.AllBlocksCleared()])
    assert tap.blocks == {}


def test_the_tap_reads_the_relays_notices_and_forgets_all_on_an_engine_restart() -> None:
    tap = TokenTap(BS)
    batch = kv_wire.KvEventBatch(ts=0.0, events=[stored([1], None, [5, 6, 7, 8])])
    tap.take(Received(seq=0, batch=batch))
    assert tap.tokens([1]) == [5, 6, 7, 8]
    tap.take(Gap(start=1, stop=2, lost=((1, 2),)))  # what was lost is unknown; the rest holds
    assert tap.tokens([1]) == [5, 6, 7, 8]
    tap.take(Restarted(seq=0))
    assert tap.tokens([1]) is None and tap.blocks == {}


def test_a_tenants_or_an_adapters_prefix_is_offered_in_its_namespace() -> None:
    """The offer names the tenant salt and the LoRA adapter the prefix is cached under, so the
    target caches it there (a copy under the base model's keys would serve the wrong
    requests); a base-model prefix is offered with neither."""
    tokens = list(range(300, 308))
    mirror = KvMirror(BS)
    base = stored([31, 32], None, tokens)
    adapter = msgspec.structs.replace(base, block_hashes=[41, 42], lora_name="sql-adapter")
    tenant = msgspec.structs.replace(base, block_hashes=[51, 52], cache_salt="tenant-a")
    mirror.apply([base, adapter, tenant])
    migration = WorkerMigration("w0", bus=None, engine=None, mirror=lambda: mirror, block_size=BS)  # type: ignore[arg-type]
    migration.tap = TokenTap(BS)
    migration.tap.apply([base, adapter, tenant])
    offers = {}
    for name, namespace in (("base", 0), ("adapter", kv_namespace(None, "sql-adapter")),
                            ("tenant", "tenant-a")):  # fmt: skip
        deepest = BlockHasher(BS, namespace).hash_tokens(tokens).primary[-1]
        request = KvExportRequest(migration_id=name, prefix_hash=deepest)
        offers[name] = asyncio.run(migration.export(request))
    for name in ("base", "adapter", "tenant"):
        assert offers[name].blocks == 2 and offers[name].token_ids == tokens, name
    spaces = {name: (offer.cache_salt, offer.lora_name) for name, offer in offers.items()}
    assert spaces == {
        "base": (None, None), "adapter": (None, "sql-adapter"), "tenant": ("tenant-a", None),
    }  # fmt: skip
    assert mirror.namespace_of([41, 42]) == (None, "sql-adapter")
    assert mirror.namespace_of([31, 32]) is None
    mirror.apply([kv_wire.BlockRemoved(block_hashes=[42, 41], medium="GPU")])
    assert mirror.namespaced_roots == {51: ("tenant-a", None)}  # forgotten with its chain
