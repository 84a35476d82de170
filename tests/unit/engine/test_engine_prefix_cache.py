"""Prefix cache: hits, radix semantics, exact LRU order, pins, host tier, event stream."""

from hypothesis import given, settings
from hypothesis import strategies as st

from thunderagent.engine.events import AllCleared, Medium, Removed, Stored
from thunderagent.engine.prefix_cache import Match, PrefixCache


def cached(cache: PrefixCache, keys: list[int], parent: int | None = None) -> None:
    """Insert a chain and unpin it, as a finished request leaves it."""
    assert cache.insert(keys, parent) == len(keys)
    cache.release(keys)


def test_hit_is_longest_leading_run() -> None:
    cache = PrefixCache(capacity=8)
    cached(cache, [1, 2, 3])
    assert cache.match([1, 2, 3, 4]) == Match(3, 0)
    assert cache.match([1, 2, 9, 3]) == Match(2, 0)
    assert cache.match([7, 1, 2]) == Match(0, 0)


def test_block_is_reusable_only_with_its_prefix() -> None:
    cache = PrefixCache(capacity=8)
    cached(cache, [1, 2, 3])
    assert cache.match([2, 3]) == Match(0, 0)  # 2 is cached, but under parent 1
    assert cache.match([1, 3]) == Match(1, 0)


def test_stored_events_chain_and_skip_duplicates() -> None:
    cache = PrefixCache(capacity=8)
    cache.insert([1, 2], None, [10, 11, 12, 13], block_size=2)
    cache.insert([1, 2, 3], None)
    assert cache.drain_events() == [
        Stored([1, 2], None, [10, 11, 12, 13], Medium.GPU),
        Stored([3], 2, None, Medium.GPU),
    ]


def test_lru_evicts_least_recent_leaf_first() -> None:
    cache = PrefixCache(capacity=5)
    cached(cache, [1, 2])  # chain A
    cached(cache, [3, 4])  # chain B
    cache.acquire([1, 2])  # A used again: B is now least recent
    cache.release([1, 2])
    cache.drain_events()
    assert cache.evict(3) == 3
    # B's leaf, then B's root (now a leaf, older than A's leaf), then A's leaf
    assert cache.drain_events() == [Removed([4, 3, 2], Medium.GPU)]
    assert cache.contents() == {1: Medium.GPU}


def test_parent_outlives_child_even_with_equal_age() -> None:
    cache = PrefixCache(capacity=3)
    cached(cache, [1, 2, 3])
    cache.drain_events()
    cached(cache, [9])  # needs one block: the leaf 3 goes, never 1 or 2
    assert cache.drain_events() == [Removed([3], Medium.GPU), Stored([9], None, None)]


def test_pinned_blocks_are_never_evicted() -> None:
    cache = PrefixCache(capacity=4)
    cache.insert([1, 2, 3], None)  # pinned by a running request
    cached(cache, [5])
    assert cache.evict(10) == 1  # only the unpinned 5
    assert cache.contents() == {1: Medium.GPU, 2: Medium.GPU, 3: Medium.GPU}
    assert cache.reserve(1) is True
    assert cache.reserve(1) is False  # 3 pinned + 1 reserved = full
    cache.release([1, 2, 3])
    assert cache.reserve(1) is True  # now 3 can go


def test_reserve_is_all_or_nothing_and_counts_against_capacity() -> None:
    cache = PrefixCache(capacity=4)
    cached(cache, [1, 2])
    assert cache.reserve(2)
    assert cache.free == 0
    assert cache.reserve(3) is False
    assert cache.reserve(2)  # evicts both cached blocks
    assert cache.contents() == {}
    assert cache.insert([7], None) == 0  # nothing left to evict
    cache.unreserve(4)
    assert cache.free == 4


def test_insert_from_reserved_blocks() -> None:
    cache = PrefixCache(capacity=4)
    cached(cache, [1])
    assert cache.reserve(3)
    cache.acquire([1])
    cache.insert([1, 2, 3], None, reserved=True)  # 1 is a duplicate: its block is given back
    assert cache.reserved == 0
    assert cache.gpu_blocks == 3
    assert cache.refcount(1) == 2


