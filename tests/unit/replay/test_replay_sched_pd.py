"""PD disaggregation in the replay: prefill, KV transfer, decode, timed by hand on the tiny
profile."""

import pytest

from thunderagent.engine import TimingModel, get_profile
from thunderagent.replay import Replay, ReplayConfig, TraceRequest
from thunderagent.replay.pd import transfer_s

TINY = get_profile("tiny")  # block 4 tokens, 32 blocks, chunk 32 tokens, 8 running
BS = TINY.engine.block_size
LINK = 1e6  # bytes/s: slow enough that the transfer is visible


def _run(trace: list[TraceRequest], scheduler: str = "pd_uncapped"):
    cfg = ReplayConfig(
        profile=TINY,
        policy="round_robin",
        workers=2,
        scheduler=scheduler,
        scheduler_params={"window": "none"},  # dispatch arrivals of one instant together
        roles=["prefill", "decode"],
        link_bytes_per_s=LINK,
    )
    return Replay(cfg, BS).run(trace)


def test_transfer_time_is_kv_bytes_over_link() -> None:
    # tiny: 2 (K,V) * 4 layers * 2 kv heads * 128 dims * 2 bytes = 4096 bytes per token
    assert TINY.kv_bytes_per_token == 4096
    assert transfer_s(40, 4096, 1e6) == pytest.approx(0.16384)


def test_one_request_prefills_transfers_and_decodes_on_time() -> None:
    timing = TimingModel(TINY)
    result = _run([TraceRequest("r", 0.0, 40, 5, list(range(1, 11)))])
    (rec,) = result.records
    assert rec.status == "completed" and rec.completion_tokens == 5
    # prefill worker: 40 prompt tokens in chunks of 32, then 8 over 32 cached
    t1 = timing.prefill_time([(32, 0)]) + timing.prefill_time([(8, 32)])
    assert rec.first_token == pytest.approx(t1)
    assert result.transfers_s == [pytest.approx(40 * 4096 / LINK)]
    t2 = t1 + 40 * 4096 / LINK
    # decode worker: all 10 blocks arrived, so only the first token's KV is computed, then
    # the remaining 3 tokens decode in one fused run (batch 1, context 41 + 1)
    t3 = t2 + timing.prefill_time([(1, 40)]) + timing.decode_run_time(1, 42, 3)
    assert rec.finish == pytest.approx(t3)
    assert rec.worker == 1  # finished on the decode worker
    assert result.sched_stats["pd_transfers"] == 1
    assert result.sched_stats["pd_inflight"] == 0


def test_transfers_out_of_one_prefill_worker_queue_on_its_link() -> None:
    trace = [
        TraceRequest(f"r{i}", 0.0, 16, 3, [10 * i + j for j in range(1, 5)], expected_output=3)
        for i in range(2)
    ]
    result = _run(trace)
    assert all(r.status == "completed" for r in result.records)
    one = 16 * 4096 / LINK
    # both prefills end in the same step: the second transfer waits for the first
    assert sorted(result.transfers_s) == [pytest.approx(one), pytest.approx(2 * one)]


# ---- SGLang's own PD (``pd_via="sglang"``): the decode engine reserves first, streams every token
def _run_sglang(trace: list[TraceRequest], pd_via: str = "sglang", **cfg):
    config = ReplayConfig(
        profile=TINY,
        policy="round_robin",
        workers=2,
        scheduler="pd_uncapped",
        scheduler_params={"window": "none"},
        roles=["prefill", "decode"],
        link_bytes_per_s=LINK,
        pd_via=pd_via,
        **cfg,
    )
    return Replay(config, BS).run(trace)


def test_sglang_pd_streams_the_first_token_from_the_decode_engine() -> None:
    timing = TimingModel(TINY)
    result = _run_sglang([TraceRequest("r", 0.0, 40, 5, list(range(1, 11)))])
    (rec,) = result.records
    assert rec.status == "completed" and rec.completion_tokens == 5
    t1 = timing.prefill_time([(32, 0)]) + timing.prefill_time([(8, 32)])
    t2 = t1 + 40 * 4096 / LINK  # the KV lands in the pages the decode engine reserved
    # the client's first token is the decode engine's, after the transfer: not the prefill's
    assert rec.first_token == pytest.approx(t2 + timing.prefill_time([(1, 40)]))
    assert rec.finish == pytest.approx(
        t2 + timing.prefill_time([(1, 40)]) + timing.decode_run_time(1, 42, 3)
    )
    assert rec.worker == 1 and rec.cached_tokens == 0
    assert result.sched_stats["pd_transfers"] == 1 and result.sched_stats["pd_inflight"] == 0


