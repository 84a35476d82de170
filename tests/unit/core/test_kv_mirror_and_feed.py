"""SGLang events -> our events (mirror), batches -> index (feeder), lazy verification."""

from __future__ import annotations

import itertools

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from thunderagent.hashing import BlockHasher
from thunderagent.prefix_index import PrefixIndex
from thunderagent.prefix_index.feed import FeedOutcome, IndexFeeder
from thunderagent.prefix_index.state import capture, restore
from thunderagent.router_core import RouterCore, RouterParams
from thunderagent.router_core.verification import Dispatch, Verifier
from thunderagent.schemas import AllCleared, BlocksRemoved, BlocksStored, KvEventBatch, Medium
from thunderagent.sglang import kv_wire
from thunderagent.sglang.mirror import KvMirror

PAGE = 4


def stored(tokens, parent=None, medium="GPU"):
    hashes = kv_wire.sglang_block_hashes(tokens, PAGE)
    return kv_wire.BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=list(tokens),
        block_size=PAGE,
        lora_id=None,
        medium=medium,
    ), hashes


def test_mirror_rehashes_token_ids_into_our_chain():
    tokens = list(range(12))
    ev, _ = stored(tokens)
    mirror = KvMirror(PAGE)
    [out] = mirror.apply([ev])
    ours = BlockHasher(PAGE).hash_tokens(tokens)
    assert isinstance(out, BlocksStored)
    assert (out.hashes, out.check_hashes, out.parent_hash) == (ours.primary, ours.check, None)


def test_mirror_continues_the_chain_from_a_known_parent_and_skips_orphans():
    tokens = list(range(16))
    first, _ = stored(tokens[:8])
    # SGLang chains the second event on the full digest of block 2; take its hashes from the
    # whole-prompt computation and give the event the parent SGLang would give it.
    all_hashes = kv_wire.sglang_block_hashes(tokens, PAGE)
    second = kv_wire.BlockStored(
        block_hashes=all_hashes[2:],
        parent_block_hash=all_hashes[1],
        token_ids=tokens[8:],
        block_size=PAGE,
        lora_id=None,
        medium="GPU",
    )
    mirror = KvMirror(PAGE)
    mirror.apply([first])
    [out] = mirror.apply([second])
    ours = BlockHasher(PAGE).hash_tokens(tokens)
    assert out.hashes == ours.primary[2:]
    assert out.parent_hash == ours.primary[1]
    orphan = kv_wire.BlockStored(
        block_hashes=[123], parent_block_hash=999, token_ids=[1, 2, 3, 4],
        block_size=PAGE, lora_id=None, medium="GPU",
    )  # fmt: skip
    assert mirror.apply([orphan]) == []
    assert mirror.stats.orphan_blocks == 1


def test_every_block_the_mirror_skips_is_counted_by_its_reason():
    mirror = KvMirror(PAGE)
    ok, hashes = stored(list(range(8)))
    mirror.apply([ok])
    wrong_size = kv_wire.BlockStored(
        block_hashes=[7, 8], parent_block_hash=None, token_ids=list(range(16)),
        block_size=2 * PAGE, lora_id=None, medium="GPU",
    )  # fmt: skip
    orphan = kv_wire.BlockStored(
        block_hashes=[5], parent_block_hash=999, token_ids=[1, 2, 3, 4],
        block_size=PAGE, lora_id=None, medium="GPU",
    )  # fmt: skip
    disk, _ = stored(list(range(100, 104)), medium="DISK")
    gone = kv_wire.BlockRemoved(block_hashes=[hashes[1], 424242], medium="GPU")
    ours = BlockHasher(PAGE).hash_tokens(list(range(8)))
    assert mirror.apply([wrong_size, orphan, disk, gone]) == [
        BlocksRemoved(hashes=[ours.primary[1]])
    ]
    assert mirror.stats.by_outcome() == {
        "stored": 2, "removed": 1, "orphan": 1, "unknown_removal": 1,
        "size_mismatch": 2, "other_tier": 1, "unhashable": 0,
    }  # fmt: skip


