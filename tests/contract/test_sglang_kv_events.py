"""Contract: our KV-event wire format, publisher, subscriber and hashes against SGLang 0.5.23.

Needs `pip install --no-deps sglang==0.5.23` (plus pydantic, psutil); skipped otherwise.
The hash checks also need g++, OpenSSL headers and pybind11 to build SGLang's C++ hash
(see `sglang_shim.py`); without them only those tests skip.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import random
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import msgspec
import pytest
import zmq
from sglang_shim import (
    SGLANG_VERSION,
    load_event_recorder,
    load_kv_events,
    native_build_missing,
    sglang_version,
)

from thunderagent.sglang import kv_wire as w
from thunderagent.sglang.zmq_publisher import (
    KvEventsConfig,
    ZmqKvEventPublisher,
    offset_endpoint_port,
)
from thunderagent.sglang.zmq_subscriber import (
    Gap,
    Notice,
    Received,
    Restarted,
    ZmqKvEventSubscriber,
)
from thunderagent.worker.adapter import AdapterConfig, WorkerAdapter

_installed = sglang_version()
pytestmark = [
    pytest.mark.skipif(
        _installed != SGLANG_VERSION,
        reason=(
            f"needs sglang=={SGLANG_VERSION} (found {_installed}): "
            f"pip install --no-deps sglang=={SGLANG_VERSION} pydantic psutil"
        ),
    ),
    pytest.mark.integration,  # SGLang's publisher and ours on free loopback ports
]

WAIT = 5.0  # seconds any single wait may take before the test fails


@pytest.fixture(scope="module")
def sgl() -> ModuleType:
    return load_kv_events()


@pytest.fixture(scope="module")
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def stop_sglang(pub: object) -> None:
    """Shut SGLang's publisher down and drop its atexit hook (a second shutdown waits 1 s)."""
    pub.shutdown()
    atexit.unregister(pub.shutdown)


def wait_port_free(port: int) -> None:
    """ZMQ closes listeners on its I/O thread: wait until `port` can be bound again."""
    deadline = time.monotonic() + WAIT
    while True:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
                return
            except OSError:
                assert time.monotonic() < deadline, f"port {port} still bound"
        time.sleep(0.01)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- sample events, built once in each library -------------------------------------------------


def sample_events(rng: random.Random) -> list[w.AnyKvEvent]:
    """A mix of every event kind with optional fields both set and unset."""
    events: list[w.AnyKvEvent] = []
    for _ in range(rng.randint(1, 5)):
        kind = rng.choice(("stored", "stored", "removed", "cleared"))
        hashes = [rng.randint(-(2**63), 2**63 - 1) for _ in range(rng.randint(1, 4))]
        if kind == "stored":
            events.append(
                w.BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=rng.choice((None, rng.randint(-(2**63), 2**63 - 1))),
                    token_ids=[rng.randrange(200_000) for _ in range(4 * len(hashes))],
                    block_size=4,
                    lora_id=None,
                    medium=rng.choice((None, w.MEDIUM_GPU, w.MEDIUM_CPU)),
                    cache_salt=rng.choice((None, "salt")),
                    session_id=rng.choice((None, "sess-1")),
                    lora_name=rng.choice((None, "adapter-a")),
                )
            )
        elif kind == "removed":
            events.append(w.BlockRemoved(block_hashes=hashes, medium=rng.choice((None, "DISK"))))
        else:
            events.append(w.AllBlocksCleared())
    return events


def to_sglang(sgl: ModuleType, batch: w.KvEventBatch) -> object:
    """The same batch built from SGLang's own classes (medium as its StorageMedium enum)."""
    events = []
    for ev in batch.events:
        fields = msgspec.structs.asdict(ev)
        if fields.get("medium") is not None:
            fields["medium"] = sgl.StorageMedium(fields["medium"])
        events.append(getattr(sgl, type(ev).__name__)(**fields))
    return sgl.KVEventBatch(ts=batch.ts, events=events, attn_dp_rank=batch.attn_dp_rank)


def sample_batches(n: int, seed: int) -> list[w.KvEventBatch]:
    rng = random.Random(seed)
    return [
        w.KvEventBatch(ts=1_700_000_000.0 + i, events=sample_events(rng), attn_dp_rank=None)
        for i in range(n)
    ]


# --- encoding ----------------------------------------------------------------------------------


