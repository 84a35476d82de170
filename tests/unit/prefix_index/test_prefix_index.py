"""PrefixIndex behaviour, case by case (the model-based property test is in
``test_prefix_index_model.py``)."""

from __future__ import annotations

import gc

import msgspec
import pytest

from thunderagent.hashing import BlockHasher, BlockHashes
from thunderagent.prefix_index import (
    APPLIED,
    DEFAULT_TTL_S,
    Gap,
    IndexSnapshot,
    PrefixIndex,
    Stale,
    decode,
    encode,
    ttl,
)

H = BlockHasher(block_size=1)


def chain(*ids: int) -> BlockHashes:
    """Hashes of a prefix given as block ids (shared leading ids = shared prefix)."""
    return H.hash_block_ids(ids)


def tail(ids: tuple[int, ...], start: int) -> tuple[BlockHashes, int | None]:
    """Blocks ``ids[start:]`` as a stored event continuing ``ids[:start]``: (hashes, parent)."""
    whole = H.hash_block_ids(ids)
    part = BlockHashes(whole.primary[start:], whole.check[start:])
    return part, (whole.primary[start - 1] if start else None)


def store(ix: PrefixIndex, worker: str, seq: int, ids: tuple[int, ...], now: float = 0.0):
    return ix.apply_stored(worker, seq, chain(*ids), None, now)


def query(ix: PrefixIndex, *ids: int) -> dict[str, int]:
    return ix.overlap(*chain(*ids))


# --------------------------------------------------------------------------------- overlap


@pytest.mark.parametrize(
    ("stored", "prompt", "expected"),
    [
        ({}, (1, 2, 3), {}),
        ({"a": (1, 2, 3)}, (1, 2, 3), {"a": 3}),
        ({"a": (1, 2, 3)}, (1, 2, 3, 4, 5), {"a": 3}),
        ({"a": (1, 2, 3)}, (1, 2), {"a": 2}),
        ({"a": (1, 2, 3)}, (9, 2, 3), {}),
        ({"a": (1, 2, 3)}, (1, 9, 3), {"a": 1}),  # same block 3, different prefix: no match
        ({"a": (1, 2, 3), "b": (1, 2)}, (1, 2, 3), {"a": 3, "b": 2}),
        ({"a": (1, 2, 3), "b": (1, 7)}, (1, 2, 3), {"a": 3, "b": 1}),
        ({"a": (1, 2), "b": (1, 2), "c": (5,)}, (1, 2), {"a": 2, "b": 2}),
        ({"a": (1,), "b": (2,)}, (2, 3), {"b": 1}),
    ],
)
def test_overlap(stored: dict, prompt: tuple, expected: dict) -> None:
    ix = PrefixIndex()
    for seq, (worker, ids) in enumerate(stored.items()):
        assert store(ix, worker, seq, ids) is APPLIED
    assert query(ix, *prompt) == expected


def test_walk_needs_every_block_a_hole_stops_a_worker() -> None:
    ix = PrefixIndex()
    store(ix, "a", 0, (1, 2, 3, 4))
    store(ix, "b", 0, (1, 2, 3, 4))
    ix.apply_removed("a", 1, [chain(1, 2).primary[1]], 0.0)  # a loses block 2 only
    assert query(ix, 1, 2, 3, 4) == {"a": 1, "b": 4}


def test_continuation_event_and_orphans() -> None:
    ix = PrefixIndex()
    ids = (1, 2, 3, 4)
    ix.apply_stored("a", 0, *tail(ids[:2], 0), 0.0)
    ix.apply_stored("a", 1, *tail(ids, 2), 0.0)
    assert query(ix, *ids) == {"a": 4}
    assert ix.stats.orphan_stores == 0
    ix.apply_stored("b", 0, *tail(ids, 2), 0.0)  # b never stored blocks 1, 2
    assert ix.stats.orphan_stores == 1
    assert query(ix, *ids) == {"a": 4}


# ------------------------------------------------------------------------------- sequences


