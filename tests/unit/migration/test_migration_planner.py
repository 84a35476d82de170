"""The migration planner on constructed situations: exact actions, hysteresis, replica cap,
cost, failures, drains and drops."""

from __future__ import annotations

import pytest

from thunderagent.migration import (
    Drop,
    Migrate,
    MigrationParams,
    MigrationPlanner,
    ParamError,
    Replicate,
    RouteSeen,
    WorkerSeen,
    estimate,
)

P = 0xABC
BLOCKS = 64
MIB_128 = 64 * 16 * 131_072  # 64 blocks x 16 tokens x 128 KiB per token


PARITY = MigrationParams().attention_parity_tokens


def busy(wid: str, backlog_tokens: int = 30_000, queued: int = 3, live: int = 0) -> WorkerSeen:
    """Saturated: a queue and over 1.5 s of queued prefill at the default 20k tokens/s."""
    return WorkerSeen(wid, "m", running=4, queued=queued, prefill_backlog_tokens=backlog_tokens,
                      live_tokens=live, kv_total_blocks=1000, block_size=16)  # fmt: skip


def idle(wid: str, running: int = 0, live: int = 0) -> WorkerSeen:
    return WorkerSeen(wid, "m", running=running, queued=0, prefill_backlog_tokens=0,
                      live_tokens=live, kv_total_blocks=1000, block_size=16)  # fmt: skip


def demand(planner: MigrationPlanner, t0: float, rate: float, seconds: float, *,
           prefix: int = P, worker: str = "w0", blocks: int = BLOCKS) -> None:  # fmt: skip
    """``rate * seconds`` hits spread over (t0, t0 + seconds]: all inside a window ending there."""
    n = round(rate * seconds)
    for i in range(n):
        planner.observe_route(RouteSeen(worker, prefix, blocks, "m"), t0 + (i + 1) * seconds / n)


def hot_setup(**params) -> tuple[MigrationPlanner, dict]:
    """w0 holds P, saturated since t=0; w1 idle, w2 idle but running more; P at 2 req/s. The
    planner requires saturation (hot_for_s=1), the rule behind a router that queues on holders."""
    rules = {"hot_for_s": 1.0, "cooldown_s": 10.0, "replica_cap": 3}
    planner = MigrationPlanner(MigrationParams(**(rules | params)))
    planner.observe_load(busy("w0"), 0.0)
    planner.observe_load(idle("w1"), 0.0)
    planner.observe_load(idle("w2", running=3), 0.0)
    demand(planner, 0.0, 2.0, 10.0)
    holders = {P: {"w0"}}
    return planner, holders


def plan(planner: MigrationPlanner, now: float, holders: dict) -> list:
    return planner.plan(now, lambda p: holders.get(p, set()))


def test_cost_estimate_is_exact() -> None:
    est = estimate(MigrationParams(), blocks=BLOCKS, block_size=16, rate=2.0, holders=1)
    assert est.bytes == MIB_128
    assert est.transfer_s == pytest.approx(0.005 + MIB_128 / 25e9)
    assert est.prefill_s == pytest.approx(1024 * (1 + 512 / PARITY) / 20_000), "with attention"
    linear = estimate(MigrationParams(attention_parity_tokens=0.0), blocks=BLOCKS, block_size=16,
                      rate=2.0, holders=1)  # fmt: skip
    assert linear.prefill_s == pytest.approx(1024 / 20_000)
    assert est.hits == pytest.approx(2.0 * (30.0 - est.transfer_s) / 2)
    assert est.benefit_s == pytest.approx(est.hits * est.prefill_s)
    assert est.pays(2.0)
    waited = estimate(MigrationParams(), blocks=BLOCKS, block_size=16, rate=2.0, holders=1,
                      link_wait_s=1.5)  # fmt: skip
    assert waited.transfer_s == pytest.approx(est.transfer_s + 1.5)