def test_batch_bytes_identical_both_ways(sgl: ModuleType) -> None:
    sgl_encoder = msgspec.msgpack.Encoder()
    sgl_decoder = msgspec.msgpack.Decoder(sgl.KVEventBatch)
    for batch in sample_batches(50, seed=1):
        for rank in (None, 0, 3):
            ours = msgspec.structs.replace(batch, attn_dp_rank=rank)
            theirs = to_sglang(sgl, ours)
            assert w.encode_batch(ours) == sgl_encoder.encode(theirs)
            assert w.decode_batch(sgl_encoder.encode(theirs)) == ours
            decoded = sgl_decoder.decode(w.encode_batch(ours))
            assert sgl_encoder.encode(decoded) == w.encode_batch(ours)


def test_event_fields_match_sglang(sgl: ModuleType) -> None:
    for name in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
        ours = [(f.name, f.required) for f in msgspec.structs.fields(getattr(w, name))]
        theirs = [(f.name, f.required) for f in msgspec.structs.fields(getattr(sgl, name))]
        assert ours == theirs, name
    batch = [f.name for f in msgspec.structs.fields(sgl.KVEventBatch)]
    assert batch == [f.name for f in msgspec.structs.fields(w.KvEventBatch)]


def test_config_matches_sglang(sgl: ModuleType) -> None:
    theirs = {name: f.default for name, f in sgl.KVEventsConfig.model_fields.items()}
    ours = {f.name: f.default for f in msgspec.structs.fields(KvEventsConfig)}
    assert ours == theirs
    text = json.dumps(
        {
            "publisher": "zmq",
            "endpoint": "tcp://*:6000",
            "replay_endpoint": "tcp://*:6001",
            "topic": "kv",
            "buffer_steps": 7,
            "hwm": 9,
            "bind": True,
        }
    )
    assert msgspec.structs.asdict(KvEventsConfig.from_cli(text)) == (
        sgl.KVEventsConfig.from_cli(text).model_dump()
    )


# --- (a) SGLang reads what our publisher sends -------------------------------------------------


def recv(sock: zmq.Socket, timeout: float = WAIT) -> list[bytes]:
    assert sock.poll(int(timeout * 1000)), "timed out waiting for a ZMQ message"
    return sock.recv_multipart()