@pytest.mark.parametrize(
    ("seqs", "results", "gaps", "stale"),
    [
        ([0, 1, 2], [APPLIED, APPLIED, APPLIED], 0, 0),
        ([5, 6], [APPLIED, APPLIED], 0, 0),  # the first event of an unknown worker sets the base
        ([0, 2], [APPLIED, Gap("w", 1, 2)], 1, 0),
        ([0, 1, 1], [APPLIED, APPLIED, Stale("w", 1, 1)], 0, 1),
        ([3, 1], [APPLIED, Stale("w", 3, 1)], 0, 1),
        ([0, 4, 5], [APPLIED, Gap("w", 1, 4), APPLIED], 1, 0),
    ],
)
def test_sequence_results(seqs: list[int], results: list, gaps: int, stale: int) -> None:
    ix = PrefixIndex()
    assert [store(ix, "w", s, (s,)) for s in seqs] == results
    assert (ix.stats.gaps, ix.stats.stale_events) == (gaps, stale)
    assert ix.worker_seq("w") == max(seqs)


def test_gap_is_applied_and_stale_is_not() -> None:
    ix = PrefixIndex()
    store(ix, "w", 0, (1,))
    assert store(ix, "w", 3, (2,)) == Gap("w", 1, 3)
    assert query(ix, 2) == {"w": 1}
    assert store(ix, "w", 3, (7,)) == Stale("w", 3, 3)
    assert query(ix, 7) == {}
    assert ix.apply_removed("w", 2, chain(2).primary, 0.0) == Stale("w", 3, 2)
    assert query(ix, 2) == {"w": 1}
    assert ix.clear_worker("w", 1) == Stale("w", 3, 1)
    assert ix.block_counts() == {"w": 2}


def test_add_worker_can_require_seq_zero() -> None:
    ix = PrefixIndex()
    ix.add_worker("w", last_seq=-1)
    assert store(ix, "w", 2, (1,)) == Gap("w", 0, 2)


def test_reset_worker_resyncs() -> None:
    ix = PrefixIndex()
    store(ix, "w", 0, (1, 2))
    store(ix, "w", 5, (3,))
    ix.reset_worker("w", 100)
    assert query(ix, 1, 2) == {} and ix.block_counts() == {"w": 0}
    assert store(ix, "w", 101, (1, 2)) is APPLIED
    assert query(ix, 1, 2) == {"w": 2}


# --------------------------------------------------------------------- removal and workers


def test_removed_and_cleared() -> None:
    ix = PrefixIndex()
    store(ix, "a", 0, (1, 2, 3))
    store(ix, "b", 0, (1, 2))
    assert ix.apply_removed("a", 1, chain(1, 2, 3).primary[2:], 1.0) is APPLIED
    assert query(ix, 1, 2, 3) == {"a": 2, "b": 2}
    assert ix.apply_removed("a", 2, [12345, chain(9).primary[0]], 1.0) is APPLIED  # unknown
    assert ix.clear_worker("b", 1, now=2.0) is APPLIED
    assert query(ix, 1, 2, 3) == {"a": 2}
    assert ix.block_counts() == {"a": 2, "b": 0}
    assert len(ix) == 2
    assert ix.worker_last_event_at("b") == 2.0


def test_remove_worker_frees_and_reuses_its_slot() -> None:
    ix = PrefixIndex()
    for seq, w in enumerate("abc"):
        store(ix, w, seq, (1, 2))
    assert ix.remove_worker("b") is True
    assert ix.remove_worker("b") is False
    assert query(ix, 1, 2) == {"a": 2, "c": 2}
    store(ix, "d", 0, (1,))  # takes b's slot: must not inherit b's blocks
    assert query(ix, 1, 2) == {"a": 2, "c": 2, "d": 1}
    assert ix.block_counts() == {"a": 2, "c": 2, "d": 1}
    assert ix.worker_seq("b") is None
    assert sorted(ix.workers) == ["a", "c", "d"]