def test_the_planner_and_the_router_assume_one_prefill_rate() -> None:
    """A hit saves the same prefill time in the planner's cost as in the router's."""
    from thunderagent.routing.cost import PREFILL_S_PER_TOKEN
    from thunderagent.routing.thunder import Thunder

    assert MigrationParams().prefill_tokens_per_s == pytest.approx(1.0 / PREFILL_S_PER_TOKEN)
    assert MigrationParams().attention_parity_tokens == Thunder().attention_parity_tokens


def test_a_backlog_of_long_prompts_is_longer_than_its_tokens() -> None:
    """The backlog is split over the waiting requests: one 60k-token prompt holds more
    attention than six of 10k, and linear (parity 0) both are 3 s at 20k tokens/s."""
    params = MigrationParams(attention_parity_tokens=30_000.0)
    planner = MigrationPlanner(params)
    one = WorkerSeen("w0", queued=1, prefill_backlog_tokens=60_000)
    six = WorkerSeen("w0", queued=6, prefill_backlog_tokens=60_000)
    assert planner.backlog_s(one) == pytest.approx(60_000 * (1 + 1) / 20_000)
    assert planner.backlog_s(six) == pytest.approx(6 * 10_000 * (1 + 5_000 / 30_000) / 20_000)
    linear = MigrationPlanner(MigrationParams(attention_parity_tokens=0.0))
    assert linear.backlog_s(one) == linear.backlog_s(six) == pytest.approx(3.0)
    assert planner.backlog_s(WorkerSeen("w0", prefill_backlog_tokens=-1)) == 0.0, "unknown"


def test_a_hot_prefix_is_copied_to_the_least_loaded_worker_with_room() -> None:
    planner, holders = hot_setup()
    actions = plan(planner, 10.0, holders)
    est = estimate(planner.params, blocks=BLOCKS, block_size=16, rate=2.0, holders=1)
    assert len(actions) == 1
    a = actions[0]
    assert isinstance(a, Replicate)
    assert (a.action_id, a.prefix_hash, a.blocks, a.source, a.target) == ("m-1", P, 64, "w0", "w1")
    assert a.bytes == MIB_128
    assert a.transfer_s == pytest.approx(est.transfer_s)
    assert a.benefit_s == pytest.approx(est.benefit_s)
    assert plan(planner, 10.5, holders) == []  # in flight: nothing more for this prefix
    assert planner.stats.ordered["replicate"] == 1


@pytest.mark.parametrize(
    ("lora", "w2_has_it", "target"),
    [(None, True, "w1"), ("sql", True, "w2"), ("sql", False, None)],
)
def test_an_adapters_prefix_is_copied_only_to_a_worker_with_the_adapter(
    lora, w2_has_it, target
) -> None:
    """The router's decisions name the adapter: its prefix is cached in the adapter's
    namespace, useless where the adapter is not loaded. A base-model prefix goes to the least
    loaded worker (w1); an adapter's to w2, the one with the adapter, or nowhere."""
    planner = MigrationPlanner(MigrationParams(hot_for_s=1.0, replica_cap=3))
    planner.observe_load(busy("w0"), 0.0)
    planner.observe_load(idle("w1"), 0.0)
    adapters = frozenset({"sql"}) if w2_has_it else frozenset()
    w2 = WorkerSeen("w2", "m", lora_adapters=adapters, running=3, queued=0,
                    prefill_backlog_tokens=0, kv_total_blocks=1000, block_size=16)  # fmt: skip
    planner.observe_load(w2, 0.0)
    for i in range(20):
        planner.observe_route(RouteSeen("w0", P, BLOCKS, "m", lora_name=lora), (i + 1) * 0.5)
    actions = plan(planner, 10.0, {P: {"w0"}})
    assert [a.target for a in actions] == ([target] if target else [])


def test_holders_must_stay_saturated_for_hot_for_s() -> None:
    planner = MigrationPlanner(MigrationParams(hot_for_s=1.0))
    planner.observe_load(idle("w1"), 0.0)
    planner.observe_load(busy("w0"), 9.5)
    demand(planner, 0.0, 2.0, 10.0)
    holders = {P: {"w0"}}
    assert plan(planner, 10.0, holders) == []  # saturated for 0.5 s only
    assert plan(planner, 10.4, holders) == []
    assert [a.target for a in plan(planner, 10.5, holders)] == ["w1"]