def sglang_style_replay(ctx: zmq.Context, endpoint: str, start: int) -> list[list[bytes]]:
    """A DEALER replay request as SGLang's ROUTER expects it; every reply up to the end marker."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        replies = []
        while True:
            frames = recv(dealer)
            replies.append(frames)
            if frames[2] == (-1).to_bytes(8, "big", signed=True):
                return replies
    finally:
        dealer.close(linger=0)


def test_sglang_decodes_our_publisher_live_and_replay(sgl: ModuleType, ctx: zmq.Context) -> None:
    config = KvEventsConfig(
        publisher="zmq",
        endpoint="tcp://127.0.0.1:*",
        replay_endpoint="tcp://127.0.0.1:*",
        topic="kv",
        buffer_steps=64,
    )
    decoder = msgspec.msgpack.Decoder(sgl.KVEventBatch)
    with ZmqKvEventPublisher(config, attn_dp_rank=2) as pub:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(pub.endpoint)
        try:
            warmup = 0  # the SUB joins late: publish until its subscription has arrived
            while not sub.poll(20):
                pub.publish([w.AllBlocksCleared()], ts=0.0)
                warmup += 1
                assert warmup < WAIT / 0.02
            first = int.from_bytes(sub.recv_multipart()[1], "big")
            batches = sample_batches(10, seed=2)
            for batch in batches:
                assert pub.publish_batch(batch)
            seen = []
            while len(seen) < len(batches):
                topic, seq, payload = recv(sub)
                if payload == w.encode_batch(
                    w.KvEventBatch(ts=0.0, events=[w.AllBlocksCleared()], attn_dp_rank=2)
                ):
                    continue  # a warm-up batch
                seen.append((topic, int.from_bytes(seq, "big"), decoder.decode(payload)))
        finally:
            sub.close(linger=0)
        assert [s for _, s, _ in seen] == list(range(warmup, warmup + len(batches)))
        assert first < warmup
        for (topic, _, theirs), batch in zip(seen, batches, strict=True):
            assert topic == b"kv"
            assert theirs.attn_dp_rank == 2
            expected = msgspec.structs.replace(batch, attn_dp_rank=2)
            assert msgspec.msgpack.encode(theirs) == w.encode_batch(expected)

        replies = sglang_style_replay(ctx, pub.replay_endpoint, start=warmup + 4)
        *data, end = replies
        assert end == [b"", b"", sgl.ZmqEventPublisher.END_SEQ, b""]
        assert [int.from_bytes(f[2], "big") for f in data] == list(
            range(warmup + 4, warmup + len(batches))
        )
        for frames, batch in zip(data, batches[4:], strict=True):
            assert frames[:2] == [b"", b"kv"]
            assert decoder.decode(frames[3]).events == to_sglang(sgl, batch).events


def test_replay_answers_identical_to_sglang(sgl: ModuleType, ctx: zmq.Context) -> None:
    """Same batches into both publishers: every replay answer is the same, frame for frame."""
    cfg = {"publisher": "zmq", "endpoint": "tcp://127.0.0.1:*", "topic": "t", "buffer_steps": 5}
    theirs = sgl.EventPublisherFactory.create(
        json.dumps(cfg | {"replay_endpoint": "tcp://127.0.0.1:*"}), attn_dp_rank=0
    )
    ours = ZmqKvEventPublisher(
        KvEventsConfig(**cfg, replay_endpoint="tcp://127.0.0.1:*"), attn_dp_rank=0
    ).start()
    try:
        batches = sample_batches(8, seed=3)  # more than buffer_steps: the oldest fall out
        for batch in batches:
            ours.publish_batch(batch)
            theirs.publish(to_sglang(sgl, batch))
        deadline = time.monotonic() + WAIT
        while ours.published < 8 or theirs._event_queue.qsize():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.2)  # SGLang's thread may hold the last batch between dequeue and send
        their_replay = theirs.describe_local_source(4)["replay_endpoint"]
        for start in (0, 4, 7, 8, 2**40):
            assert sglang_style_replay(ctx, ours.replay_endpoint, start) == sglang_style_replay(
                ctx, their_replay, start
            ), start
    finally:
        ours.close()
        stop_sglang(theirs)


# --- (b) our subscriber reads SGLang's publisher -----------------------------------------------


@dataclass
class Collector:
    """Runs a subscriber in a task and lets the test wait for notices."""

    sub: ZmqKvEventSubscriber
    notices: list[Notice]
    task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        async for notice in self.sub:
            self.notices.append(notice)

    def start(self) -> None:
        self.task = asyncio.create_task(self._run())

    async def wait_for(self, predicate, publish=None) -> None:
        deadline = time.monotonic() + WAIT
        while not predicate(self.notices):
            assert time.monotonic() < deadline, f"timed out; got {self.notices}"
            if publish is not None:
                publish()
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        assert self.task is not None
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.sub.close()


def received(notices: list[Notice], since: int = 0) -> list[Received]:
    return [n for n in notices[since:] if isinstance(n, Received)]


async def test_our_subscriber_reads_sglang_publisher_gap_and_restart(sgl: ModuleType) -> None:
    port, replay_port = free_port(), free_port()
    config = json.dumps(
        {
            "publisher": "zmq",
            "endpoint": f"tcp://127.0.0.1:{port}",
            "bind": True,
            "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
            "topic": "kv",
            "buffer_steps": 1000,
        }
    )
    sent: list[w.KvEventBatch] = []  # what SGLang published, in order, in our types

    def publish(pub, batch: w.KvEventBatch) -> None:
        batch = msgspec.structs.replace(batch, attn_dp_rank=0)
        sent.append(batch)
        pub.publish(to_sglang(sgl, batch))

    pub = sgl.EventPublisherFactory.create(config, attn_dp_rank=0)
    collector = Collector(
        ZmqKvEventSubscriber(
            f"tcp://127.0.0.1:{port}",
            replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
            topic="kv",
            start_seq=0,
        ),
        [],
    )
    extra = iter(sample_batches(1000, seed=5))
    try:
        for batch in sample_batches(5, seed=4):  # before any subscriber: lost live
            publish(pub, batch)
        await asyncio.sleep(0.3)  # let SGLang's thread send them
        collector.start()
        await collector.wait_for(
            lambda ns: any(isinstance(n, Received) and not n.replayed for n in ns),
            publish=lambda: publish(pub, next(extra)),
        )
        for _ in range(40):  # well past where a restarted publisher will be when rejoined
            publish(pub, next(extra))
        await collector.wait_for(lambda ns: len(received(ns)) >= len(sent))

        gap = collector.notices[0]
        assert isinstance(gap, Gap) and gap.start == 0 and gap.recovered
        got = received(collector.notices)
        assert [r.seq for r in got] == list(range(len(sent)))
        assert [r.batch for r in got] == sent
        assert all(r.replayed == (r.seq < gap.stop) for r in got)

        # Engine restart: a new publisher on the same ports counts from 0 again.
        stop_sglang(pub)
        before, old_count = len(collector.notices), len(sent)
        sent.clear()
        wait_port_free(port)
        wait_port_free(replay_port)
        pub = sgl.EventPublisherFactory.create(config, attn_dp_rank=0)
        await collector.wait_for(
            lambda ns: any(isinstance(n, Restarted) for n in ns[before:]) and received(ns, before),
            publish=lambda: publish(pub, next(extra)),
        )
        await collector.wait_for(lambda ns: len(received(ns, before)) >= len(sent))
        after = collector.notices[before:]
        assert isinstance(after[0], Restarted) and after[0].seq < old_count
        got = received(collector.notices, before)
        assert [r.seq for r in got] == list(range(len(sent)))
        assert [r.batch for r in got] == sent
    finally:
        stop_sglang(pub)
        await collector.stop()


# --- (c) block hashes against SGLang's own recorder and native hash ----------------------------


@dataclass(eq=False)
class FakeKey:
    """What KVCacheEventRecorder reads of a RadixKey."""

    token_ids: list[int]
    extra_key: str | None = None
    cache_salt: str | None = None
    is_bigram: bool = False

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass(eq=False)
class FakeNode:
    """What KVCacheEventRecorder reads of a radix tree node."""

    key: FakeKey
    parent: FakeNode | None
    hash_value: list[str] | None = None
    event_hash_value: list[str] | None = None


@pytest.fixture(scope="module")
def recorder_module(
    pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory
) -> ModuleType:
    missing = native_build_missing()
    if missing:
        pytest.skip(f"cannot build SGLang's C++ block hash here: {missing}")
    cache = getattr(pytestconfig, "cache", None)  # reuse the build across runs when possible
    build_dir = cache.mkdir("sglang_native_hash") if cache else tmp_path_factory.mktemp("hash")
    return load_event_recorder(Path(build_dir))


@pytest.mark.parametrize("block_size", [1, 4, 16, 64])
def test_block_hashes_equal_sglang_recorder(recorder_module: ModuleType, block_size: int) -> None:
    rng = random.Random(block_size)
    for salt in (None, "tenant-7"):
        root = FakeNode(FakeKey([], cache_salt=salt), None, hash_value=[])
        parent, prior = root, (w.sglang_salt_parent(salt) if salt else None)
        recorder = recorder_module.KVCacheEventRecorder(enabled=True, page_size=block_size)
        for depth in range(4):  # a chain root -> a -> b -> c -> d, each node block-aligned
            top = 2**40 if depth == 2 else 150_000  # one node with wide (> uint32) token ids
            tokens = [rng.randrange(top) for _ in range(block_size * rng.randint(1, 5))]
            node = FakeNode(FakeKey(tokens, cache_salt=salt), parent)
            recorder.record_store(node)
            recorder.record_remove(node)
            stored, removed = recorder.take()
            digests = w.sglang_block_digests(tokens, block_size, prior)
            ours = [w.digest_to_int64(d) for d in digests]
            assert stored.block_hashes == ours
            assert stored.parent_block_hash == (
                None if parent is root else w.digest_to_int64(prior)
            )
            assert stored.token_ids == tokens
            assert removed.block_hashes == ours
            parent, prior = node, digests[-1]


def test_block_digests_equal_sglang_native(recorder_module: ModuleType) -> None:
    get_hash_str = recorder_module.compute_node_hash_values.__globals__["get_hash_str"]
    hash_str_to_int64 = recorder_module.compute_node_hash_values.__globals__["hash_str_to_int64"]
    rng = random.Random(9)
    for _ in range(200):
        block_size = rng.choice((1, 2, 3, 16, 32))
        tokens = [rng.randrange(2**32) for _ in range(rng.randrange(0, 130))]
        prior = rng.choice((None, rng.randbytes(32)))
        theirs = get_hash_str(tokens, prior.hex() if prior else None, page_size=block_size)
        ours = w.sglang_block_digests(tokens, block_size, prior)
        assert [d.hex() for d in ours] == theirs  # partial last blocks included
        assert [hash_str_to_int64(h) for h in theirs] == w.sglang_block_hashes(
            tokens, block_size, prior
        )


def test_bigram_pages_of_eagle_decode_to_their_tokens(sgl: ModuleType) -> None:
    """With EAGLE speculative decoding SGLang's radix keys are bigrams and its recorder
    publishes each page as (token, next token) pairs (sglang/srt/mem_cache/events.py), which
    its own `token_ids: list[int]` does not describe. The batch decodes (it was refused whole,
    removals included), the pairs become their first tokens, and the mirror hashes those as it
    hashes the same prompt's plain ids."""
    from thunderagent.hashing import BlockHasher
    from thunderagent.sglang.mirror import KvMirror

    tokens = list(range(100, 109))  # two 4-token pages and the token after them
    pairs = [(tokens[j], tokens[j + 1]) for j in range(8)]
    hashes = w.sglang_block_hashes(tokens[:8], 4)
    gpu = sgl.StorageMedium("GPU")
    stored = sgl.BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=pairs,
                             block_size=4, lora_id=None, medium=gpu)  # fmt: skip
    removed = sgl.BlockRemoved(block_hashes=hashes[1:], medium=gpu)
    payload = msgspec.msgpack.encode(sgl.KVEventBatch(ts=1.0, events=[stored, removed]))
    batch = w.decode_batch(payload)
    assert batch.events[0].token_ids == tokens[:8]
    [ours, gone] = KvMirror(4).apply(list(batch.events))
    plain = BlockHasher(4).hash_tokens(tokens[:8])
    assert ours.hashes == plain.primary and gone.hashes == plain.primary[1:]


