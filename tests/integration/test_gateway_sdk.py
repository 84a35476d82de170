"""The gateway driven by the official ``openai`` SDK (sync, async, streaming) against a real
stack: nats-server, router, scheduler, worker adapters and simulated engines on real ports, the
gateway serving HTTP on a free port, all in this test's event loop (the sync client runs in a
thread so the loop keeps serving)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
import openai
import pytest

from tests.integration.inproc import MODEL, InprocStack, inproc_stack, start_full_stack
from thunderagent.bus import connect
from thunderagent.gateway.service import Gateway, GatewayConfig
from thunderagent.schemas import CancelRequest, GenerateRequest, subjects

pytestmark = pytest.mark.integration

PROFILE = "llama-3.1-8b-h100"
"""Large KV pool (the tiny profile holds 128 tokens); block size 16."""


@dataclass
class Running:
    stack: InprocStack
    gateway: Gateway

    @property
    def url(self) -> str:
        return self.gateway.url

    def client(self, **kw) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, **kw)


@contextlib.asynccontextmanager
async def gateway_stack(
    nats_url: str,
    *,
    workers: int = 1,
    speedup: float = 50.0,
    config: GatewayConfig | None = None,
    **stack_kw,
) -> AsyncIterator[Running]:
    """The stack, its gateway, and the fleet loaded into the gateway (models listed)."""
    async with inproc_stack(nats_url) as stack:
        await start_full_stack(stack, workers=workers, policy="thunder", profile=PROFILE,
                               block_size=16, speedup=speedup, **stack_kw)  # fmt: skip
        config = config or GatewayConfig(port=0)
        svc = await stack.start_service(
            "gateway", lambda ctx, gw: gw.run(ctx.stop), build=lambda ctx: Gateway(ctx.bus, config)
        )
        gateway: Gateway = svc.runtime
        await asyncio.wait_for(gateway.started.wait(), 10)
        give_up_at = time.monotonic() + 10
        while len(gateway.registry) < workers:
            assert time.monotonic() < give_up_at, "the gateway never saw the workers"
            await asyncio.sleep(0.02)
        yield Running(stack, gateway)


MESSAGES = [
    {"role": "system", "content": "You are a terse assistant. " * 8},
    {"role": "user", "content": "Tell me about KV caches."},
]


async def test_lora_adapters_are_listed_as_models_and_selected_by_their_id(nats_server):
    """As SGLang's ``/v1/models``: each loaded adapter is a card whose parent is the base
    model; its id is what selects it as ``model``, and the adapter's repeated prompt hits its
    own cache, never the base model's. An adapter no worker has is a 404 saying so."""
    async with gateway_stack(nats_server.url, lora_adapters=["sql"]) as run:
        client = run.client()
        listed = [(m.id, getattr(m, "parent", None)) for m in (await client.models.list()).data]
        assert listed == [(MODEL, None), (f"{MODEL}:sql", MODEL)]
        card = await client.models.retrieve(f"{MODEL}:sql")
        assert (card.id, card.parent, card.root) == (f"{MODEL}:sql", MODEL, "sql")
        first = await client.chat.completions.create(model=f"{MODEL}:sql", messages=MESSAGES,
                                                     max_tokens=4)  # fmt: skip
        assert first.model == f"{MODEL}:sql"
        again = await client.chat.completions.create(model=f"{MODEL}:sql", messages=MESSAGES,
                                                     max_tokens=4)  # fmt: skip
        assert again.usage.prompt_tokens_details.cached_tokens > 0
        base = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
        assert base.usage.prompt_tokens_details.cached_tokens == 0
        with pytest.raises(openai.NotFoundError) as missing:
            await client.chat.completions.create(model=f"{MODEL}:chat", messages=MESSAGES)
        assert "'chat'" in missing.value.message
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve(f"{MODEL}:chat")