def test_the_demand_gate_fans_out_while_requests_per_holder_reach_the_bound() -> None:
    """12 req/s on one idle holder, 3 req/s per holder asked: one copy (one source); once it
    has landed, one more from each holder in the same round, then 12 / 4 = 3 still reaches the
    bound but every holder's link is taken."""
    planner = MigrationPlanner(MigrationParams(min_rate_per_holder=3.0))
    for w in ("w0", "w1", "w2", "w3", "w4", "w5"):
        planner.observe_load(idle(w, running=int(w[1])), 0.0)
    holders = {P: {"w0"}}
    demand(planner, 0.0, 12.0, 10.0)
    [a] = plan(planner, 10.0, holders)
    assert isinstance(a, Replicate) and (a.source, a.target) == ("w0", "w1")
    assert "1 holder(s)" in a.reason and "saturated" not in a.reason
    assert plan(planner, 10.01, holders) == []  # w0's link is busy; w1 counts as a holder
    planner.on_transfer_done(a.action_id, 10.02)
    holders[P] = {"w0", "w1"}
    b, c = plan(planner, 10.03, holders)  # no cooldown for the demand gate
    assert {(b.source, b.target), (c.source, c.target)} == {("w0", "w2"), ("w1", "w3")}
    assert plan(planner, 10.04, holders) == []


def test_the_demand_gate_stops_at_the_bound_and_the_cap() -> None:
    planner = MigrationPlanner(MigrationParams(min_rate_per_holder=3.0, replica_cap=3))
    for w in ("w0", "w1", "w2", "w3", "w4"):
        planner.observe_load(idle(w), 0.0)
    demand(planner, 0.0, 2.9, 10.0)  # 29 hits: under 3 per holder
    assert plan(planner, 10.0, {P: {"w0"}}) == []
    demand(planner, 10.0, 30.0, 1.0)  # a burst: 59 hits in the window, 5.9 req/s
    assert len(plan(planner, 11.0, {P: {"w0"}})) == 1
    assert plan(planner, 11.0, {P: {"w0", "w1", "w2"}}) == []  # the cap (w1 in flight too)
    planner = MigrationPlanner(MigrationParams(min_rate_per_holder=0.0, hot_for_s=0.0))
    planner.observe_load(idle("w1"), 0.0)
    demand(planner, 0.0, 50.0, 10.0)
    assert plan(planner, 10.0, {P: {"w0"}}) == []  # both gates off


def test_moves_per_prefix_are_bounded() -> None:
    planner = MigrationPlanner(MigrationParams(min_rate_per_holder=1.0, max_moves_per_prefix=2))
    workers = [f"w{i}" for i in range(8)]
    for w in workers:
        planner.observe_load(idle(w), 0.0)
    demand(planner, 0.0, 20.0, 10.0)
    holders = {P: {"w0", "w1", "w2"}}
    assert len(plan(planner, 10.0, holders)) == 2
    assert plan(planner, 10.0, holders) == []


def test_default_waits_for_saturated_holders() -> None:
    """The default gate: demand alone is not enough while the holder serves it without queueing."""
    planner = MigrationPlanner(MigrationParams())
    for w in ("w0", "w1"):
        planner.observe_load(idle(w), 0.0)
    holders = {P: {"w0"}}
    demand(planner, 0.0, 2.0, 10.0)
    assert plan(planner, 10.0, holders) == []
    planner.observe_load(busy("w0"), 10.0)
    assert plan(planner, 10.5, holders) == []  # saturated 0.5 s of the 1 s asked
    [a] = plan(planner, 11.0, holders)
    assert (a.source, a.target) == ("w0", "w1") and "saturated" in a.reason