def test_mirror_translates_removals_and_tiers_and_dumps_parents_first():
    tokens = list(range(12))
    ev, engine_hashes = stored(tokens)
    mirror = KvMirror(PAGE)
    mirror.apply([ev])
    ours = BlockHasher(PAGE).hash_tokens(tokens)
    out = mirror.apply([kv_wire.BlockRemoved(block_hashes=[engine_hashes[2]], medium="GPU")])
    assert out == [BlocksRemoved(hashes=[ours.primary[2]], medium=Medium.GPU)]
    dump = mirror.dump()  # the chain left, in one event
    assert dump == [BlocksStored(hashes=ours.primary[:2], check_hashes=ours.check[:2])]
    assert mirror.apply([kv_wire.AllBlocksCleared()]) == [AllCleared()]
    assert mirror.dump() == []


def batch(worker, seq, events, epoch=1):
    return KvEventBatch(worker_id=worker, seq=seq, ts=0.0, events=events, epoch=epoch)


def test_feeder_detects_gaps_stale_batches_and_new_epochs():
    h = BlockHasher(PAGE).hash_tokens(list(range(8)))
    feeder = IndexFeeder(PrefixIndex(ttl_s=None))
    store = BlocksStored(hashes=h.primary, check_hashes=h.check)
    assert feeder.apply(batch("w", 0, [AllCleared(), store]), 0) is FeedOutcome.NEW_EPOCH
    assert feeder.index.overlap(h.primary, h.check) == {"w": 2}
    assert feeder.apply(batch("w", 0, [store]), 0) is FeedOutcome.STALE
    assert feeder.apply(batch("w", 2, [BlocksRemoved(hashes=h.primary[1:])]), 0) is FeedOutcome.GAP
    assert feeder.index.overlap(h.primary, h.check) == {"w": 1}
    assert feeder.apply(batch("w", 5, [store], epoch=0), 0) is FeedOutcome.STALE
    assert feeder.apply(batch("w", 0, [AllCleared()], epoch=2), 0) is FeedOutcome.NEW_EPOCH
    assert feeder.index.overlap(h.primary, h.check) == {}


def test_feeder_state_survives_a_snapshot_round_trip():
    h = BlockHasher(PAGE).hash_tokens(list(range(8)))
    feeder = IndexFeeder(PrefixIndex(ttl_s=None))
    feeder.apply(batch("w", 0, [BlocksStored(hashes=h.primary, check_hashes=h.check)]), 0)
    data = capture(feeder, stream_seq=42, now=0.0)
    fresh = IndexFeeder(PrefixIndex(ttl_s=None))
    assert restore(fresh, data, now=0.0) == 42
    assert fresh.index.overlap(h.primary, h.check) == {"w": 2}
    assert fresh.apply(batch("w", 1, [AllCleared()]), 0) is FeedOutcome.APPLIED
    assert fresh.index.overlap(h.primary, h.check) == {}


def test_verifier_finds_false_and_missed_hits():
    v = Verifier(capacity=2)
    v.remember("r1", Dispatch("w0", predicted_blocks=3, block_size=16, best_blocks=4))
    verdict = v.verify("r1", "w0", cached_tokens=16)
    assert verdict.false_hit and not verdict.missed_hit
    assert (verdict.predicted_tokens, verdict.actual_tokens, verdict.recomputed_tokens) == (
        48,
        16,
        48,
    )
    v.remember("r2", Dispatch("w0", predicted_blocks=0, block_size=16))
    assert v.verify("r2", "w0", cached_tokens=32).missed_hit
    assert v.verify("r2", "w0", cached_tokens=0) is None  # already verified
    v.remember("a", Dispatch("w0", 0, 16))
    v.remember("b", Dispatch("w0", 0, 16))
    v.remember("c", Dispatch("w0", 0, 16))
    assert v.unverified == 1 and v.verify("a", "w0", 0) is None
    assert v.verify("b", "w1", 0) is None  # spilled to another worker: nothing to conclude


