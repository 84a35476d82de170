"""One request end to end through router, scheduler, adapter and engine, over real NATS."""

from __future__ import annotations

import asyncio
import base64

import msgspec
import pytest

from tests.integration.inproc import MODEL, inproc_stack, start_full_stack
from thunderagent.bus import connect
from thunderagent.client import RequestFailed, ThunderClient
from thunderagent.schemas import (
    REPLY_DECODER,
    ErrorCode,
    ErrorReply,
    FinalReply,
    GenerateRequest,
    RouteDecisionBatch,
    TokenChunk,
    subjects,
)

pytestmark = pytest.mark.integration


async def _routable_client(stack, nats_url: str) -> ThunderClient:
    """Workers are registered; wait until the router's fleet view has them too."""
    client = await ThunderClient.connect(nats_url, idle_timeout_s=10)
    for _ in range(300):
        try:
            await client.generate(GenerateRequest(model=MODEL, token_ids=[5], max_tokens=1))
            return client
        except RequestFailed as err:
            if err.error.code not in (ErrorCode.UNKNOWN_MODEL, ErrorCode.UNAVAILABLE):
                raise
            await asyncio.sleep(0.05)
    raise AssertionError("router never saw the workers")


async def test_request_streams_tokens_and_final_usage(nats_server):
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=2)
        client = await _routable_client(stack, nats_server.url)
        replies = []
        request = GenerateRequest(model=MODEL, text="hello " * 20, max_tokens=12)
        async for reply in client.stream(request):
            replies.append(reply)
        await client.close()
    chunks = [r for r in replies if isinstance(r, TokenChunk)]
    final = replies[-1]
    assert isinstance(final, FinalReply), final
    assert sum(len(c.token_ids) for c in chunks) == 12
    assert [c.index for c in chunks] == sorted(c.index for c in chunks)
    assert final.usage.prompt_tokens == len("hello " * 20)  # byte tokenizer: one id per byte
    assert final.usage.completion_tokens == 12
    assert final.worker_id in {"w0", "w1"}
    assert final.ttft_ms <= final.e2e_ms


async def test_repeated_prompt_reports_cached_tokens(nats_server):
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=1)
        client = await _routable_client(stack, nats_server.url)
        prompt = list(range(10, 10 + 100))  # 6 full blocks of 16, 4 tokens left over
        first = await client.generate(GenerateRequest(model=MODEL, token_ids=prompt, max_tokens=2))
        second = await client.generate(GenerateRequest(model=MODEL, token_ids=prompt, max_tokens=2))
        await client.close()
    assert first.final.usage.cached_tokens == 0
    assert second.final.usage.cached_tokens == 96


@pytest.mark.parametrize(
    ("request_", "code", "fragment"),
    [
        (GenerateRequest(model="no/such-model", text="hi"), ErrorCode.UNKNOWN_MODEL, "no worker"),
        (
            GenerateRequest(model=MODEL, token_ids=[2**32 - 1], max_tokens=1),
            ErrorCode.BAD_REQUEST,
            "outside the model's vocabulary",
        ),
        (GenerateRequest(model=MODEL, token_ids=[128_255], max_tokens=1), None, None),
    ],
)
async def test_clear_errors_for_unknown_model(nats_server, request_, code, fragment):
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=1)
        client = await _routable_client(stack, nats_server.url)
        if code is None:
            done = await client.generate(request_)
            assert done.final is not None
        else:
            with pytest.raises(RequestFailed) as info:
                await client.generate(request_)
            assert info.value.error.code == code
            assert fragment in info.value.error.message
        await client.close()


@pytest.mark.parametrize(
    ("payload", "fragment"),
    [
        (b"{not json", "invalid GenerateRequest"),
        (b'{"model": "m"}', "exactly one of token_ids, text or messages"),
        (b'{"model": "m", "text": ""}', "the prompt is empty"),
        (b'{"model": "m", "token_ids": [1], "max_tokens": 0}', "max_tokens"),
    ],
)
async def test_malformed_request_gets_error_reply_and_dead_letter(nats_server, payload, fragment):
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=1)
        await (await _routable_client(stack, nats_server.url)).close()
        nc = await connect(nats_server.url, name="raw")
        dead = asyncio.get_running_loop().create_future()

        async def on_dead(msg) -> None:
            if not dead.done():
                dead.set_result(msg.data)

        await nc.subscribe(subjects.dead_letter("router"), cb=on_dead)
        reply = await nc.request(subjects.requests(MODEL), payload, timeout=5)
        error = REPLY_DECODER.decode(reply.data)
        record = msgspec.json.decode(await asyncio.wait_for(dead, 5))
        # the router survived: a good request still works afterwards
        client = ThunderClient(nc)
        done = await client.generate(GenerateRequest(model=MODEL, token_ids=[7] * 3, max_tokens=2))
        await nc.close()
    assert isinstance(error, ErrorReply)
    assert error.code == ErrorCode.BAD_REQUEST
    assert fragment in error.message
    assert record["service"] == "router"
    assert fragment in record["reason"]
    assert base64.b64decode(record["raw"]) == payload
    assert done.final is not None


async def test_no_router_is_an_immediate_error_not_a_timeout(nats_server):
    client = await ThunderClient.connect(nats_server.url, idle_timeout_s=30)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(RequestFailed) as info:
        await client.generate(GenerateRequest(model=MODEL, text="anyone?"))
    await client.close()
    assert info.value.error.code == ErrorCode.UNAVAILABLE
    assert loop.time() - started < 5


