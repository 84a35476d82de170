"""Limits with clear errors where a request enters, over real NATS: context length, vocabulary,
the bus payload limit, the bounded queue (``overloaded`` with a retry hint) and the per-run
time limit that frees the engine slot."""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.inproc import MODEL, inproc_stack, start_full_stack
from thunderagent.client import RequestFailed, ThunderClient
from thunderagent.schemas import ErrorCode, GenerateRequest, SamplingParams

pytestmark = pytest.mark.integration


async def routable(nats_url: str) -> ThunderClient:
    client = await ThunderClient.connect(nats_url, idle_timeout_s=20)
    await client.generate(GenerateRequest(model=MODEL, token_ids=[5], max_tokens=1))
    return client


async def expect_error(client: ThunderClient, request: GenerateRequest) -> RequestFailed:
    with pytest.raises(RequestFailed) as info:
        await client.generate(request)
    return info.value


async def test_requests_past_the_models_limits_are_refused_at_once(nats_server):
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=1, profile="tiny")
        client = await routable(nats_server.url)
        loop = asyncio.get_running_loop()
        started = loop.time()
        runaway = await expect_error(
            client, GenerateRequest(model=MODEL, token_ids=[5, 6], max_tokens=1_000_000_000)
        )
        assert runaway.error.code == ErrorCode.CONTEXT_LENGTH
        assert "limit (512 tokens" in runaway.error.message, "the tiny profile's KV pool"
        # under the model's context (131,072) but over the pool: the engine could never take it
        # (SGLang's max_req_input_len is bounded by the pool too), so it is refused here
        past_pool = await expect_error(
            client, GenerateRequest(model=MODEL, token_ids=[5] * 600, max_tokens=1)
        )
        assert past_pool.error.code == ErrorCode.CONTEXT_LENGTH
        assert "prompt (600 tokens)" in past_pool.error.message
        long_text = await expect_error(client, GenerateRequest(model=MODEL, text="x" * 400_000))
        assert long_text.error.code == ErrorCode.CONTEXT_LENGTH
        assert "prompt (400000 tokens)" in long_text.error.message
        vocab = await expect_error(
            client, GenerateRequest(model=MODEL, token_ids=[7, 2**32 - 1], max_tokens=1)
        )
        assert vocab.error.code == ErrorCode.BAD_REQUEST
        assert "vocabulary (ids below 128256)" in vocab.error.message
        limit = client.nc.max_payload  # the server's max_payload
        too_big = await expect_error(client, GenerateRequest(model=MODEL, text="y" * limit))
        assert too_big.error.code == ErrorCode.PAYLOAD_TOO_LARGE
        assert "bus limit of" in too_big.error.message
        assert loop.time() - started < 5, "every refusal is immediate"
        done = await client.generate(GenerateRequest(model=MODEL, token_ids=[9] * 8, max_tokens=2))
        await client.close()
    assert done.final is not None, "the stack still serves after the refusals"


async def test_full_queue_answers_overloaded_with_a_retry_hint(nats_server):
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(
            stack, workers=1, profile="tiny", scheduler="fcfs",
            scheduler_params={"max_running": 1},
            scheduler_config={"max_waiting_per_model": 1},
        )  # fmt: skip
        client = await routable(nats_server.url)
        slow = SamplingParams(ignore_eos=True)
        running = asyncio.create_task(
            client.generate(
                GenerateRequest(model=MODEL, token_ids=[11] * 8, max_tokens=300, sampling=slow)
            )
        )
        await asyncio.sleep(0.3)  # it holds the only slot
        waiting = asyncio.create_task(
            client.generate(GenerateRequest(model=MODEL, token_ids=[12] * 8, max_tokens=2))
        )
        await asyncio.sleep(0.3)  # it fills the queue
        refused = await expect_error(
            client, GenerateRequest(model=MODEL, token_ids=[13] * 8, max_tokens=2)
        )
        assert refused.error.code == ErrorCode.OVERLOADED
        assert refused.error.retry_after_s is not None and refused.error.retry_after_s >= 1.0
        await asyncio.gather(running, waiting)  # nothing that was accepted is lost
        await client.close()


async def test_a_run_past_its_time_limit_is_aborted_and_frees_the_engine(nats_server):
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=1, profile="tiny", adapter={"max_request_s": 0.5})
        client = await routable(nats_server.url)
        loop = asyncio.get_running_loop()
        started = loop.time()
        stopped = await expect_error(
            client, GenerateRequest(model=MODEL, token_ids=[21] * 8, max_tokens=480)
        )  # ~2.4 s of decode on the tiny profile
        assert stopped.error.code == ErrorCode.DEADLINE
        assert "limit of 0.5 s" in stopped.error.message
        assert loop.time() - started < 3
        engine = stack.engines["w0"]
        for _ in range(100):  # the abort reaches the engine: its slot is free again
            if not engine.core.has_work:
                break
            await asyncio.sleep(0.02)
        assert not engine.core.has_work
        await client.close()