def test_saturation_has_two_thresholds() -> None:
    planner, holders = hot_setup()
    # backlog falls to 0.45 s with an empty queue (8k tokens, attention included): between
    # idle_s (0.1) and busy_s (0.5): still busy
    planner.observe_load(busy("w0", backlog_tokens=8_000, queued=0), 5.0)
    assert planner.saturated_for("w0", 5.0) == 5.0
    # 0.08 s and no queue: clear; climbing back to 0.45 s does not make it busy again
    planner.observe_load(busy("w0", backlog_tokens=1_500, queued=0), 6.0)
    planner.observe_load(busy("w0", backlog_tokens=8_000, queued=0), 7.0)
    assert planner.saturated_for("w0", 10.0) == 0.0
    assert plan(planner, 10.0, holders) == []
    planner.observe_load(busy("w0"), 8.0)  # a queue again: busy from t=8
    assert plan(planner, 8.5, holders) == []
    assert len(plan(planner, 9.0, holders)) == 1


def test_a_prefix_hit_less_than_min_rate_or_too_short_stays_put() -> None:
    planner = MigrationPlanner()
    planner.observe_load(busy("w0"), 0.0)
    planner.observe_load(idle("w1"), 0.0)
    demand(planner, 0.0, 0.9, 10.0)  # 9 hits in 10 s
    demand(planner, 0.0, 5.0, 10.0, prefix=0xDEF, blocks=3)
    assert plan(planner, 10.0, {P: {"w0"}, 0xDEF: {"w0"}}) == []


def test_no_target_with_room_means_no_copy() -> None:
    planner, holders = hot_setup()
    planner.observe_load(busy("w1"), 0.0)
    planner.observe_load(idle("w2", live=12_000), 0.0)  # 12k of 16k tokens held by running reqs
    assert plan(planner, 10.0, holders) == []
    planner.observe_load(idle("w2", live=11_000), 10.0)  # 0.69 <= target_max_live 0.7
    assert [a.target for a in plan(planner, 10.0, holders)] == ["w2"]


def test_replica_cap_bounds_the_holders() -> None:
    planner, _ = hot_setup(replica_cap=2)
    planner.observe_load(busy("w1"), 0.0)
    planner.observe_load(idle("w3"), 0.0)
    assert plan(planner, 10.0, {P: {"w0", "w1"}}) == []
    planner.params.replica_cap = 3
    actions = plan(planner, 10.0, {P: {"w0", "w1"}})
    assert [(a.source, a.target) for a in actions] == [("w0", "w3")]
    # the estimate credits the new replica with a third of the demand
    assert actions[0].benefit_s == pytest.approx(
        2.0 * (30.0 - actions[0].transfer_s) / 3 * 1024 * (1 + 512 / PARITY) / 20_000
    )


def test_a_copy_that_does_not_pay_is_not_made() -> None:
    # 128 MiB over 20 MB/s is 6.7 s; 2 req/s over the 23 s left, halved, saves 0.8 s < 2 x 6.7 s
    planner, holders = hot_setup(link_bytes_per_s=20e6)
    assert plan(planner, 10.0, holders) == []
    planner.params.benefit_margin = 0.1
    assert len(plan(planner, 10.0, holders)) == 1


def test_kv_pressure_at_the_source_turns_the_copy_into_a_migration() -> None:
    planner, holders = hot_setup()
    planner.observe_load(busy("w0", live=13_000), 10.0)  # 0.81 of 16k tokens
    [action] = plan(planner, 10.0, holders)
    assert isinstance(action, Migrate)
    assert (action.source, action.target) == ("w0", "w1")


def test_cooldown_after_a_move_then_the_next_replica() -> None:
    planner, holders = hot_setup(cooldown_s=10.0)
    [a] = plan(planner, 10.0, holders)
    planner.on_transfer_done(a.action_id, 10.2, moved_bytes=a.bytes)
    holders[P] = {"w0", "w1"}
    planner.observe_load(busy("w1"), 10.2)
    demand(planner, 10.2, 2.0, 10.0)
    assert plan(planner, 20.1, holders) == []  # cooling down until 20.2
    [b] = plan(planner, 21.5, holders)  # w1 saturated since 10.2 (> hot_for_s)
    assert (b.action_id, b.source, b.target) == ("m-2", "w0", "w2")
    assert planner.stats.done == 1 and planner.stats.moved_bytes == MIB_128
    assert planner.replicated_prefixes() == 1


