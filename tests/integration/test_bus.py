"""The bus helpers against a real NATS server."""

from __future__ import annotations

import asyncio
import base64

import msgspec
import pytest

from thunderagent.bus import Bus, BusError, NoResponders, RequestTimeout, connect
from thunderagent.schemas import REPLY_DECODER, Ack, ErrorCode, ErrorReply, ResyncRequest, subjects

pytestmark = pytest.mark.integration


async def test_handler_failure_is_answered_dead_lettered_and_survived(nats_server):
    nc = await connect(nats_server.url, name="svc")
    bus = Bus(nc, service="svc")
    calls = []

    async def handler(msg: ResyncRequest, delivery) -> None:
        calls.append(msg.worker_id)
        if msg.worker_id == "boom":
            raise RuntimeError("kaput")
        await bus.publish(delivery.reply, Ack(accepted=True))

    await bus.subscribe("t.resync", ResyncRequest, handler)
    client = await connect(nats_server.url, name="client")
    dead: asyncio.Queue = asyncio.Queue()
    await client.subscribe(subjects.dead_letter("svc"), cb=dead.put)
    payload = msgspec.json.encode(ResyncRequest(worker_id="boom", reason="x"))
    reply = REPLY_DECODER.decode((await client.request("t.resync", payload, timeout=2)).data)
    assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.INTERNAL
    assert "kaput" in reply.message
    record = msgspec.json.decode((await asyncio.wait_for(dead.get(), 2)).data)
    assert base64.b64decode(record["raw"]) == payload
    ok = await bus.request("t.resync", ResyncRequest(worker_id="fine", reason="x"), Ack, timeout=2)
    assert ok.accepted and calls == ["boom", "fine"]
    assert bus.stats["t.resync"].handler_errors == 1
    assert bus.stats["t.resync"].dead_lettered == 1
    await client.close()
    await nc.close()


async def test_traceparent_travels_in_headers(nats_server):
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("t")
    nc = await connect(nats_server.url, name="a")
    bus = Bus(nc, service="a")
    got: asyncio.Future = asyncio.get_running_loop().create_future()

    async def on_msg(msg) -> None:
        got.set_result(msg.headers)

    await nc.subscribe("t.trace", cb=on_msg)
    with tracer.start_as_current_span("parent") as span:
        await bus.publish("t.trace", Ack(accepted=True))
        trace_id = format(span.get_span_context().trace_id, "032x")
    headers = await asyncio.wait_for(got, 2)
    assert headers["traceparent"].split("-")[1] == trace_id
    await nc.close()


async def test_request_errors_are_typed(nats_server):
    nc = await connect(nats_server.url, name="a")
    bus = Bus(nc, service="a")
    with pytest.raises(NoResponders):
        await bus.request("nobody.here", Ack(accepted=True), Ack, timeout=1)

    async def ignore(msg) -> None:
        pass

    await nc.subscribe("silent", cb=ignore)
    with pytest.raises(RequestTimeout):
        await bus.request("silent", Ack(accepted=True), Ack, timeout=0.2)
    await nc.close()


async def test_connect_retries_until_the_server_appears(tmp_path):
    from thunderagent.embedded import NatsServer

    server = NatsServer(tmp_path / "late")
    task = asyncio.create_task(connect(server.url, name="early", deadline_s=20))
    await asyncio.sleep(0.5)
    server.start()
    try:
        nc = await asyncio.wait_for(task, 20)
        assert nc.is_connected
        await nc.close()
    finally:
        server.stop()


async def test_publishing_on_a_closed_connection_raises_the_bus_error(nats_server):
    nc = await connect(nats_server.url, name="closed")
    bus = Bus(nc, service="closed")
    await nc.close()
    with pytest.raises(BusError, match="not published"):
        await bus.publish(subjects.ROUTE_DECISIONS, Ack(accepted=True))


async def test_connect_gives_up_with_a_clear_error():
    from thunderagent.embedded import free_port

    with pytest.raises(ConnectionError, match="cannot connect to NATS"):
        await connect(f"nats://127.0.0.1:{free_port()}", name="x", deadline_s=0.5)


