"""KV migration in the replay: the live planner fed in virtual time, its moves carried out on
the simulated engines (``thunderagent.replay.migration``), and the bench's migration fields."""

import json
import math
import random
from pathlib import Path

import pytest

from thunderagent.engine import get_profile
from thunderagent.migration import Drop, Migrate, Replicate
from thunderagent.replay import Record, Replay, ReplayConfig, TraceRequest
from thunderagent.replay.hot import hot_summary, hot_ttft_floor_ms, shared_prefix_blocks
from thunderagent.replay.migration import (
    PLAN_INTERVAL_S,
    TIMER,
    WARMUP_PREFIX,
    ReplayMigration,
)
from thunderagent.stats import percentile

BS = 64
PROFILE = get_profile("llama-3.1-8b-h100").with_engine(block_size=BS, max_running_requests=4)
"""Small batches, so a worker that takes every hot request queues (the planner's trigger)."""
STICKY = {"load_scale": 1000.0}
"""Thunder whose cache credit hardly decays with load: once the prefix is cached it keeps the
hot queries on the holder (routing alone does not spread them, so any spreading is the
planner's)."""
HOT_BLOCKS = 128


def hot_trace(n: int = 60, rate: float = 10.0, seed: int = 0) -> list[TraceRequest]:
    """``n`` queries of one 8,192-token prefix plus a short unique question: the first alone
    (it computes the prefix), the rest from 2 s on at ``rate`` per s."""
    rng = random.Random(seed)
    prefix = list(range(1, HOT_BLOCKS + 1))
    out, t = [], 0.0
    for i in range(n):
        tail = [10**6 + i]  # the question: one part-filled block
        prompt = HOT_BLOCKS * BS + rng.randint(8, 120)
        out.append(TraceRequest(f"h{i}", t, prompt, 64, prefix + tail, hot=True))
        t = 2.0 if i == 0 else t + rng.expovariate(rate)
    return out


def replay(mode: str, workers: int = 3, link: float = 25e9, overrides: dict | None = None):
    cfg = ReplayConfig(
        profile=PROFILE,
        policy="thunder",
        policy_params=STICKY,
        workers=workers,
        scheduler="direct",
        seed=0,
        link_bytes_per_s=link,
    )
    r = Replay(cfg, BS)
    return r, ReplayMigration.attach(r, mode, overrides)


def hot_p99(records: list[Record]) -> float:
    return hot_summary(records, {r.request_id for r in records}, (0.0, math.inf))["hot"][
        "ttft_p99_ms"
    ]


def test_copies_of_the_hot_prefix_cut_its_ttft_tail() -> None:
    trace = hot_trace()
    off, _ = replay("off")
    base = off.run(trace)
    assert {r.worker for r in base.records} == {base.records[0].worker}  # one holder takes all
    tails = {}
    for mode in ("nixl", "replicate"):
        r, mig = replay(mode)
        tails[mode] = hot_p99(r.run(trace).records)
        s = mig.summary()
        assert s["replications"] >= 1 and s["failed_moves"] == 0
        if mode == "nixl":  # the whole prefix over the link, nothing prefilled
            assert s["bytes_moved"] == s["replications"] * HOT_BLOCKS * BS * 131_072
            assert s["transfer_s"]["p50"] == pytest.approx(HOT_BLOCKS * BS * 131_072 / 25e9 + 0.005)
            assert s["warmup_prefill_tokens"] == 0
        else:  # the target prefilled it; no link
            assert s["bytes_moved"] == 0 and s["warmup_prefill_tokens"] > 0
    assert tails["nixl"] < 0.8 * hot_p99(base.records)
    assert tails["replicate"] < hot_p99(base.records)
    assert tails["nixl"] <= tails["replicate"]


def prefilled(mode: str = "nixl", link: float = 25e9):
    """Two workers; the prefix (10 blocks) is cached on one of them, seen by the planner."""
    prefix = list(range(1, 11))
    trace = [
        TraceRequest("a", 0.0, 10 * BS + 5, 4, [*prefix, 100]),
        TraceRequest("b", 2.0, 10 * BS + 9, 4, [*prefix, 200]),  # a hit: the planner learns it
    ]
    r, mig = replay(mode, workers=2, link=link)
    result = r.run(trace)
    (source,) = {rec.worker for rec in result.records}
    keys = r.keys["a"].primary[:10]
    return r, mig, r.ids[source], r.ids[1 - source], keys


