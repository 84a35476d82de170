"""The pull at dispatch's decision (``thunderagent.migration.pull``): which holder a run's
worker copies its prefix from, if any, and the link time each sender books."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from thunderagent.migration import MigrationParams
from thunderagent.migration.pull import PullLinks, PullPlanner, plan_pull
from thunderagent.schemas import Candidate, PullHint

BLOCK_BYTES = 16 * 131_072  # a 16-token block of Llama-3.1-8B: 2 MiB
FAST = {"min_blocks": 1, "block_bytes": BLOCK_BYTES, "link_bytes_per_s": 25e9,
        "prefill_s_per_block": 16 / 20_000}  # fmt: skip
"""25 GB/s: a block crosses in 84 µs and takes 800 µs to prefill."""


def cands(**overlaps: int) -> list[Candidate]:
    return [Candidate(worker_id=w, score=0.0, overlap_blocks=n) for w, n in overlaps.items()]


def test_the_run_copies_from_the_worker_holding_the_most_of_its_prefix() -> None:
    plan = plan_pull(cands(w0=2, w1=10, w2=6), "w0", 20, **FAST)
    assert plan is not None and (plan.source, plan.blocks, plan.present) == ("w1", 10, 2)


def test_no_copy_when_the_target_holds_as_much_as_anyone() -> None:
    assert plan_pull(cands(w0=10, w1=10), "w0", 20, **FAST) is None
    assert plan_pull(cands(w0=0, w1=0), "w0", 20, **FAST) is None


def test_a_prompt_s_last_token_is_never_copied() -> None:
    """``usable_blocks`` bounds what counts: the blocks a run could be served from cache."""
    plan = plan_pull(cands(w0=0, w1=10), "w0", 4, **FAST)
    assert plan is not None and plan.blocks == 4


def test_min_blocks_is_a_floor_and_zero_turns_copies_off() -> None:
    assert plan_pull(cands(w0=7, w1=10), "w0", 20, **{**FAST, "min_blocks": 4}) is None
    plan = plan_pull(cands(w0=6, w1=10), "w0", 20, **{**FAST, "min_blocks": 4})
    assert plan is not None and plan.source == "w1"
    assert plan_pull(cands(w0=0, w1=10), "w0", 20, **{**FAST, "min_blocks": 0}) is None


def test_a_link_slower_than_prefill_never_pays() -> None:
    slow = {**FAST, "link_bytes_per_s": BLOCK_BYTES / FAST["prefill_s_per_block"] * 0.9}
    assert plan_pull(cands(w0=0, w1=100), "w0", 200, **slow) is None


def test_a_busy_link_sends_the_copy_to_a_nearer_holder_or_nowhere() -> None:
    """Saved = blocks x (prefill - copy) per block, less the wait for the link: w1 holds more
    but its link is busy for 5 ms; w2's 8 blocks save 5.7 ms with no wait."""
    per_block = FAST["prefill_s_per_block"] - BLOCK_BYTES / FAST["link_bytes_per_s"]
    waits = {"w1": 0.005, "w2": 0.0}
    plan = plan_pull(cands(w0=0, w1=10, w2=8), "w0", 20, **FAST, link_wait_s=waits.get)
    assert plan is not None and plan.source == "w2"
    assert 10 * per_block - 0.005 < 8 * per_block  # why w2 won
    busy = {"w1": 1.0, "w2": 1.0}
    assert plan_pull(cands(w0=0, w1=10, w2=8), "w0", 20, **FAST, link_wait_s=busy.get) is None