def test_dump_worker_in_stored_order_without_stale_items() -> None:
    ix = PrefixIndex()
    h = chain(1, 2, 3, 4)
    ix.apply_stored("a", 0, h, None, 0.0)
    ix.apply_removed("a", 1, [h.primary[1]], 0.0)
    ix.apply_stored("a", 2, BlockHashes(h.primary[1:2], h.check[1:2]), h.primary[0], 0.0)
    assert ix.dump_worker("a") == h
    assert ix.dump_worker("nobody") == BlockHashes([], [])


def test_worker_log_stays_bounded_under_churn() -> None:
    ix = PrefixIndex()
    h = chain(*range(50))
    seq = 0
    for _ in range(200):
        ix.apply_stored("a", seq, h, None, 0.0)
        ix.apply_removed("a", seq + 1, h.primary, 0.0)
        seq += 2
    ix.apply_stored("a", seq, h, None, 0.0)
    assert ix.block_counts() == {"a": 50}
    assert len(list(ix._workers["a"].logged())) <= 2 * 50 + 1024 + 50
    assert ix.dump_worker("a") == h


def test_a_compaction_reads_a_few_log_items_per_event_and_loses_no_block() -> None:
    """A log past its threshold is compacted over the events that follow, at most
    ``max(4 x blocks, 64)`` of its items per event (in one go it held the event loop for the
    whole log); meanwhile dumps, counts and a worker's removal see every block it holds."""
    ix = PrefixIndex(ttl_s=None)
    h = chain(*range(600))
    seq = 0
    for _ in range(4):  # 2,400 log items for 600 blocks: past 2 x 600 + 1,024
        ix.apply_stored("a", seq, h, None, 0.0)
        ix.apply_removed("a", seq + 1, h.primary[300:], 0.0)
        seq += 2
    w = ix._workers["a"]
    assert w.sweep is not None and len(w.sweep.old) == 2400 and len(w.log) == 0
    ix.apply_stored("a", seq, BlockHashes([], []), None, 0.0)  # a step: 64 items read
    seq += 1
    assert len(w.sweep.seen) == 64 and not gc.is_tracked(w.sweep.seen)  # nothing for the GC
    held = set(h.primary[:300])
    extra = [chain(*range(600), 10_000 + i) for i in range(60)]
    events = 0
    for longer in extra:
        events += 1
        before = w.sweep.pos if w.sweep is not None else None
        ix.apply_stored("a", seq, BlockHashes(longer.primary[-1:], longer.check[-1:]),
                        h.primary[-1], 0.0)  # fmt: skip
        seq += 1
        held.add(longer.primary[-1])
        if before is not None and w.sweep is not None:
            assert w.sweep.pos - before == 64  # one block stored: the minimum
        assert set(ix.dump_worker("a").primary) == held
        assert ix.block_counts() == {"a": len(held)}
        if w.sweep is None:
            break
    assert w.sweep is None and events == 2400 // 64  # with the empty one, 38 events read it all
    assert list(w.log) == [*h.primary[:300], *(e.primary[-1] for e in extra[:events])]
    ix.apply_stored("a", seq, h, None, 0.0)  # and once more past the threshold, then removed
    for _ in range(3):
        ix.apply_removed("a", seq + 1, h.primary, 0.0)
        ix.apply_stored("a", seq + 2, h, None, 0.0)
        seq += 2
    assert w.sweep is not None
    assert ix.remove_worker("a")
    assert all(e.held == 0 for e in ix._entries.values()) and len(ix) == 0


def test_more_than_64_workers() -> None:
    ix = PrefixIndex()
    for i in range(130):
        store(ix, f"w{i}", 0, (1, 2, i + 10))
    res = query(ix, 1, 2, 77)
    assert res == {f"w{i}": 2 for i in range(130)} | {"w67": 3}


# ---------------------------------------------------------------------------------------- TTL


def test_ttl_expires_within_one_bucket_after_the_ttl() -> None:
    ix = PrefixIndex(ttl_s=10.0, ttl_buckets=4)  # buckets of 2.5 s
    store(ix, "a", 0, (1, 2), now=1.0)  # bucket 0: expires at (0 + 1) * 2.5 + 10 = 12.5
    assert ix.expire(12.4) == 0
    assert query(ix, 1, 2) == {"a": 2}
    assert ix.expire(12.5) == 2
    assert query(ix, 1, 2) == {} and ix.block_counts() == {"a": 0} and len(ix) == 0
    assert ix.stats.expired_blocks == 2


