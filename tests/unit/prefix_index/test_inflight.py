"""The router's in-flight overlay re-confirms the prefix a worker already has recorded instead
of storing the whole prompt again: whatever the records, removals, clears and expiries, every
answer is the one storing each prompt whole gives."""

from hypothesis import given, settings
from hypothesis import strategies as st

from thunderagent.hashing import BlockHasher
from thunderagent.prefix_index.inflight import InflightPrefixes
from thunderagent.schemas import AllCleared, BlocksRemoved, KvEventBatch

HASHER = BlockHasher(4)
WORKERS = ("w0", "w1", "w2")
TRUNKS = [[100 * t + i for i in range(48)] for t in range(3)]
"""Three 12-block token trunks; a prompt is a trunk's first blocks, then a tail of its own."""


class WholePrompts(InflightPrefixes):
    """The overlay as it was: every prompt stored whole, from its first block."""

    def record(self, worker, primary, check, now) -> None:
        self.index.apply_stored(worker, self._next_seq(worker), (primary, check), None, now)


def prompt(trunk: int, blocks: int, tail: int, tail_blocks: int):
    tokens = TRUNKS[trunk][: 4 * blocks] + [10_000 + 97 * tail + i for i in range(4 * tail_blocks)]
    return HASHER.hash_tokens(tokens)


prompts = st.builds(
    prompt,
    st.integers(0, 2),
    st.integers(1, 12),
    st.integers(0, 3),
    st.integers(0, 3),
)
ops = st.one_of(
    st.tuples(st.just("record"), st.sampled_from(WORKERS), prompts, st.floats(0, 3)),
    st.tuples(
        st.just("remove"),
        st.sampled_from(WORKERS),
        prompts,
        st.tuples(st.integers(0, 11), st.integers(1, 15)),
    ),
    st.tuples(st.just("clear"), st.sampled_from(WORKERS), prompts, st.just(0)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(ops, max_size=40), st.lists(prompts, min_size=1, max_size=4))
def test_answers_match_storing_every_prompt_whole(steps, queries) -> None:
    fast, whole = InflightPrefixes(ttl_s=5.0), WholePrompts(ttl_s=5.0)
    now, seq = 0.0, 0
    for kind, worker, hashes, arg in steps:
        if kind == "record":
            now += arg
            for overlay in (fast, whole):
                overlay.record(worker, hashes.primary, hashes.check, now)
        else:
            seq += 1
            start, span = arg if kind == "remove" else (0, 0)
            event = (AllCleared() if kind == "clear"
                     else BlocksRemoved(hashes=hashes.primary[start : start + span]))  # fmt: skip
            batch = KvEventBatch(worker_id=worker, seq=seq, ts=now, events=[event])
            fast.drop_removed(batch)
            whole.drop_removed(batch)
        for q in (*queries, hashes):
            assert fast.matches(q.primary, q.check, now) == whole.matches(q.primary, q.check, now)
        assert fast.index.block_counts() == whole.index.block_counts()


def test_a_repeated_prefix_is_reconfirmed_not_stored_again() -> None:
    """What the change is for: a turn that extends the last one logs only its new blocks, and
    the prefix it repeats stays alive past the TTL of its first record."""
    overlay = InflightPrefixes(ttl_s=5.0)
    first, longer = prompt(0, 8, 0, 0), prompt(0, 12, 0, 0)
    overlay.record("w0", first.primary, first.check, 0.0)
    overlay.record("w0", longer.primary, longer.check, 4.0)
    w = overlay.index._workers["w0"]
    assert list(w.logged()) == longer.primary, "each block logged once"
    assert overlay.matches(longer.primary, longer.check, 8.0) == {"w0": 12}
    assert overlay.matches(longer.primary, longer.check, 10.0) == {}, "all of it expires after"


def test_a_block_lost_under_a_reconfirmed_prefix_cuts_every_longer_prompt_there() -> None:
    """The stored rest hangs under the reconfirmed prefix's last block (its parent): a block
    lost above it takes the rest's claim too, as it does for a prompt stored whole."""
    fast, whole = InflightPrefixes(ttl_s=5.0), WholePrompts(ttl_s=5.0)
    short, long_, middle = prompt(0, 5, 0, 0), prompt(0, 12, 1, 3), prompt(0, 3, 0, 0)
    lost = KvEventBatch(worker_id="w0", seq=1, ts=0.0,
                        events=[BlocksRemoved(hashes=middle.primary[2:])])  # fmt: skip
    for overlay in (fast, whole):
        overlay.record("w0", short.primary, short.check, 0.0)
        overlay.record("w0", long_.primary, long_.check, 0.0)
        overlay.drop_removed(lost)
    assert whole.matches(long_.primary, long_.check, 0.0) == {"w0": 2}
    assert fast.matches(long_.primary, long_.check, 0.0) == {"w0": 2}