def test_host_tier_blocks_are_tracked_apart_from_gpu_blocks():
    h = BlockHasher(PAGE).hash_tokens(list(range(16)))
    feeder = IndexFeeder(PrefixIndex(ttl_s=None))
    store = BlocksStored(hashes=h.primary, check_hashes=h.check)
    feeder.apply(batch("w", 0, [store]), 0)
    assert feeder.gpu is None and feeder.gpu_index is feeder.index  # no host tier yet: one index
    # the engine demotes the last two blocks to host memory
    demoted = h.primary[2:]
    feeder.apply(
        batch("w", 1, [
            BlocksRemoved(hashes=demoted, medium=Medium.GPU),
            BlocksStored(hashes=demoted, check_hashes=h.check[2:], parent_hash=h.primary[1],
                         medium=Medium.CPU_PINNED),
        ]),
        0,
    )  # fmt: skip
    assert feeder.gpu_index.overlap(h.primary, h.check) == {"w": 2}
    assert feeder.index.overlap(h.primary, h.check) == {"w": 4}
    # loaded back: GPU again
    feeder.apply(
        batch("w", 2, [
            BlocksRemoved(hashes=demoted, medium=Medium.CPU_PINNED),
            BlocksStored(hashes=demoted, check_hashes=h.check[2:], parent_hash=h.primary[1]),
        ]),
        0,
    )  # fmt: skip
    assert feeder.gpu_index.overlap(h.primary, h.check) == {"w": 4}
    data = capture(feeder, stream_seq=3, now=0.0)
    fresh = IndexFeeder(PrefixIndex(ttl_s=None))
    restore(fresh, data, now=0.0)
    assert fresh.gpu is not None
    assert fresh.gpu_index.overlap(h.primary, h.check) == {"w": 4}


def test_dump_leaves_out_blocks_whose_parent_is_gone_and_keeps_a_zero_hash_parent():
    tokens = list(range(12))
    ev, engine_hashes = stored(tokens)
    mirror = KvMirror(PAGE)
    mirror.apply([ev])
    ours = BlockHasher(PAGE).hash_tokens(tokens)
    # a removal of the middle block (its child's own removal was lost): the child's chain is
    # broken, and dumping it as a root would claim a prefix it does not start
    mirror.apply([kv_wire.BlockRemoved(block_hashes=[engine_hashes[1]], medium="GPU")])
    dump = mirror.dump()
    assert [(d.hashes[0], d.parent_hash) for d in dump] == [(ours.primary[0], None)]

    zero = KvMirror(PAGE)
    root = kv_wire.BlockStored(block_hashes=[0], parent_block_hash=None, token_ids=tokens[:4],
                               block_size=PAGE, lora_id=None, medium="GPU")  # fmt: skip
    child = kv_wire.BlockStored(block_hashes=[7], parent_block_hash=0, token_ids=tokens[4:8],
                                block_size=PAGE, lora_id=None, medium="GPU")  # fmt: skip
    zero.apply([root, child])
    assert [(d.hashes, d.parent_hash) for d in zero.dump()] == [(ours.primary[:2], None)]


def _scan_run(mirror: KvMirror, chain: list[int]) -> list[int]:
    """The reference: the longest leading run found by scanning every mirrored block."""
    ours = {b.primary: h for h, b in mirror.blocks.items()}
    run, parent = [], None
    for primary in chain:
        h = ours.get(primary)
        if h is None or mirror.blocks[h].parent_engine_hash != parent:
            break
        run.append(h)
        parent = h
    return run