def test_restore_reconfirms_and_any_worker_confirms() -> None:
    ix = PrefixIndex(ttl_s=10.0, ttl_buckets=4)
    store(ix, "a", 0, (1, 2), now=0.0)
    store(ix, "b", 0, (1,), now=6.0)  # bucket 2 for block 1: expires at 17.5
    assert ix.expire(12.5) == 1  # block 2 (a only) went; block 1 re-confirmed by b
    assert query(ix, 1, 2) == {"a": 1, "b": 1}
    assert ix.expire(17.4) == 0
    assert ix.expire(17.5) == 1
    assert query(ix, 1) == {}


def test_the_same_worker_storing_again_reconfirms() -> None:
    ix = PrefixIndex(ttl_s=10.0, ttl_buckets=4)
    store(ix, "a", 0, (1,), now=0.0)
    store(ix, "a", 1, (1,), now=7.5)  # bucket 3: expires at 20
    assert ix.expire(19.9) == 0
    assert ix.expire(20.0) == 1


def test_removed_then_restored_block_gets_a_fresh_ttl() -> None:
    ix = PrefixIndex(ttl_s=10.0, ttl_buckets=1)
    store(ix, "a", 0, (1,), now=0.0)
    ix.apply_removed("a", 1, chain(1).primary, 1.0)
    store(ix, "a", 2, (1,), now=15.0)  # bucket 1: expires at 30
    assert ix.expire(29.0) == 0
    assert query(ix, 1) == {"a": 1}
    assert ix.expire(30.0) == 1


def test_clock_stepping_back_never_expires_early() -> None:
    ix = PrefixIndex(ttl_s=10.0, ttl_buckets=4)
    store(ix, "a", 0, (1,), now=20.0)  # bucket 8
    store(ix, "a", 1, (2,), now=3.0)  # clamped to bucket 8 as well
    assert ix.expire(32.4) == 0
    assert ix.expire(32.5) == 2


def test_no_ttl() -> None:
    ix = PrefixIndex(ttl_s=None)
    store(ix, "a", 0, (1,), now=0.0)
    assert ix.expire(1e12) == 0
    assert query(ix, 1) == {"a": 1}
    assert not ix._pending[-1][1]  # nothing is queued when TTL is off


