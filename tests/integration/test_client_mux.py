"""ThunderClient over its one shared reply subscription, against a real NATS server and a
stand-in router: replies reach the right request, errors stay errors, abandoned runs can be
cancelled."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from thunderagent.bus import connect
from thunderagent.client import ThunderClient
from thunderagent.schemas import (
    CancelRequest,
    ErrorCode,
    ErrorReply,
    FinalReply,
    GenerateRequest,
    HeldReply,
    TokenChunk,
    Usage,
    subjects,
)

pytestmark = pytest.mark.integration
MODEL = "sim/mux-test"
enc = msgspec.json.Encoder()


async def _router(
    nats_url: str,
    *,
    answer: bool = True,
    final: bool = True,
    seen: list[GenerateRequest] | None = None,
    hold_s: float = 0.0,
):
    """Answers every request with one chunk per prompt token (its id), then a final reply.
    ``hold_s``: a first send is kept that long before the answer, and a resend is answered
    ``HeldReply`` at once (what the router does when the scheduler accepted a resend)."""
    nc = await connect(nats_url, name="fake-router")
    held: set[asyncio.Task] = set()

    async def on_request(msg) -> None:
        req = msgspec.json.decode(msg.data, type=GenerateRequest)
        if seen is not None:
            seen.append(req)
        if not answer:
            return
        if hold_s and req.retry:
            await nc.publish(msg.reply, enc.encode(HeldReply(request_id=req.request_id)))
        elif hold_s:  # answered later, from a task: the next message is read meanwhile
            task = asyncio.ensure_future(reply(req, msg.reply, hold_s))
            held.add(task)
            task.add_done_callback(held.discard)
        else:
            await reply(req, msg.reply, 0.0)

    async def reply(req: GenerateRequest, subject: str, after_s: float) -> None:
        await asyncio.sleep(after_s)
        for i, tok in enumerate(req.token_ids or []):
            chunk = TokenChunk(request_id=req.request_id, index=i, token_ids=[tok], text="x")
            await nc.publish(subject, enc.encode(chunk))
            await asyncio.sleep(0)
        if final:
            usage = Usage(prompt_tokens=len(req.token_ids or []), cached_tokens=0,
                          completion_tokens=len(req.token_ids or []))  # fmt: skip
            done = FinalReply(request_id=req.request_id, worker_id="w", usage=usage,
                              ttft_ms=0.1, e2e_ms=0.2)  # fmt: skip
            await nc.publish(subject, enc.encode(done))

    await nc.subscribe(subjects.requests(MODEL), cb=on_request)
    await nc.flush()
    return nc


async def test_concurrent_streams_share_one_subscription(nats_server):
    router = await _router(nats_server.url)
    client = await ThunderClient.connect(nats_server.url, idle_timeout_s=5)
    first = await client.generate(GenerateRequest(model=MODEL, token_ids=[9], max_tokens=1))
    subs = len(client.nc._subs)
    prompts = [[i, i + 1, i + 2] for i in range(0, 60, 3)]
    done = await asyncio.gather(
        *(client.generate(GenerateRequest(model=MODEL, token_ids=p, max_tokens=3)) for p in prompts)
    )
    assert first.token_ids == [9]
    assert [d.token_ids for d in done] == prompts, "every reply reached its own request"
    assert all(d.final is not None and d.final.usage.prompt_tokens == 3 for d in done)
    assert len(client.nc._subs) == subs, "no subscription per request"
    assert len(client.mux) == 0, "every inbox closed"
    await client.close()
    await router.close()


async def test_idle_timeout_and_no_router_are_error_replies(nats_server):
    # retries=0: the first silence is the answer (retries resend after retry_after_s)
    client = await ThunderClient.connect(nats_server.url, idle_timeout_s=0.3, retries=0)
    request = GenerateRequest(model=MODEL, token_ids=[1], max_tokens=1)
    replies = [r async for r in client.stream(request)]
    assert len(replies) == 1 and isinstance(replies[0], ErrorReply)
    assert replies[0].code == ErrorCode.UNAVAILABLE and "no router" in replies[0].message
    # no retry: _router's flush() returns once the server has its SUB (bus.fastpath)
    silent = await _router(nats_server.url, answer=False)
    replies = [r async for r in client.stream(request)]
    assert isinstance(replies[-1], ErrorReply) and replies[-1].code == ErrorCode.UNAVAILABLE
    assert "no reply within 0.3s" in replies[-1].message
    too_big = GenerateRequest(
        model=MODEL, token_ids=[1] * (client.nc.max_payload // 2 + 1), max_tokens=1
    )
    replies = [r async for r in client.stream(too_big)]
    assert replies[-1].code == ErrorCode.PAYLOAD_TOO_LARGE and "bus limit of" in replies[-1].message
    await client.close()
    await silent.close()


async def test_a_router_restarting_is_waited_for_by_the_retries(nats_server):
    """With no router subscribed (the only replica restarting), the request failed at once
    although the client had retries left."""
    client = await ThunderClient.connect(nats_server.url, idle_timeout_s=5, retries=3)
    request = GenerateRequest(model=MODEL, token_ids=[4, 5], max_tokens=2)
    pending = asyncio.ensure_future(client.generate(request))
    await asyncio.sleep(0.3)  # the first try has been refused: no responders
    router = await _router(nats_server.url)  # back before the retries run out (0.5 + 1 + 2 s)
    done = await asyncio.wait_for(pending, 10)
    assert done.token_ids == [4, 5] and done.final is not None
    await client.close()
    await router.close()


async def test_a_hung_router_is_an_error_after_the_retries_not_the_idle_timeout(nats_server):
    """A router that reads requests and never answers (stopped with SIGSTOP) held a request
    for the whole idle timeout (120 s at the gateway) after the retries had run out."""
    seen: list[GenerateRequest] = []
    hung = await _router(nats_server.url, answer=False, seen=seen)
    client = await ThunderClient.connect(
        nats_server.url, idle_timeout_s=30, retries=2, retry_after_s=0.2
    )
    request = GenerateRequest(model=MODEL, token_ids=[1], max_tokens=1, request_id="r-h")
    started = asyncio.get_running_loop().time()
    replies = await asyncio.wait_for(_collect(client.stream(request)), 10)
    waited = asyncio.get_running_loop().time() - started
    assert len(replies) == 1 and isinstance(replies[0], ErrorReply)
    error = replies[0]
    assert (error.code, error.service) == (ErrorCode.UNAVAILABLE, "router")
    assert "no router answered the request" in error.message and "(3 sends)" in error.message
    assert [r.retry for r in seen] == [0, 1, 2]
    assert 0.6 <= waited < 5  # three silences of 0.2 s, nowhere near the 30 s idle timeout
    await client.close()
    await hung.close()


async def test_a_held_resend_waits_for_its_answer_without_resending(nats_server):
    """A request queued for longer than ``retry_after_s`` is resent once, answered held, and
    then only waited for, however long it takes (up to the idle timeout)."""
    seen: list[GenerateRequest] = []
    router = await _router(nats_server.url, seen=seen, hold_s=1.0)
    client = await ThunderClient.connect(
        nats_server.url, idle_timeout_s=5, retries=3, retry_after_s=0.2
    )
    done = await asyncio.wait_for(
        client.generate(GenerateRequest(model=MODEL, token_ids=[7, 8], max_tokens=2)), 10
    )
    assert done.token_ids == [7, 8] and done.final is not None
    assert [r.retry for r in seen] == [0, 1]  # held at the first resend: no more sends
    await client.close()
    await router.close()


async def _collect(stream) -> list:
    return [r async for r in stream]


async def test_an_abandoned_stream_is_cancelled_when_asked(nats_server):
    router = await _router(nats_server.url, final=False)
    watcher = await connect(nats_server.url, name="watch")
    cancels: asyncio.Queue = asyncio.Queue()

    async def on_cancel(msg) -> None:
        cancels.put_nowait(msgspec.json.decode(msg.data, type=CancelRequest))

    await watcher.subscribe(subjects.SCHED_CANCEL, cb=on_cancel)
    await watcher.flush()
    polite = await ThunderClient.connect(nats_server.url, idle_timeout_s=5, cancel_abandoned=True)
    request = GenerateRequest(model=MODEL, token_ids=[1, 2, 3], max_tokens=3, request_id="r-1")
    async for reply in polite.stream(request):
        assert isinstance(reply, TokenChunk)
        break  # the consumer walks away mid-stream
    await asyncio.sleep(0)
    cancel = await asyncio.wait_for(cancels.get(), 5)
    assert cancel.request_id == "r-1"
    plain = await ThunderClient.connect(nats_server.url, idle_timeout_s=5)
    async for _ in plain.stream(GenerateRequest(model=MODEL, token_ids=[4, 5], max_tokens=2)):
        break
    await asyncio.sleep(0.3)
    assert cancels.empty(), "without cancel_abandoned nothing is cancelled (the default)"
    for nc in (polite, plain):
        await nc.close()
    await watcher.close()
    await router.close()


async def test_a_second_run_from_the_same_position_reaches_the_client_once(nats_server):
    """A run the scheduler could not stop (its worker answered neither the hand-off nor the
    abort) streams on beside the run that replaced it, both from the same position: the client
    gets each position's tokens once, in order, however the two interleave."""
    nc = await connect(nats_server.url, name="two-runs")

    async def on_request(msg) -> None:
        req = msgspec.json.decode(msg.data, type=GenerateRequest)
        tokens = req.token_ids or []
        # the stray run got two tokens out, then the replacement streams them all from 0
        for i in [0, 1, 0, 1, 2, 3]:
            chunk = TokenChunk(request_id=req.request_id, index=i, token_ids=[tokens[i]])
            await nc.publish(msg.reply, enc.encode(chunk))
        usage = Usage(prompt_tokens=4, cached_tokens=0, completion_tokens=4)
        done = FinalReply(request_id=req.request_id, worker_id="w", usage=usage,
                          ttft_ms=0.1, e2e_ms=0.2)  # fmt: skip
        await nc.publish(msg.reply, enc.encode(done))

    await nc.subscribe(subjects.requests(MODEL), cb=on_request)
    await nc.flush()
    for retries in (0, 3):  # the first chunk comes through the retrying path too
        client = await ThunderClient.connect(nats_server.url, idle_timeout_s=5, retries=retries)
        request = GenerateRequest(model=MODEL, token_ids=[7, 8, 9, 10], max_tokens=4)
        replies = await _collect(client.stream(request))
        chunks = [r for r in replies if isinstance(r, TokenChunk)]
        assert [c.index for c in chunks] == [0, 1, 2, 3]
        assert [t for c in chunks for t in c.token_ids] == [7, 8, 9, 10]
        assert isinstance(replies[-1], FinalReply)
        await client.close()
    await nc.close()
