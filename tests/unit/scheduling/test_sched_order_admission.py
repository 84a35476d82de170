"""Ordering (FCFS vs priority+SRPT, aging), admission caps and spill, windows, deadlines."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from thunderagent.prefill_model import prefill_work
from thunderagent.scheduling import (
    SCHEDULERS,
    Dispatch,
    Reject,
    SchedParams,
    SchedRequest,
    ThunderScheduler,
    WorkerRoom,
)
from thunderagent.scheduling.ordering import prefill_s
from thunderagent.scheduling.window import Window


def req(rid, at=0.0, prompt=160, out=16, cands=(("w0", 0),), prio=0, **kw) -> SchedRequest:
    return SchedRequest(rid, at, prompt, out, list(cands), priority=prio, **kw)


def room(w="w0", running=0, total=0, max_running=1, **kw) -> WorkerRoom:
    return WorkerRoom(w, running, 0, 0, total, max_running, **kw)


def sent(actions) -> list[str]:
    return [a.request_id for a in actions if isinstance(a, Dispatch)]


def serve_one_at_a_time(s, now: float) -> list[str]:
    """Finish whatever runs, poll, repeat: the order in which a 1-slot worker serves."""
    order: list[str] = []
    while s.waiting():
        got = sent(s.poll(now))
        assert len(got) == 1
        order += got
        s.on_finished(got[0], "w0", now)
    return order


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("fcfs", ["long1", "short0", "mid0", "short1"]),
        ("priority_srpt", ["short0", "mid0", "short1", "long1"]),
    ],
)
def test_fcfs_vs_priority_srpt(name: str, expected: list[str]) -> None:
    s = SCHEDULERS.create(name)
    s.update_worker(room(), 0.0)
    s.submit(req("busy"), 0.0)
    assert sent(s.poll(0.0)) == ["busy"]
    s.submit(req("long1", 0.1, prompt=8000, out=1000, prio=1), 0.1)
    s.submit(req("short0", 0.2, prompt=64, out=8, prio=0), 0.2)
    s.submit(req("mid0", 0.3, prompt=2000, out=200, prio=0), 0.3)
    s.submit(req("short1", 0.4, prompt=64, out=8, prio=1), 0.4)
    assert s.poll(0.5) == []
    s.on_finished("busy", "w0", 0.5)
    assert serve_one_at_a_time(s, 0.5) == expected


def test_aging_serves_low_priority_under_a_high_priority_stream() -> None:
    s = SCHEDULERS.create("priority_srpt", class_step_s=5.0)
    s.update_worker(room(), 0.0)
    s.submit(req("low", 0.0, prio=1), 0.0)
    order: list[str] = []
    for t in range(10):  # one short arrives each second; the worker is never idle
        if order:
            s.on_finished(order[-1], "w0", float(t))
        s.submit(req(f"s{t}", float(t)), float(t))
        order += sent(s.poll(float(t)))
    # low's key is 0 + 5 s + work: it ties with the short arriving at t=5 and wins on seq.
    assert order.index("low") == 5
    assert order[:5] == ["s0", "s1", "s2", "s3", "s4"]


@pytest.mark.parametrize(("cap", "served_before_big"), [(float("inf"), 10), (2.0, 2)])
def test_srpt_delay_cap_bounds_how_long_size_holds_a_request_back(cap, served_before_big) -> None:
    """A 100k-token prompt's size is worth ~50 s of waiting under SRPT; capped at 2 s it goes
    before every small request that arrived 2 s or more after it (one arrives per second)."""
    s = SCHEDULERS.create("priority_srpt", srpt_max_delay_s=cap)
    s.update_worker(room(), 0.0)
    s.submit(req("busy"), 0.0)
    assert sent(s.poll(0.0)) == ["busy"]
    s.submit(req("big", 0.0, prompt=100_000, out=16), 0.0)
    for t in range(10):
        s.submit(req(f"s{t}", float(t), prompt=64, out=8), float(t))
    s.on_finished("busy", "w0", 10.0)
    order = serve_one_at_a_time(s, 10.0)
    assert order.index("big") == served_before_big


def test_running_cap_and_reports() -> None:
    s = SCHEDULERS.create("fcfs")
    s.update_worker(room(max_running=2), 0.0)
    for i in range(3):
        s.submit(req(f"r{i}"), 0.0)
    assert sent(s.poll(0.0)) == ["r0", "r1"]
    s.update_worker(room(running=0, max_running=2), 0.01)  # stale report: own count holds
    assert sent(s.poll(0.01)) == []
    s.on_finished("r0", "w0", 0.02)
    assert sent(s.poll(0.02)) == ["r2"]


def test_kv_watermark_counts_own_dispatches() -> None:
    s = SCHEDULERS.create("fcfs", kv_watermark=0.9)  # 90 of 100 blocks
    s.update_worker(room(total=100, max_running=10, active_blocks=0), 0.0)
    for i in range(3):
        s.submit(req(f"r{i}", prompt=640, out=1), 0.0)  # 40 + 1 blocks each
    assert sent(s.poll(0.0)) == ["r0", "r1"]
    s.update_worker(room(total=100, max_running=10, active_blocks=0), 0.1)  # lags
    assert sent(s.poll(0.1)) == []
    s.on_finished("r0", "w0", 0.2)
    assert sent(s.poll(0.2)) == ["r2"]


def test_a_big_request_on_an_idle_worker_always_goes() -> None:
    s = SCHEDULERS.create("fcfs")
    s.update_worker(room(total=10, max_running=4), 0.0)
    s.submit(req("huge", prompt=16000), 0.0)
    assert sent(s.poll(0.0)) == ["huge"]


def test_spill_to_next_candidate_after_the_bound() -> None:
    s = SCHEDULERS.create("fcfs", spill_after_s=0.5)
    s.update_worker(room("w0"), 0.0)
    s.update_worker(room("w1"), 0.0)
    s.submit(req("busy"), 0.0)
    assert s.poll(0.0) == [Dispatch("busy", "w0")]
    s.submit(req("r", cands=[("w0", 0), ("w1", 0)]), 0.0)
    assert s.poll(0.0) == []
    assert s.poll(0.4) == []
    assert s.next_wakeup(0.4) == 0.5
    assert s.poll(0.5) == [Dispatch("r", "w1")]
    assert s.next_wakeup(0.5) is None


def _spill_with_a_hit(**kw):
    """``r`` holds 500 blocks (8,000 tokens) on busy w0, none on idle w1."""
    s = SCHEDULERS.create("fcfs", spill_after_s=0.5, prefill_tokens_per_s=10_000.0, **kw)
    s.update_worker(room("w0"), 0.0)
    s.update_worker(room("w1"), 0.0)
    s.submit(req("busy"), 0.0)
    assert s.poll(0.0) == [Dispatch("busy", "w0")]
    s.submit(req("r", prompt=8160, cands=[("w0", 500), ("w1", 0)]), 0.0)
    assert s.poll(0.0) == []
    return s


def test_a_spilled_request_gives_up_its_hit_only_after_waiting_its_prefill() -> None:
    s = _spill_with_a_hit(attention_parity_tokens=0.0)
    assert s.poll(0.5) == []  # spilled, but w1 would prefill 8,000 tokens more: 0.8 s
    assert s.next_wakeup(0.5) == pytest.approx(1.3)
    assert s.poll(1.2) == []
    assert s.poll(1.3) == [Dispatch("r", "w1")]
    assert s.next_wakeup(1.3) is None


def test_the_wait_for_a_hit_counts_the_attention_it_spares() -> None:
    """Parity 10,000: w1 prefills all 8,160 tokens, 8,160 x (1 + 4,080 / 10,000) = 11,489.28;
    w0 the last 160 after 8,000, 160 x (1 + 8,080 / 10,000) = 289.28; 11,200 more at 10k/s."""
    s = _spill_with_a_hit(attention_parity_tokens=10_000.0)
    assert s.poll(0.5) == []
    assert s.next_wakeup(0.5) == pytest.approx(0.5 + 1.12)
    assert s.poll(1.6) == []
    assert s.poll(1.62) == [Dispatch("r", "w1")]


@settings(max_examples=200, deadline=None)
@given(
    prompt=st.integers(1, 200_000),
    block=st.sampled_from([16, 64, 512]),
    cached=st.lists(st.integers(0, 500), min_size=2, max_size=2),
    parity=st.sampled_from([0.0, 1_000.0, 30_632.0]),
)
def test_prefill_time_falls_with_the_cache_and_its_differences_are_the_work_between(
    prompt: int, block: int, cached: list[int], parity: float
) -> None:
    """What the spill rule waits for (``prefill_s(c) - prefill_s(best)``) is the prefill of the
    tokens between the two cached prefixes after the shorter one, never negative, and never
    less than linear; parity 0 is tokens / rate."""
    p = SchedParams(attention_parity_tokens=parity)
    r = SchedRequest("r", 0.0, prompt, 1, [("w0", 0)], block_size=block)
    lo, hi = sorted(cached)
    a, b = (min(c * block, prompt) for c in (lo, hi))
    gap = prefill_s(r, lo, p) - prefill_s(r, hi, p)
    assert gap == pytest.approx(prefill_work(b - a, a, parity) / p.prefill_tokens_per_s, abs=1e-9)
    assert gap >= (b - a) / p.prefill_tokens_per_s - 1e-9
    if parity == 0.0:
        assert prefill_s(r, lo, p) == pytest.approx((prompt - a) / p.prefill_tokens_per_s)


def test_a_spilled_request_takes_its_hit_when_the_holder_frees_first() -> None:
    s = _spill_with_a_hit()
    assert s.poll(0.5) == []
    s.on_finished("busy", "w0", 0.9)
    assert s.poll(0.9) == [Dispatch("r", "w0")]
    assert (s.stats()["spilled"], s.stats()["spilled_off_cache"]) == (1, 0)


def test_without_paying_for_hits_every_candidate_opens_at_the_spill() -> None:
    s = _spill_with_a_hit(spill_pays_for_hits=False)
    assert s.poll(0.5) == [Dispatch("r", "w1")]


@pytest.mark.parametrize(("past_queues", "first"), [(False, "q1"), (True, "r")])
def test_a_spilled_request_leaves_its_hit_only_for_a_worker_nobody_waits_for(past_queues, first):
    """``r`` (its hit on busy w0) is open to w1 from 1.3 s, but w1 is busy too and ``q1``,
    homed there, waits: the room w1 frees goes to ``q1``, and ``r`` re-prefills there only
    once nobody waits for w1. With ``spill_past_queues`` the spilled request goes first."""
    s = _spill_with_a_hit(attention_parity_tokens=0.0, spill_past_queues=past_queues)
    s.submit(req("busy1", cands=[("w1", 0)]), 0.0)
    s.submit(req("q1", 0.1, cands=[("w1", 0)]), 0.1)
    assert sent(s.poll(0.1)) == ["busy1"]
    assert s.poll(0.5) == []  # spilled: w1 opens to it at 1.3
    assert s.poll(1.3) == []  # and has no room
    s.on_finished("busy1", "w1", 1.4)
    assert sent(s.poll(1.4)) == [first]
    if not past_queues:
        s.on_finished("q1", "w1", 1.5)
        assert sent(s.poll(1.5)) == ["r"]
    assert (s.stats()["spilled"], s.stats()["spilled_off_cache"]) == (1, 1)


@pytest.mark.parametrize(
    ("window", "polls", "expected"),
    [
        ("none", [0.0, 0.05], [["long"], []]),
        ("fixed", [0.0, 0.05, 0.1], [[], [], ["short"]]),
    ],
)
def test_window_modes_decide_arrivals_together(window, polls, expected) -> None:
    s = ThunderScheduler(SchedParams(window=window, fixed_window_s=0.1, grouping=False))
    s.update_worker(room(), 0.0)
    s.submit(req("long", 0.0, prompt=8000, out=500), 0.0)
    got = [sent(s.poll(polls[0]))]
    s.submit(req("short", 0.05, prompt=64, out=8), 0.05)
    got += [sent(s.poll(t)) for t in polls[1:]]
    assert got == expected


def test_fixed_window_wakes_the_driver_at_its_close() -> None:
    s = ThunderScheduler(SchedParams(window="fixed", fixed_window_s=0.1))
    s.update_worker(room(), 0.0)
    s.submit(req("r"), 0.0)
    assert s.poll(0.0) == []
    assert s.next_wakeup(0.0) == pytest.approx(0.1)


@pytest.mark.parametrize(
    ("prio", "waiting", "expected"),
    [(0, 0, 0.0), (1, 0, 0.0), (0, 5, 0.005), (0, 20, 0.010), (1, 20, 0.020), (1, 500, 0.050)],
)
def test_adaptive_window_length(prio: int, waiting: int, expected: float) -> None:
    assert Window(SchedParams()).length(prio, waiting, 0.0) == pytest.approx(expected)


def test_adaptive_window_is_zero_when_idle() -> None:
    s = SCHEDULERS.create("thunder")
    s.update_worker(room(), 0.0)
    s.submit(req("r"), 0.0)
    assert sent(s.poll(0.0)) == ["r"]


@pytest.mark.parametrize(
    ("deadline", "now", "reason"),
    [(1.0, 2.0, "deadline passed"), (2.1, 2.0, "deadline cannot be met")],
)
def test_deadline_rejects_at_submit(deadline: float, now: float, reason: str) -> None:
    s = SCHEDULERS.create("thunder")
    s.update_worker(room(), now)
    s.submit(req("r", now, deadline=deadline), now)  # service ~0.42 s
    assert s.poll(now) == [Reject("r", reason)]
    assert s.waiting() == 0


def test_a_request_no_worker_can_take_is_unavailable_not_late() -> None:
    """Its candidates all left: the client used to hear ``deadline`` for a request that had
    none."""
    s = SCHEDULERS.create("thunder")
    s.update_worker(room(), 0.0)
    s.remove_worker("w0", 0.0)
    s.submit(req("r"), 0.0)
    assert s.poll(0.0) == [Reject("r", "no eligible worker", unavailable=True)]
    assert s.waiting() == 0


def test_deadline_rejects_a_waiting_request_when_it_passes() -> None:
    s = SCHEDULERS.create("thunder", window="none")
    s.update_worker(room(), 0.0)
    s.submit(req("busy"), 0.0)
    s.submit(req("r", deadline=3.0), 0.0)
    assert sent(s.poll(0.0)) == ["busy"]
    assert s.next_wakeup(0.0) == 3.0
    assert s.poll(3.0) == [Reject("r", "deadline passed")]


def test_shared_prefix_counted_once_the_engine_reports_it() -> None:
    """Requests sent together each charge their uncached prompt (a shared prefix once per
    request) until the engine starts them; from then its deduplicated report counts, so the
    queue is not held by the double count."""
    s = SCHEDULERS.create("fcfs", kv_watermark=0.9)  # 90 of 100 blocks
    s.update_worker(room(total=100, max_running=10, active_blocks=0), 0.0)
    for i in range(3):
        s.submit(req(f"r{i}", prompt=640, out=1), 0.0)  # 40 + 1 blocks each
    assert sent(s.poll(0.0)) == ["r0", "r1"]
    s.on_started("r0", "w0", 0.05)
    s.on_started("r1", "w0", 0.05)
    s.update_worker(room(total=100, max_running=10, active_blocks=42), 0.1)  # one shared prefix
    assert sent(s.poll(0.1)) == ["r2"]
    s.submit(req("r3", prompt=640, out=1), 0.1)
    assert sent(s.poll(0.1)) == []  # 42 reported + 41 not started + 41 > 90


def test_output_still_to_come_is_counted_after_the_start() -> None:
    """A started run's report shows its prompt and the output so far; the output it is still
    expected to generate (expected minus decode rate x time since its start) counts too."""
    s = SCHEDULERS.create("fcfs")  # kv_watermark 1.0 of 100 blocks
    s.update_worker(room(total=100, max_running=10, active_blocks=0), 0.0)
    for i in range(3):
        s.submit(req(f"r{i}", prompt=160, out=640), 0.0)  # 10 + 40 blocks each
    assert sent(s.poll(0.0)) == ["r0", "r1"]
    s.on_started("r0", "w0", 0.05)
    s.on_started("r1", "w0", 0.05)
    s.update_worker(room(total=100, max_running=10, active_blocks=20), 0.1)  # prompts only
    assert sent(s.poll(0.1)) == []  # 20 reported + 80 blocks of output to come: full
    s.update_worker(room(total=100, max_running=10, active_blocks=40), 15.0)
    assert sent(s.poll(15.0)) == ["r2"]  # 598 of 640 tokens each: 40 + 6 to come + 50 <= 100


def test_a_run_past_its_expected_output_does_not_hide_a_fresh_runs_output() -> None:
    """Each started run's output to come is counted down to zero on its own: ``old``, 30 s
    past its expected 64 tokens, must not cancel the 40 blocks ``new`` will still generate."""
    s = SCHEDULERS.create("fcfs")  # kv_watermark 1.0 of 100 blocks
    s.update_worker(room(total=100, max_running=10, active_blocks=0), 0.0)
    s.submit(req("old", prompt=160, out=64), 0.0)  # 10 + 4 blocks
    assert sent(s.poll(0.0)) == ["old"]
    s.on_started("old", "w0", 0.0)
    s.submit(req("new", prompt=160, out=640), 30.0)  # 10 + 40 blocks
    assert sent(s.poll(30.0)) == ["new"]
    s.on_started("new", "w0", 30.0)
    s.update_worker(room(total=100, max_running=10, active_blocks=30), 30.0)
    s.submit(req("next", prompt=320, out=16), 30.0)  # 20 + 1 blocks
    # 30 reported + 40 blocks of new's output to come + 21 = 91 <= 100; one more does not fit
    assert sent(s.poll(30.0)) == ["next"]
    s.submit(req("last", prompt=160, out=16), 30.0)  # 10 + 1 blocks: 91 + 11 > 100
    assert sent(s.poll(30.0)) == []


@pytest.mark.parametrize(
    ("what_changes", "want"),
    [("a cached prefix on w0", [Dispatch("r", "w0")]), ("room on w1", [Dispatch("r", "w1")]),
     ("nothing", [])],
)  # fmt: skip
def test_a_spilled_request_is_tried_again_exactly_when_its_answer_can_change(what_changes, want):
    """A spilled request that found no room on a worker is skipped there while the worker's
    headroom and grouping are as they were, and tried again as soon as either moves: a prefix
    reported cached shrinks its need, a load report frees room."""
    s = SCHEDULERS.create("thunder", window="none", spill_after_s=0.5, grouping=True)
    for w in ("w0", "w1"):
        s.update_worker(room(w, running=1, total=100, max_running=8, active_blocks=80), 0.0)
    hashes = list(range(1000, 1020))
    # 20 prompt blocks + 1 of output against 100 - 80 = 20 free on either: no room
    s.submit(req("r", prompt=320, out=16, cands=[("w0", 0), ("w1", 0)], block_hashes=hashes), 0)
    assert s.poll(0.0) == []
    assert s.poll(1.0) == []  # spilled now, still no room anywhere
    assert set(s.entries["r"].no_room or {}) == {"w0", "w1"}
    assert s.poll(1.1) == []  # nothing changed: skipped on both, the same answer
    if what_changes == "a cached prefix on w0":
        s.on_prefix_cached("w0", hashes[:15], 1.2)  # 5 + 1 blocks to add there now
    elif what_changes == "room on w1":
        s.update_worker(room("w1", running=1, total=100, max_running=8, active_blocks=50), 1.2)
    assert s.poll(1.3) == want


def test_a_dispatch_in_a_spill_pass_unsettles_the_requests_after_it() -> None:
    """``c`` spilled and found no room anywhere: settled, skipped while nothing changes. In
    the next pass a small request ahead of it in the pool (``a``, just spilled from behind a
    head that cannot go) is sent to w0 and starts prefilling ``c``'s prefix there. The pass
    began with ``c`` settled, but that dispatch changed w0's books, so ``c`` is tried there
    again and waits for ``a``'s prefill instead of staying spilled."""
    s = SCHEDULERS.create("thunder", window="none", spill_after_s=0.5, grouping=True)
    for w in ("w0", "w1"):
        s.update_worker(room(w, running=1, total=100, max_running=8, active_blocks=80), 0.0)
    hashes = list(range(1000, 1020))
    both = [("w0", 0), ("w1", 0)]
    s.submit(req("big", prompt=640, cands=[("w0", 0)]), 0.0)  # w0's queue head: never fits
    s.submit(req("c", 1.1, prompt=320, cands=both, block_hashes=hashes), 1.1)  # 21 blocks > 20
    s.submit(req("a", 1.2, prompt=80, cands=both, block_hashes=hashes[:5]), 1.2)  # 6 blocks
    assert s.poll(1.2) == [] and s.poll(1.65) == [] and s.poll(1.66) == []
    assert s.entries["c"].state == "spill" and s.entries["c"].settled == s._gen
    assert s.entries["a"].state == "queued"  # behind "big" until it spills at 1.7
    assert s.poll(1.75) == [Dispatch("a", "w0")]
    assert s.entries["c"].state == "held"