async def test_async_sdk_chat_completions_streams_and_cached_tokens(nats_server):
    async with gateway_stack(nats_server.url) as run:
        client = run.client()
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]
        assert (await client.models.retrieve(MODEL)).id == MODEL

        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=MESSAGES, max_tokens=8, extra_headers={"x-request-id": "req-1"}
        )
        assert raw.headers["x-request-id"] == "req-1"
        first = raw.parse()
        assert first.id == "chatcmpl-req-1" and first.object == "chat.completion"
        assert first.choices[0].message.role == "assistant"
        assert first.choices[0].message.content and first.choices[0].finish_reason == "length"
        assert first.usage.completion_tokens == 8
        again = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8)
        assert again.usage.prompt_tokens == first.usage.prompt_tokens
        cached = again.usage.prompt_tokens_details.cached_tokens
        assert cached > 0, "the repeated prompt must be served from the KV cache"
        assert cached >= first.usage.prompt_tokens - 16

        stream = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=6, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = [c async for c in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text
        choice_chunks = [c for c in chunks if c.choices]
        assert choice_chunks[-1].choices[0].finish_reason == "length"
        assert all(c.choices[0].finish_reason is None for c in choice_chunks[:-1])
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0

        done = await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5)
        assert done.object == "text_completion" and done.choices[0].text
        assert done.usage.completion_tokens == 5
        by_ids = await client.completions.create(model=MODEL, prompt=[10, 11, 12, 13], max_tokens=3)
        assert by_ids.usage.prompt_tokens == 4
        pieces = [c async for c in await client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=4, stream=True)]  # fmt: skip
        assert pieces[-1].choices[0].finish_reason == "length"
        assert "".join(p.choices[0].text for p in pieces)
        await client.close()


def _sync_session(url: str) -> dict:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    with client:
        chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
        text = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
        streamed = "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=4, stream=True
            )
        )
        try:
            client.chat.completions.create(model="no/such-model", messages=MESSAGES)
            missing = None
        except openai.NotFoundError as err:
            missing = err
    return {"chat": chat, "text": text, "streamed": streamed, "missing": missing}


async def test_sync_sdk(nats_server):
    async with gateway_stack(nats_server.url) as run:
        got = await asyncio.to_thread(_sync_session, run.url)
    assert got["chat"].usage.completion_tokens == 4 and got["chat"].choices[0].message.content
    assert got["text"].usage.completion_tokens == 3
    assert got["streamed"]
    assert got["missing"] is not None and got["missing"].status_code == 404


async def no_interest(url: str, subject: str, timeout_s: float = 10.0) -> None:
    """Wait until the NATS server has dropped every subscription to ``subject``: a service's
    stop returns when its connection closes, and a publish racing the server's clean-up can
    still be routed to the closing subscription (and never answered)."""
    import nats

    nc = await nats.connect(url)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                await nc.request(subject, b"", timeout=0.2)
            except nats.errors.NoRespondersError:
                return
            except nats.errors.TimeoutError:
                pass
            await asyncio.sleep(0.05)
        raise AssertionError(f"{subject} still has subscribers after {timeout_s} s")
    finally:
        await nc.close()


async def test_error_statuses_the_stack_produces(nats_server):
    config = GatewayConfig(port=0, max_body_bytes=16 * 2**20)
    async with gateway_stack(nats_server.url, config=config) as run:
        client = run.client()
        with pytest.raises(openai.BadRequestError) as bad:
            await client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2)
        assert bad.value.status_code == 400 and bad.value.param == "n"
        assert "n > 1" in bad.value.body["message"]
        with pytest.raises(openai.BadRequestError, match="missing required field `messages`"):
            await client.post("/chat/completions", body={"model": MODEL}, cast_to=object)
        with pytest.raises(openai.BadRequestError, match=r"expected `int \| null`"):
            await client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                                 extra_body={"max_tokens": "many"})  # fmt: skip

        with pytest.raises(openai.NotFoundError) as missing:
            await client.chat.completions.create(model="no/such-model", messages=MESSAGES)
        assert missing.value.code == "model_not_found" and MODEL in missing.value.message
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("no/such-model")

        past = (time.time() - 60) * 1e3
        for stream in (False, True):
            with pytest.raises(openai.APIStatusError) as late:
                await client.chat.completions.create(
                    model=MODEL, messages=MESSAGES, max_tokens=4, stream=stream,
                    extra_body={"deadline_ms": past},
                )  # fmt: skip
            assert late.value.status_code == 504, late.value
            assert late.value.code == "deadline_exceeded"

        # under the gateway's body limit here, over the NATS server's max_payload (8 MB)
        huge = [{"role": "user", "content": "x" * (9 * 2**20)}]
        with pytest.raises(openai.APIStatusError) as big:
            await client.chat.completions.create(model=MODEL, messages=huge, max_tokens=1)
        assert big.value.status_code == 413 and big.value.code == "payload_too_large"
        assert "too large for NATS" in big.value.message

        await run.stack.stop_service("router")
        await no_interest(nats_server.url, subjects.requests(MODEL))
        with pytest.raises(openai.InternalServerError) as down:
            await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
        assert down.value.status_code == 503 and "no router" in down.value.message
        await client.close()