async def test_drain_answers_every_request_that_reached_the_service(nats_server):
    """A stopping service (a router replica going away) takes no new work, and every message
    that reached it before its interest was gone is handled to the end: each request gets its
    answer or, once no one subscribes, NATS's 503 at once; none is left to a client's timeout.
    The case that used to be lost: requests arriving while the drain waited for the running
    handlers started handlers of their own that nobody waited for."""
    nc = await connect(nats_server.url, name="svc")
    bus = Bus(nc, service="svc")

    async def slow_echo(msg: ResyncRequest, delivery) -> None:
        await asyncio.sleep(0.05)  # waits on something, as a router waits for an adapter's ack
        await bus.publish(delivery.reply, Ack(accepted=True, reason=msg.worker_id))

    await bus.subscribe("t.echo", ResyncRequest, slow_echo, queue="q", concurrent=True)
    client = await connect(nats_server.url, name="client")
    inbox = client.new_inbox()
    answered, refused = set(), set()

    async def on_reply(msg) -> None:
        if msg.headers and msg.headers.get("Status") == "503":
            refused.add(msg.subject.rsplit(".", 1)[1])
        else:
            answered.add(msgspec.json.decode(msg.data, type=Ack).reason[1:])

    await client.subscribe(inbox + ".*", cb=on_reply)
    await client.flush()
    sent = 300

    async def send() -> None:  # a steady stream of requests across the drain
        for i in range(sent):
            payload = msgspec.json.encode(ResyncRequest(worker_id=f"w{i}", reason="x"))
            await client.publish("t.echo", payload, reply=f"{inbox}.{i}", headers={})
            await client.flush()
            await asyncio.sleep(0.001)

    sender = asyncio.create_task(send())
    await asyncio.sleep(0.1)
    await bus.drain()
    await sender
    assert nc.is_closed
    for _ in range(100):
        if len(answered | refused) == sent:
            break
        await asyncio.sleep(0.02)
    assert answered and refused, "the drain ran while requests were arriving"
    missing = {str(i) for i in range(sent)} - answered - refused
    assert not missing, (
        f"requests got no answer: {sorted(missing, key=int)} of {sent}; "
        f"answered {len(answered)}, refused {len(refused)}"
    )
    assert not answered & refused
    await client.close()


async def test_a_durable_consumer_acks_cumulatively_and_its_lag_clears(nats_server):
    """Every message handled once, in order; acks go out a batch at a time (not one per
    message), and the server's ack floor reaches the last message within a tenth of a second
    of it being handled."""
    from thunderagent.bus.jetstream import ACK_EVERY
    from thunderagent.schemas import KvEventBatch

    nc = await connect(nats_server.url, name="index")
    bus = Bus(nc, service="index")
    await bus.ensure_kv_events_stream()
    acks: list[bytes] = []

    async def on_ack(msg) -> None:
        acks.append(msg.data)

    await nc.subscribe("$JS.ACK.>", cb=on_ack)
    seen: list[int] = []

    async def handle(batch: KvEventBatch, seq: int) -> None:
        seen.append(batch.seq)

    durable = "test-durable"
    await bus.consume(subjects.KV_EVENTS_STREAM, subjects.KV_EVENTS_WILDCARD, KvEventBatch,
                      handle, durable=durable)  # fmt: skip
    n = 3 * ACK_EVERY + 5
    for i in range(1, n + 1):
        batch = KvEventBatch(worker_id="w0", seq=i, ts=0.0, events=[])
        await bus.stream_publish(subjects.kv_events("w0"), msgspec.json.encode(batch))
    for _ in range(100):
        info = await nc.jetstream().consumer_info(subjects.KV_EVENTS_STREAM, durable)
        if info.ack_floor.stream_seq == n:
            break
        await asyncio.sleep(0.02)
    assert seen == list(range(1, n + 1))
    assert info.ack_floor.stream_seq == n and info.num_ack_pending == 0
    assert 3 <= len(acks) <= n // 8, f"{len(acks)} acks for {n} messages"
    await nc.close()


async def test_a_resumed_replica_consumer_handles_each_message_once(nats_server):
    """An ephemeral consumer (a router replica's) resumes after a reconnect from the message
    after the last one it handled: nothing twice, nothing skipped."""
    from thunderagent.schemas import KvEventBatch

    nc = await connect(nats_server.url, name="router-0")
    bus = Bus(nc, service="router")
    await bus.ensure_kv_events_stream()
    seen: list[int] = []

    async def publish(first: int, last: int) -> None:
        for i in range(first, last + 1):
            batch = KvEventBatch(worker_id="w0", seq=i, ts=0.0, events=[])
            await bus.stream_publish(subjects.kv_events("w0"), msgspec.json.encode(batch))

    async def handled(count: int) -> None:
        for _ in range(250):
            if len(seen) >= count:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # a second delivery of any of them would have arrived

    async def handle(batch: KvEventBatch, seq: int) -> None:
        seen.append(batch.seq)

    await publish(1, 200)
    consumer = await bus.consume(
        subjects.KV_EVENTS_STREAM, subjects.KV_EVENTS_WILDCARD, KvEventBatch, handle
    )
    await handled(200)
    await consumer.resume()  # what a reconnect does
    await publish(201, 300)
    await handled(300)
    assert seen == list(range(1, 301)), f"{len(seen)} handled for 300 published"
    await consumer.stop()
    await nc.close()