@pytest.mark.parametrize("kwargs", [{"ttl_s": 0}, {"ttl_s": -1.0}, {"ttl_buckets": 0}])
def test_bad_ttl_params(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        PrefixIndex(**kwargs)


def test_default_ttl() -> None:
    assert PrefixIndex().ttl_s == DEFAULT_TTL_S == 600.0


# ------------------------------------------------------------------------------- collisions


def test_store_collision_keeps_first_writer_and_is_counted() -> None:
    ix = PrefixIndex()
    ix.apply_stored("a", 0, ([100, 101], [1, 2]), None, 0.0)
    ix.apply_stored("b", 0, ([100, 101], [1, 999]), None, 0.0)  # block 101: other content
    assert ix.stats.store_collisions == 1
    assert ix.overlap([100, 101], [1, 2]) == {"a": 2, "b": 1}
    assert ix.block_counts() == {"a": 2, "b": 1}


@pytest.mark.parametrize(
    ("query_checks", "expected"),
    [
        ([1, 2, 3], {"a": 3, "b": 2}),
        ([1, 2, 9], {"a": 2, "b": 2}),  # a's last block is other content: a is cut back
        ([1, 9, 8], {"a": 1, "b": 1}),  # mismatch at b's credit point: slow path stops at 1
        ([9, 8, 7], {}),
    ],
)
# Check hashes are chained, so once a prompt's content differs at block j its check differs
# at every later block too: the query_checks above keep that shape.
def test_query_collision_becomes_a_shorter_match(query_checks: list, expected: dict) -> None:
    ix = PrefixIndex()
    ix.apply_stored("a", 0, ([100, 101, 102], [1, 2, 3]), None, 0.0)
    ix.apply_stored("b", 0, ([100, 101], [1, 2]), None, 0.0)
    assert ix.overlap([100, 101, 102], query_checks) == expected
    assert ix.stats.query_collisions == (0 if query_checks == [1, 2, 3] else 1)


def test_collision_where_the_walk_ends_because_no_worker_is_left() -> None:
    ix = PrefixIndex()
    ix.apply_stored("a", 0, ([100, 101], [1, 2]), None, 0.0)
    ix.apply_stored("b", 0, ([300], [3]), None, 0.0)
    # the walk ends at block 300 (a does not hold it): a is credited there, after a check
    assert ix.overlap([100, 101, 300], [1, 2, 3]) == {"a": 2}
    assert ix.overlap([100, 101, 300], [1, 9, 8]) == {"a": 1}
    assert ix.stats.query_collisions == 1


def test_overlap_without_check_hashes_skips_verification() -> None:
    ix = PrefixIndex()
    ix.apply_stored("a", 0, ([100, 101], [1, 2]), None, 0.0)
    assert ix.overlap([100, 101], None) == {"a": 2}
    assert ix.overlap([100, 101], [100, 101]) == {}  # primary passed as check: all mismatch
    assert ix.stats.query_collisions == 1


def test_a_block_repeated_within_one_event_counts_once() -> None:
    ix = PrefixIndex()
    ix.apply_stored("a", 0, ([5, 5, 6], [1, 1, 2]), None, 0.0)
    ix.apply_stored("b", 0, ([5], [1]), None, 0.0)
    ix.apply_stored("b", 1, ([7, 7], [3, 3]), 5, 0.0)
    assert ix.block_counts() == {"a": 2, "b": 2}
    assert ix.dump_worker("a") == BlockHashes([5, 6], [1, 2])


def test_mismatched_hash_lists_are_rejected() -> None:
    with pytest.raises(ValueError, match="check hashes"):
        PrefixIndex().apply_stored("a", 0, ([1, 2], [1]), None, 0.0)


# -------------------------------------------------------------------------------- snapshots


def _populated(ttl_s: float | None = 60.0) -> PrefixIndex:
    ix = PrefixIndex(ttl_s=ttl_s)
    store(ix, "a", 0, (1, 2, 3), now=1.0)
    store(ix, "b", 4, (1, 2, 7), now=30.0)
    store(ix, "c", 0, (5,), now=2.0)
    ix.remove_worker("c")  # leaves a free slot
    return ix


def test_snapshot_round_trip() -> None:
    ix = _populated()
    snap = decode(encode(ix.snapshot()))
    assert isinstance(snap, IndexSnapshot)
    other = PrefixIndex(ttl_s=60.0)
    other.restore(snap)
    for prompt in [(1, 2, 3), (1, 2, 7), (5,)]:
        assert query(other, *prompt) == query(ix, *prompt)
    assert other.block_counts() == ix.block_counts()
    assert other.worker_seq("b") == 4
    assert other.worker_last_event_at("b") == 30.0
    assert sorted(other.dump_worker("a").primary) == sorted(ix.dump_worker("a").primary)
    assert store(other, "d", 0, (1,)) is APPLIED  # reuses the free slot
    assert query(other, 1, 2) == {"a": 2, "b": 2, "d": 1}
    # TTL positions survive: a's blocks 3 (bucket 0) expire before b's (bucket 3)
    assert other.expire(61.0 + 60 / 64) == ix.expire(61.0 + 60 / 64) == 1


def test_restore_rescales_ttl_buckets_and_confirms_untimed_snapshots() -> None:
    coarse = PrefixIndex(ttl_s=60.0, ttl_buckets=2)
    coarse.restore(_populated().snapshot())
    assert coarse.expire(60.0 + 29.9) == 0
    assert coarse.expire(90.0) == 1  # block 3, confirmed at 1.0
    timeless = PrefixIndex(ttl_s=10.0, ttl_buckets=1)
    timeless.restore(_populated(ttl_s=None).snapshot(), now=100.0)
    assert timeless.expire(119.9) == 0
    assert timeless.expire(120.0) == 4  # blocks 1, 2, 3, 7 (c left with block 5)


def test_snapshot_of_wide_masks() -> None:
    ix = PrefixIndex()
    for i in range(150):
        store(ix, f"w{i}", 0, (1, i + 10))
    snap = decode(encode(ix.snapshot()))
    assert snap.mask_words == 3
    other = PrefixIndex()
    other.restore(snap)
    assert query(other, 1, 140) == query(ix, 1, 140)


def test_restore_rejects_other_hash_schemes() -> None:
    snap = PrefixIndex().snapshot()
    import msgspec

    with pytest.raises(ValueError, match="scheme"):
        PrefixIndex().restore(msgspec.structs.replace(snap, hash_scheme=99))


# ------------------------------------------------------ prefix-closed sets (the query's search)


def closed_of(ix: PrefixIndex, *ids: int) -> set[str]:
    """Workers the index records as holding the whole prefix ``ids`` (its ``closed`` set)."""
    e = ix._entries[chain(*ids).primary[-1]]
    return {w.name for w in ix._workers.values() if e.closed & w.bit}


def test_removing_a_middle_block_clears_the_prefix_below_it() -> None:
    ix = PrefixIndex()
    store(ix, "a", 0, (1, 2, 3, 4))
    ix.apply_removed("a", 1, chain(1, 2).primary[1:], 0.0)  # not a leaf: 3 and 4 stay held
    assert closed_of(ix, 1, 2, 3, 4) == set() and query(ix, 1, 2, 3, 4) == {"a": 1}
    assert ix.block_counts() == {"a": 3}
    part, parent = tail((1, 2), 1)
    ix.apply_stored("a", 2, part, parent, 0.0)  # block 2 again: 3 and 4 are reachable again
    assert query(ix, 1, 2, 3, 4) == {"a": 4}  # found by following held bits past block 2
    assert closed_of(ix, 1, 2) == {"a"} and closed_of(ix, 1, 2, 3) == set()


def test_expiry_of_a_parent_clears_the_prefix_of_surviving_children() -> None:
    ix = PrefixIndex(ttl_s=10.0, ttl_buckets=4)
    store(ix, "a", 0, (1, 2), now=0.0)
    part, parent = tail((1, 2, 3), 2)
    ix.apply_stored("a", 1, part, parent, 6.0)  # block 3 confirmed later than its parents
    assert ix.expire(12.5) == 2
    assert query(ix, 1, 2, 3) == {} and ix.block_counts() == {"a": 1}
    store(ix, "b", 0, (1, 2), now=13.0)
    assert query(ix, 1, 2, 3) == {"b": 2}
    store(ix, "a", 2, (1, 2), now=14.0)
    assert query(ix, 1, 2, 3) == {"a": 3, "b": 2}


def test_blocks_stored_before_their_parent_count_once_it_arrives() -> None:
    ix = PrefixIndex()
    part, parent = tail((1, 2, 3, 4), 2)
    ix.apply_stored("a", 0, part, parent, 0.0)  # an orphan: a does not hold 1, 2 yet
    assert ix.stats.orphan_stores == 1 and query(ix, 1, 2, 3, 4) == {}
    store(ix, "a", 1, (1, 2))
    assert query(ix, 1, 2, 3, 4) == {"a": 4}
    assert query(ix, 1, 2, 3) == {"a": 3}


def test_a_branch_point_keeps_every_child() -> None:
    ix = PrefixIndex()
    store(ix, "a", 0, (1, 2))
    n = 200
    for i in range(n):  # 200 conversations under the same 2-block system prompt
        ix.apply_stored("a", 1 + i, *tail((1, 2, 1000 + i), 2), 0.0)
    kids = ix._entries[chain(1, 2).primary[-1]].kids
    assert len(kids) == n
    leaves = [chain(1, 2, 1000 + i).primary[-1] for i in range(n - 5)]
    ix.apply_removed("a", n + 1, leaves, 0.0)  # leaf-first evictions of most of them
    assert all(query(ix, 1, 2, 1000 + i) == {"a": 3} for i in range(n - 5, n))
    ix.apply_removed("a", n + 2, [chain(1, 2).primary[-1]], 0.0)  # then the branch point
    assert all(query(ix, 1, 2, 1000 + i) == {"a": 1} for i in range(n - 5, n))
    assert all(closed_of(ix, 1, 2, 1000 + i) == set() for i in range(n - 5, n))


def test_kid_sets_are_pruned_of_gone_entries() -> None:
    ix = PrefixIndex()
    seq = 0
    for i in range(1000):  # children come and go one at a time under block 1
        part, parent = tail((1, 10 + i), 1)
        ix.apply_stored("a", seq, *tail((1,), 0), 0.0)
        ix.apply_stored("a", seq + 1, part, parent, 0.0)
        ix.apply_removed("a", seq + 2, part.primary, 0.0)
        seq += 3
    kids = ix._entries[chain(1).primary[0]].kids
    assert len(kids) < 100  # pruned as it grows, not 1000


def test_search_agrees_with_the_block_by_block_walk() -> None:
    from thunderagent.bench.index_workload import build_workload
    from thunderagent.prefix_index.search import walk

    w = build_workload(3000, 300, seed=11)
    ix = PrefixIndex(ttl_s=5.0, ttl_buckets=8)
    names = [f"w{i}" for i in range(8)]
    for i, (wid, seq, p, c, parent, _ids) in enumerate(w.events):
        ix.apply_stored(names[wid], seq, (p, c), parent, i * 0.001)
        if i % 7 == 0:  # remove some blocks anywhere in the chain, leaves or not
            ix.apply_removed(names[wid], seq + 10**6, p[len(p) // 2 :], i * 0.001)
            ix.add_worker(names[wid], seq)
        if i % 500 == 0:
            ix.expire(i * 0.001)
    get = ix._entries.get
    hits = 0
    for primary, check, _ids in w.queries:
        expected = walk(get, primary, check, ix._credit, True)
        assert ix.overlap(primary, check) == expected
        hits += bool(expected)
    assert hits > len(w.queries) // 2
    assert ix.stats.query_collisions == 0


def test_a_full_collection_does_not_walk_the_index() -> None:
    """Nothing the index keeps per block is a GC container: with tuples as entries the dict was
    tracked, and every full collection walked all of it (~200 ms per million blocks)."""
    ix = PrefixIndex(ttl_s=60.0)
    store(ix, "a", 0, (1, 2, 3))
    for i, leaf in enumerate((4, 5, 6)):  # block 3 becomes a branch point: a Kids set
        part, parent = tail((1, 2, 3, leaf), 3)
        ix.apply_stored("a", 1 + i, part, parent, 1.0)
    store(ix, "b", 0, (1, 2))
    ix.apply_removed("a", 4, [chain(1, 2, 3, 5).primary[-1]], 2.0)
    gc.collect()
    assert not gc.is_tracked(ix._entries)
    logs = [w.log for w in ix._workers.values()] + [hashes for _, hashes in ix._pending]
    assert all(len(log) for log in logs)
    assert not any(isinstance(o, int) for log in logs for o in gc.get_referents(log))
    # the branch point's kid set is referenced only from an untracked entry: still intact
    assert query(ix, 1, 2, 3, 4) == {"a": 4, "b": 2}
    ix.apply_removed("a", 5, [chain(1, 2).primary[-1]], 3.0)
    assert closed_of(ix, 1, 2, 3, 4) == set() and closed_of(ix, 1, 2, 3, 6) == set()


@pytest.mark.parametrize("bad", [-1, 2**64])
def test_a_hash_outside_64_bits_is_refused_and_changes_nothing(bad: int) -> None:
    ix = PrefixIndex()
    store(ix, "a", 0, (1, 2))
    good = chain(1, 2, 3)
    with pytest.raises(ValueError, match="unsigned 64-bit"):
        ix.apply_stored("a", 1, ([good.primary[2], bad], [good.check[2], 7]), good.primary[1], 0.0)
    assert len(ix) == 2 and ix.block_counts() == {"a": 2}
    assert query(ix, 1, 2, 3) == {"a": 2}


def test_a_snapshot_with_a_signed_hash_is_refused_before_anything_changes() -> None:
    ix = PrefixIndex()
    store(ix, "a", 0, (1, 2))
    snap = ix.snapshot()
    bad = msgspec.structs.replace(
        snap, workers=[msgspec.structs.replace(snap.workers[0], blocks=[-5])]
    )
    other = PrefixIndex()
    store(other, "b", 0, (7,))
    with pytest.raises(ValueError, match="unsigned 64-bit"):
        other.restore(decode(encode(bad)))
    assert query(other, 7) == {"b": 1} and len(other) == 1


def test_snapshot_keeps_closed_sets_and_kids() -> None:
    ix = PrefixIndex()
    store(ix, "a", 0, (1, 2, 3))
    for i, leaf in enumerate((4, 5, 6)):  # block 3 becomes a branch point
        part, parent = tail((1, 2, 3, leaf), 3)
        ix.apply_stored("a", 1 + i, part, parent, 0.0)
    part, parent = tail((1, 2, 3, 4), 3)
    ix.apply_stored("b", 0, part, parent, 0.0)  # an orphan: held, never closed
    other = PrefixIndex()
    other.restore(decode(encode(ix.snapshot())))
    assert other._entries == ix._entries
    other.apply_removed("a", 10, [chain(1, 2).primary[1]], 0.0)  # the kids came back too
    assert closed_of(other, 1, 2, 3, 5) == set()
    assert query(other, 1, 2, 3, 5) == {"a": 1}


def test_restore_refuses_an_older_snapshot_layout() -> None:
    import msgspec

    snap = PrefixIndex().snapshot()
    with pytest.raises(ValueError, match="version"):
        PrefixIndex().restore(msgspec.structs.replace(snap, version=1))


def test_a_long_due_list_is_read_in_steps_doubling_per_bucket_of_lag(monkeypatch) -> None:
    """A refresh puts a whole cache in one TTL list: its expiry reads ``EXPIRE_STEP`` items per
    call, twice as many per bucket's width the list has waited since it was due, and skips
    what was confirmed again since."""
    monkeypatch.setattr(ttl, "EXPIRE_STEP", 8)
    ix = PrefixIndex(ttl_s=64.0, ttl_buckets=64)  # buckets of 1 s
    for i in range(40):
        store(ix, "a", i, (1000 + i,), now=0.5)  # 40 blocks in bucket 0: due at 65
    store(ix, "a", 40, (1000,), now=30.0)  # confirmed again: due at 95
    assert ix.expire(64.9) == 0
    assert [ix.expire(t) for t in (65.0, 65.5)] == [7, 8]  # one of the first 8 is block 1000
    assert ix.expire(66.0) == 16  # a bucket late: 16 items
    assert ix.expire(66.5) == 8  # the list's rest
    assert ix.expire(67.0) == 0 and len(ix) == 1 and query(ix, 1000) == {"a": 1}
    snap = ix.snapshot()
    assert [len(h) for _, h in snap.ttl_queue] == [1]  # what was read is not kept
    assert ix.expire(95.0) == 1 and len(ix) == 0


def test_a_snapshot_taken_mid_list_restores_what_is_left_to_read(monkeypatch) -> None:
    monkeypatch.setattr(ttl, "EXPIRE_STEP", 4)
    ix = PrefixIndex(ttl_s=64.0, ttl_buckets=64)
    for i in range(10):
        store(ix, "a", i, (2000 + i,), now=0.5)
    assert ix.expire(65.0) == 4
    fresh = PrefixIndex(ttl_s=64.0, ttl_buckets=64)
    fresh.restore(decode(encode(ix.snapshot())), 65.0)
    assert [fresh.expire(65.0) for _ in range(3)] == [4, 2, 0]
    assert len(fresh) == 0
