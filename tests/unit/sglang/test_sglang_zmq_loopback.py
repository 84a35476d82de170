"""Our KV-event publisher and subscriber over real ZMQ sockets on loopback (fast, no SGLang).

The SGLang side of the same protocol is checked in tests/contract/test_sglang_kv_events.py.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import msgspec
import pytest
import zmq

from thunderagent.sglang import kv_wire as w
from thunderagent.sglang.zmq_publisher import (
    KvEventsConfig,
    PublisherClosedError,
    ZmqKvEventPublisher,
    start_rank_publishers,
)
from thunderagent.sglang.zmq_subscriber import (
    Gap,
    Notice,
    Received,
    Restarted,
    Undecodable,
    ZmqKvEventSubscriber,
)

pytestmark = pytest.mark.integration  # ZMQ sockets on free loopback ports

WAIT = 5.0


def batch(i: int) -> list[w.AnyKvEvent]:
    return [w.BlockRemoved(block_hashes=[i])]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port_free(port: int) -> None:
    deadline = time.monotonic() + WAIT
    while True:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
                return
            except OSError:
                assert time.monotonic() < deadline
        time.sleep(0.01)


async def pump(sub: ZmqKvEventSubscriber, out: list[Notice]) -> None:
    async for notice in sub:
        out.append(notice)


async def wait_until(pred, tick=None) -> None:
    deadline = time.monotonic() + WAIT
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        if tick is not None:
            tick()
        await asyncio.sleep(0.02)


def live(notices: list[Notice]) -> list[Received]:
    return [n for n in notices if isinstance(n, Received) and not n.replayed]


def hashes(notices: list[Notice]) -> list[int]:
    return [n.batch.events[0].block_hashes[0] for n in notices if isinstance(n, Received)]


async def test_late_subscriber_replays_what_the_buffer_still_holds() -> None:
    cfg = KvEventsConfig(
        publisher="zmq",
        endpoint="tcp://127.0.0.1:*",
        replay_endpoint="tcp://127.0.0.1:*",
        buffer_steps=4,
    )
    notices: list[Notice] = []
    count = 0

    def publish() -> None:
        nonlocal count
        assert pub.publish(batch(count), ts=float(count))
        count += 1

    with ZmqKvEventPublisher(cfg) as pub:
        for _ in range(6):
            publish()
        await wait_until(lambda: pub.published == 6)
        sub = ZmqKvEventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint)
        task = asyncio.create_task(pump(sub, notices))
        try:
            await wait_until(lambda: live(notices), tick=publish)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            sub.close()
    first = live(notices)[0].seq
    gap = notices[0]
    assert isinstance(gap, Gap) and (gap.start, gap.stop) == (0, first)
    ((lost_start, kept),) = gap.lost  # the 4-batch buffer had rolled over: the oldest are lost
    assert lost_start == 0 and first - 4 <= kept < first
    # Live batches published while the pump was being cancelled may follow the first one.
    received = notices[1:]
    seqs = [n.seq for n in received]
    assert seqs == list(range(kept, kept + len(seqs))) and first in seqs
    assert [n.replayed for n in received] == [n.seq < first for n in received]
    assert hashes(notices) == seqs
    assert all(n.batch.attn_dp_rank == 0 for n in received)


async def test_restart_is_reported_not_read_as_a_gap() -> None:
    port, replay = free_port(), free_port()
    cfg = KvEventsConfig(
        publisher="zmq",
        endpoint=f"tcp://127.0.0.1:{port}",
        bind=True,
        replay_endpoint=f"tcp://127.0.0.1:{replay}",
    )
    notices: list[Notice] = []
    sub = ZmqKvEventSubscriber(
        f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{replay}", start_seq=None
    )
    task = asyncio.create_task(pump(sub, notices))
    pub = ZmqKvEventPublisher(cfg).start()
    try:
        await wait_until(lambda: live(notices), tick=lambda: pub.publish(batch(-1)))
        for i in range(30):
            pub.publish(batch(i))
        await wait_until(lambda: hashes(notices)[-1:] == [29])
        pub.close()
        wait_port_free(port)
        wait_port_free(replay)
        mark = len(notices)
        pub = ZmqKvEventPublisher(cfg).start()
        n = 0

        def publish_new() -> None:
            nonlocal n
            pub.publish(batch(1000 + n))
            n += 1

        await wait_until(lambda: live(notices[mark:]), tick=publish_new)
    finally:
        pub.close()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        sub.close()
    after = notices[mark:]
    assert isinstance(after[0], Restarted)
    received = [x for x in after if isinstance(x, Received)]
    assert [x.seq for x in received] == list(range(len(received)))
    assert hashes(after) == list(range(1000, 1000 + len(received)))


async def test_gap_without_replay_endpoint_is_lost_and_bad_frames_are_skipped() -> None:
    ctx = zmq.Context()
    raw = ctx.socket(zmq.PUB)
    raw.setsockopt(zmq.LINGER, 0)
    port = raw.bind_to_random_port("tcp://127.0.0.1")
    notices: list[Notice] = []
    sub = ZmqKvEventSubscriber(f"tcp://127.0.0.1:{port}", start_seq=0)
    task = asyncio.create_task(pump(sub, notices))
    good = w.encode_batch(w.KvEventBatch(ts=0.0, events=batch(7), attn_dp_rank=0))
    try:
        await wait_until(
            lambda: notices, tick=lambda: raw.send_multipart((b"", w.seq_to_bytes(5), good))
        )
        raw.send_multipart((b"", b"short"))
        raw.send_multipart((b"", w.seq_to_bytes(6), b"\xc1"))
        await wait_until(lambda: any(isinstance(n, Undecodable) for n in notices))
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        sub.close()
        raw.close()
        ctx.term()
    assert notices[0] == Gap(0, 5, ((0, 5),))
    assert not notices[0].recovered
    assert isinstance(notices[1], Received) and notices[1].seq == 5
    assert isinstance(notices[-1], Undecodable) and notices[-1].seq == 6
    assert sub.malformed == 1


def test_config_and_lifecycle() -> None:
    assert ZmqKvEventPublisher.from_cli('{"publisher": "null"}') is None
    with pytest.raises(msgspec.ValidationError, match="buffer_steps"):
        KvEventsConfig.from_cli('{"publisher": "zmq", "buffer_steps": -1}')
    pub = ZmqKvEventPublisher.from_cli('{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:*"}')
    assert pub is not None and pub.endpoint is not None and pub.replay_endpoint is None
    pub.close()
    with pytest.raises(PublisherClosedError):
        pub.publish([])


def test_rank_publishers_take_consecutive_ports_from_a_wildcard() -> None:
    """SGLang's ranks publish on rank 0's ports + r, and subscribers count on it: a wildcard
    port is drawn once, by rank 0, and the other ranks bind the ports after it."""
    config = json.dumps({"publisher": "zmq", "endpoint": "tcp://127.0.0.1:*", "bind": True,
                         "replay_endpoint": "tcp://127.0.0.1:*"})  # fmt: skip
    publishers = start_rank_publishers(config, 3)
    try:
        ports = [int(p.endpoint.rsplit(":", 1)[1]) for p in publishers]
        replays = [int(p.replay_endpoint.rsplit(":", 1)[1]) for p in publishers]
        assert ports == [ports[0] + r for r in range(3)]
        assert replays == [replays[0] + r for r in range(3)]
        assert [p.attn_dp_rank for p in publishers] == [0, 1, 2]
    finally:
        for p in publishers:
            p.close()
    assert start_rank_publishers('{"publisher": "null"}', 2) == []


def test_rank_publishers_on_a_fixed_port_that_is_taken_fail_with_every_socket_closed() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = json.dumps(
            {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port - 1}", "bind": True}
        )
        with pytest.raises(zmq.ZMQError):
            start_rank_publishers(config, 2)  # rank 1 would take the port in use
    # rank 0's socket was closed: its port binds again
    start_rank_publishers(config, 1)[0].close()
