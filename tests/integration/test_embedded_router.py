"""A router replica embedded in the client's or the gateway's process (``serve_requests=False``):
with no router service running, requests are still routed by where their prefix is cached, go
the credit fast path straight to the adapter, and errors come back as with a router service."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import msgspec
import pytest

from tests.integration.inproc import MODEL, inproc_stack, start_full_stack
from tests.integration.test_kv_routing import PAGE, conversation, holder_known, wait_for
from thunderagent.bus import connect
from thunderagent.cli.main import gateway_with_router
from thunderagent.client import RequestFailed, ThunderClient
from thunderagent.embedded import free_port
from thunderagent.gateway.service import GatewayConfig
from thunderagent.router.service import RouterConfig, RouterService
from thunderagent.router_core import RouterParams
from thunderagent.schemas import DirectDispatch, ErrorCode, GenerateRequest, subjects

pytestmark = pytest.mark.integration
PROFILE = "llama-3.1-8b-h100"


def _router_config() -> RouterConfig:
    return RouterConfig(params=RouterParams(policy="thunder", seed=1))


async def _embedded_router(stack, workers: int = 3, *, alone: bool = True) -> RouterService:
    """A replica that serves no requests started (``alone``: the router service stopped)."""
    if alone:
        await stack.stop_service("router")
    config = _router_config()
    running = await stack.start_service(
        "embedded-router",
        lambda ctx, svc: svc.run(),
        build=lambda ctx: RouterService(ctx, config, serve_requests=False),
    )
    router: RouterService = running.runtime
    await asyncio.wait_for(router.serving.wait(), 15)
    await wait_for(lambda: len(router.core.fleet.for_model(MODEL)) == workers, what="the fleet")
    return router


async def test_client_with_an_embedded_router_routes_by_prefix_on_the_fast_path(nats_server):
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=3, policy="thunder", profile=PROFILE, speedup=50)
        router = await _embedded_router(stack)
        spy = await connect(nats_server.url, name="spy")
        directs: list[DirectDispatch] = []

        async def on_direct(msg) -> None:
            directs.append(msgspec.json.decode(msg.data, type=DirectDispatch))

        await spy.subscribe(subjects.SCHED_DIRECT_WILDCARD, cb=on_direct)

        # nothing serves the request subject: a plain client is refused at once
        plain = await ThunderClient.connect(nats_server.url, idle_timeout_s=10, retries=0)
        with pytest.raises(RequestFailed) as refused:
            await plain.generate(GenerateRequest(model=MODEL, token_ids=[5], max_tokens=1))
        assert refused.value.error.code == ErrorCode.UNAVAILABLE
        await plain.close()

        # on the replica's own connection: a run's end, published before the client's answer,
        # then reaches the replica first (on another connection the next turn could be routed
        # while the replica still books the first run on its worker)
        client = ThunderClient(router.ctx.bus.nc, idle_timeout_s=10, route=router.router.handle)
        prefix = conversation(3, 12)  # 12 full blocks
        first = await client.generate(
            GenerateRequest(model=MODEL, token_ids=prefix + [9, 9], max_tokens=4)
        )
        await holder_known(router.core, prefix, first.final.worker_id)
        second = await client.generate(
            GenerateRequest(model=MODEL, token_ids=prefix + [8, 8, 8], max_tokens=4)
        )
        with pytest.raises(RequestFailed) as unknown:
            await client.generate(GenerateRequest(model="no/such-model", token_ids=[1]))
        await wait_for(lambda: len(directs) >= 2, what="the direct-dispatch notices")
        await spy.close()  # the client's connection is the replica's: the stack closes it
    assert first.final.usage.completion_tokens == 4
    assert second.final.worker_id == first.final.worker_id
    assert second.final.usage.cached_tokens == 12 * PAGE
    assert unknown.value.error.code == ErrorCode.UNKNOWN_MODEL
    assert unknown.value.error.service == "router"
    # both went the credit fast path, dispatched by the embedded replica itself
    ours = {
        d.submit.request.request_id
        for d in directs
        if d.submit.router_id == router.router.config.router_id
    }
    assert {first.request_id, second.request_id} <= ours


async def test_gateway_with_an_embedded_router_serves_http(nats_server):
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=2, policy="thunder", profile=PROFILE, speedup=50)
        await stack.stop_service("router")
        config = GatewayConfig(port=free_port())
        await stack.start_service(
            "gateway", lambda ctx: gateway_with_router(ctx, config, _router_config())
        )
        url = f"http://127.0.0.1:{config.port}"
        body = {"model": MODEL, "prompt": "Once upon a time " * 8, "max_tokens": 5}
        answers = []
        async with aiohttp.ClientSession() as session:
            give_up_at = time.monotonic() + 20
            # until the replica serves, then three more: with two workers, once the second
            # request has missed (routed by load to the worker without the prefix) both hold
            # it, so one of the three follow-ups finds it cached whatever the routing
            while len(answers) < 4:
                assert time.monotonic() < give_up_at, "the gateway never served a completion"
                try:
                    async with session.post(url + "/v1/completions", json=body) as resp:
                        if resp.status == 200:
                            answers.append(await resp.json())
                            continue
                except aiohttp.ClientConnectionError:
                    pass
                await asyncio.sleep(0.1)
    first, *again = answers
    assert first["usage"]["completion_tokens"] == 5
    assert {a["usage"]["prompt_tokens"] for a in again} == {first["usage"]["prompt_tokens"]}
    assert any(a["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for a in again)


async def test_the_replica_that_routes_gets_the_room_not_half(nats_server):
    """An embedded replica taking all the requests beside an idle router service: once its
    requests count as demand (the scheduler reweighs every second), it is lent nearly all of
    each worker's room, where an equal split held it to half."""
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=2, policy="thunder", profile=PROFILE, speedup=50)
        idle = stack.services["router"].runtime.router
        embedded = await _embedded_router(stack, 2, alone=False)
        ours = embedded.router.wallet

        def lent(wallet) -> int:
            return sum(wallet.credits.values())

        await wait_for(lambda: lent(ours) > 0 and lent(idle.wallet) > 0, what="both lent room")
        assert abs(lent(ours) - lent(idle.wallet)) <= 2  # no demand yet: an equal split
        client = ThunderClient(embedded.ctx.bus.nc, idle_timeout_s=10, route=embedded.router.handle)
        for i in range(40):
            await client.generate(
                GenerateRequest(model=MODEL, token_ids=[1000 + i] * 40, max_tokens=1)
            )
        await wait_for(
            lambda: lent(ours) >= 8 * max(1, lent(idle.wallet)), what="the room to follow demand"
        )
        assert lent(idle.wallet) >= 1  # the idle replica keeps a sliver
