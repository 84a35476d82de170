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
