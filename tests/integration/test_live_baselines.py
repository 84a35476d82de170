"""bench live's HTTP baselines for real: sglang-router 0.3.2 and SMG 1.13.0 started as the
benchmark starts them, in front of simulated engines, driven by its load generator with reused
and with fresh client connections, then stopped with their whole process group."""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.inproc import inproc_stack
from thunderagent.bench import baseline_routers as routers
from thunderagent.bench import live

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.parametrize("baseline", ["sglang-router", "smg"])
async def test_baseline_serves_the_load_generator(nats_server, tmp_path, baseline: str) -> None:
    if routers.baseline_missing(baseline):
        pytest.skip(routers.baseline_missing(baseline))
    prompt = live.block_tokens(1, 64) + live.block_tokens(2, 64)
    requests = [live.LiveRequest(i, i * 0.02, prompt, 3) for i in range(6)]
    async with inproc_stack(nats_server.url) as stack:
        urls = [await stack.start_engine(f"e{i}", kv_events=False) for i in range(2)]
        results = {}
        for mode in live.CONNECTIONS:
            proc, url = routers.start_router(baseline, urls, tmp_path / f"{baseline}.log")
            try:
                await routers.wait_http(url)
                results[mode] = (await live.run_http(url, baseline, requests, mode)).summary()
            finally:
                await asyncio.to_thread(routers.stop_router, proc)
            assert proc.poll() is not None
    log = (tmp_path / f"{baseline}.log").read_text()[-2000:]
    for summary in results.values():
        assert (summary["completed"], summary["errors"]) == (6, 0), log
        assert summary["added_latency_ms"]["p50"] >= 0  # the engine's own TTFT came through
        # the same prompt again: cache_aware keeps it where its prefix is cached
        assert summary["prefix_hit_ratio"] > 0.5, log


async def test_smg_dp_aware_routes_to_the_ranks_of_a_simulated_engine(nats_server, tmp_path):
    """SMG's ``--dp-aware`` reads the engines' ``dp_size`` and names a rank on every request;
    the simulated engine serves the same discovery and honours the rank, so a repeated prompt
    stays on one rank (engine-level routing would spread it over both by SGLang's round robin)."""
    if routers.baseline_missing("smg-dp-aware"):
        pytest.skip(routers.baseline_missing("smg-dp-aware"))
    prompt = live.block_tokens(3, 64) + live.block_tokens(4, 64)
    requests = [live.LiveRequest(i, i * 0.05, prompt, 2) for i in range(6)]
    async with inproc_stack(nats_server.url) as stack:
        url = await stack.start_engine("e0", kv_events=False, dp_size=2)
        proc, router_url = routers.start_router("smg-dp-aware", [url], tmp_path / "smg.log")
        try:
            await routers.wait_http(router_url)
            summary = (await live.run_http(router_url, "smg-dp-aware", requests)).summary()
        finally:
            await asyncio.to_thread(routers.stop_router, proc)
        blocks = [e.load_snapshot()["cached_blocks"] for e in stack.dp_ranks["e0"]]
    log = (tmp_path / "smg.log").read_text()[-2000:]
    assert (summary["completed"], summary["errors"]) == (6, 0), log
    assert summary["prefix_hit_ratio"] > 0.7, log  # five of six served from the first's cache
    assert sorted(blocks)[0] == 0 and sorted(blocks)[1] > 0, blocks  # one rank holds it all
