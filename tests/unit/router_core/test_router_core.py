"""The router core: what it books where, what it learns from run ends, what it forgets."""

from __future__ import annotations

import msgspec

from thunderagent.fleet.views import worker_view
from thunderagent.fleet.workers import CARRIED_LIMIT
from thunderagent.hashing import BlockHasher
from thunderagent.router_core import RouterCore, RouterParams
from thunderagent.routing.cost import queued_prefill_tokens
from thunderagent.schemas import (
    BlocksRemoved,
    BlocksStored,
    KvEventBatch,
    LoadReport,
    WorkerRegistration,
)

BS = 16
HASHER = BlockHasher(BS)


def core(**params) -> RouterCore:
    c = RouterCore(RouterParams(**{"policy": "thunder", "seed": 1, **params}))
    for w in ("w0", "w1"):
        reg = WorkerRegistration(
            worker_id=w, model="m", engine_url="", block_size=BS, kv_capacity_blocks=1000,
            lease_s=10.0, registered_at=1.0,
        )  # fmt: skip
        c.register(reg, 0.0)
        c.report(LoadReport(worker_id=w, ts=0.0, running=0, queued=0, kv_used_blocks=0,
                            kv_total_blocks=1000, prefill_backlog_tokens=0), 0.0)  # fmt: skip
    return c


def route(c: RouterCore, rid: str, tokens: list[int], now: float = 1.0):
    return c.route(
        request_id=rid, model="m", hashes=c.hash_tokens(tokens, BS), prompt_tokens=len(tokens),
        block_size=BS, expected_output_tokens=16, now=now,
    )  # fmt: skip


PROMPT = list(range(100, 100 + 8 * BS)) + [1]


def test_bookings_follow_the_worker_that_got_the_request() -> None:
    c = core()
    first = route(c, "a", PROMPT)
    other = next(
        x.worker_id for x in first.decision.candidates if x.worker_id != first.decision.worker_id
    )
    c.on_dispatched("a", other, 1.0)  # the scheduler spilled it to its second choice
    again = route(c, "b", PROMPT)
    assert again.query.overlaps == {other: 8}, "the overlay credits where it actually went"
    assert c.fleet.get(other).assigned_since_report == 1
    assert c.fleet.get(other).assigned_prefill_since_report == len(PROMPT)


def test_only_a_policy_that_predicts_on_route_is_shown_the_overlay() -> None:
    """ThunderAgent's overlay of prompts just dispatched is its own design: Dynamo 1.6.1 adds a
    routed request's blocks before their events only with ``router_predicted_ttl_secs`` set
    (off by default), llm-d's precise scorer only with speculative indexing. Such a peer sees
    the engines' confirmed prefixes; what the router books and tells the workers and the
    scheduler (the decision's candidates) still counts the overlay."""
    for policy, params, shown in [("thunder", {}, True), ("dynamo_kv", {}, False),
                                  ("dynamo_kv", {"predict_on_route": True}, True),
                                  ("llm_d", {"prefix": "precise"}, False)]:  # fmt: skip
        c = core(policy=policy, policy_params=params)
        route(c, "a", PROMPT)
        c.on_dispatched("a", "w1", 1.0)
        again = route(c, "b", PROMPT)
        assert again.query.overlaps == ({"w1": 8} if shown else {}), (policy, params)
        assert again.expected == {"w1": 8} and again.confirmed == {}
        assert {x.worker_id: x.overlap_blocks for x in again.decision.candidates} == {
            "w0": 0,
            "w1": 8,
        }
        c.on_dispatched("b", again.decision.worker_id, 1.1)
        booked = c.fleet.get(again.decision.worker_id).assigned_prefill_since_report
        assert booked == (
            len(PROMPT) if again.decision.worker_id == "w0" else 2 * len(PROMPT) - 8 * BS
        )


def test_a_run_that_ends_before_its_dispatch_notice_is_still_booked() -> None:
    """An instant engine: the run's end overtakes the scheduler's notice. Its prefix still
    lands in the overlay, and its work stops counting as queued on the worker."""
    c = core()
    route(c, "a", PROMPT)
    c.on_finished("a", "w1", 1.1, cached_tokens=0, completion_tokens=1)
    assert c.fleet.get("w1").assigned_since_report == 0
    assert c.fleet.get("w1").assigned_prefill_since_report == 0
    assert not c.on_dispatched("a", "w1", 1.2), "the late notice books nothing twice"
    again = route(c, "b", PROMPT)
    assert again.query.overlaps == {"w1": 8}
    assert again.decision.worker_id == "w1", "nothing queued there: its cache wins"