PROMPTS = [[1] * 8 + [2] * 8 + [3] * 8, [1] * 8 + [2] * 8 + [4] * 8, [5] * 12]
"""Three prompts of 6, 6 and 3 blocks; the first two share their first 4 blocks."""


@given(st.lists(st.tuples(st.sampled_from(["store", "remove", "clear"]), st.integers(0, 2),
                          st.integers(0, 5)), max_size=30))  # fmt: skip
def test_exports_find_by_our_hash_exactly_what_a_scan_of_the_mirror_finds(ops) -> None:
    """Stores (a prompt up to some block, as one event or continuing a stored parent),
    removals and clears in any order: the reverse map always names every mirrored block, and
    ``leading_run`` / ``chain_to`` answer as a scan over every block would."""
    mirror = KvMirror(PAGE)
    hasher = BlockHasher(PAGE)
    for op, which, upto in ops:
        tokens = PROMPTS[which][: (upto + 1) * PAGE]
        engine = kv_wire.sglang_block_hashes(tokens, PAGE)
        if op == "store":
            split = len(engine) // 2
            if split and engine[split - 1] in mirror.blocks:  # continue from a stored parent
                ev = kv_wire.BlockStored(
                    block_hashes=engine[split:], token_ids=tokens[split * PAGE :],
                    parent_block_hash=engine[split - 1], block_size=PAGE, lora_id=None,
                    medium="GPU",
                )  # fmt: skip
            else:
                ev, _ = stored(tokens)
            mirror.apply([ev])
        elif op == "remove":
            mirror.apply([kv_wire.BlockRemoved(block_hashes=[engine[-1]], medium="GPU")])
        else:
            mirror.apply([kv_wire.AllBlocksCleared()])
        assert mirror.by_primary == {b.primary: h for h, b in mirror.blocks.items()}
        for prompt in PROMPTS:
            chain = hasher.hash_tokens(prompt).primary
            run = _scan_run(mirror, chain)
            assert mirror.leading_run(chain) == run
            for depth, primary in enumerate(chain, 1):
                assert mirror.chain_to(primary) == (run[:depth] if len(run) >= depth else None)


CHAIN = 5
TIERS = ("GPU", "CPU_PINNED")
tier_ops = st.lists(
    st.tuples(st.sampled_from(("store", "remove")), st.sampled_from(TIERS), st.integers(0, 4)),
    max_size=40,
)


@given(ops=tier_ops)
def test_hierarchical_cache_events_keep_both_tiers_of_a_block(ops):
    """SGLang's hierarchical cache stores and removes a block on GPU and on host by separate
    events, and a block is often on both (written through to host, evicted from GPU, loaded
    back, its host copy released). Per tier, parents come before children and children go
    first, as in SGLang's radix tree. After every event the index's GPU view and all-tier view
    hold exactly the blocks the engine holds on GPU, and on any tier; a dump rebuilds both."""
    tokens = list(range(CHAIN * PAGE))
    hashes = kv_wire.sglang_block_hashes(tokens, PAGE)
    ours = BlockHasher(PAGE).hash_tokens(tokens)
    held: dict[str, set[int]] = {t: set() for t in TIERS}
    mirror, feeder = KvMirror(PAGE), IndexFeeder(PrefixIndex(ttl_s=None))
    seq = 0

    def leading(blocks: set[int]) -> int:
        n = 0
        while n in blocks:
            n += 1
        return n

    for op, tier, i in ops:
        on = held[tier]
        if op == "store" and i not in on and (i == 0 or i - 1 in on):
            ev = kv_wire.BlockStored(
                block_hashes=[hashes[i]], parent_block_hash=hashes[i - 1] if i else None,
                token_ids=tokens[i * PAGE:(i + 1) * PAGE], block_size=PAGE, lora_id=None,
                medium=tier,
            )  # fmt: skip
            on.add(i)
        elif op == "remove" and i in on and i + 1 not in on:
            ev = kv_wire.BlockRemoved(block_hashes=[hashes[i]], medium=tier)
            on.discard(i)
        else:
            continue
        feeder.apply(batch("w", seq, mirror.apply([ev])), 0)
        seq += 1
        gpu, anywhere = leading(held["GPU"]), leading(held["GPU"] | held["CPU_PINNED"])
        assert feeder.gpu_index.overlap(ours.primary, ours.check).get("w", 0) == gpu
        assert feeder.index.overlap(ours.primary, ours.check).get("w", 0) == anywhere
        assert mirror.stats.unknown_removals == 0
    rebuilt = IndexFeeder(PrefixIndex(ttl_s=None))
    rebuilt.apply(batch("w", 0, [AllCleared(), *mirror.dump()]), 0)
    assert rebuilt.gpu_index.overlap(ours.primary, ours.check).get("w", 0) == leading(held["GPU"])
    assert rebuilt.index.overlap(ours.primary, ours.check).get("w", 0) == leading(
        held["GPU"] | held["CPU_PINNED"]
    )