async def test_full_queue_is_a_429_with_retry_after(nats_server):
    """The scheduler's bounded queue refuses with ``overloaded``: the SDK sees a
    RateLimitError and the Retry-After header; what was accepted still completes."""
    async with gateway_stack(
        nats_server.url, speedup=1.0, scheduler="fcfs", scheduler_params={"max_running": 1},
        scheduler_config={"max_waiting_per_model": 1},
    ) as run:  # fmt: skip
        client = run.client()
        slow = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=200, extra_body={"ignore_eos": True}
        )
        running = asyncio.create_task(slow)
        await asyncio.sleep(0.5)  # it holds the only slot
        waiting = asyncio.create_task(
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
        )
        await asyncio.sleep(0.3)  # it fills the queue
        with pytest.raises(openai.RateLimitError) as refused:
            await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
        assert refused.value.status_code == 429 and refused.value.code == "rate_limit_exceeded"
        assert "already waiting" in refused.value.message
        assert int(refused.value.response.headers["retry-after"]) >= 1
        done = await asyncio.gather(running, waiting)
        assert [len(r.choices) for r in done] == [1, 1]
        assert done[0].usage.completion_tokens == 200
        await client.close()


async def _cancel_listener(nats_url: str) -> tuple:
    nc = await connect(nats_url, name="test-cancel")
    got: asyncio.Queue[CancelRequest] = asyncio.Queue()

    async def on_cancel(msg) -> None:
        got.put_nowait(msgspec.json.decode(msg.data, type=CancelRequest))

    await nc.subscribe(subjects.SCHED_CANCEL, cb=on_cancel)
    await nc.flush()
    return nc, got


async def _next_cancel(got: asyncio.Queue, request_id: str) -> CancelRequest:
    while True:
        cancel = await asyncio.wait_for(got.get(), 10)
        if cancel.request_id == request_id:
            return cancel


async def test_client_disconnect_publishes_a_cancel(nats_server):
    # Real-time engines: a 2,000-token answer runs ~20 s, so it is surely running when the
    # client goes away.
    async with gateway_stack(nats_server.url, speedup=1.0) as run:
        nc, got = await _cancel_listener(nats_server.url)
        client = run.client()
        streamed_id = f"stream-{uuid.uuid4().hex}"
        stream = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=2000, stream=True,
            extra_headers={"x-request-id": streamed_id},
        )  # fmt: skip
        async for _ in stream:
            break
        await stream.close()
        cancel = await _next_cancel(got, streamed_id)
        assert cancel.reason == "client disconnected"

        waiting_id = f"plain-{uuid.uuid4().hex}"
        impatient = run.client(timeout=0.5)
        with pytest.raises(openai.APITimeoutError):
            await impatient.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=2000,
                extra_headers={"x-request-id": waiting_id},
            )  # fmt: skip
        assert (await _next_cancel(got, waiting_id)).request_id == waiting_id
        give_up_at = time.monotonic() + 5
        while len(run.gateway.mux):  # both replies' inboxes were dropped
            assert time.monotonic() < give_up_at, "the gateway still reads an abandoned inbox"
            await asyncio.sleep(0.02)
        for c in (client, impatient):
            await c.close()
        await nc.close()


