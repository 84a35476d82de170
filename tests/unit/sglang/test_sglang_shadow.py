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