def test_a_migrate_moves_the_prefix_and_frees_the_source() -> None:
    r, mig, source, target, keys = prefilled()
    assert set(mig.holders(keys[-1])) == {source}
    move = mig.planner.order(keys[-1], r.now, mig.holders, target=target, migrate=True)
    assert isinstance(move, Migrate) and move.source == source
    mig.execute(move, r.now)
    r.run([])  # deliver the landing
    src, dst = r.cores[r.slot[source]].cache, r.cores[r.slot[target]].cache
    assert not any(k in src for k in keys)
    assert all(k in dst for k in keys)
    assert set(mig.holders(keys[-1])) == {target}  # the router learned it from the events
    s = mig.summary()
    assert (s["migrations"], s["freed_blocks"], s["failed_moves"]) == (1, 10, 0)
    assert mig.planner.stats.done == 1


def test_a_moving_prefix_occupies_the_target_while_it_lands() -> None:
    link = 1e9  # 10 blocks x 64 tokens x 128 KiB = 84 MB: 84 ms on the link
    r, mig, source, target, keys = prefilled(link=link)
    dst = r.cores[r.slot[target]]
    used = dst.load().kv_used_blocks
    move = mig.planner.order(keys[-1], r.now, mig.holders, target=target)
    assert isinstance(move, Replicate)
    mig.execute(move, r.now)
    (landing, _, kind, _) = r.timers[0]
    assert kind == TIMER
    assert landing == pytest.approx(r.now + 10 * BS * 131_072 / link + 0.005)
    assert dst.cache.reserved == 10 and dst.load().kv_used_blocks == used + 10
    assert not any(k in dst.cache for k in keys)
    assert r.cores[r.slot[source]].cache.refcount(keys[0]) == 1  # pinned while copied
    r.run([])
    assert dst.cache.reserved == 0 and all(k in dst.cache for k in keys)
    assert r.cores[r.slot[source]].cache.refcount(keys[0]) == 0
    assert set(mig.holders(keys[-1])) == {source, target}  # a replica: both keep it
    assert mig.summary()["bytes_moved"] == 10 * BS * 131_072


def test_a_replicate_mode_drop_fails_as_stock_sglang_does() -> None:
    r, mig, source, target, keys = prefilled(mode="replicate")
    move = mig.planner.order(keys[-1], r.now, mig.holders, target=target)
    mig.execute(move, r.now)
    assert WARMUP_PREFIX + move.action_id in mig._warmups
    r.run([])  # the warm-up runs on the target's engine
    assert set(mig.holders(keys[-1])) == {source, target}
    s = mig.summary()
    assert (s["replications"], s["bytes_moved"], s["warmup_prefill_tokens"]) == (1, 0, 10 * BS)
    # a cold replica: SGLang cannot free it selectively, so the drop fails
    mig.execute(Drop("manual-drop", keys[-1], 10, target), r.now)
    assert mig.summary()["failure_reasons"] == {"this engine cannot free a prefix selectively": 1}
    assert all(k in r.cores[r.slot[target]].cache for k in keys)


@pytest.mark.parametrize("mode", ["off", "replicate", "nixl"])
def test_every_request_is_accounted_for_and_no_warm_up_is_one(mode: str) -> None:
    trace = hot_trace(n=40)
    r, _ = replay(mode)
    result = r.run(trace)
    assert [rec.request_id for rec in result.records] == [t.request_id for t in trace]
    assert all(rec.status == "completed" for rec in result.records)
    assert all(rec.completion_tokens == 64 for rec in result.records)
    assert not any(rid.startswith(WARMUP_PREFIX) for rid in r.records)
    assert not any(core.has_work for core in r.cores)


def test_same_trace_and_seed_give_the_same_run() -> None:
    trace = hot_trace(n=40)
    runs = []
    for _ in range(2):
        r, mig = replay("nixl")
        result = r.run(trace)
        runs.append(([(x.worker, x.first_token, x.finish) for x in result.records], mig.summary()))
    assert runs[0] == runs[1]
    assert runs[0][1]["replications"] >= 1


def test_the_planner_is_asked_as_often_as_the_live_service_asks() -> None:
    from thunderagent.migrator.service import MigrationConfig

    assert PLAN_INTERVAL_S == MigrationConfig().interval_s


def test_hot_summary_splits_by_window_and_hotness() -> None:
    def rec(rid: str, arrival: float, ttft: float) -> Record:
        r = Record(rid, arrival, 10, 1)
        r.first_token = arrival + ttft if ttft >= 0 else math.nan
        return r

    records = [rec("a", 0.5, 1.0), rec("b", 1.5, 2.0), rec("c", 2.5, 3.0), rec("d", 1.0, -1)]
    out = hot_summary(records, {"b", "d"}, (1.0, 2.0))
    assert out["window_s"] == [1.0, 2.0]
    assert out["hot"]["requests"] == 2 and out["hot"]["ttft_p99_ms"] == math.inf
    assert out["in_window"]["requests"] == 2  # b and d (start inclusive)
    assert out["outside"] == {"requests": 2, "ttft_p50_ms": 2000.0, "ttft_p99_ms": 2980.0}