async def test_extensions_and_trace_context_reach_the_request_subject(nats_server):
    async with gateway_stack(nats_server.url) as run:
        nc = await connect(nats_server.url, name="test-spy")
        seen: asyncio.Queue = asyncio.Queue()

        async def spy(msg) -> None:
            seen.put_nowait(msg)

        await nc.subscribe(subjects.requests(MODEL), cb=spy)
        await nc.flush()
        trace_id = uuid.uuid4().hex
        headers = {
            "traceparent": f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01",
            "x-session-id": "agent-42",
            "x-priority": "2",
            "x-tenant-id": "acme",
            "x-request-id": "traced-1",
        }
        client = run.client()
        await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=2, extra_headers=headers
        )
        msg = await asyncio.wait_for(seen.get(), 5)
        req = msgspec.json.decode(msg.data, type=GenerateRequest)
        assert (req.request_id, req.program_id, req.priority, req.cache_salt) == (
            "traced-1", "agent-42", 2, "acme")  # fmt: skip
        assert req.stream is False and req.messages[0].role == "system"
        assert msg.headers["traceparent"].split("-")[1] == trace_id, "the client's trace goes on"
        await client.close()
        await nc.close()


async def test_metrics_health_and_the_body_limit(nats_server):
    import aiohttp

    config = GatewayConfig(port=0, max_body_bytes=2**16)
    async with gateway_stack(nats_server.url, config=config) as run:
        client = run.client()
        stream = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=64, stream=True
        )
        assert len([c async for c in stream]) >= 3
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="no/such-model", messages=MESSAGES)
        with pytest.raises(openai.APIStatusError) as big:
            await client.completions.create(model=MODEL, prompt="y" * 2**17)
        assert big.value.status_code == 413 and "over 65536 bytes" in big.value.message
        async with aiohttp.ClientSession() as http:
            async with http.get(run.url + "/health") as resp:
                health = await resp.json()
            assert resp.status == 200 and health["models"] == [MODEL] and health["workers"] == 1
            async with http.get(run.url + "/ready") as resp:
                assert resp.status == 200 and (await resp.json())["ready"] is True
            async with http.get(run.url + "/metrics") as resp:
                text = await resp.text()
            async with http.get(run.url + "/v2/nothing") as resp:
                assert resp.status == 404 and (await resp.json())["error"]["code"] == "not_found"
        await client.close()
    chat = 'route="/v1/chat/completions"'
    assert f'thunderagent_gateway_requests_total{{{chat},status="200"}}' in text
    assert f'thunderagent_gateway_requests_total{{{chat},status="404"}}' in text

    def count(name: str) -> float:
        lines = [line for line in text.splitlines() if line.startswith(f"{name}_count{{{chat}}}")]
        return float(lines[0].split()[-1]) if lines else 0.0

    assert count("thunderagent_gateway_ttft_seconds") >= 1
    assert count("thunderagent_gateway_inter_token_seconds") >= 2
    assert f"thunderagent_gateway_requests_in_flight{{{chat}}} 0.0" in text


async def test_replicas_share_the_stack(nats_server):
    async with gateway_stack(nats_server.url, workers=2) as run:
        config = GatewayConfig(port=0)
        svc = await run.stack.start_service(
            "gateway-2",
            lambda ctx, gw: gw.run(ctx.stop),
            build=lambda ctx: Gateway(ctx.bus, config),
        )
        await asyncio.wait_for(svc.runtime.started.wait(), 10)
        assert svc.runtime.url != run.url
        clients = [run.client(), openai.AsyncOpenAI(base_url=svc.runtime.url + "/v1",
                                                    api_key="unused", max_retries=0)]  # fmt: skip
        answers = await asyncio.gather(*(
            clients[i % 2].chat.completions.create(
                model=MODEL, max_tokens=3, messages=[{"role": "user", "content": f"q{i}"}],
                extra_headers={"x-request-id": f"rep-{i}"},
            )
            for i in range(20)
        ))  # fmt: skip
        assert sorted(a.id for a in answers) == sorted(f"chatcmpl-rep-{i}" for i in range(20))
        assert all(a.usage.completion_tokens == 3 for a in answers)
        for c in clients:
            await c.close()