def test_a_prompt_stops_counting_as_queued_prefill_at_its_first_token() -> None:
    """w0 holds the prompt's 8 blocks but was just sent 4,000 uncached tokens: queued work that
    outweighs the 128 tokens its cache saves. Once that run's first token is out, the engine
    has prefilled it and the cache wins again, without waiting for w0's next load report."""
    c = core()
    hashes = HASHER.hash_tokens(PROMPT)
    c.apply_kv(KvEventBatch(worker_id="w0", seq=0, ts=0.0, events=[
        BlocksStored(hashes=hashes.primary, check_hashes=hashes.check)]), 0.5)  # fmt: skip
    route(c, "big", list(range(10_000, 14_000)))
    c.on_dispatched("big", "w0", 1.0)
    assert route(c, "a", PROMPT).decision.worker_id == "w1"
    c.on_started("big", "w0", 1.05)
    w0 = c.fleet.get("w0")
    assert (w0.assigned_prefill_since_report, w0.assigned_since_report) == (0, 1)
    assert w0.assigned_kv_since_report == 4000, "its KV stays until a report covers it"
    assert route(c, "b", PROMPT).decision.worker_id == "w0"
    c.on_started("big", "w0", 1.06)  # a repeated start books nothing
    c.on_started("ghost", "w0", 1.06)  # nor does one this replica did not route
    assert w0.assigned_prefill_since_report == 0
    c.on_finished("big", "w0", 2.0)
    assert (w0.assigned_since_report, w0.assigned_kv_since_report) == (0, 0)


def test_a_reported_backlog_shrinks_as_the_runs_in_it_start() -> None:
    """The report came while two prompts sent to w0 were still queued: its backlog counts them
    and its running requests' KV does not. As each starts, w0's backlog drops by that prompt
    and its KV counts as held, until it ends or the next report, which starts the count again;
    a report of an empty queue forgets what was carried."""
    c = core()
    for rid, n in (("a", 3000), ("b", 1000)):
        route(c, rid, list(range(n * 10, n * 11)))
        c.on_dispatched(rid, "w0", 1.0)
    report = LoadReport(worker_id="w0", ts=1.1, running=0, queued=2, kv_used_blocks=0,
                        kv_total_blocks=1000, prefill_backlog_tokens=4000)  # fmt: skip
    c.report(report, 1.1)
    w0 = c.fleet.get("w0")

    def queued() -> float:  # what thunder's cost sees as queued ahead on w0
        return queued_prefill_tokens(worker_view(w0), 0.0)

    assert (queued(), w0.assigned_prefill_since_report) == (4000, 0)
    assert worker_view(w0).pending_kv_tokens == 0
    c.on_started("a", "w0", 1.2)
    assert queued() == 1000
    assert worker_view(w0).pending_kv_tokens == 3000, "a's KV is held now"
    assert worker_view(w0).prefill_tokens == 4000, "the report itself, for peers that poll"
    c.on_started("a", "w0", 1.2)  # once only
    c.on_finished("b", "w0", 1.3)  # an end without a start seen: its prefill is done too
    assert (queued(), worker_view(w0).pending_kv_tokens) == (0, 3000)
    c.on_finished("a", "w0", 1.35)
    assert worker_view(w0).pending_kv_tokens == 0, "a ended: its KV is no one's now"
    c.report(msgspec.structs.replace(report, ts=1.4, prefill_backlog_tokens=4000), 1.4)
    assert queued() == 4000, "a new report says what is queued now"
    route(c, "d", list(range(50_000, 50_500)))
    c.on_dispatched("d", "w0", 1.45)
    c.report(msgspec.structs.replace(report, ts=1.5, prefill_backlog_tokens=0), 1.5)
    assert not w0.carried
    c.on_started("d", "w0", 1.6)
    assert w0.started_since_report == 0
    c.report(msgspec.structs.replace(report, ts=1.7, prefill_backlog_tokens=-1), 1.7)
    assert worker_view(w0).prefill_tokens == -1, "an engine that reports no backlog stays unknown"