def test_failures_back_off_exponentially_then_give_up() -> None:
    planner, holders = hot_setup(cooldown_s=10.0, max_failures=3, target_backoff_s=30.0)
    planner.observe_load(idle("w3", running=5), 0.0)
    demand(planner, 10.0, 2.0, 60.0)
    [a] = plan(planner, 10.0, holders)
    assert a.target == "w1"
    planner.on_transfer_failed(a.action_id, 10.0, "target died")
    assert plan(planner, 19.9, holders) == []  # prefix backs off 10 s
    [b] = plan(planner, 20.0, holders)
    assert b.target == "w2"  # w1 is backed off for 30 s
    planner.on_transfer_failed(b.action_id, 20.0)
    assert plan(planner, 39.9, holders) == []  # 20 s now
    [c] = plan(planner, 40.0, holders)
    assert c.target == "w1"  # w1's 30 s are over; w2 is backed off
    planner.on_transfer_failed(c.action_id, 40.0)
    assert planner.stats.failed == 3 and planner.stats.abandoned_prefixes == 1
    assert plan(planner, 500.0, holders) == []  # given up, never retried forever


def test_a_move_never_reported_times_out_as_a_failure() -> None:
    planner, holders = hot_setup(transfer_timeout_s=60.0)
    [a] = plan(planner, 10.0, holders)
    assert planner.expire(69.9) == []
    assert planner.expire(70.0) == [a.action_id]
    assert planner.stats.timed_out == 1 and planner.stats.failed == 1
    assert planner.inflight == {}
    planner.on_transfer_done(a.action_id, 71.0)  # a late report is ignored
    assert planner.stats.done == 0


def test_a_leaving_worker_hands_over_its_only_copies() -> None:
    planner = MigrationPlanner()
    for wid in ("w0", "w1", "w2"):
        planner.observe_load(idle(wid, running=int(wid[1])), 0.0)
    demand(planner, 0.0, 0.2, 10.0)  # 2 hits: not hot, still worth saving
    demand(planner, 0.0, 0.2, 10.0, prefix=0x2, worker="w1")
    holders = {P: {"w0"}, 0x2: {"w0", "w1"}}
    assert plan(planner, 10.0, holders) == []
    planner.set_draining("w0")
    [a] = plan(planner, 10.0, holders)  # 0x2 survives on w1: only P moves
    assert isinstance(a, Migrate)
    assert (a.prefix_hash, a.source, a.target) == (P, "w0", "w1")
    assert a.reason.startswith("drain")


def test_a_cold_replica_the_planner_made_is_dropped() -> None:
    planner, holders = hot_setup(cold_for_s=30.0, drop_rate=0.2)
    [a] = plan(planner, 10.0, holders)
    planner.on_transfer_done(a.action_id, 10.0)
    holders[P] = {"w0", "w1"}
    assert plan(planner, 21.0, holders) == []  # no hits since t=10: cold from 21
    assert plan(planner, 50.9, holders) == []
    [d] = plan(planner, 51.0, holders)
    assert isinstance(d, Drop) and (d.worker, d.prefix_hash, d.blocks) == ("w1", P, BLOCKS)
    planner.on_transfer_done(d.action_id, 51.0)
    assert planner.replicated_prefixes() == 0


def test_a_refused_drop_gives_the_replica_up_without_giving_up_the_prefix() -> None:
    planner, holders = hot_setup(cold_for_s=30.0, drop_rate=0.2, max_failures=1)
    [a] = plan(planner, 10.0, holders)
    planner.on_transfer_done(a.action_id, 10.0)
    holders[P] = {"w0", "w1"}
    assert plan(planner, 21.0, holders) == []  # cold from here
    [d] = plan(planner, 51.0, holders)
    planner.on_transfer_failed(d.action_id, 51.0, "dropped nothing: extended")
    assert planner.replicated_prefixes() == 0  # not ours to drop any more
    assert planner.stats.drops_refused == 1 and planner.stats.failed == 0
    assert planner.stats.abandoned_prefixes == 0
    assert plan(planner, 200.0, holders) == []  # and never asked again
    demand(planner, 200.0, 2.0, 10.0)
    planner.observe_load(busy("w0"), 200.0)
    planner.observe_load(busy("w1"), 200.0)
    assert [x.target for x in plan(planner, 211.0, holders)] == ["w2"]  # hot again: copied