async def _decision_watcher(url: str):
    """A connection watching ``ROUTE_DECISIONS``, and the batches it has seen so far."""
    decoder = msgspec.json.Decoder(RouteDecisionBatch)
    watcher = await connect(url, name="decision-watcher")
    batches: list[RouteDecisionBatch] = []

    async def on_batch(msg) -> None:
        batches.append(decoder.decode(msg.data))

    await watcher.subscribe(subjects.ROUTE_DECISIONS, cb=on_batch)
    await watcher.flush()
    return watcher, batches


async def test_route_decisions_reach_observers_in_batches(nats_server):
    """Every routed request's decision reaches a watcher of ``ROUTE_DECISIONS``, once, in
    batches of one router replica's decisions (not one message per request)."""
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=2)
        client = await _routable_client(stack, nats_server.url)
        watcher, batches = await _decision_watcher(nats_server.url)
        requests = [
            GenerateRequest(model=MODEL, token_ids=[7, i], max_tokens=2, request_id=f"d{i}")
            for i in range(20)
        ]
        await asyncio.gather(*(client.generate(r) for r in requests))
        for _ in range(100):  # the last batch leaves a window after its first decision
            if sum(d.request_id.startswith("d") for b in batches for d in b.decisions) >= 20:
                break
            await asyncio.sleep(0.02)
        await client.close()
        await watcher.close()
        router_id = stack.services["router"].runtime.router.config.router_id
    mine = {r.request_id for r in requests}  # (the warm-up request's may be in a batch too)
    ids = [d.request_id for b in batches for d in b.decisions if d.request_id in mine]
    assert sorted(ids) == sorted(mine)
    assert len(batches) < 20, "decisions of concurrent requests share messages"
    assert {b.router_id for b in batches} == {router_id}


async def test_decisions_over_the_payload_limit_go_in_halves_in_order(nats_server):
    """A fleet of 600 workers: 256 decisions, each naming every worker, are ~9 MB, over the
    server's 8 MB payload limit. The router's batch goes as two messages, every decision
    once, in order, none dropped."""
    from thunderagent.bus import Bus
    from thunderagent.router.service import Router, RouterConfig
    from thunderagent.schemas import Candidate, RouteDecision

    nc = await connect(nats_server.url, name="big-decisions")
    watcher, batches = await _decision_watcher(nats_server.url)
    router = Router(RouterConfig(router_id="r-big"), Bus(nc, service="router"))
    fleet = [Candidate(worker_id=f"worker-{i:03d}", score=-1.0 / (i + 1)) for i in range(600)]
    for n in range(256):
        router.decisions.add(RouteDecision(
            request_id=f"big-{n}", model=MODEL, worker_id="worker-000", overlap_blocks=0,
            prompt_blocks=1, candidates=fleet, policy="thunder", decided_at=0.0,
        ))  # fmt: skip
    await router.decisions.close()
    for _ in range(200):
        if sum(len(b.decisions) for b in batches) >= 256:
            break
        await asyncio.sleep(0.02)
    await nc.close()
    await watcher.close()
    assert [d.request_id for b in batches for d in b.decisions] == [f"big-{n}" for n in range(256)]
    assert len(batches) == 2 and router.decisions.sent == 2 and router.decisions.dropped == 0


async def test_a_model_whose_workers_left_is_unavailable_not_unknown(nats_server):
    """With its only worker gone, a served model was answered `unknown_model` (HTTP 404) as
    if it had never existed; a client should retry, not give up."""
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=1)
        client = await _routable_client(stack, nats_server.url)
        await stack.stop_service("worker-w0")  # deregisters: the router's fleet empties
        client.retries = 0
        for _ in range(100):
            try:
                await client.generate(GenerateRequest(model=MODEL, token_ids=[5], max_tokens=1))
            except RequestFailed as err:
                failed = err.error
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the router kept routing to a worker that left")
        await client.close()
    assert failed.code == ErrorCode.UNAVAILABLE and failed.service == "router"
    assert "no live worker serves model" in failed.message


async def test_a_resend_of_a_running_request_is_answered_held_and_runs_once(nats_server):
    """The client resends a request it has heard nothing of; the router tells it the request
    is held (else a client can't tell a queued request from one a hung router swallowed)."""
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=2)
        client = await _routable_client(stack, nats_server.url)
        await client.close()
        nc = await connect(nats_server.url, name="resender")
        inbox = nc.new_inbox()
        replies: asyncio.Queue = asyncio.Queue()

        async def on_reply(msg) -> None:
            replies.put_nowait(REPLY_DECODER.decode(msg.data))

        await nc.subscribe(inbox, cb=on_reply)
        request = GenerateRequest(model=MODEL, token_ids=list(range(40, 140)), max_tokens=256,
                                  request_id="r-resent")  # fmt: skip
        subject = subjects.requests(MODEL)
        await nc.publish(subject, msgspec.json.encode(request), reply=inbox)
        first = await asyncio.wait_for(replies.get(), 10)
        assert isinstance(first, TokenChunk)
        resend = msgspec.structs.replace(request, retry=1)
        await nc.publish(subject, msgspec.json.encode(resend), reply=inbox)
        got = [first]
        while not isinstance(got[-1], FinalReply | ErrorReply):
            got.append(await asyncio.wait_for(replies.get(), 10))
        await asyncio.sleep(0.3)  # anything trailing the final reply
        while not replies.empty():
            got.append(replies.get_nowait())
        await nc.close()
    kinds = [type(r).__name__ for r in got]
    assert kinds.count("HeldReply") == 1 and kinds.count("FinalReply") == 1, kinds
    assert "ErrorReply" not in kinds
    tokens = [t for r in got if isinstance(r, TokenChunk) for t in r.token_ids]
    assert len(tokens) == 256  # generated once