def test_host_tier_demotes_then_loads_back() -> None:
    cache = PrefixCache(capacity=2, host_capacity=2)
    cached(cache, [1, 2])
    cached(cache, [3, 4])  # each new block pushes the LRU leaf to the host tier
    assert cache.drain_events() == [
        Stored([1, 2], None, None, Medium.GPU),
        Removed([2], Medium.GPU),
        Stored([2], 1, None, Medium.CPU_PINNED),
        Stored([3], None, None, Medium.GPU),
        Removed([1], Medium.GPU),
        Stored([1], None, None, Medium.CPU_PINNED),
        Stored([4], 3, None, Medium.GPU),
    ]
    assert cache.match([1, 2]) == Match(0, 2)
    # room for 1: leaf 4 goes to the host, which overflows and drops its LRU leaf (4 itself,
    # as 1 and 2 were just refreshed); room for 2: 3 goes to the host
    assert cache.load([1, 2]) == 2
    assert cache.contents() == {1: Medium.GPU, 2: Medium.GPU, 3: Medium.CPU_PINNED}
    assert cache.refcount(1) == cache.refcount(2) == 1


def test_host_tier_evicts_its_own_lru_leaves() -> None:
    cache = PrefixCache(capacity=1, host_capacity=1)
    cached(cache, [1])
    cached(cache, [2])  # 1 -> host
    cached(cache, [3])  # 2 -> host, host full: 1 dropped
    assert cache.contents() == {2: Medium.CPU_PINNED, 3: Medium.GPU}


def test_clear_refused_while_pinned() -> None:
    cache = PrefixCache(capacity=4)
    cache.insert([1], None)
    assert cache.clear() is False
    cache.release([1])
    cache.drain_events()
    assert cache.clear() is True
    assert cache.drain_events() == [AllCleared()]
    assert cache.contents() == {}


# ---- reference model: the event stream rebuilds the contents ----------------------------

PATHS = st.lists(st.integers(0, 2), min_size=1, max_size=4)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), PATHS, st.booleans()),
        st.tuples(st.just("evict"), st.integers(1, 4), st.booleans()),
        st.tuples(st.just("reserve"), st.integers(1, 4), st.booleans()),
        st.tuples(st.just("load"), PATHS, st.booleans()),
        st.tuples(st.just("clear"), st.integers(0, 0), st.booleans()),
    ),
    max_size=60,
)


def chain(path: list[int]) -> list[int]:
    """Keys for a path in a small trie; each key names its whole prefix."""
    return [hash(tuple(path[: i + 1])) & 0xFFFFFFFF for i in range(len(path))]


def replay(events: list, state: dict[int, Medium]) -> None:
    for event in events:
        if isinstance(event, Stored):
            for key in event.block_hashes:
                assert key not in state, "Stored for a block already present"
                state[key] = event.medium
        elif isinstance(event, Removed):
            for key in event.block_hashes:
                assert state.pop(key) is event.medium
        else:
            state.clear()


def check_invariants(cache: PrefixCache) -> None:
    contents = cache.contents()
    assert cache.gpu_blocks + cache.reserved <= cache.capacity
    assert cache.host_blocks <= cache.host_capacity
    assert sum(m is Medium.GPU for m in contents.values()) == cache.gpu_blocks


@settings(max_examples=300, deadline=None)
@given(ops=OPS, capacity=st.integers(1, 6), host=st.integers(0, 3))
def test_event_stream_rebuilds_contents(ops, capacity: int, host: int) -> None:
    cache = PrefixCache(capacity=capacity, host_capacity=host)
    state: dict[int, Medium] = {}
    pinned: list[list[int]] = []
    for op, arg, keep in ops:
        if op == "insert":
            keys = chain(arg)
            match = cache.match(keys)
            cache.acquire(keys[: match.gpu])
            loaded = cache.load(keys[match.gpu : match.gpu + match.host])
            held = match.gpu + loaded
            parent = keys[held - 1] if held else None
            if held == match.gpu + match.host:
                held += cache.insert(keys[held:], parent)
            pinned.append(keys[:held])
        elif op == "evict":
            cache.evict(arg)
        elif op == "reserve" and cache.reserve(arg):
            cache.unreserve(arg)
        elif op == "clear" and not pinned:
            cache.clear()
        if not keep and pinned:
            cache.release(pinned.pop(0))
        replay(cache.drain_events(), state)
        check_invariants(cache)
        assert state == cache.contents()
    for keys in pinned:
        cache.release(keys)
    cache.evict(capacity)
    replay(cache.drain_events(), state)
    assert state == cache.contents()
    assert cache.gpu_blocks == 0