def test_a_lora_adapters_blocks_are_announced_in_the_adapters_namespace():
    """SGLang keys a LoRA adapter's blocks in the adapter's namespace and names it on their
    events (``lora_name``): the mirror chains them from the root of (adapter, salt), where the
    router hashes a request for that adapter, so a hit is predicted for that adapter's requests
    alone; children follow their parent's namespace and removals translate as any other."""
    tokens = list(range(16))
    base, base_hashes = stored(tokens[:8])
    mirror = KvMirror(PAGE)
    [plain] = mirror.apply([base])
    for salt in (None, "tenant-a"):
        head = msgspec.structs.replace(base, block_hashes=[h + 1 for h in base_hashes],
                                       lora_name="adapter-a", cache_salt=salt)  # fmt: skip
        tail = msgspec.structs.replace(head, block_hashes=[h + 2 for h in base_hashes],
                                       parent_block_hash=head.block_hashes[-1],
                                       token_ids=tokens[8:])  # fmt: skip
        [first] = mirror.apply([head])
        [second] = mirror.apply([tail])
        router = RouterCore(RouterParams(policy="thunder"))
        expected = router.hash_tokens(tokens, PAGE, salt, "adapter-a").primary
        assert first.hashes + second.hashes == expected
        assert set(expected).isdisjoint(plain.hashes)  # no hit for the base model's requests
        [gone] = mirror.apply([kv_wire.BlockRemoved(block_hashes=tail.block_hashes, medium="GPU")])
        assert gone.hashes == second.hashes
    assert mirror.stats.unknown_removals == 0


def test_a_reloaded_adapters_old_blocks_leave_without_taking_the_new_ones():
    """SGLang keys an adapter's blocks by the adapter's load: after a reload, the old load's
    blocks (never matched again) and the new load's are both named by the adapter and hash to
    the same prefix here. The old ones' eviction announces no removal while the new ones hold
    the tier; the last one's does, and a twin on the other tier is announced there again."""
    tokens = list(range(8))
    first, hashes = stored(tokens)
    old = msgspec.structs.replace(first, block_hashes=[h + 1 for h in hashes], lora_name="sql")
    new = msgspec.structs.replace(old, block_hashes=[h + 2 for h in hashes])
    mirror = KvMirror(PAGE)
    [stored_old] = mirror.apply([old])
    [stored_new] = mirror.apply([new])
    assert stored_new.hashes == stored_old.hashes  # one prefix, two loads
    children_first = list(reversed(old.block_hashes))
    assert mirror.apply([kv_wire.BlockRemoved(block_hashes=children_first, medium="GPU")]) == []
    assert mirror.chain_to(stored_new.hashes[-1]) == new.block_hashes  # still found, at the new
    gone = mirror.apply([kv_wire.BlockRemoved(block_hashes=[new.block_hashes[1]], medium="GPU")])
    assert gone == [BlocksRemoved(hashes=[stored_new.hashes[1]])]
    # across tiers: the old load on the host tier, the new one's GPU copy evicted
    host = msgspec.structs.replace(old, medium="CPU_PINNED")
    mirror.apply([host])
    out = mirror.apply([kv_wire.BlockRemoved(block_hashes=[new.block_hashes[0]], medium="GPU")])
    assert out[0] == BlocksRemoved(hashes=[stored_new.hashes[0]])
    assert [(e.hashes, e.medium) for e in out[1:]] == [([stored_new.hashes[0]], Medium.CPU_PINNED)]
    assert mirror.stats.unknown_removals == 0