def test_what_is_carried_over_reports_is_bounded() -> None:
    """Starts this router never hears of must not pile up while the worker stays busy."""
    w0 = core().fleet.get("w0")
    report = LoadReport(worker_id="w0", ts=1.0, running=0, queued=1, kv_used_blocks=0,
                        kv_total_blocks=1000, prefill_backlog_tokens=100)  # fmt: skip
    for i in range(CARRIED_LIMIT):
        w0.assign(f"r{i}", 100, 100)
        w0.take_report(report, 1.0)
    assert len(w0.carried) == CARRIED_LIMIT
    w0.assign("last", 100, 100)
    w0.take_report(report, 1.1)
    assert not w0.carried, "past the limit the carry starts afresh"


def test_a_start_that_overtakes_the_dispatch_notice_books_the_run_first() -> None:
    c = core(policy="dynamo_kv")
    route(c, "a", PROMPT)
    c.on_started("a", "w1", 1.1)
    assert c.policy.active_blocks("w1") == 8 and c.policy.active_prefill_tokens("w1") == 0
    assert c.fleet.get("w1").assigned_since_report == 1
    assert c.fleet.get("w1").assigned_prefill_since_report == 0
    assert not c.on_dispatched("a", "w1", 1.2), "the late notice books nothing twice"


def test_a_false_hit_is_counted_and_leaves_the_index_as_the_events_left_it() -> None:
    """The run that found blocks missing prefilled them: its worker holds them when it ends.
    Dropping them then (the old rule) hid the worker's cache behind a stale-looking entry."""
    c = core()
    hashes = HASHER.hash_tokens(PROMPT)
    c.apply_kv(KvEventBatch(worker_id="w0", seq=0, ts=0.0, events=[
        BlocksStored(hashes=hashes.primary, check_hashes=hashes.check)]), 0.5)  # fmt: skip
    routed = route(c, "a", PROMPT)
    assert routed.query.overlaps["w0"] == 8 and routed.confirmed["w0"] == 8
    c.on_dispatched("a", "w0", 1.0)
    verdict = c.on_finished("a", "w0", 2.0, cached_tokens=3 * BS, completion_tokens=16)
    assert verdict.false_hit and not verdict.missed_hit
    assert c.feeder.index.overlap(hashes.primary, hashes.check) == {"w0": 8}
    assert c.window.predicted_tokens == 8 * BS and c.window.hit_tokens == 3 * BS
    assert c.window.false_hit_rate() == 5 / 8


def test_requests_batched_on_a_prefix_in_flight_keep_the_workers_cache_in_view() -> None:
    """Two requests sharing a first block arrive together: the second is predicted to hit what
    the first is about to compute (the in-flight overlay), the engine prefills both in one batch
    and reports no hit for either. Every prompt of the workload starts with that block, so
    dropping it would hide every prefix the worker holds under it."""
    c = core()
    shared = list(range(500, 500 + BS))
    first = shared + list(range(1000, 1000 + 4 * BS)) + [1]
    second = shared + list(range(2000, 2000 + 4 * BS)) + [1]
    a = route(c, "a", first)
    worker = a.decision.worker_id
    c.on_dispatched("a", worker, 1.0)
    b = route(c, "b", second)
    assert b.query.overlaps.get(worker) == 1, "the overlay predicts the shared block"
    c.on_dispatched("b", worker, 1.0)
    for seq, tokens in enumerate((first, second)):  # the batch's prefill stores both prompts
        h = HASHER.hash_tokens(tokens)
        c.apply_kv(KvEventBatch(worker_id=worker, seq=seq, ts=1.5, events=[
            BlocksStored(hashes=h.primary, check_hashes=h.check)]), 1.5)  # fmt: skip
    c.on_finished("a", worker, 2.0, cached_tokens=0, completion_tokens=4)
    verdict = c.on_finished("b", worker, 2.0, cached_tokens=0, completion_tokens=4)
    assert verdict.false_hit
    h = HASHER.hash_tokens(first)
    assert c.feeder.gpu_index.overlap(h.primary, h.check) == {worker: 5}
    later = route(c, "c", first, now=60.0)  # long after the overlay's TTL
    assert later.confirmed == {worker: 5} and later.decision.worker_id == worker


def test_reported_evictions_also_leave_the_in_flight_overlay() -> None:
    c = core()
    routed = route(c, "a", PROMPT)
    worker = routed.decision.worker_id
    c.on_dispatched("a", worker, 1.0)
    assert route(c, "b", PROMPT).query.overlaps[worker] == 8
    hashes = HASHER.hash_tokens(PROMPT)
    c.apply_kv(KvEventBatch(worker_id=worker, seq=0, ts=2.0,
                            events=[BlocksRemoved(hashes=hashes.primary)]), 2.0)  # fmt: skip
    assert route(c, "c", PROMPT, now=2.1).query.overlaps == {}


