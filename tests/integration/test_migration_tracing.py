"""A move is one trace of its own: the migration service's root span, its export / pull /
release steps, and the source and target adapters' spans under them, exported over OTLP by the
real processes `thunderagent up` starts (simulated engines with NIXL KV pools). A pull at
dispatch is a span in its run's trace."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from tests.integration.migration_stack import skip_without_nixl
from tests.integration.otlp_receiver import OtlpReceiver
from thunderagent.bus import Bus, connect
from thunderagent.bus.bus import encode
from thunderagent.hashing import BlockHasher
from thunderagent.schemas import (
    Ack,
    FinalReply,
    GenerateRequest,
    MigrationMode,
    MigrationOrder,
    MigrationReport,
    PullHint,
    TokenChunk,
    WorkerGenerate,
    subjects,
)
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
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30  # until the source's adapter has mirrored the prefix
        while True:
            report = await bus.request(subjects.MIGRATION_REQUEST, order, MigrationReport,
                                       timeout=20)  # fmt: skip
            if report.phase == "done" or "not in this worker" not in report.reason:
                return report
            if loop.time() > deadline:
                return report
            await asyncio.sleep(0.1)
    finally:
        await nc.close()


SAMPLED = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
"""A client's sampled trace context (W3C ``traceparent``): the adapter traces the run."""


async def _pulled_run(stack: Stack, tokens: list[int]) -> FinalReply:
    """A run on w0 whose hint names w1, which holds the prefix (the move left it there), sent
    with a sampled trace context; its final reply."""
    import msgspec

    prefix = BlockHasher(BLOCK).hash_tokens(tokens).primary
    hint = PullHint(source_worker="w1", prefix_hash=prefix[-1], blocks=len(prefix), budget_s=5.0)
    nc = await connect(stack.nats_url, name="test-trace", identity="admin")
    try:
        inbox = nc.new_inbox()
        got: asyncio.Queue = asyncio.Queue()
        await nc.subscribe(inbox, cb=got.put)
        request = GenerateRequest(model=stack.config.model, request_id="pulled",
                                  token_ids=[*tokens, 7, 7], max_tokens=2)  # fmt: skip
        work = WorkerGenerate(request=request, reply_subject=inbox, pull=hint)
        ack = await nc.request(subjects.worker_generate("w0"), encode(work), timeout=10,
                               headers={"traceparent": SAMPLED})  # fmt: skip
        assert msgspec.json.decode(ack.data, type=Ack).accepted
        while True:
            msg = await asyncio.wait_for(got.get(), 20)
            reply = msgspec.json.decode(msg.data, type=TokenChunk | FinalReply)
            if isinstance(reply, FinalReply):
                return reply
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
            tokens = [(i * 37) % 5000 + 4 for i in range(8 * BLOCK)]
            report = asyncio.run(_move(stack, tokens))
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
            pulled = asyncio.run(_pulled_run(stack, tokens))
            assert pulled.usage.cached_tokens == 8 * BLOCK, pulled.usage
            run_trace, pull_spans = SAMPLED.split("-")[1], []
            source: set = set()
            while time.monotonic() < deadline + 20 and not (pull_spans and source):
                spans = receiver.snapshot()
                pull_spans = [s for s in spans if s.name == "worker pull"]
                source = {s.name for s in spans if s.trace_id == run_trace
                          and s.service == "thunderagent-worker-w1"}  # fmt: skip
                time.sleep(0.2)
        finally:
            stack.stop()
    [pull] = pull_spans
    assert pull.service == "thunderagent-worker-w0" and pull.trace_id == run_trace
    assert source, "the source's export and release are in the run's trace too"
    assert pull.attribute("thunderagent.pull.outcome") == "done"
    assert pull.attribute("thunderagent.pull.source") == "w1"
    assert pull.attribute("thunderagent.pull.blocks") == 8
    names = {s.name for s in trace}
    assert {"migration migrate", "migration export", "migration pull", "migration release"} <= names
    services = {s.service for s in trace}
    assert services == {"thunderagent-migration", "thunderagent-worker-w0",
                        "thunderagent-worker-w1"}  # fmt: skip
    [root] = [s for s in trace if not s.parent_span_id]
    assert root.name == "migration migrate" and root.service == "thunderagent-migration"