@given(back=st.lists(st.integers(-1, 3), min_size=1, max_size=40), data=st.data())
def test_a_dump_of_a_forked_cache_rebuilds_every_prefix_in_chain_events(back, data):
    """A cache of prompts that share prefixes (a tree: node ``i`` is a block whose parent is an
    earlier node, or a root) is dumped as chain events, parents first: applied to an empty index
    it holds every prefix the block-by-block events built, and answers alike after evictions;
    each block is announced once, and a chain without forks is a single event."""
    # node i continues node i - 1 - k (deep chains with forks), or starts a prompt (k = -1)
    parent_of = [i - 1 - k if 0 <= k < i else None for i, k in enumerate(back)]
    path: list[list[int]] = []
    for i, p in enumerate(parent_of):
        path.append(
            (path[p] if p is not None else []) + [10_000 + PAGE * i + k for k in range(PAGE)]
        )
    engine = [kv_wire.sglang_block_hashes(t, PAGE)[-1] for t in path]
    order = data.draw(st.permutations(range(len(path))))
    order = sorted(order, key=lambda i: len(path[i]))  # parents before children
    mirror, live = KvMirror(PAGE), IndexFeeder(PrefixIndex(ttl_s=None))

    def store(i: int) -> list:
        p = parent_of[i]
        return mirror.apply([kv_wire.BlockStored(
            block_hashes=[engine[i]], parent_block_hash=None if p is None else engine[p],
            token_ids=path[i][-PAGE:], block_size=PAGE, lora_id=None, medium="GPU",
        )])  # fmt: skip

    live_seq = itertools.count()
    for i in order:
        live.apply(batch("w", next(live_seq), store(i)), 0)
    # evicted and stored again (its children's removals lost): now after them in the cache's
    # order, so the dump meets children before their parent
    for i in data.draw(st.lists(st.sampled_from(range(len(path))), max_size=4)):
        removed = mirror.apply([kv_wire.BlockRemoved(block_hashes=[engine[i]], medium="GPU")])
        live.apply(batch("w", next(live_seq), removed), 0)
        live.apply(batch("w", next(live_seq), store(i)), 0)
    dump = mirror.dump()
    rebuilt = IndexFeeder(PrefixIndex(ttl_s=None))
    rebuilt.apply(batch("w", 0, [AllCleared(), *dump]), 0)
    announced = [h for ev in dump for h in ev.hashes]
    assert sorted(announced) == sorted(b.primary for b in mirror.blocks.values())
    parent_hash = {  # each block's own parent, in our hashes
        b.primary: None
        if b.parent_engine_hash is None
        else mirror.blocks[b.parent_engine_hash].primary
        for b in mirror.blocks.values()
    }
    for ev in dump:  # every event a chain: each block the child of the one before it
        assert [parent_hash[h] for h in ev.hashes] == [ev.parent_hash, *ev.hashes[:-1]]
    for t in path:
        ours = BlockHasher(PAGE).hash_tokens(t)
        want = live.index.overlap(ours.primary, ours.check)
        assert want == {"w": len(ours.primary)}
        assert rebuilt.index.overlap(ours.primary, ours.check) == want
    # evictions afterwards (children left behind, as after a lost removal): both indexes stop
    # every prefix at the same block, which only holds if the dump linked each block to its
    # own parent
    for seq, i in enumerate(data.draw(st.lists(st.sampled_from(range(len(path))), max_size=8))):
        removed = mirror.apply([kv_wire.BlockRemoved(block_hashes=[engine[i]], medium="GPU")])
        live.apply(batch("w", next(live_seq), removed), 0)
        rebuilt.apply(batch("w", 1 + seq, removed), 0)
    for t in path:
        ours = BlockHasher(PAGE).hash_tokens(t)
        want = live.index.overlap(ours.primary, ours.check)
        assert rebuilt.index.overlap(ours.primary, ours.check) == want
    forks = sum(1 for i in range(len(path)) if sum(p == i for p in parent_of) > 1)
    roots = parent_of.count(None)
    if forks == 0 and roots == 1:
        assert len(dump) == 1


