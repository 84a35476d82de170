"""The scheduler service over real NATS with PD disaggregation: a request prefilled on one worker
and decoded on another (ThunderAgent's KV hand-off and SGLang's own bootstrap pairing), and what
happens when a side is cancelled or none can take it."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import msgspec
import pytest

from tests.integration.inproc import MODEL, inproc_stack, start_full_stack
from tests.integration.test_kv_routing import routable, wait_for
from tests.integration.test_scheduler_service import collect
from thunderagent.bus import Bus, connect
from thunderagent.client import RequestFailed, ThunderClient
from thunderagent.schemas import (
    Ack,
    CancelRequest,
    GenerateRequest,
    PdBootstrap,
    WorkerGenerate,
    subjects,
)

pytestmark = pytest.mark.integration


async def post_json(url: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as resp:
        return resp.status, await resp.json(content_type=None)


@pytest.mark.parametrize(("salt", "lora"), [(None, None), ("tenant-a", "sql-adapter")])
async def test_pd_disaggregation_prefills_on_one_worker_and_decodes_on_the_other(
    nats_server, salt, lora
):
    """The prompt's KV moves to the decode worker in the namespace it was cached in (a tenant's
    salt, a LoRA adapter), so the decode run finds it there."""
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(
            stack,
            workers=2,
            roles=["prefill", "decode"],
            scheduler="pd_capped",
            policy="thunder",
            profile="llama-3.1-8b-h100",
            speedup=20,
            lora_adapters=["sql-adapter"],
        )
        client = await routable(nats_server.url, 2)
        sched = stack.services["scheduler"].runtime
        # the scheduler learns the roles from the load reports
        await wait_for(lambda: len(sched.core.admission.workers) == 2, what="both workers' rooms")
        prompt = list(range(1000, 1000 + 160))  # 10 full blocks
        request = GenerateRequest(model=MODEL, token_ids=prompt, max_tokens=12, cache_salt=salt,
                                  lora_name=lora)  # fmt: skip
        if lora:  # the router has the workers' adapters once it has their registrations
            await wait_for(lambda: len(stack.services["router"].runtime.core.fleet.for_model(
                MODEL, lora)) == 2, what="both workers' adapters")  # fmt: skip
        chunks, final, _ = await collect(client, request)
        decode_engine = stack.engines["w1"]
        await wait_for(lambda: sched.core.stats()["pd_inflight"] == 0, what="the transfer to end")
        await client.close()
    assert final.worker_id == "w1", "the decode worker finishes the request"
    indices = [i for c in chunks for i in range(c.index, c.index + len(c.token_ids))]
    assert indices == list(range(12)), "one unbroken stream across the hand-off"
    assert final.usage.completion_tokens == 12
    assert final.usage.prompt_tokens == 160
    # the decode engine found the transferred prompt in its cache instead of prefilling it
    assert final.usage.cached_tokens >= 160
    assert decode_engine.core.cache.gpu_blocks >= 10
    stats = sched.core.stats()
    assert stats["pd_transfers"] >= 1
    assert stats["pd_inflight"] == 0, "the transfer was reported done: the cap slot is free"


@pytest.mark.parametrize("stream", [True, False])
async def test_sglang_pd_pairs_a_prefill_and_a_decode_engine_through_a_bootstrap_room(
    nats_server, stream
):
    """Engines in SGLang's PD modes (``disaggregation_mode``): the workers take their roles
    from them, the prefill worker sends the decode worker the whole request with a new room
    (SGLang's bootstrap fields) and its own engine the same; the decode engine takes the KV
    from the prefill engine's registry and answers every token, a tenant's prompt cached in
    its namespace. Neither engine serves a request that is not paired."""
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(
            stack, workers=2, pd_modes=["prefill", "decode"], scheduler="pd_capped",
            policy="thunder", profile="llama-3.1-8b-h100", speedup=20,
        )  # fmt: skip
        client = await routable(nats_server.url, 2)
        sched = stack.services["scheduler"].runtime
        router = stack.services["router"].runtime.core
        await wait_for(lambda: len(sched.core.admission.workers) == 2, what="both workers' rooms")
        roles = {w: router.fleet.get(w).registration for w in ("w0", "w1")}
        assert (roles["w0"].role, roles["w1"].role) == ("prefill", "decode")
        assert roles["w0"].bootstrap_port > 0 and roles["w1"].bootstrap_port == 0
        prompt = list(range(2000, 2000 + 160))  # 10 full blocks
        request = GenerateRequest(model=MODEL, token_ids=prompt, max_tokens=12,
                                  cache_salt="tenant-a", stream=stream)  # fmt: skip
        chunks, final, _ = await collect(client, request)
        await wait_for(lambda: sched.core.stats()["pd_inflight"] == 0, what="the pairing to end")
        await wait_for(lambda: not sched.pending, what="the scheduler to close its books")
        decode, prefill = stack.engines["w1"], stack.engines["w0"]
        unpaired = await post_json(stack.engine_urls["w1"] + "/generate",
                                   {"input_ids": prompt, "sampling_params": {}})  # fmt: skip
        nc = await connect(nats_server.url, name="pd-test")
        bus = Bus(nc, service="pd-test")
        alone = WorkerGenerate(request=request, reply_subject=nc.new_inbox())
        refusals = [await bus.request(subjects.worker_generate(w), alone, Ack, timeout=5)
                    for w in ("w0", "w1")]  # fmt: skip
        pairing = PdBootstrap(host="127.0.0.1", port=1, room=7)
        paired = msgspec.structs.replace(alone, decode_worker="w1", bootstrap=pairing)
        refusals.append(await bus.request(subjects.worker_generate("w0"), paired, Ack, timeout=5))
        await nc.close()
        await client.close()
    assert final.worker_id == "w1", "the decode worker answers"
    assert final.usage.completion_tokens == 12 and final.usage.prompt_tokens == 160
    assert final.usage.cached_tokens >= 144, "the decode engine took the prompt's KV"
    if stream:
        indices = [i for c in chunks for i in range(c.index, c.index + len(c.token_ids))]
        assert indices == list(range(12)), "every token, once, from the decode engine"
    assert prefill.core.cache.gpu_blocks >= 10, "the prefill engine computed the prompt"
    assert decode.salts.salt_of(next(iter(decode.core.cache.contents()))) is not None
    assert unpaired[0] == 400 and "bootstrap_room" in unpaired[1]["error"]["message"]
    assert [a.accepted for a in refusals] == [False, False, False]
    assert "needs a decode worker" in refusals[0].reason
    assert "needs a prefill pairing" in refusals[1].reason
    assert "cannot take a pairing" in refusals[2].reason  # a prefill engine cannot decode one


async def test_sglang_pd_pairs_the_ranks_of_data_parallel_engines(nats_server):
    """Both engines with two data-parallel ranks: every rank is a worker, a prefill rank pairs
    with a decode rank, and the pairing names the prefill rank that holds the KV (an engine
    balancing by room refuses a run routed to another rank without it: no run fails here)."""
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(
            stack, workers=2, pd_modes=["prefill", "decode"], dp_size=2, scheduler="pd_capped",
            policy="thunder", profile="llama-3.1-8b-h100", speedup=20,
        )  # fmt: skip
        sched = stack.services["scheduler"].runtime
        await wait_for(lambda: len(sched.core.admission.workers) == 4, what="four ranks' rooms")
        client = await ThunderClient.connect(nats_server.url, idle_timeout_s=20)
        watcher = await connect(nats_server.url, name="run-failed")
        failures: list = []

        async def on_failure(msg) -> None:
            failures.append(msg)

        await watcher.subscribe(subjects.SCHED_RUN_FAILED_WILDCARD, cb=on_failure)
        finals = []
        for i in range(4):
            prompt = list(range(3000 + 1000 * i, 3000 + 1000 * i + 160))
            finals.append((await client.generate(
                GenerateRequest(model=MODEL, token_ids=prompt, max_tokens=4))).final)  # fmt: skip
        await watcher.flush()
        await watcher.close()
        await client.close()
    assert failures == [], [f.data[:200] for f in failures]
    assert all(f.worker_id.startswith("w1-dp") for f in finals), [f.worker_id for f in finals]
    assert all(f.usage.cached_tokens >= 144 for f in finals)


async def test_a_request_cancelled_during_its_paired_prefill_stops_both_sides(nats_server):
    """Cancelled while its prefill engine still computes (a 16k-token prompt at the modelled
    GPU's speed): the scheduler aborts the prefill worker's run, which aborts the decode side
    too, so the decode engine does not go on generating 2,000 tokens nobody reads."""
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(
            stack, workers=2, pd_modes=["prefill", "decode"], scheduler="pd_capped",
            policy="thunder", profile="llama-3.1-8b-h100", speedup=1,
        )  # fmt: skip
        sched = stack.services["scheduler"].runtime
        decode = stack.services["worker-w1"].runtime
        await wait_for(lambda: len(sched.core.admission.workers) == 2, what="both workers' rooms")
        client = await ThunderClient.connect(nats_server.url, idle_timeout_s=20)
        request = GenerateRequest(model=MODEL, token_ids=list(range(100, 100 + 16_384)),
                                  max_tokens=2000, request_id="long-1")  # fmt: skip
        stream = asyncio.create_task(client.generate(request))
        await wait_for(lambda: "long-1" in decode.running, what="the decode side of the pairing")
        prefill = stack.services["worker-w0"].runtime
        await wait_for(lambda: prefill.runs.prefill_backlog_tokens > 0, what="the prefill's run")
        # the prompt is prefilled by the prefill engine: no backlog reported by the decode side
        assert decode.runs.inflight == 1 and decode.runs.prefill_backlog_tokens == 0
        nc = await connect(nats_server.url, name="canceller")
        await Bus(nc, service="canceller").publish(
            subjects.SCHED_CANCEL, CancelRequest(request_id="long-1", reason="test")
        )
        await wait_for(lambda: "long-1" not in decode.running, timeout_s=5.0,
                       what="the decode side to stop")  # fmt: skip
        stream.cancel()
        await nc.close()
        await client.close()
    assert not stack.engines["w1"].core.has_work, "the decode engine generates nothing more"


async def test_a_pairing_no_decode_engine_can_take_fails_saying_why(nats_server):
    """A decode worker whose engine is not in SGLang's PD decode mode refuses the pairing; the
    prefill worker hands the run back, no other prefill worker is left, and the client hears
    why in under a second, each resend taken as new (not refused as already run)."""
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(
            stack, workers=2, pd_modes=["prefill", "null"], roles=["prefill", "decode"],
            scheduler="pd_capped", policy="thunder", profile="llama-3.1-8b-h100", speedup=20,
        )  # fmt: skip
        router = stack.services["router"].runtime.core
        sched = stack.services["scheduler"].runtime
        await wait_for(lambda: len(router.fleet.for_model(MODEL, None)) == 2
                       and len(sched.core.admission.workers) == 2, what="both workers")  # fmt: skip
        client = await ThunderClient.connect(nats_server.url, idle_timeout_s=20)
        started = time.monotonic()
        with pytest.raises(RequestFailed) as failed:
            await client.generate(GenerateRequest(model=MODEL, token_ids=list(range(100, 420)),
                                                  max_tokens=4))  # fmt: skip
        await client.close()
    assert time.monotonic() - started < 5
    assert "unavailable" in str(failed.value)
    assert "w0" in str(failed.value) and "not in SGLang's PD decode mode" in str(failed.value)