def test_the_only_copy_is_never_dropped() -> None:
    planner, holders = hot_setup(cold_for_s=30.0)
    [a] = plan(planner, 10.0, holders)
    planner.on_transfer_done(a.action_id, 10.0)
    holders[P] = {"w1"}  # w0 evicted its copy meanwhile
    assert plan(planner, 100.0, holders) == []


def test_spilled_requests_count_for_the_holders_prefix() -> None:
    planner = MigrationPlanner()
    planner.observe_route(RouteSeen("w0", P, BLOCKS, "m"), 0.0)
    spilled = RouteSeen("w1", None, 0, "m", candidates=(("w1", 0), ("w0", BLOCKS)))
    assert planner.observe_route(spilled, 0.1) == P
    assert planner.demand.hits(P, 1.0) == 2
    nobody = RouteSeen("w1", None, 0, "m", candidates=(("w1", 0), ("w2", 5)))
    assert planner.observe_route(nobody, 0.2) is None


def test_moves_share_links_and_the_inflight_budget() -> None:
    planner, holders = hot_setup(max_inflight=1)
    demand(planner, 0.0, 3.0, 10.0, prefix=0x2)
    holders[0x2] = {"w0"}
    actions = plan(planner, 10.0, holders)
    assert [a.prefix_hash for a in actions] == [0x2]  # the busier prefix first; budget 1
    planner.params.max_inflight = 4
    assert plan(planner, 10.0, holders) == []  # w0's link is taken (one move per worker)
    planner.params.max_moves_per_worker = 2
    [b] = plan(planner, 10.0, holders)
    assert (b.prefix_hash, b.source, b.target) == (P, "w0", "w1")
    # it queues behind 0x2's transfer on the same two links
    assert b.transfer_s == pytest.approx(actions[0].transfer_s + (0.005 + MIB_128 / 25e9))


def test_manual_orders_are_checked_and_booked() -> None:
    planner, holders = hot_setup()
    m = planner.order(P, 1.0, lambda p: holders.get(p, set()), target="w2", migrate=True)
    assert isinstance(m, Migrate) and (m.source, m.target, m.blocks) == ("w0", "w2", BLOCKS)
    with pytest.raises(ValueError, match="in flight"):
        planner.order(P, 1.0, lambda p: holders.get(p, set()))
    with pytest.raises(ValueError, match="no worker is known"):
        planner.order(0x999, 1.0, lambda p: set())
    r = planner.order(0x999, 1.0, lambda p: set(), source="w1", target="w0", blocks=8)
    assert isinstance(r, Replicate) and r.bytes == 8 * 16 * 131_072
    assert planner.demand.hits(0x999, 1.0) == 0  # an order is not demand


@pytest.mark.parametrize(
    ("values", "field", "fragment"),
    [
        ({"idle_s": 1.0, "busy_s": 0.5}, "idle_s", "<= busy_s"),
        ({"drop_rate": 2.0}, "drop_rate", "<= min_rate"),
        ({"replica_cap": 0}, "replica_cap", "> 0"),
        ({"pressure_live": 1.5}, "pressure_live", "fraction"),
        ({"cooldown_s": -1}, "cooldown_s", ">= 0"),
        ({"bogus": 1}, "bogus", "unknown"),
        ({"hot_for_s": "abc"}, "hot_for_s", "must be a number"),
        ({"hot_for_s": None}, "hot_for_s", "must be a number"),
        ({"max_moves_per_prefix": 1.5}, "max_moves_per_prefix", "must be an integer"),
        ({"replica_cap": True}, "replica_cap", "must be an integer"),
    ],
)
def test_bad_params_name_the_field_and_the_reason(values, field, fragment) -> None:
    with pytest.raises(ParamError) as err:
        MigrationParams.from_dict(values)
    assert err.value.field == field and fragment in str(err.value)