@given(back=st.lists(st.integers(-1, 3), min_size=1, max_size=30), data=st.data())
def test_a_resync_dumped_in_pieces_while_the_cache_changes_never_overstates(back, data):
    """An adapter answers a resync a piece of its dump at a time, reading its engine's events
    between pieces (they go out among the pieces, in order). A consumer rebuilt from that
    stream never credits the worker with a block its engine does not hold, and holds every
    prompt the engine kept untouched while the dump ran. (A block whose parent was evicted
    when its piece was made is left out, as a one-shot dump leaves it out; its parent stored
    again later does not bring it back: a missed hit, never a false one.)"""
    parent_of = [i - 1 - k if 0 <= k < i else None for i, k in enumerate(back)]
    path: list[list[int]] = []
    for i, p in enumerate(parent_of):
        path.append(
            (path[p] if p is not None else []) + [10_000 + PAGE * i + k for k in range(PAGE)]
        )
    ancestors: list[list[int]] = []  # each node's path, as node indices
    for i, p in enumerate(parent_of):
        ancestors.append((ancestors[p] if p is not None else []) + [i])
    engine = [kv_wire.sglang_block_hashes(t, PAGE)[-1] for t in path]
    mirror = KvMirror(PAGE)

    def event(op: str, i: int) -> list:
        if op == "remove":
            return [kv_wire.BlockRemoved(block_hashes=[engine[i]], medium="GPU")]
        p = parent_of[i]
        return [kv_wire.BlockStored(
            block_hashes=[engine[i]], parent_block_hash=None if p is None else engine[p],
            token_ids=path[i][-PAGE:], block_size=PAGE, lora_id=None, medium="GPU",
        )]  # fmt: skip

    for i in sorted(range(len(path)), key=lambda i: len(path[i])):
        mirror.apply(event("store", i))
    stream: list[list] = []  # the resync's batches as published, live events among them
    touched: set[int] = set()
    first: list = [AllCleared()]
    for piece in mirror.dump_pieces(data.draw(st.integers(1, 3), label="blocks per piece")):
        stream.append(first + piece)
        first = []
        for op, i in data.draw(
            st.lists(st.tuples(st.sampled_from(["remove", "store"]), st.integers(0, len(path) - 1)),
                     max_size=2), label="the engine meanwhile"):  # fmt: skip
            touched.add(i)
            out = mirror.apply(event(op, i))
            if out:
                stream.append(out)
    rebuilt = IndexFeeder(PrefixIndex(ttl_s=None))
    for seq, events in enumerate(stream):
        rebuilt.apply(batch("w", seq, events), 0)
    for i, t in enumerate(path):
        ours = BlockHasher(PAGE).hash_tokens(t)
        credited = rebuilt.index.overlap(ours.primary, ours.check).get("w", 0)
        held = 0  # leading blocks of the prompt the engine holds now
        while held < len(ancestors[i]) and engine[ancestors[i][held]] in mirror.blocks:
            held += 1
        assert credited <= held, (t, credited, held)
        if not touched & set(ancestors[i]):
            assert credited == held == len(ancestors[i])
