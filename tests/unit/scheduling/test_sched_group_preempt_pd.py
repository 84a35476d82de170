"""Prefix grouping, preemption and the PD in-flight cap."""

from __future__ import annotations

import pytest

from thunderagent.scheduling import (
    SCHEDULERS,
    Dispatch,
    Preempt,
    SchedParams,
    SchedRequest,
    ThunderScheduler,
    WorkerRoom,
)
from thunderagent.scheduling.preemption import PREEMPTED_REMEMBERED, Preemptor, Running

HASHES = list(range(101, 109))  # 8 blocks, none cached


def req(rid, at=0.0, prompt=128, out=16, cands=(("w0", 0),), prio=0, **kw) -> SchedRequest:
    return SchedRequest(rid, at, prompt, out, list(cands), priority=prio, **kw)


def room(w="w0", max_running=8, role="both", total=0) -> WorkerRoom:
    return WorkerRoom(w, 0, 0, 0, total, max_running, role)


def sent(actions) -> list[str]:
    return [a.request_id for a in actions if isinstance(a, Dispatch)]


def grouping_scheduler() -> ThunderScheduler:
    s = ThunderScheduler(SchedParams(window="none", group_min_blocks=4, group_timeout_s=2.0))
    s.update_worker(room(), 0.0)
    for rid in ("a", "b", "c"):
        s.submit(req(rid, block_hashes=HASHES), 0.0)
    return s


def test_grouping_sends_one_and_releases_the_rest_when_cached() -> None:
    s = grouping_scheduler()
    assert sent(s.poll(0.0)) == ["a"]
    assert s.waiting() == 2
    s.on_prefix_cached("w0", HASHES, 0.3)
    assert sent(s.poll(0.3)) == ["b", "c"]
    st = s.stats()
    assert (st["grouped_requests"], st["group_released_cached"]) == (2, 2)
    assert st["prefill_tokens_saved"] == 2 * 8 * 16


def test_grouping_releases_the_rest_at_the_leaders_first_token() -> None:
    """A worker without KV events never says the blocks are cached; the leader's first token
    says its prefill is done, and the engine has them (its events would say so now)."""
    s = grouping_scheduler()
    assert sent(s.poll(0.0)) == ["a"]
    s.on_started("a", "w0", 0.3)
    assert sent(s.poll(0.3)) == ["b", "c"]
    st = s.stats()
    assert (st["grouped_requests"], st["group_released_cached"]) == (2, 2)
    assert st["prefill_tokens_saved"] == 2 * 8 * 16
    s.on_prefix_cached("w0", HASHES, 0.4)  # the events arriving after change nothing
    assert s.poll(0.4) == []


def test_grouping_releases_on_timeout_without_credit() -> None:
    s = grouping_scheduler()
    assert sent(s.poll(0.0)) == ["a"]
    assert s.next_wakeup(0.0) == 2.0
    assert s.poll(1.9) == []
    assert sent(s.poll(2.0)) == ["b", "c"]
    assert s.stats()["group_released_timeout"] == 2
    assert s.stats()["prefill_tokens_saved"] == 0


def test_grouping_needs_enough_shared_blocks() -> None:
    s = ThunderScheduler(SchedParams(window="none", group_min_blocks=4))
    s.update_worker(room(), 0.0)
    s.submit(req("a", block_hashes=[1, 2, 3]), 0.0)
    s.submit(req("b", block_hashes=[1, 2, 3, 4, 5]), 0.0)
    assert sent(s.poll(0.0)) == ["a", "b"]


def preempt_setup(**knobs) -> ThunderScheduler:
    s = SCHEDULERS.create("preempt", **knobs)
    s.update_worker(room(max_running=2), 0.0)
    s.submit(req("long1", prompt=1000, out=2000, prio=1), 0.0)
    s.submit(req("long2", prompt=1000, out=4000, prio=1), 0.0)
    assert sent(s.poll(0.0)) == ["long1", "long2"]
    s.on_started("long1", "w0", 0.1)
    s.on_started("long2", "w0", 0.1)
    s.submit(req("short", 1.0, prompt=64, out=8), 1.0)
    return s


def test_preemption_fires_and_picks_the_longest_victim() -> None:
    s = preempt_setup()
    assert s.poll(1.0) == [Preempt("long2", "w0", "for short"), Dispatch("short", "w0")]
    # the driver aborts long2 and re-submits it as a continuation; it waits its turn
    s.submit(req("long2", 0.0, prompt=1000, out=4000, prio=1, generated_tokens=36), 1.0)
    assert s.poll(1.0) == []
    assert s.stats()["preempted"] == 1


@pytest.mark.parametrize(
    "knobs",
    [{"preempt_gain_ratio": 1000.0}, {"preempt_min_remaining_tokens": 5000}, {"preemption": False}],
)
def test_preemption_respects_the_threshold(knobs) -> None:
    s = preempt_setup(**knobs)
    assert s.poll(1.0) == []


