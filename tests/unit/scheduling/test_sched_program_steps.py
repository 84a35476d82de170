"""Agent programs: stickiness that yields to a shorter prefill queue, rescue of a paused
program whose KV is still cached. Every expectation below is worked out by hand in comments."""

from __future__ import annotations

import math

import pytest
from program_helpers import run, sched

from thunderagent.scheduling import Dispatch, SchedRequest, ThunderScheduler
from thunderagent.scheduling.programs import ACTING, PAUSED, REASONING

BS = 16


def step(rid, pid, prompt, cands=(("w0", 0),), hashes=0) -> SchedRequest:
    """A program step of ``prompt`` tokens whose first ``hashes`` full blocks are the
    program's own (block hashes 1000*program + i, so a longer prompt extends a shorter one)."""
    base = 1000 * (ord(pid[0]) - ord("A") + 1)
    return SchedRequest(
        rid, 0.0, prompt, 16, list(cands), block_size=BS, program_id=pid,
        block_hashes=[base + i for i in range(hashes)],
    )  # fmt: skip


# ---- stickiness yields ----------------------------------------------------------------------


def acting_on_w0(s: ThunderScheduler, backlog_tokens: int) -> None:
    """Program A (160-token prompt, 10 blocks) ran on w0 and is acting there (11 blocks with
    its output); X, a plain request with ``backlog_tokens`` of uncached prompt, was sent to w0
    at t=1.0 and has not produced its first token: w0's prefill backlog."""
    assert run(s, step("A-0", "A", 160, hashes=10), 0.0) == [Dispatch("A-0", "w0")]
    s.on_finished("A-0", "w0", 0.5)
    if backlog_tokens:
        x = SchedRequest("X", 1.0, backlog_tokens, 16, [("w0", 0)], block_size=BS)
        assert run(s, x, 1.0) == [Dispatch("X", "w0")]


@pytest.mark.parametrize(
    ("backlog", "at", "w1_cached", "params", "expected"),
    [
        # w0's backlog 8000 > extra (10 - 0 blocks) * 16 = 160 tokens: the router's w1 first.
        (8000, 1.0, 0, {}, "w1"),
        # backlog 100 tokens < 160 re-prefilled on w1: back to the holder.
        (100, 1.0, 0, {}, "w0"),
        # w1 caches 5 of A's 10 blocks: extra 80 tokens; backlog 100 > 80: w1.
        (100, 1.0, 5, {}, "w1"),
        # 0.79 s after X was sent w0 prefilled 7,900 of its 8,000 tokens: 100 left < 160.
        (8000, 1.79, 0, {}, "w0"),
        # 0.5 s after: 3,000 left > 160.
        (8000, 1.5, 0, {}, "w1"),
        # ratio 60: 8000 > 60 * 160 = 9600 is false: holder.
        (8000, 1.0, 0, {"program_yield_ratio": 60.0}, "w0"),
        # ratio inf: always the holder, even with nothing to re-prefill on w1.
        (8000, 1.0, 10, {"program_yield_ratio": math.inf}, "w0"),
        # no backlog anywhere: the holder.
        (0, 1.0, 0, {}, "w0"),
    ],
)
def test_a_step_yields_its_holder_only_when_the_holders_prefill_queue_costs_more(
    backlog: int, at: float, w1_cached: int, params: dict, expected: str
) -> None:
    s = sched(total=1000, **params)
    acting_on_w0(s, backlog)
    got = run(s, step("A-1", "A", 176, [("w1", w1_cached), ("w0", 10)], hashes=11), at)
    assert got == [Dispatch("A-1", expected)]


