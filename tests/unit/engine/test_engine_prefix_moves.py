"""Engine core: exporting a cached prefix (pin, tokens, drop) and importing one (reserve,
commit, abort), on the tiny profile (block 4 tokens, 32 blocks)."""

from thunderagent.engine.core import EngineCore
from thunderagent.engine.events import Removed, Stored
from thunderagent.engine.profiles import get_profile

TINY = get_profile("tiny")
BS = TINY.engine.block_size


def keys_and_tokens(n: int, base: int = 100) -> tuple[list[int], list[int]]:
    return [base + i for i in range(n)], [base * 10 + t for t in range(n * BS)]


def cached_core(n: int = 6) -> tuple[EngineCore, list[int], list[int]]:
    core = EngineCore(TINY)
    keys, tokens = keys_and_tokens(n)
    assert core.import_blocks(keys, tokens) == n
    core.drain_events()
    return core, keys, tokens


def test_pin_prefix_pins_the_cached_run_and_returns_its_tokens() -> None:
    core, keys, tokens = cached_core(6)
    pinned, got = core.pin_prefix([*keys[:4], 999, 1000])
    assert pinned == keys[:4]
    assert got == tokens[: 4 * BS]
    assert [core.cache.refcount(k) for k in keys] == [1, 1, 1, 1, 0, 0]
    # pinned blocks survive a full eviction sweep; the unpinned tail does not
    core.cache.evict(32)
    assert set(core.cache.contents()) == set(keys[:4])
    assert core.unpin_prefix(pinned) == 0
    assert all(core.cache.refcount(k) == 0 for k in keys[:4])


def test_pin_prefix_of_a_missing_prefix_pins_nothing() -> None:
    core, _, _ = cached_core(2)
    assert core.pin_prefix([5, 6]) == ([], [])
    core.import_blocks([7], None)  # stored without tokens: cannot be exported
    assert core.pin_prefix([7]) == ([], [])
    assert core.cache.refcount(7) == 0


def test_unpin_with_drop_frees_the_chain_but_keeps_blocks_in_use() -> None:
    core, keys, _ = cached_core(6)
    pinned, _ = core.pin_prefix(keys)
    core.cache.acquire(keys[:2])  # a running request still uses the first two blocks
    assert core.unpin_prefix(pinned, drop=True) == 4
    assert set(core.cache.contents()) == set(keys[:2])
    removed = [k for e in core.drain_events() if isinstance(e, Removed) for k in e.block_hashes]
    assert removed == list(reversed(keys[2:]))


def test_drop_stops_below_a_branch_other_prefixes_hang_on() -> None:
    core, keys, tokens = cached_core(4)
    core.cache.insert([500], keys[1], tokens[:BS], block_size=BS)  # a sibling branch at block 2
    core.cache.release([500])
    assert core.cache.discard(keys) == 2  # keys[3], keys[2]; keys[1] still has a child
    assert set(core.cache.contents()) == {keys[0], keys[1], 500}


def test_drop_takes_the_blocks_that_extend_the_prefix_unless_in_use() -> None:
    """A hot prefix's requests leave their outputs hanging below it: dropping the prefix
    takes them too (unreachable without it), but never a block a running request holds."""
    core, keys, tokens = cached_core(3)
    for base in (600, 700):  # two requests' outputs below the prefix, two blocks each
        core.cache.insert([base], keys[2], tokens[:BS], block_size=BS)
        core.cache.insert([base + 1], base, tokens[:BS], block_size=BS)
        core.cache.release([base, base + 1])
    core.drain_events()
    assert core.cache.discard(keys) == 7
    assert core.cache.contents() == {}
    removed = [k for e in core.drain_events() if isinstance(e, Removed) for k in e.block_hashes]
    assert removed.index(601) < removed.index(600) < removed.index(keys[2])

    core, keys, tokens = cached_core(3)
    core.cache.insert([600], keys[2], tokens[:BS], block_size=BS)  # still running: stays
    assert core.cache.discard(keys) == 0
    assert set(core.cache.contents()) == {*keys, 600}


def test_a_drop_without_extensions_leaves_a_prefix_others_built_on() -> None:
    """A cold replica of a shared prompt that programs extended: their contexts are not the
    prefix's to give away, so nothing is freed; unextended, the prefix goes."""
    core, keys, tokens = cached_core(3)
    core.cache.insert([600], keys[2], tokens[:BS], block_size=BS)  # a context built on it
    core.cache.release([600])
    core.drain_events()
    assert core.cache.discard(keys, extensions=False) == 0
    assert set(core.cache.contents()) == {*keys, 600}
    core, keys, _ = cached_core(3)
    assert core.cache.discard(keys, extensions=False) == 3
    assert core.cache.contents() == {}


def test_import_reserves_then_commits_only_the_missing_blocks() -> None:
    core, keys, tokens = cached_core(3)
    more, more_tokens = keys_and_tokens(6)
    assert more[:3] == keys and more_tokens[: 3 * BS] == tokens
    free_before = core.cache.free
    present = core.begin_import(more)
    assert present == 3
    assert core.cache.reserved == 3 and core.cache.free == free_before - 3
    assert core.commit_import(more, present, more_tokens) == 3
    events = core.drain_events()
    stored = [e for e in events if isinstance(e, Stored)]
    assert [e.block_hashes for e in stored] == [more[3:]]
    assert stored[0].parent_key == more[2]
    assert stored[0].token_ids == more_tokens[3 * BS :]
    assert core.cache.reserved == 0
    assert all(core.cache.refcount(k) == 0 for k in more)


def test_import_abort_leaves_no_trace() -> None:
    core, _, _ = cached_core(2)
    more, _ = keys_and_tokens(5)
    before = core.cache.contents()
    present = core.begin_import(more)
    core.abort_import(more, present)
    assert core.cache.contents() == before
    assert core.cache.reserved == 0
    assert all(core.cache.refcount(k) == 0 for k in before)
    assert core.drain_events() == []


def test_import_without_room_is_refused_and_pins_nothing() -> None:
    core = EngineCore(TINY)
    keys, tokens = keys_and_tokens(2)
    core.import_blocks(keys, tokens)
    core.cache.acquire(keys)  # pinned: eviction cannot make room
    assert core.cache.reserve(core.cache.free)
    big, _ = keys_and_tokens(8)
    assert core.begin_import(big) is None
    assert [core.cache.refcount(k) for k in keys] == [1, 1]


def test_import_keeps_the_room_asked_for_and_counts_imports_in_flight() -> None:
    core, keys, _ = cached_core(3)  # 3 cached blocks, unpinned: evictable, so allocatable
    more, more_tokens = keys_and_tokens(6)  # 3 of them missing
    # 32 blocks, 3 present (pinned by the import), 3 to reserve: 26 stay allocatable
    assert core.begin_import(more, keep_blocks=27) is None
    assert all(core.cache.refcount(k) == 0 for k in keys) and core.cache.reserved == 0
    assert core.imports_pending == 0
    present = core.begin_import(more, keep_blocks=26)
    assert present == 3 and core.imports_pending == 1
    core.commit_import(more, present, more_tokens)
    assert core.imports_pending == 0
    present = core.begin_import([*more, 900])
    core.abort_import([*more, 900], present)
    assert core.imports_pending == 0
