"""A move is one trace of its own: the migration service's root span, its export / pull /
release steps, and the source and target adapters' spans under them, exported over OTLP by the
real processes `thunderagent up` starts (simulated engines with NIXL KV pools)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from tests.integration.migration_stack import skip_without_nixl
from tests.integration.otlp_receiver import OtlpReceiver
from thunderagent.bus import Bus, connect
from thunderagent.hashing import BlockHasher
from thunderagent.schemas import MigrationMode, MigrationOrder, MigrationReport, subjects
from thunderagent.stack.up import Stack, StackConfig

skip_without_nixl()

pytestmark = [pytest.mark.integration, pytest.mark.slow]
BLOCK = 16


async def _move(stack: Stack, tokens: list[int]) -> MigrationReport:
    body = {"rid": "warm", "input_ids": tokens, "sampling_params": {"max_new_tokens": 1}}
    async with aiohttp.ClientSession() as s, s.post(stack.engine_urls[0] + "/generate",
                                                    json=body) as r:  # fmt: skip
        assert r.status == 200
    prefix = BlockHasher(BLOCK).hash_tokens(tokens).primary[-1]
    order = MigrationOrder(prefix_hash=prefix, source="w0", target="w1",
                           mode=MigrationMode.MIGRATE)  # fmt: skip
    nc = await connect(stack.nats_url, name="test-trace", identity="admin")  # orders a move
    try:
        bus = Bus(nc, service="test")
        for _ in range(50):  # until the source's adapter has mirrored the prefix
            report = await bus.request(subjects.MIGRATION_REQUEST, order, MigrationReport,
                                       timeout=20)  # fmt: skip
            if report.phase == "done" or "not in this worker" not in report.reason:
                return report
            await asyncio.sleep(0.1)
        return report
    finally:
        await nc.close()


@pytest.mark.timeout(180)
def test_a_move_is_one_trace_across_the_service_and_both_adapters(tmp_path, monkeypatch):
    with OtlpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        config = StackConfig(workers=2, profile="tiny", block_size=BLOCK, speedup=20,
                             gateways=0, kv_pool=True, kv_blocks=64, run_dir=tmp_path / "run",
                             migration_args=["--orders-only"])  # fmt: skip
        stack = Stack.start(config)
        try:
            report = asyncio.run(_move(stack, [(i * 37) % 5000 + 4 for i in range(8 * BLOCK)]))
            assert report.phase == "done", report.reason
            deadline = time.monotonic() + 20
            trace: list = []
            while time.monotonic() < deadline:
                spans = receiver.snapshot()
                roots = [s for s in spans if s.name == "migration migrate"]
                if roots:
                    trace = [s for s in spans if s.trace_id == roots[-1].trace_id]
                    ids = {s.span_id for s in trace}
                    services = {s.service for s in trace}
                    complete = all(not s.parent_span_id or s.parent_span_id in ids for s in trace)
                    both = {"thunderagent-worker-w0", "thunderagent-worker-w1"} <= services
                    if complete and both:
                        break
                time.sleep(0.2)
        finally:
            stack.stop()
    names = {s.name for s in trace}
    assert {"migration migrate", "migration export", "migration pull", "migration release"} <= names
    services = {s.service for s in trace}
    assert services == {"thunderagent-migration", "thunderagent-worker-w0",
                        "thunderagent-worker-w1"}  # fmt: skip
    [root] = [s for s in trace if not s.parent_span_id]
    assert root.name == "migration migrate" and root.service == "thunderagent-migration"