def test_a_step_does_not_yield_to_a_worker_it_does_not_fit_on() -> None:
    """w1 is 100 blocks; B lives there with 70 (a 1,104-token prompt and 16 of output): under
    the resume watermark (75 blocks) A's 11 blocks do not fit, so A stays on w0 although w0's
    backlog (1,000 tokens) is over the 160 it would re-prefill on w1."""
    s = sched(total=100)
    assert run(s, step("B-0", "B", 1104, [("w1", 0)], hashes=69), 0.0) == [Dispatch("B-0", "w1")]
    s.on_finished("B-0", "w1", 0.2)
    assert s.programs.resident("w1") == 70
    acting_on_w0(s, 1000)
    got = run(s, step("A-1", "A", 176, [("w1", 0), ("w0", 10)], hashes=11), 1.0)
    assert got == [Dispatch("A-1", "w0")]


# ---- rescue of a paused program whose KV is still cached ------------------------------------


def crowded(**params) -> ThunderScheduler:
    """As in test_sched_programs: on a 100-block w0 (pause above 95, resume under 75) A (11
    blocks), B (31) and C (51) act; D's 20-block step takes them to 113, so A and B, the
    smallest, are paused (C 51 + D 20 = 71 stay)."""
    s = sched(total=100, **params)
    for pid, prompt in (("A", 160), ("B", 480), ("C", 800)):
        assert len(run(s, step(f"{pid}-0", pid, prompt, hashes=prompt // BS), 0.0)) == 1
        s.on_finished(f"{pid}-0", "w0", 1.0)
    assert run(s, step("D-0", "D", 320, hashes=20), 2.0) == [Dispatch("D-0", "w0")]
    s.poll(2.0)
    assert [s.programs.programs[p].phase for p in "ABC"] == [PAUSED, PAUSED, ACTING]
    return s


@pytest.mark.parametrize(
    ("cands", "params", "expected"),
    [
        # all 10 blocks of A's previous prompt still on w0: resumed there at once.
        ((("w0", 10),), {}, "w0"),
        # 9 of 10: 9 >= 0.9 * 10.
        ((("w0", 9),), {}, "w0"),
        # 8 of 10 < 9: parked (71 + 11 is over the resume mark on w0).
        ((("w0", 8),), {}, None),
        # the first candidate that still holds it, in router order.
        ((("w0", 0), ("w1", 10)), {}, "w1"),
        # share 0: rescue off, parked.
        ((("w0", 10),), {"program_rescue_share": 0.0}, None),
        # share 0.5: 5 of 10 blocks is enough.
        ((("w0", 5),), {"program_rescue_share": 0.5}, "w0"),
    ],
)
def test_a_paused_programs_step_resumes_where_its_kv_still_is(
    cands: tuple, params: dict, expected: str | None
) -> None:
    s = crowded(**params)
    got = run(s, step("A-1", "A", 176, cands, hashes=11), 3.0)
    if expected is None:
        assert got == [] and s.waiting() == 1
        assert s.programs.programs["A"].phase == PAUSED
        assert s.stats()["program_rescues"] == 0
    else:
        assert got == [Dispatch("A-1", expected)]
        assert s.programs.programs["A"].phase == REASONING
        assert s.stats()["program_rescues"] == 1


def test_a_rescue_over_the_watermark_pauses_the_smallest_acting_program() -> None:
    """A (11) and B (31) rescued on w0: C 51 + D 20 + A 11 + B 31 = 113 > 95. A and B are
    reasoning, D reasoning: C, the one acting program, is paused (51 blocks: back to 62)."""
    s = crowded()
    assert run(s, step("A-1", "A", 176, [("w0", 10)], hashes=11), 3.0) == [Dispatch("A-1", "w0")]
    assert run(s, step("B-1", "B", 496, [("w0", 30)], hashes=31), 3.1) == [Dispatch("B-1", "w0")]
    s.poll(3.2)
    phases = {p: s.programs.programs[p].phase for p in "ABCD"}
    assert phases == {"A": REASONING, "B": REASONING, "C": PAUSED, "D": REASONING}
    assert s.programs.resident("w0") == 11 + 31 + 20
