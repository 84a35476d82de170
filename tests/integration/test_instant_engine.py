"""The simulated engine's instant mode (``--engine instant``): one token at once, over SGLang's
``/generate`` (streamed and not), with the prefix cache and its KV events still real; and the
whole stack in front of it."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from tests.integration.inproc import MODEL, inproc_stack, start_full_stack
from thunderagent.client import ThunderClient
from thunderagent.schemas import GenerateRequest
from thunderagent.sglang import kv_wire

pytestmark = pytest.mark.integration


async def test_one_token_at_once_with_a_real_cache(nats_server):
    prompt = list(range(10, 50))  # 2 full blocks of 16, and 8 tokens more
    async with inproc_stack(nats_server.url) as stack:
        url = await stack.start_engine("e0", instant=True)
        engine = stack.engines["e0"]
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 8}}
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/generate", json={**body, "stream": True}) as r:
                streamed = (await r.read()).decode()
                kind = r.headers["Content-Type"]
            async with s.post(url + "/generate", json=body) as r:
                whole = await r.json()
            bad = [
                await s.post(url + "/generate", data=b"{nope"),
                await s.post(url + "/generate", json={"input_ids": []}),
                await s.post(url + "/generate", json={"input_ids": [-1]}),
            ]
    lines = [ln for ln in streamed.split("\n") if ln.startswith("data:")]
    assert kind.startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]" and len(lines) == 2, "one chunk, then the end"
    first = json.loads(lines[0][5:])
    assert len(first["output_ids"]) == 1, "one token whatever max_new_tokens asks"
    meta = first["meta_info"]
    assert (meta["prompt_tokens"], meta["cached_tokens"], meta["completion_tokens"]) == (40, 0, 1)
    assert meta["finish_reason"] == {"type": "length", "length": 1}
    assert 0 <= meta["engine_ttft_s"] < 0.5
    # the same prompt again: its two full blocks are cached now
    assert whole["meta_info"]["cached_tokens"] == 32
    keys = kv_wire.sglang_block_hashes(prompt[:32], 16)
    assert engine.core.cache.match(keys).gpu == 2
    assert [r.status for r in bad] == [400, 400, 400]


async def test_the_stack_in_front_of_instant_engines(nats_server):
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=2, policy="thunder", instant=True,
                               profile="llama-3.1-8b-h100", block_size=16)  # fmt: skip
        client = await ThunderClient.connect(nats_server.url, idle_timeout_s=10)
        # long enough that its cached prefix outweighs any load difference in thunder's cost
        request = GenerateRequest(model=MODEL, token_ids=list(range(100, 2148)), max_tokens=4)
        first = await client.generate(request)
        for _ in range(40):  # until the engine's KV event has reached the router
            again = await client.generate(request)
            if again.final.usage.cached_tokens:
                break
            await asyncio.sleep(0.05)
        await client.close()
    assert len(first.token_ids) == 1 and first.final.usage.completion_tokens == 1
    assert first.final.usage.cached_tokens == 0
    assert again.final.usage.cached_tokens == 2047, "routed to the engine that holds its prefix"
    assert again.final.worker_id == first.final.worker_id
