"""Workers whose engines publish no KV events, for a policy that keeps its own record of them
(Dynamo's approximate mode): the prompts this router had prefilled there, entered at each run's
first token and kept ``approximate_ttl_s``. ThunderAgent's own policy keeps none: the adapters
announce such a cache on the KV stream (``tests/unit/sglang/test_sglang_shadow.py``)."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from thunderagent.router_core import RouterCore, RouterParams
from thunderagent.schemas import BlocksStored, KvEventBatch, LoadReport, WorkerRegistration

BS = 16
PROMPT = list(range(100, 100 + 8 * BS)) + [1]
OTHER = list(range(5000, 5000 + 8 * BS)) + [1]


def registration(worker_id: str, kv_events: bool) -> WorkerRegistration:
    return WorkerRegistration(
        worker_id=worker_id, model="m", engine_url="", block_size=BS, kv_capacity_blocks=1000,
        lease_s=10.0, registered_at=1.0, kv_events=kv_events,
    )  # fmt: skip


def core(kv_events: bool = False, **params) -> RouterCore:
    params = {"policy": "dynamo_kv", "seed": 1, "inflight_ttl_s": 5.0, **params}
    c = RouterCore(RouterParams(**params))
    for w in ("w0", "w1"):
        c.register(registration(w, kv_events), 0.0)
        c.report(LoadReport(worker_id=w, ts=0.0, running=0, queued=0, kv_used_blocks=0,
                            kv_total_blocks=1000, prefill_backlog_tokens=0), 0.0)  # fmt: skip
    return c


def route(c: RouterCore, rid: str, tokens: list[int], now: float):
    return c.route(
        request_id=rid, model="m", hashes=c.hash_tokens(tokens, BS), prompt_tokens=len(tokens),
        block_size=BS, expected_output_tokens=16, now=now,
    )  # fmt: skip


def serve(c: RouterCore, rid: str, tokens: list[int], worker: str, now: float) -> None:
    route(c, rid, tokens, now)
    c.on_dispatched(rid, worker, now)
    c.on_started(rid, worker, now + 0.1)
    c.on_finished(rid, worker, now + 0.2, cached_tokens=0, completion_tokens=4)


def test_a_prompt_prefilled_there_outlives_the_in_flight_overlay() -> None:
    c = core()
    serve(c, "a", PROMPT, "w1", 1.0)
    later = route(c, "b", PROMPT, 60.0)  # the overlay's 5 s are long gone
    assert later.query.overlaps == {"w1": 8}
    assert later.confirmed == {"w1": 8}, "the engine's cache as far as anyone can know it"
    assert later.decision.worker_id == "w1"
    assert route(c, "c", PROMPT, 121.09).confirmed == {"w1": 8}
    assert route(c, "d", PROMPT, 121.2).query.overlaps == {}, "gone after approximate_ttl_s"


def test_thunder_keeps_no_record_of_its_own() -> None:
    c = core(policy="thunder")
    serve(c, "a", PROMPT, "w1", 1.0)
    assert not c.approximate.holds_any()
    assert route(c, "b", PROMPT, 60.0).confirmed == {}, "the adapter's announcements say it"


def test_with_kv_events_only_the_events_confirm_a_prefix() -> None:
    c = core(kv_events=True)
    serve(c, "a", PROMPT, "w1", 1.0)
    assert route(c, "b", PROMPT, 60.0).query.overlaps == {}, "no event said w1 holds it"


def test_a_run_dispatched_but_not_started_is_only_in_flight() -> None:
    """Its prompt is not prefilled yet: a follower predicted on it goes through the scheduler,
    as it does for a worker with events (``may_dispatch_directly``)."""
    c = core()
    c.remove("w1")
    route(c, "a", PROMPT, 1.0)
    c.on_dispatched("a", "w0", 1.0)
    follower = route(c, "b", PROMPT, 1.5)
    assert follower.query.overlaps == {"w0": 8} and follower.confirmed == {}
    assert not follower.may_dispatch_directly(None, None)
    c.on_started("a", "w0", 2.0)
    assert route(c, "c", PROMPT, 2.5).confirmed == {"w0": 8}


def test_a_run_that_ended_without_a_start_notice_still_counts_once_completed() -> None:
    c = core()
    route(c, "a", PROMPT, 1.0)
    c.on_finished("a", "w0", 1.2, cached_tokens=0, completion_tokens=1)
    assert route(c, "b", PROMPT, 60.0).confirmed == {"w0": 8}


def test_a_run_that_failed_before_its_first_token_enters_nothing() -> None:
    c = core()
    route(c, "a", PROMPT, 1.0)
    c.on_dispatched("a", "w0", 1.0)
    c.on_finished("a", "w0", 1.2)  # aborted or failed: no usage
    assert route(c, "b", PROMPT, 60.0).confirmed == {}
    c.on_started("a", "w0", 1.3)  # a late start of the ended run books nothing
    assert route(c, "c", PROMPT, 61.0).confirmed == {}


def test_each_prefill_renews_the_prompt_ttl() -> None:
    c = core()
    serve(c, "a", PROMPT, "w0", 1.0)
    serve(c, "b", PROMPT, "w0", 100.0)
    assert route(c, "c", PROMPT, 200.0).confirmed == {"w0": 8}


def test_a_worker_that_leaves_or_comes_back_with_events_is_forgotten() -> None:
    c = core()
    serve(c, "a", PROMPT, "w0", 1.0)
    serve(c, "b", OTHER, "w1", 1.0)
    c.register(msgspec.structs.replace(registration("w0", True), registered_at=2.0), 2.0)
    assert route(c, "c", PROMPT, 60.0).confirmed == {}, "w0's own events speak for it now"
    c.remove("w1")
    c.register(registration("w1", False), 61.0)
    assert route(c, "d", OTHER, 62.0).confirmed == {}


def test_the_policy_sees_how_full_an_eventless_cache_is() -> None:
    c = core()
    serve(c, "a", PROMPT, "w0", 1.0)
    views = {v.worker_id: v.cached_blocks for v in c._views(c.fleet.for_model("m", None))}
    assert views == {"w0": 8, "w1": 0}


def test_a_mixed_fleet_reads_each_worker_its_own_way() -> None:
    c = core()
    c.register(registration("w2", True), 0.0)
    hashes = c.hash_tokens(PROMPT, BS)
    c.apply_kv(KvEventBatch(worker_id="w2", seq=0, ts=0.0, events=[
        BlocksStored(hashes=hashes.primary[:4], check_hashes=hashes.check[:4])]), 0.5)  # fmt: skip
    serve(c, "a", PROMPT, "w0", 1.0)
    assert route(c, "b", PROMPT, 60.0).confirmed == {"w0": 8, "w2": 4}


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 3),  # which prompt
            st.sampled_from(["w0", "w1"]),
            st.floats(0.0, 200.0, allow_nan=False),  # gap before this run
            st.booleans(),  # completed (else failed before its first token)
        ),
        max_size=25,
    )
)
def test_a_prefix_counts_as_cached_only_where_it_was_prefilled_within_the_ttl(runs) -> None:
    """Against a model (per worker, each block's last prefill): every prompt's confirmed
    overlap on every worker is its leading blocks prefilled there less than ``ttl`` ago,
    whatever the other worker does with them. Prompt 3 forks from prompt 0 after one block."""
    ttl = 120.0
    prompts = [list(range(1000 * (i + 1), 1000 * (i + 1) + (i + 2) * BS)) + [7] for i in range(3)]
    prompts.append(prompts[0][:BS] + list(range(9000, 9000 + 4 * BS)) + [7])
    c, now = core(approximate_ttl_s=ttl), 1.0
    keys = [c.hash_tokens(p, BS).primary for p in prompts]
    last: dict[tuple[str, int], float] = {}
    for n, (p, worker, gap, completed) in enumerate(runs):
        now += gap
        route(c, f"r{n}", prompts[p], now)
        c.on_dispatched(f"r{n}", worker, now)
        if completed:
            c.on_started(f"r{n}", worker, now)
            c.on_finished(f"r{n}", worker, now, cached_tokens=0, completion_tokens=1)
            last.update(((worker, k), now) for k in keys[p])
        else:
            c.on_finished(f"r{n}", worker, now)
    probe = now + 1.0
    for p, prompt in enumerate(prompts):
        expected = {}
        for w in ("w0", "w1"):
            held = 0
            while held < len(keys[p]) and probe - last.get((w, keys[p][held]), -1e9) < ttl:
                held += 1
            if held:
                expected[w] = held
        assert route(c, f"probe{p}", prompt, probe).confirmed == expected


def test_a_resend_while_the_run_prefills_keeps_the_run_recorded() -> None:
    """A client resends a request whose run is still prefilling; the router routes the resend
    and the scheduler tells it to let that routing go (``forget``). The run it already sent
    still enters the record at its first token."""
    c = core()
    route(c, "a", PROMPT, 1.0)
    c.on_dispatched("a", "w1", 1.0)
    route(c, "a", PROMPT, 2.0)  # the resend
    c.forget("a")
    c.on_started("a", "w1", 2.5)
    assert route(c, "b", PROMPT, 60.0).confirmed == {"w1": 8}