def test_sglang_pd_one_token_answer_arrives_with_the_kv() -> None:
    timing = TimingModel(TINY)
    result = _run_sglang([TraceRequest("r", 0.0, 40, 1, list(range(1, 11)))])
    (rec,) = result.records
    t2 = timing.prefill_time([(32, 0)]) + timing.prefill_time([(8, 32)]) + 40 * 4096 / LINK
    assert rec.status == "completed" and rec.completion_tokens == 1
    assert rec.first_token == pytest.approx(t2) and rec.finish == pytest.approx(t2)


def _long_decode_then_another(at: float) -> list[TraceRequest]:
    # r0 decodes 80 tokens (its KV grows from 10 to 30 of the pool's 32 blocks) though its
    # client expected 4; r1 (10 blocks) arrives while it decodes
    return [
        TraceRequest("r0", 0.0, 40, 80, list(range(1, 11)), expected_output=4),
        TraceRequest("r1", at, 40, 5, list(range(101, 111)), expected_output=4),
    ]


def _stale_views(pd_via: str = "sglang", **cfg):
    # load reports every 10 s: the scheduler's view of the decode pool stays the one at t=0,
    # so it dispatches r1 at once and the decode engine's own rule is what holds it
    return _run_sglang(_long_decode_then_another(0.3), pd_via=pd_via, load_interval=10.0, **cfg)


def test_sglang_pd_prefill_waits_for_the_decode_engines_reservation() -> None:
    result = _stale_views()
    r0, r1 = result.records
    assert r0.status == r1.status == "completed" and result.in_flight == 0
    # SGLang keeps 512 tokens (128 blocks, more than this pool) free per request the decode
    # engine holds: r1's pages are reserved only once r0 is done there, and only then does its
    # prefill start
    timing = TimingModel(TINY)
    prefill = timing.prefill_time([(32, 0)]) + timing.prefill_time([(8, 32)])
    assert r1.first_token >= r0.finish + prefill + 40 * 4096 / LINK
    assert r0.preemptions == 0
    r1_wait = r0.finish - 0.3  # from its dispatch at arrival to r0's end
    assert result.bootstrap_waits_s == [0.0, pytest.approx(r1_wait)]
    # the hand-off prefills r1 at once: its first token (the prefill's) comes before r0 is done
    handed = _stale_views(pd_via="workers")
    assert handed.records[1].first_token < handed.records[0].finish


def test_sglang_pd_reservation_without_headroom_retracts_a_decode() -> None:
    # no room kept for decodes: r1's reservation takes the blocks r0 needs to grow, so the
    # decode engine retracts r0 and idles until r1's KV lands, then finishes both
    result = _stale_views(pd_reserved_decode_tokens=0)
    r0, r1 = result.records
    assert r0.status == r1.status == "completed" and result.in_flight == 0
    assert r0.preemptions == 1 and r0.completion_tokens == 80
    waited = _stale_views().records[1]
    assert r1.first_token < waited.first_token  # reserved at once, not after r0


def test_sglang_pd_rejects_a_prompt_the_decode_pool_can_never_reserve() -> None:
    result = _run_sglang([TraceRequest("big", 0.0, 132, 2, list(range(1, 34)))])
    (rec,) = result.records
    assert rec.status == "rejected" and "decode engine's KV pool" in rec.reason
    assert result.in_flight == 0


def test_replay_refuses_an_unknown_pd_transfer() -> None:
    with pytest.raises(ValueError, match="pd_via"):
        _run_sglang([TraceRequest("r", 0.0, 8, 2, [1, 2])], pd_via="nixl")


def test_sglang_pd_prefill_engine_keeps_the_pages_it_sends_until_they_land() -> None:
    timing = TimingModel(TINY)
    t1 = timing.prefill_time([(32, 0)]) + timing.prefill_time([(8, 32)])
    transfer = 40 * 4096 / LINK

    def replay(pd_via: str) -> Replay:
        config = ReplayConfig(
            profile=TINY, policy="round_robin", workers=2, scheduler="pd_uncapped",
            scheduler_params={"window": "none"}, roles=["prefill", "decode"],
            link_bytes_per_s=LINK, pd_via=pd_via,
        )  # fmt: skip
        return Replay(config, BS)

    trace = [TraceRequest("r", 0.0, 40, 5, list(range(1, 11)))]
    mid = replay("sglang")
    result = mid.run(trace, until=t1 + transfer / 2)
    assert result.in_flight == 1 and result.records[0].status == "transferring"
    assert mid.cores[0].cache.pinned == 10  # the prompt's blocks, pinned while they are sent
    handed = replay("workers")
    handed.run(trace, until=t1 + transfer / 2)
    assert handed.cores[0].cache.pinned == 0  # the hand-off's copy is not modelled as pinning
    done = replay("sglang")
    assert done.run(trace).records[0].status == "completed"
    assert done.cores[0].cache.pinned == 0  # unpinned once landed