@given(
    st.dictionaries(st.sampled_from(["w0", "w1", "w2", "w3"]), st.integers(0, 64), min_size=1),
    st.integers(0, 64),
    st.integers(0, 8),
    st.dictionaries(st.sampled_from(["w1", "w2", "w3"]), st.floats(0, 0.1)),
)
def test_a_planned_copy_always_adds_blocks_and_saves_the_most_time(
    overlaps: dict[str, int], usable: int, min_blocks: int, waits: dict[str, float]
) -> None:
    plan = plan_pull(cands(**overlaps), "w0", usable, **{**FAST, "min_blocks": min_blocks},
                     link_wait_s=lambda s: waits.get(s, 0.0))  # fmt: skip
    per_block = FAST["prefill_s_per_block"] - BLOCK_BYTES / FAST["link_bytes_per_s"]
    present = min(overlaps.get("w0", 0), usable)
    savings = {
        w: (min(n, usable) - present) * per_block - waits.get(w, 0.0)
        for w, n in overlaps.items()
        if w != "w0" and min_blocks > 0 and min(n, usable) - present >= min_blocks
    }
    if plan is None:
        assert all(v <= 0 for v in savings.values())
        return
    assert plan.source != "w0" and plan.present == present
    assert plan.blocks == min(overlaps[plan.source], usable) > present
    assert savings[plan.source] == max(savings.values()) > 0


def test_links_hold_both_ends_one_copy_at_a_time() -> None:
    links = PullLinks()
    links.book(10.0, 0.5, "w1", "w0")
    assert links.wait(10.1, "w1") == pytest.approx(0.4)
    assert links.wait(10.1, "w0", "w2") == pytest.approx(0.4)
    links.book(10.1, 0.2, "w2", "w0")  # queues behind w0's first copy
    assert links.wait(10.1, "w2") == pytest.approx(0.6)
    assert links.wait(11.0, "w0", "w1", "w2") == 0.0


ANY = MigrationParams(pull_min_tokens=1)
"""Any prefix worth its copy (the default asks for 8,192 tokens)."""


def test_the_hint_names_the_prefix_by_its_deepest_block_and_the_taken_run_books_the_link() -> None:
    planner = PullPlanner(ANY)
    hashes = [100 + i for i in range(12)]
    hint = planner.hint(cands(w0=0, w1=10), "w0", hashes, 12 * 16 + 3, 16, now=5.0)
    assert hint == PullHint(
        source_worker="w1", prefix_hash=109, blocks=10, budget_s=10 * 16 / 20_000
    )
    assert planner.links.wait(5.0, "w0", "w1") == 0.0, "an offer the worker refuses books nothing"
    planner.book(hint, "w0", now=5.0)
    seconds = 10 * BLOCK_BYTES / 25e9
    assert planner.links.wait(5.0, "w1") == pytest.approx(seconds)
    assert planner.links.wait(5.0, "w0") == pytest.approx(seconds)


def test_a_hint_respects_the_token_floor_and_the_switch() -> None:
    hashes = list(range(1, 13))
    few = PullPlanner(MigrationParams(pull_min_tokens=64))  # 4 blocks of 16 tokens
    assert few.hint(cands(w0=7, w1=10), "w0", hashes, 12 * 16 + 1, 16, now=0.0) is None
    assert few.hint(cands(w0=0, w1=10), "w0", hashes, 12 * 16 + 1, 16, now=0.0) is not None


def test_a_copy_must_save_more_than_its_fixed_cost() -> None:
    """``link_latency_s`` (5 ms: three request/replies, pinning) is paid by every copy: 6
    blocks of 16 tokens save 4.3 ms of prefill, 7 save 5.0 ms."""
    hashes = list(range(1, 13))
    planner = PullPlanner(ANY)
    assert planner.hint(cands(w0=4, w1=10), "w0", hashes, 12 * 16 + 1, 16, now=0.0) is None
    assert planner.hint(cands(w0=2, w1=10), "w0", hashes, 12 * 16 + 1, 16, now=0.0) is not None
    off = PullPlanner(MigrationParams(pull_min_tokens=0))
    assert off.hint(cands(w0=0, w1=10), "w0", hashes, 12 * 16 + 1, 16, now=0.0) is None
    default = PullPlanner(MigrationParams())  # 8,192 tokens: 512 blocks of 16
    long = list(range(1, 1025))
    assert default.hint(cands(w0=0, w1=511), "w0", long, 1024 * 16, 16, now=0.0) is None
    assert default.hint(cands(w0=0, w1=512), "w0", long, 1024 * 16, 16, now=0.0) is not None