# --- (d) data-parallel ranks: each publishes on rank 0's port + r ------------------------------


@pytest.mark.parametrize("endpoint", ["tcp://*:5557", "tcp://10.0.0.7:6000", "inproc://cache"])
def test_rank_endpoints_are_sglangs(sgl: ModuleType, endpoint: str) -> None:
    for rank in range(4):
        ours = offset_endpoint_port(endpoint, rank)
        assert ours == sgl.ZmqEventPublisher.offset_endpoint_port(endpoint, rank)


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_rank_r_is_the_publisher_at_offset_r_with_or_without_dp_attention(
    sgl: ModuleType, dp_size: int
) -> None:
    """The adapter's rank r (``routed_dp_rank`` r, port + r) is SGLang's publisher r whether its
    ranks are attention-DP ranks (one model, KV sharded per rank) or whole replicas."""
    attention = [sgl.select_kv_publisher_dp_rank(dp_size, r, None) for r in range(dp_size)]
    replicas = [sgl.select_kv_publisher_dp_rank(1, 0, r) for r in range(dp_size)]
    assert attention == replicas == list(range(dp_size))


async def test_an_adapter_of_rank_1_reads_sglangs_rank_1_publisher(sgl: ModuleType) -> None:
    port = _two_free_ports()
    config = {"publisher": "zmq", "endpoint": f"tcp://*:{port}", "topic": "kv"}
    publishers = [
        sgl.EventPublisherFactory.create(json.dumps(config), attn_dp_rank=r) for r in range(2)
    ]
    adapter = WorkerAdapter(
        AdapterConfig(worker_id="w0-dp1", engine_url="http://127.0.0.1:30000", dp_rank=1),
        bus=None,  # type: ignore[arg-type]
        engine=_ServerInfo({"kv_events_config": json.dumps(config)}),  # type: ignore[arg-type]
    )
    endpoint, _, topic = await adapter._kv_event_source()
    collector = Collector(ZmqKvEventSubscriber(endpoint, topic=topic), [])
    collector.start()
    batches = iter(sample_batches(1000, seed=6))
    try:
        await collector.wait_for(
            lambda ns: received(ns),
            publish=lambda: [p.publish(to_sglang(sgl, next(batches))) for p in publishers],
        )
        assert {n.batch.attn_dp_rank for n in received(collector.notices)} == {1}
    finally:
        for p in publishers:
            stop_sglang(p)
        await collector.stop()


class _ServerInfo:
    base_url = "http://127.0.0.1:30000"

    def __init__(self, info: dict) -> None:
        self.info = info

    async def get_json(self, path: str) -> dict:
        return self.info


def _two_free_ports() -> int:
    """A port whose next one is free too (rank 1 binds it)."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise AssertionError("no two consecutive free ports")