def test_preemption_needs_a_less_urgent_victim() -> None:
    s = SCHEDULERS.create("preempt")
    s.update_worker(room(max_running=1), 0.0)
    s.submit(req("long", prompt=1000, out=4000, prio=0), 0.0)
    assert sent(s.poll(0.0)) == ["long"]
    s.on_started("long", "w0", 0.1)
    s.submit(req("batch", 1.0, prompt=64, out=8, prio=1), 1.0)
    assert s.poll(1.0) == []


def test_preemption_rate_limit() -> None:
    p = SchedParams(preemption=True, preempt_max_per_s=1.0)
    pre = Preemptor(p)
    victim = Running(req("v", prompt=1000, out=4000, prio=1), "w0", 0, 100, 0.0, started_at=0.0)
    short = req("s", prompt=64, out=8)
    assert pre.pick(short, 0, [victim], 1.0) is victim
    pre.record(victim, 1.0)
    assert pre.pick(short, 0, [victim], 1.5) is None
    assert pre.allowed_at("w0") == 2.0
    assert pre.pick(short, 0, [victim], 2.0) is victim


@pytest.mark.parametrize(("parity", "preempts"), [(0.0, True), (10_000.0, False)])
def test_a_victim_s_resume_counts_the_attention_of_its_lost_tail(parity, preempts) -> None:
    """The victim has 100,000 tokens of context (99,960 prompt + 40 decoded) and 99 s of decode
    left (3,960 tokens at 40/s); resuming re-prefills its last 10 % (10,000 tokens). Linear,
    the cost is 0.2064 s (short's 64-token prefill + 8 tokens of decode) + 1.0 s: 20 x 1.21 =
    24 s < 99 s, preempt. At parity 10,000 the lost tail attends to the 90,000 before it:
    10,000 x (1 + 95,000 / 10,000) = 105,000 tokens of work, 10.5 s; 20 x 10.71 = 214 s > 99 s."""
    p = SchedParams(preemption=True, preempt_gain_ratio=20.0, attention_parity_tokens=parity)
    victim = Running(req("v", prompt=99_960, out=4000, prio=1), "w0", 0, 100, 0.0, started_at=0.0)
    got = Preemptor(p).pick(req("s", prompt=64, out=8), 0, [victim], 1.0)
    assert (got is victim) is preempts


def pd_scheduler(cap: int) -> ThunderScheduler:
    s = SCHEDULERS.create("pd_capped", pd_max_inflight=cap, window="none")
    s.update_worker(room("p0", role="prefill"), 0.0)
    s.update_worker(room("d0", role="decode"), 0.0)
    s.update_worker(room("d1", role="decode", max_running=1), 0.0)
    for i in range(3):  # the router ranks every worker of the model
        s.submit(req(f"r{i}", cands=[("d0", 9), ("p0", 0), ("d1", 0)]), 0.0)
    return s


def test_pd_dispatch_names_prefill_and_decode_workers() -> None:
    s = pd_scheduler(cap=0)
    assert s.poll(0.0) == [
        Dispatch("r0", "p0", "d0"),  # both idle: tie broken by id
        Dispatch("r1", "p0", "d1"),  # d0 runs 1/8, d1 0/1: the smaller share
        Dispatch("r2", "p0", "d0"),  # d1 is full
    ]


def test_the_decode_worker_serves_the_requests_model() -> None:
    """Only a candidate of the request (a worker of its model, with its LoRA adapter) decodes
    it: d1 serves another model or lacks the adapter, so it is not picked though it is idle,
    and with d0 full the request waits rather than go there."""
    s = SCHEDULERS.create("pd_capped", window="none")
    s.update_worker(room("p0", role="prefill"), 0.0)
    s.update_worker(room("d0", role="decode", max_running=1), 0.0)
    s.update_worker(room("d1", role="decode"), 0.0)
    for i in range(2):
        s.submit(req(f"r{i}", cands=[("p0", 0), ("d0", 0)]), 0.0)
    assert s.poll(0.0) == [Dispatch("r0", "p0", "d0")]  # r1 waits for d0, never d1


def test_pd_cap_holds_prefills_until_a_transfer_lands() -> None:
    s = pd_scheduler(cap=2)
    assert sent(s.poll(0.0)) == ["r0", "r1"]
    s.on_started("r0", "p0", 0.2)  # prefill done, transfer still in flight
    assert s.poll(0.2) == []
    assert s.stats()["pd_inflight"] == 2
    s.on_transfer_done("r0", "d0", 0.3)
    assert sent(s.poll(0.3)) == ["r2"]


def test_preemption_counts_are_bounded_and_the_recent_ones_kept() -> None:
    """Each request's preemptions are counted (the per-request cap); the table keeps the most
    recent ``PREEMPTED_REMEMBERED`` requests, so a scheduler that runs for months stays small."""
    p = SchedParams(preemption=True, preempt_max_per_s=1e9)
    pre = Preemptor(p)
    n = PREEMPTED_REMEMBERED + 10
    for i in range(n):
        pre.record(Running(req(f"v{i}"), "w0", 0, 1, 0.0, started_at=0.0), float(i))
    pre.record(Running(req(f"v{n - 1}"), "w0", 0, 1, 0.0, started_at=0.0), float(n))
    assert len(pre.counts) == PREEMPTED_REMEMBERED
    assert "v0" not in pre.counts and pre.counts[f"v{n - 1}"] == 2