async def test_the_live_benchmark_drives_the_gateway_like_the_baselines(nats_server):
    """``bench live --via gateway``: token-id prompts over /v1/completions, the engine's own
    TTFT from the usage chunk, so the added latency is measured as for an HTTP router."""
    from thunderagent.bench import live

    async with gateway_stack(nats_server.url) as run:
        block = live.block_tokens(1, 32)
        requests = [live.LiveRequest(i, i * 0.02, block + [i + 1] * 8, 4) for i in range(6)]
        result = await live.run_http(run.url, "thunderagent", requests, openai_model=MODEL)
    summary = result.summary()
    assert summary["requests"] == summary["completed"] == 6, summary["first_errors"]
    assert all(o.engine_ttft_ms >= 0 and o.ttft_ms >= o.engine_ttft_ms for o in result.outcomes)
    assert summary["added_latency_ms"]["p50"] > 0
    assert summary["prefix_hit_ratio"] > 0  # the shared 32-token block is cached after the first


async def test_ready_is_503_while_no_worker_can_serve_and_health_stays_200(nats_server):
    """`/health` said 200 "ok" with no worker registered while every chat request failed: a
    load balancer had nothing to tell a gateway that can serve from one that cannot."""
    import aiohttp

    async with gateway_stack(nats_server.url, workers=0) as run:
        async with aiohttp.ClientSession() as http:
            async with http.get(run.url + "/ready") as resp:
                ready = (resp.status, await resp.json())
            async with http.get(run.url + "/health") as resp:
                health = resp.status
    assert ready == (
        503,
        {"ready": False, "reason": "no worker registered", "workers": 0, "models": []},
    )
    assert health == 200


async def test_bad_http_from_a_client_is_one_warning_not_an_error_traceback(nats_server, caplog):
    """aiohttp logged an ERROR with a traceback for each request it could not parse."""
    async with gateway_stack(nats_server.url) as run:
        host, port = run.url.removeprefix("http://").split(":")
        with caplog.at_level("WARNING"):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: a\r\n"
                b"Content-Type: b\r\nContent-Length: 2\r\n\r\n{}"
            )
            await writer.drain()
            status = (await reader.readline()).split()[1]
            writer.close()
            await asyncio.sleep(0.1)
    assert status == b"400"
    about = [r for r in caplog.records if r.name == "thunderagent.gateway.http"]
    assert [(r.levelname, r.getMessage(), r.exc_info) for r in about] == [
        ("WARNING", "bad HTTP from a client: Duplicate 'Content-Type' header found.", None)
    ]


async def test_a_stop_string_ends_the_answer_before_it(nats_server):
    """The simulated engine took `stop` and ignored it: the answer ran to max_tokens."""
    async with gateway_stack(nats_server.url) as run:
        client = run.client()
        done = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=20, stop=["output", "nowhere"]
        )
        stream = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=20, stop="output", stream=True
        )
        chunks = [c async for c in stream]
        await client.close()
    assert done.choices[0].message.content == "Simulated "
    assert done.choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Simulated "
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


async def test_past_its_request_bound_the_gateway_answers_429_with_retry_after(nats_server):
    """One permit, no queue: while a streamed answer holds it, a second request is answered
    429 with ``retry-after`` at once (the SDK's ``RateLimitError``); once the stream ends, the
    next request is served."""
    config = GatewayConfig(port=0, max_concurrent_requests=1, queue_size=0)
    async with gateway_stack(nats_server.url, speedup=5.0, config=config) as run:
        client = run.client()
        stream = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=64, stream=True
        )
        first = await stream.__anext__()  # the permit is held while the answer streams
        with pytest.raises(openai.RateLimitError) as refused:
            await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
        assert refused.value.response.headers["retry-after"] == "1"
        assert "limit" in refused.value.message
        rest = [chunk async for chunk in stream]
        assert first.choices and rest[-1].choices[0].finish_reason is not None
        served = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
        assert served.choices[0].message.content is not None
        assert run.gateway.admission.held == 0
        await client.close()
