"""``bench live --baseline dynamo``: Dynamo 1.6.1's selection core behind our proxy, in front of
simulated engines whose KV events it reads from their own ZMQ publishers."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from tests.integration.inproc import inproc_stack
from thunderagent.bench import dynamo_router
from thunderagent.embedded import free_port

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _dynamo():
    pytest.importorskip("dynamo", reason="run scripts/setup.sh (the dynamo extra)")


async def _generate(session, url: str, tokens: list[int]) -> dict:
    body = {"input_ids": tokens, "sampling_params": {"max_new_tokens": 3}, "stream": True}
    last: dict = {}
    async with session.post(url + "/generate", json=body) as r:
        assert r.status == 200
        async for raw in r.content:
            line = raw.strip()
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                last = json.loads(line[5:])
    return last["meta_info"]


async def test_dynamos_router_sends_a_prompt_back_to_the_engine_that_cached_it(nats_server):
    async with inproc_stack(nats_server.url) as stack:
        urls = [await stack.start_engine(f"e{i}", speedup=50.0) for i in range(2)]
        application = await dynamo_router.app(urls)
        runner = web.AppRunner(application)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        proxy = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as s:
                # each engine caches a document of its own, sent to it directly
                docs = [list(range(100 + 1000 * i, 100 + 1000 * i + 96)) for i in range(2)]
                for url, doc in zip(urls, docs, strict=True):
                    assert (await _generate(s, url, doc))["cached_tokens"] == 0
                await asyncio.sleep(0.5)  # the engines' KV events reach Dynamo's index
                hits = [
                    await _generate(s, proxy, [*docs[k % 2], 7 + k]) for k in range(6)
                ]  # fmt: skip
                bad = await s.post(proxy + "/generate", json={"input_ids": []})
                not_json = await s.post(proxy + "/generate", data=b"{nope")
            loads = application[dynamo_router.SERVICE].loads()
        finally:
            await runner.cleanup()
    # every question about a document went to the engine holding it (a chance routing finds
    # both holders six times in 64): its 6 pages found, not recomputed on the other engine
    assert [m["cached_tokens"] for m in hits] == [96] * 6
    assert (bad.status, not_json.status) == (400, 400)
    # every booking freed at its run's end
    assert all(w["active_requests"] == 0 for m in loads for w in m["loads"])


async def test_an_engine_without_kv_events_is_refused_with_the_reason(nats_server):
    async with inproc_stack(nats_server.url) as stack:
        url = await stack.start_engine("e0", kv_events=False)
        with pytest.raises(SystemExit, match="publishes no KV events"):
            await dynamo_router.app([url])