def test_the_policy_gets_feedback_once_per_window() -> None:
    c = core(feedback_interval_s=1.0)
    scale = c.policy.load_scale
    assert not c.tick(0.0)  # the first tick starts the window
    c.report(LoadReport(worker_id="w0", ts=0.5, running=50, queued=0, kv_used_blocks=0,
                        kv_total_blocks=1000), 0.5)  # fmt: skip
    assert not c.tick(0.5)
    assert c.tick(1.0)  # depths 50 vs 0: imbalanced, the credit decays faster
    assert c.policy.load_scale < scale


def test_expected_output_follows_finished_runs_unless_the_client_says() -> None:
    c = core(prior_output_tokens=100, output_alpha=0.5)
    assert c.expected_output(max_tokens=4096) == 100
    c.on_finished("x", "w0", 1.0, completion_tokens=300)  # the first sample replaces the prior
    c.on_finished("y", "w0", 1.0, completion_tokens=100)
    assert c.expected_output(max_tokens=4096) == 200
    assert c.expected_output(max_tokens=50) == 50  # never past the budget
    assert c.expected_output(max_tokens=4096, hint=7) == 7


def test_the_policy_sees_how_full_each_cache_is_from_the_index() -> None:
    """w0 holds the prompt's first block in a cache the index shows full; w1's is empty. The
    block it saves wins the request for w0 until the blocks it would evict count."""
    filler = HASHER.hash_tokens(PROMPT[:BS] + list(range(5000, 5000 + 11 * BS)))
    for weight, expected in ((0.0, "w0"), (0.5, "w1")):
        c = core(policy_params={"evict_weight": weight})
        for w in ("w0", "w1"):
            c.report(LoadReport(worker_id=w, ts=0.5, running=0, queued=0, kv_used_blocks=0,
                                kv_total_blocks=12, prefill_backlog_tokens=0), 0.5)  # fmt: skip
        c.apply_kv(KvEventBatch(worker_id="w0", seq=0, ts=0.5, events=[
            BlocksStored(hashes=filler.primary, check_hashes=filler.check)]), 0.5)  # fmt: skip
        routed = route(c, "a", PROMPT)
        assert routed.query.overlaps == {"w0": 1}
        assert routed.decision.worker_id == expected, weight


def _load(c: RouterCore, worker: str, now: float, queued: int) -> None:
    c.report(LoadReport(worker_id=worker, ts=now, running=0, queued=queued, kv_used_blocks=0,
                        kv_total_blocks=1000, prefill_backlog_tokens=0), now)  # fmt: skip


def test_a_policy_that_polls_engine_load_reads_one_report_per_poll() -> None:
    """SMG polls engine load every 10 s (``--load-monitor-interval``): a router running its
    policy, live or replayed, takes the first report after each 10 s boundary; the reports in
    between renew the worker's lease and nothing else, and what it sent meanwhile stays counted
    as its own dispatches (SMG's since-poll work)."""
    c = core(policy="smg_cache_aware")
    sent = route(c, "a", PROMPT, now=1.0).decision.worker_id
    c.on_dispatched("a", sent, 1.0)
    for w in ("w0", "w1"):
        _load(c, w, 5.0, queued=9)
    assert [c.fleet.get(w).load.queued for w in ("w0", "w1")] == [0, 0], "between polls"
    assert c.fleet.get(sent).assigned_since_report == 1
    assert c.expire(12.0) == [], "the unread reports still renewed the 10 s leases"
    for w in ("w0", "w1"):
        _load(c, w, 10.1, queued=7)
    assert [c.fleet.get(w).load.queued for w in ("w0", "w1")] == [7, 7], "the poll at 10 s"
    assert c.fleet.get(sent).assigned_since_report == 0
    _load(c, "w0", 19.9, queued=3)
    assert c.fleet.get("w0").load.queued == 7


def test_policies_that_do_not_poll_read_every_report() -> None:
    for c in (core(), core(policy="smg_cache_aware", policy_params={"load_monitor_interval_s": 0})):
        _load(c, "w0", 5.0, queued=9)
        assert c.fleet.get("w0").load.queued == 9, c.policy.name