def test_a_spilled_step_of_a_program_paused_meanwhile_is_tried_at_once() -> None:
    """The memo never hides a pause: a spilled program step that found no room is skipped
    while its books stand, but once its program is paused (here by memory pressure on the
    worker it lives on, not on the step's candidates) the next pass tries it, and the try
    parks or resumes it instead of leaving it spilled."""
    s = SCHEDULERS.create("thunder", window="none", spill_after_s=0.5)
    for w in ("w0", "w1", "w2"):
        s.update_worker(room(w, running=1, total=100, max_running=8, active_blocks=80), 0.0)
    s.submit(req("p1-0", prompt=64, cands=[("w0", 0)], program_id="p1"), 0.0)
    assert sent(s.poll(0.0)) == ["p1-0"]
    s.on_started("p1-0", "w0", 0.0)
    s.on_finished("p1-0", "w0", 0.1)  # its tool call: the program acts, living on w0
    hashes = list(range(1000, 1020))
    step = req("p1-1", prompt=320, cands=[("w1", 0), ("w2", 0)], program_id="p1",
               block_hashes=hashes)  # fmt: skip
    s.submit(step, 0.2)
    assert s.poll(0.2) == [] and s.poll(1.0) == [] and s.poll(1.1) == []
    assert s.entries["p1-1"].state == "spill" and set(s.entries["p1-1"].no_room) == {"w1", "w2"}
    assert s.programs.over_capacity("w0", 1) == ["p1"]
    s.poll(1.3)
    assert s.entries["p1-1"].state != "spill"
