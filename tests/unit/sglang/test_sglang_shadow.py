"""The cache an adapter infers for an engine without KV events, and the events it announces."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from thunderagent.hashing import BlockHasher, kv_namespace
from thunderagent.sglang.mirror import KvMirror, KvNamespace
from thunderagent.sglang.shadow import CacheShadow, EngineShadow

BS = 4


def test_the_announced_blocks_are_the_routers_own_hashes_in_the_requests_namespace() -> None:
    tokens = list(range(50, 50 + 3 * BS + 2))  # three full blocks and a partial one
    for space in (None, KvNamespace("tenant-a", None), KvNamespace(None, "sql")):
        mirror = KvMirror(BS)
        stored = mirror.apply(EngineShadow(100, BS).cached(tokens, space))
        salt, lora = (space.cache_salt, space.lora_name) if space else (None, None)
        router = BlockHasher(BS, kv_namespace(salt, lora)).hash_tokens(tokens)
        assert [h for ev in stored for h in ev.hashes] == router.primary, space
        assert [c for ev in stored for c in ev.check_hashes] == router.check


def test_a_full_pool_evicts_the_least_recently_cached_prompt() -> None:
    shadow = EngineShadow(4, BS)
    a, b, c = ([n] * (2 * BS) for n in (1, 2, 3))  # two blocks each
    mirror = KvMirror(BS)
    for prompt in (a, b, a, c):  # a touched again: b is the oldest when c needs room
        mirror.apply(shadow.cached(prompt, None))
    held = {block.primary for block in mirror.blocks.values()}
    keys = {tuple(BlockHasher(BS).hash_tokens(p).primary) for p in (a, c)}
    assert held == {h for k in keys for h in k}


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.lists(st.integers(0, 3), min_size=1, max_size=6),  # a prompt, in blocks of 4 tokens
        max_size=30,
    ),
    st.integers(1, 12),
)
def test_replaying_the_announcements_rebuilds_the_shadow_within_its_pool(prompts, capacity):
    """Whatever the prompts, what the announced events say is cached is exactly the shadow's
    cache, never more blocks than the pool, and the last prompt is cached whole when it fits."""
    shadow = CacheShadow(capacity)
    held: dict[int, int | None] = {}  # key -> parent, from the events alone
    for prompt in prompts:
        keys = BlockHasher(1).hash_tokens(prompt).primary  # a block id per "block"
        for ev in shadow.cached(keys):
            if type(ev).__name__ == "Removed":
                for key in ev.block_hashes:
                    held.pop(key)
            else:
                parent = ev.parent_key
                for key in ev.block_hashes:
                    assert parent is None or parent in held, "a block stored under its parent"
                    held[key] = parent
                    parent = key
        assert set(held) == set(shadow.cache.contents())
        assert len(held) <= capacity
        if len(keys) <= capacity:
            assert set(keys) <= set(held)


def test_a_block_the_engine_reports_missing_goes_with_everything_under_it() -> None:
    """A flushed engine: a run finds only the first block of a prefix the shadow holds. The
    rest of that prefix and every prompt stored under it go; the first block and other
    prefixes stay."""
    shadow = CacheShadow(100)
    shared, mine, theirs, elsewhere = [1, 2, 3], [4, 5], [6, 7], [8, 9]
    for keys in (shared + mine, shared + theirs, elsewhere):
        shadow.cached(keys)
    mark = shadow.mark()
    events = shadow.refuted(shared + mine, 1, mark)
    assert {h for ev in events for h in ev.block_hashes} == {2, 3, 4, 5, 6, 7}
    assert set(shadow.cache.contents()) == {1, 8, 9}
    assert shadow.refuted(shared + mine, 1, mark) == [], "nothing left to refute"


def test_a_block_used_again_since_the_hand_over_is_not_refuted() -> None:
    """The engine's report is as of the run's admission; a run that started since stored the
    block again, so the engine may hold it now."""
    shadow = CacheShadow(100)
    shadow.cached([1, 2, 3])
    mark = shadow.mark()
    shadow.cached([1, 2, 3, 4])  # another run's first token, after the hand-over
    assert shadow.refuted([1, 2, 3], 0, mark) == []
    assert shadow.refuted([1, 2, 3], 3, mark) == [], "it found all the shadow held"
    assert set(shadow.cache.contents()) == {1, 2, 3, 4}


def test_the_adapters_refutation_is_in_the_routers_hashes_and_spares_the_last_token() -> None:
    """Only the prompt's usable blocks are checked: SGLang always computes the last token, so a
    prompt of exactly two blocks reports at most one block found. A refuted prefix is removed
    in the router's hashes, then stored again: the run has just computed it."""
    tokens = list(range(10, 10 + 2 * BS))
    router = BlockHasher(BS).hash_tokens(tokens).primary
    shadow = EngineShadow(100, BS)
    shadow.cached(tokens, None)
    mark = shadow.mark()
    assert shadow.started(tokens, None, BS, mark) == [], "one block found: all it could find"
    events = shadow.started(tokens, None, 0, shadow.mark())
    removed = [h for ev in events if type(ev).__name__ == "BlockRemoved" for h in ev.block_hashes]
    stored = [h for ev in events if type(ev).__name__ == "BlockStored" for h in ev.block_hashes]
    assert sorted(removed) == sorted(router) and stored == router
    assert type(events[0]).__name__ == "BlockRemoved", "the removals go first"
    assert set(shadow.shadow.cache.contents()) == set(router)
