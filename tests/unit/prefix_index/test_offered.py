"""Prompts offered to a worker, its answer not in yet: matched from the first block, taken back
exactly on a refusal."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from thunderagent.hashing import BlockHasher
from thunderagent.prefix_index.offered import OfferedPrompts, common_blocks

BS = 4
HASHER = BlockHasher(BS)


def hashes(tokens: list[int]):
    return HASHER.hash_tokens(tokens)


@given(
    shared=st.lists(st.integers(0, 3), max_size=40),
    a=st.lists(st.integers(0, 3), max_size=40),
    b=st.lists(st.integers(0, 3), max_size=40),
)
def test_common_blocks_is_the_longest_shared_prefix_of_whole_blocks(shared, a, b) -> None:
    x, y = hashes(shared + a), hashes(shared + b)
    tokens_x, tokens_y = shared + a, shared + b
    expected = 0
    while (expected + 1) * BS <= min(len(tokens_x), len(tokens_y)) and tokens_x[
        : (expected + 1) * BS
    ] == tokens_y[: (expected + 1) * BS]:
        expected += 1
    assert common_blocks(x, y.primary, y.check) == expected


def test_each_worker_gets_the_longest_prefix_offered_there() -> None:
    doc = list(range(100, 132))  # 8 blocks
    offers = OfferedPrompts()
    offers.add("a", "w0", hashes(doc[:16] + [1] * 8))  # shares 4 blocks with the query
    offers.add("b", "w0", hashes(doc + [2] * 8))  # shares all 8
    offers.add("c", "w1", hashes(doc[:8] + [3] * 8))  # shares 2
    offers.add("d", "w2", hashes([9] * 16))  # shares none
    query = hashes(doc + [4] * 8)
    assert offers.matches(query.primary, query.check) == {"w0": 8, "w1": 2}
    offers.remove("b")
    assert offers.matches(query.primary, query.check) == {"w0": 4, "w1": 2}
    offers.remove("a")
    offers.remove("c")
    offers.remove("never offered")
    assert offers.matches(query.primary, query.check) == {}
    assert len(offers) == 1


def test_a_prompt_shorter_than_a_block_is_not_offered() -> None:
    offers = OfferedPrompts()
    offers.add("a", "w0", hashes([1, 2]))
    assert len(offers) == 0
    assert offers.matches([], []) == {}