def test_shared_prefix_blocks_is_the_common_leading_run() -> None:
    def req(ids: list[int]) -> TraceRequest:
        return TraceRequest("r", 0.0, len(ids) * BS, 1, ids)

    assert shared_prefix_blocks([]) == 0
    assert shared_prefix_blocks([req([1, 2, 3])]) == 3
    assert shared_prefix_blocks([req([1, 2, 3, 4]), req([1, 2, 9]), req([1, 2, 3])]) == 2
    assert shared_prefix_blocks([req([1, 2]), req([7, 2])]) == 0


def test_hot_floor_counts_only_arrivals_before_the_first_prefill_ends() -> None:
    """Arrivals 0.0, 0.1 ... 0.9 s; the prefix takes 0.5 s from the first: the five before
    0.5 s wait 500, 400, 300, 200 and 100 ms at least, the rest nothing."""
    arrivals = [i / 10 for i in range(10)]
    waits = [500.0, 400.0, 300.0, 200.0, 100.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert hot_ttft_floor_ms(arrivals, 0.5) == pytest.approx(percentile(waits, 99))
    assert hot_ttft_floor_ms(arrivals, 0.5) > 400.0
    assert hot_ttft_floor_ms([3.0] * 200, 0.5) == pytest.approx(500.0)  # all at once
    assert hot_ttft_floor_ms([], 0.5) == 0.0


def write_trace(path: Path, trace: list[TraceRequest]) -> None:
    rows = [
        {
            "timestamp": t.arrival * 1000,
            "input_length": t.prompt_len,
            "output_length": t.output_len,
            "hash_ids": t.block_ids,
            "hot": t.hot,
        }
        for t in trace
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_cli_reports_moves_and_the_hot_period(tmp_path: Path, capsys) -> None:
    from thunderagent.bench.replay import main

    trace = tmp_path / "hot.jsonl"
    write_trace(trace, hot_trace(n=30))
    (tmp_path / "hot.meta.json").write_text(json.dumps({"hot_start_s": 0.5, "hot_end_s": 2.0}))
    out = tmp_path / "r.json"
    common = ["--trace", str(trace), "--block-size", str(BS), "--workers", "3"]
    common += ["--policies", "thunder", "--param", "thunder.load_scale=1000", "--quiet"]
    main([*common, "--speed", "1,2", "--migration", "nixl", "--json", str(out)])
    doc = json.loads(out.read_text())
    assert (doc["migration"], doc["hot_window_s"]) == ("nixl", [0.5, 2.0])
    for e in doc["results"]:
        assert e["migration"] == "nixl" and e["completed"] == 30
        assert {"replications", "migrations", "drops", "bytes_moved", "failed_moves"} <= set(e)
        assert set(e["transfer_s"]) == {"moves", "total", "p50", "p99"}
        assert e["hot"]["window_s"] == [0.5 / e["speed"], 2.0 / e["speed"]]
        assert e["hot"]["hot"]["requests"] == 30
    assert "| thunder | 2 | nixl |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([*common, "--migration", "nixl", "--migration-param", "replica_cap=0"])


def test_moves_and_pd_transfers_queue_on_the_same_links() -> None:
    from thunderagent.replay.pd import TransferLinks

    links = TransferLinks(kv_bytes_per_token=1, link_bytes_per_s=1.0)
    assert links.occupy(("w0", "w1"), 2.0, now=0.0) == 2.0
    assert links.send("r", "w0", 3, now=1.0) == 5.0  # a PD send out of w0 waits for the move
    assert links.occupy(("w1", "w2"), 1.0, now=0.5) == 3.0  # w1 is busy until 2
    assert links.occupy(("w0", "w2"), 1.0, now=0.0) == 6.0  # both ends: w0 until 5, w2 until 3


def round_robin(mode: str, overrides: dict | None = None, link: float = 25e9):
    """Two workers taking requests in turn: every second request lands away from the holder;
    copies of any size (``pull_min_tokens`` 1: these prefixes are 640 tokens)."""
    overrides = {"pull_min_tokens": 1, **(overrides or {})}
    cfg = ReplayConfig(profile=PROFILE, policy="round_robin", workers=2, scheduler="direct",
                       seed=0, link_bytes_per_s=link)  # fmt: skip
    r = Replay(cfg, BS)
    return r, ReplayMigration.attach(r, mode, overrides)


def shared_prefix_runs(times: list[float]) -> list[TraceRequest]:
    prefix = list(range(1, 11))  # 10 blocks of 64 tokens
    return [TraceRequest(f"q{i}", t, 10 * BS + 7, 4, [*prefix, 100 + i])
            for i, t in enumerate(times)]  # fmt: skip


def test_a_run_sent_away_from_the_holder_copies_the_prefix_first() -> None:
    """q1 goes to the worker that does not hold the prefix: with NIXL it copies the 10 blocks
    (84 MB at 25 GB/s + 5 ms, against 32 ms of prefill) and starts with them cached; without,
    or over a link slower than prefill (1 GB/s: 84 ms), it prefills them."""
    trace = shared_prefix_runs([0.0, 2.0])
    r, mig = round_robin("nixl")
    records = {rec.request_id: rec for rec in r.run(trace).records}
    assert records["q0"].worker != records["q1"].worker
    assert records["q1"].cached_tokens == 10 * BS
    s = mig.summary()
    nbytes = 10 * BS * 131_072
    assert (s["pulls"], s["pulled_blocks"], s["pulled_bytes"], s["pulls_refused"]) == (
        1, 10, nbytes, 0)  # fmt: skip
    assert s["pull_wait_s"]["p50"] == pytest.approx(nbytes / 25e9 + 0.005)
    assert records["q1"].first_token - records["q1"].arrival > nbytes / 25e9 + 0.005
    assert r.cores[records["q0"].worker].cache.refcount(r.keys["q0"].primary[0]) == 0
    for mode, overrides, link in (
        ("off", None, 25e9), ("nixl", {"pull_min_tokens": 0}, 25e9), ("nixl", None, 1e9)
    ):  # fmt: skip
        r, mig = round_robin(mode, overrides, link)
        records = {rec.request_id: rec for rec in r.run(trace).records}
        assert records["q1"].cached_tokens == 0
        assert mig is None or mig.summary()["pulls"] == 0


def test_a_run_for_a_prefix_already_crossing_waits_for_that_copy() -> None:
    """q1 and q3 both land on the worker without the prefix while q1's copy crosses: q3 waits
    for it instead of prefilling (the adapter's ``before_run``); one copy in all."""
    trace = shared_prefix_runs([0.0, 2.0, 2.001, 2.002])
    r, mig = round_robin("nixl")
    records = {rec.request_id: rec for rec in r.run(trace).records}
    assert records["q1"].worker == records["q3"].worker != records["q0"].worker
    assert records["q3"].cached_tokens == 10 * BS
    assert records["q3"].first_token >= records["q1"].arrival + 10 * BS * 131_072 / 25e9 + 0.005
    assert mig.summary()["pulls"] == 1
    assert all(rec.status == "completed" for rec in records.values())


def chunked_prefill_then(at: float):
    """q0's 200-block prompt is prefilled in chunks of 128 blocks (8,192 tokens: 0 to 0.30 s,
    then the rest to 0.50 s); q1 for the same prefix goes to the other worker at ``at``."""
    prefix = list(range(1, 201))
    trace = [TraceRequest("q0", 0.0, 200 * BS + 7, 4, [*prefix, 900]),
             TraceRequest("q1", at, 200 * BS + 9, 4, [*prefix, 901])]  # fmt: skip
    r, mig = round_robin("nixl")
    records = {rec.request_id: rec for rec in r.run(trace).records}
    assert records["q0"].first_token > at  # q0 was still prefilling when q1 came
    return records, mig.summary()


def test_a_run_copies_the_chunks_a_prefill_elsewhere_has_finished() -> None:
    """After the first chunk: q1 copies its 128 blocks and computes the rest."""
    records, s = chunked_prefill_then(0.4)
    assert records["q1"].cached_tokens == 128 * BS
    assert (s["pulls"], s["pulled_blocks"]) == (1, 128)


def test_a_chunk_still_being_computed_is_not_copied() -> None:
    """During the first chunk: the source's engine state holds its blocks from the step's
    start, but their bytes exist only at its end (live, the source offers what its engine's
    events named), so q1 gets no copy and prefills the whole prompt."""
    records, s = chunked_prefill_then(0.2)
    assert records["q1"].cached_tokens == 0
    assert (s["pulls"], s["pulls_refused"]) == (0, 1)


def test_a_copy_that_would_land_after_its_budget_is_given_up() -> None:
    """The sender does not see the planner's moves on the link: when the copy would land
    after the prefill it saves (its budget), the adapter gives it up at the budget and the run
    prefills; the replay does the same."""
    q0, q1 = shared_prefix_runs([0.0, 2.0])
    r, mig = round_robin("nixl")
    r.run([q0])
    r.links.occupy(("w00", "w01"), 10.0, r.now)  # a planner move holds the link for 10 s
    records = {rec.request_id: rec for rec in r.run([q1]).records}
    budget = 10 * BS / 20_000  # 10 blocks of 64 tokens at the router's prefill rate
    assert records["q1"].cached_tokens == 0
    assert records["q1"].first_token - records["q1"].arrival > budget
    s = mig.summary()
    assert (s["pulls"], s["pulls_given_up"]) == (0, 1)
    assert r.cores[r.slot["w01"]].cache.reserved == 0  # the reservation was given back
