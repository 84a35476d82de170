"""An engine with several data-parallel ranks (SGLang's ``--dp-size``): each rank has its own
KV cache, publishes its events on its own port and reports its own load, so the adapter makes
each a worker of the fleet and sends a rank's runs there. Over real NATS and HTTP, with the
simulated engine laid out as SGLang lays out its ranks."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from tests.integration.inproc import MODEL, inproc_stack, start_full_stack
from tests.integration.test_kv_routing import (
    PAGE,
    conversation,
    holder_known,
    routable,
    wait_for,
)
from tests.integration.test_worker_lifecycle import _sender_with_inbox
from thunderagent.schemas import (
    Ack,
    FinalReply,
    GenerateRequest,
    TokenChunk,
    WorkerGenerate,
    subjects,
)
from thunderagent.sglang.kv_wire import sglang_block_hashes

pytestmark = pytest.mark.integration


def _cached_blocks(engine, prompt: list[int]) -> int:
    """Leading blocks of ``prompt`` this rank's cache holds."""
    return engine.core.cache.match(sglang_block_hashes(prompt, PAGE)).gpu


async def test_each_rank_is_a_worker_and_a_prefix_comes_back_to_its_rank(nats_server):
    """A run handed to each rank's worker lands on that rank alone; the rank's KV events reach
    the router under that worker, and the prompt's next turn goes back there with its hit."""
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=1, dp_size=2, policy="thunder",
                               profile="llama-3.1-8b-h100", speedup=50)  # fmt: skip
        router = stack.services["router"].runtime.core
        await wait_for(
            lambda: (
                sorted(w.registration.worker_id for w in router.fleet.for_model(MODEL))
                == ["w0-dp0", "w0-dp1"]
            ),
            what="a worker per rank in the router's fleet",
        )
        client = await routable(nats_server.url, 2)
        nc, bus, inbox, got = await _sender_with_inbox(nats_server.url, "dp-test")
        ranks = stack.dp_ranks["w0"]
        for rank in (0, 1):
            worker, prefix = f"w0-dp{rank}", conversation(rank + 1, 12)
            request = GenerateRequest(model=MODEL, request_id=f"first-{rank}",
                                      token_ids=prefix + [9, 9], max_tokens=4)  # fmt: skip
            work = WorkerGenerate(request=request, reply_subject=inbox)
            assert (
                await bus.request(subjects.worker_generate(worker), work, Ack, timeout=5)
            ).accepted
            while not isinstance(await _reply(got), FinalReply):
                pass
            # the run went to the rank its worker names, and only there
            assert _cached_blocks(ranks[rank], prefix) == 12
            assert _cached_blocks(ranks[1 - rank], prefix) == 0
            await holder_known(router, prefix, worker)  # that rank's events, not the other's
            second = await client.generate(
                GenerateRequest(model=MODEL, token_ids=prefix + [8, 8, 8], max_tokens=4)
            )
            assert second.final.worker_id == worker
            assert second.final.usage.cached_tokens == 12 * PAGE
        await client.close()
        await nc.close()


async def _reply(got: asyncio.Queue):
    msg = await asyncio.wait_for(got.get(), 10)
    return msgspec.json.decode(msg.data, type=TokenChunk | FinalReply)


async def test_a_process_per_rank_stands_for_its_rank_alone(nats_server):
    """``thunderagent worker --dp-rank R``: adapters in separate processes (one per rank, so no
    single Python process carries every rank's streams) register a worker each, as one adapter
    for the whole engine would."""
    from thunderagent.worker.adapter import AdapterConfig
    from thunderagent.worker.service import main as adapter_main

    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=0, policy="thunder")
        url = await stack.start_engine("gpu0", dp_size=2, speedup=50)
        for rank in (1, 0):
            config = AdapterConfig(worker_id="gpu0", engine_url=url, dp_rank=rank,
                                   lease_s=2.0, load_interval_s=0.05)  # fmt: skip
            await stack.start_service(
                f"worker-gpu0-{rank}", lambda ctx, c=config: adapter_main(ctx, c)
            )
        router = stack.services["router"].runtime.core
        await wait_for(lambda: len(router.fleet.for_model(MODEL)) == 2, what="two rank workers")
        assert sorted(w.registration.worker_id for w in router.fleet.for_model(MODEL)) == [
            "gpu0-dp0",
            "gpu0-dp1",
        ]
        client = await routable(nats_server.url, 2)
        done = await client.generate(
            GenerateRequest(model=MODEL, token_ids=conversation(9, 4), max_tokens=2)
        )
        await client.close()
    assert done.final.worker_id in {"gpu0-dp0", "gpu0-dp1"}
