"""The bus's nats-py client with direct delivery and callback-written publishes, against a real
NATS server: what arrives, in what order, and what a failing callback, an unsubscribe or a
server restart do to it."""

from __future__ import annotations

import asyncio

import nats
import pytest

from thunderagent.bus import connect
from thunderagent.bus.fastpath import FastClient, subscribe_fast

pytestmark = pytest.mark.integration


async def until(predicate, what: str, timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + timeout_s
    while not predicate():
        if loop.time() > give_up_at:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def test_direct_delivery_in_order_survives_a_failing_callback(nats_server):
    nc = await connect(nats_server.url, name="fast")
    assert isinstance(nc, FastClient)
    got: list[bytes] = []

    def on_msg(msg) -> None:
        if msg.data == b"boom":
            raise RuntimeError("a broken callback")
        got.append(msg.data)

    sub = await nc.subscribe_direct("fast.t", on_msg)
    sender = await connect(nats_server.url, name="sender")
    for i in range(200):  # one loop turn: they leave in one write, arrive in order
        await sender.publish("fast.t", b"boom" if i == 100 else str(i).encode())
    await until(lambda: len(got) == 199, "every message but the broken one")
    assert got == [str(i).encode() for i in range(200) if i != 100]
    assert nc.is_connected, "a failing callback must not stop the read loop"

    await sub.unsubscribe()
    assert sub._id not in nc._direct
    await sender.publish("fast.t", b"late")
    await sender.flush()
    await nc.flush()
    assert got[-1] == b"199"
    await sender.close()
    await nc.close()


async def test_flush_waits_for_what_was_pending_before_it(nats_server):
    """nats-py writes flush()'s PING straight to the socket, ahead of a SUB still pending: the
    PONG could come back before the server had the SUB, and a publish from another connection
    in that window was lost (about 1 in 2,000 under load here). The PING must leave after it."""
    nc = await connect(nats_server.url, name="barrier")
    wire: list[bytes] = []
    transport = nc._transport
    write, writelines = transport.write, transport.writelines

    def record_write(data: bytes) -> None:
        wire.append(bytes(data))
        write(data)

    def record_writelines(lines: list[bytes]) -> None:
        wire.extend(bytes(line) for line in lines)
        writelines(lines)

    transport.write, transport.writelines = record_write, record_writelines
    got: list[bytes] = []
    await nc.subscribe_direct("barrier.t", lambda msg: got.append(msg.data))
    await nc.flush()
    sent = b"".join(wire)
    assert sent.index(b"SUB barrier.t") < sent.index(b"PING"), sent

    # flush() after publishes is a barrier too, and the connection still works both ways
    await nc.publish("barrier.t", b"1")
    await nc.flush()
    sent = b"".join(wire)
    assert sent.rindex(b"PUB barrier.t") < sent.rindex(b"PING"), sent
    await until(lambda: got == [b"1"], "our own message back")
    await nc.close()


async def test_subscribe_fast_on_a_plain_nats_py_client(nats_server):
    plain = await nats.connect(nats_server.url)
    got: list[bytes] = []
    await subscribe_fast(plain, "fast.plain", lambda msg: got.append(msg.data))
    await plain.publish("fast.plain", b"x")
    await until(lambda: got == [b"x"], "the message through nats-py's own path")
    await plain.close()


async def test_requests_and_direct_subscriptions_work_again_after_a_server_restart(nats_server):
    nc = await connect(nats_server.url, name="fast")
    got: list[bytes] = []
    await nc.subscribe_direct("fast.r", lambda msg: got.append(msg.data))

    async def echo(msg) -> None:
        await msg.respond(msg.data)

    responder = await connect(nats_server.url, name="responder")
    await responder.subscribe("fast.echo", cb=echo)
    await responder.flush()
    assert (await nc.request("fast.echo", b"before", timeout=2)).data == b"before"

    nats_server.stop()
    await asyncio.sleep(0.5)
    nats_server.start()
    await until(lambda: nc.is_connected and responder.is_connected, "both to reconnect", 15)
    await nc.flush()  # our SUBs are back at the server
    await responder.publish("fast.r", b"after")
    await until(lambda: got == [b"after"], "delivery on the re-made subscription")
    assert (await nc.request("fast.echo", b"again", timeout=2)).data == b"again"
    await responder.close()
    await nc.close()
