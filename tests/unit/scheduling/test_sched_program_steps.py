"""Agent programs: stickiness that yields to a shorter prefill queue. Every expectation below
is worked out by hand in comments."""

from __future__ import annotations

import math

import pytest

from thunderagent.scheduling import Dispatch, SchedRequest, ThunderScheduler, WorkerRoom

BS = 16


def step(rid, pid, prompt, cands=(("w0", 0),), hashes=0) -> SchedRequest:
    """A program step of ``prompt`` tokens whose first ``hashes`` full blocks are the
    program's own (block hashes 1000*program + i, so a longer prompt extends a shorter one)."""
    base = 1000 * (ord(pid[0]) - ord("A") + 1)
    return SchedRequest(
        rid, 0.0, prompt, 16, list(cands), block_size=BS, program_id=pid,
        block_hashes=[base + i for i in range(hashes)],
    )  # fmt: skip


def sched(total=1000, **params) -> ThunderScheduler:
    s = ThunderScheduler(
        programs=True, window="none", kv_watermark=1.0, program_resume_watermark=0.75,
        prefill_tokens_per_s=10000.0, **params,
    )  # fmt: skip
    for w in ("w0", "w1"):
        s.update_worker(WorkerRoom(w, 0, 0, 0, total, 8), 0.0)
    return s


def run(s: ThunderScheduler, r: SchedRequest, now: float) -> list[Dispatch]:
    s.submit(r, now)
    return [a for a in s.poll(now) if isinstance(a, Dispatch)]


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
    s = sched(**params)
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
