"""KV-event publisher speaking SGLang 0.5.23's ZMQ protocol (I/O helper).

Live: a PUB socket sends `[topic, seq, payload]` per batch, `seq` counting from 0 per
publisher. Replay: a ROUTER socket answers `[b"", start_seq]` from a DEALER with every buffered
`[b"", topic, seq, payload]` whose seq >= start_seq, then `[b"", b"", REPLAY_END_SEQ, b""]`.

One background thread owns both sockets; `publish` only encodes and enqueues, so the
simulated engine's asyncio loop never blocks on ZMQ.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Annotated, Final, Literal, Self

import msgspec
import zmq

from thunderagent.sglang.kv_wire import (
    REPLAY_END_SEQ,
    AnyKvEvent,
    KvEventBatch,
    encode_batch,
    seq_to_bytes,
)

log = logging.getLogger(__name__)

NonNegative = Annotated[int, msgspec.Meta(ge=0)]


QUEUE_POLL_S: Final = 0.1
"""How long the publisher thread waits for a batch before it looks at the replay socket again:
SGLang's 0.1 s. (It was 5 ms here: 200 wake-ups a second per idle engine, 23 ms of CPU a
second each, against 1.8 ms now; a replay request to an idle engine waits up to this long.)"""


class KvEventsConfig(msgspec.Struct, kw_only=True, frozen=True):
    """SGLang's `--kv-events-config` JSON; same field names and defaults as 0.5.23."""

    publisher: Literal["null", "zmq"] = "null"
    """"zmq" publishes; "null" disables publishing."""
    endpoint: str = "tcp://*:5557"
    """PUB address; bound when wildcard/ipc/inproc (or `bind`), connected otherwise."""
    bind: bool | None = None
    """Force bind (True) or connect (False) of the PUB socket; None infers from `endpoint`."""
    replay_endpoint: str | None = None
    """ROUTER address answering replay requests (always bound); None disables replay."""
    buffer_steps: NonNegative = 10_000
    """Batches kept for replay."""
    hwm: NonNegative = 100_000
    """ZMQ high-water mark of the PUB socket (send and receive)."""
    max_queue_size: Annotated[int, msgspec.Meta(ge=1)] = 100_000
    """Batches waiting for the publisher thread; beyond it `publish` drops."""
    topic: str = ""
    """Topic frame of every message; "" lets subscribers take everything."""
    format: Literal["default", "dynamo"] = "default"
    """Event hash format; the simulated engine only produces "default"."""

    @classmethod
    def from_cli(cls, text: str | bytes) -> KvEventsConfig:
        """Parse the CLI JSON; a bad field raises msgspec.ValidationError naming it."""
        return msgspec.json.decode(text, type=cls)

    def descriptor(self, block_size: int, dp_size: int) -> dict | None:
        """``/server_info``'s ``kv_events`` as SGLang 0.5.23 advertises its publisher to
        routers (``describe_kv_events_publisher``): host, base port (rank r publishes on base +
        r), topic, block size, ranks, and the replay base port; None when it publishes nothing
        a router can dial (no zmq, or not a TCP address with a port)."""
        endpoint = _tcp_host_port(self.endpoint) if self.publisher == "zmq" else None
        if endpoint is None:
            return None
        described: dict = {
            "publisher": self.publisher, "endpoint_host": endpoint[0],
            "endpoint_port_base": endpoint[1], "topic": self.topic, "block_size": block_size,
            "dp_size": dp_size,
        }  # fmt: skip
        replay = _tcp_host_port(self.replay_endpoint or "")
        if replay is not None:
            described["replay_endpoint_port_base"] = replay[1]
        return described


def _tcp_host_port(endpoint: str) -> tuple[str, int] | None:
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if not endpoint.startswith("tcp://") or not host or not port.isdigit():
        return None
    return host, int(port)


class PublisherClosedError(RuntimeError):
    """`publish` was called on a publisher that is not running (a caller bug)."""


def offset_endpoint_port(endpoint: str | None, dp_rank: int) -> str | None:
    """Endpoint for attention-DP rank `dp_rank`: tcp port + rank, inproc name + `_dp<rank>`.

    A wildcard port (`tcp://host:*`, which SGLang would reject here) is left as it is.
    """
    if not endpoint or dp_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{dp_rank}"
    if "tcp" in endpoint:
        base, _, port = endpoint.rpartition(":")
        if not base or port == "*":  # a wildcard port is free per rank already
            return endpoint
        return f"{base}:{int(port) + dp_rank}"
    raise ValueError(f"endpoint {endpoint!r} must be tcp:// or inproc://")


def publisher_binds(endpoint: str, bind: bool | None) -> bool:
    """Whether a publisher with this ``endpoint`` and ``bind`` setting binds (SGLang's rule: a
    wildcard host, ipc or inproc binds unless ``bind`` says otherwise; a concrete host connects,
    and then a subscriber has to bind, which the adapter's does not)."""
    if bind is not None:
        return bind
    return (
        "*" in endpoint
        or "::" in endpoint
        or "0.0.0.0" in endpoint
        or endpoint.startswith(("ipc://", "inproc://"))
    )


_STOP: Final = object()


class ZmqKvEventPublisher:
    """PUB + replay ROUTER publisher; a drop-in peer for SGLang's `ZmqEventPublisher`."""

    def __init__(
        self,
        config: KvEventsConfig,
        *,
        attn_dp_rank: int = 0,
        context: zmq.Context | None = None,
    ) -> None:
        self.config = config
        self.attn_dp_rank = attn_dp_rank
        self._own_ctx = context is None
        self._ctx = context if context is not None else zmq.Context()
        self._queue: queue.Queue[object] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode("utf-8")
        self._pub: zmq.Socket | None = None
        self._replay: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self._running = False
        self.endpoint: str | None = None
        """Address the PUB socket is bound to (resolved wildcard port), None if connected."""
        self.replay_endpoint: str | None = None
        """Address the replay ROUTER is bound to, None without replay."""
        self.published = 0
        """Batches sent on the PUB socket."""
        self.dropped = 0
        """Batches `publish` dropped because the queue was full."""

    @classmethod
    def from_cli(cls, text: str | bytes, *, attn_dp_rank: int = 0) -> ZmqKvEventPublisher | None:
        """Started publisher for a `--kv-events-config` JSON; None when publisher is "null"."""
        config = KvEventsConfig.from_cli(text)
        if config.publisher == "null":
            return None
        return cls(config, attn_dp_rank=attn_dp_rank).start()

    def start(self) -> Self:
        """Bind/connect the sockets (errors raise here) and start the publisher thread."""
        if self._running:
            return self
        endpoint = offset_endpoint_port(self.config.endpoint, self.attn_dp_rank)
        assert endpoint is not None
        pub = self._ctx.socket(zmq.PUB)
        pub.set_hwm(self.config.hwm)
        pub.setsockopt(zmq.LINGER, 0)
        try:
            if publisher_binds(endpoint, self.config.bind):
                pub.bind(endpoint)
                self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                pub.connect(endpoint)
            replay_endpoint = offset_endpoint_port(self.config.replay_endpoint, self.attn_dp_rank)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                # A whole buffer plus the end marker must fit, or ROUTER drops the tail.
                self._replay.setsockopt(zmq.SNDHWM, self.config.buffer_steps + 1)
                self._replay.bind(replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError:
            pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)
                self._replay = None
            raise
        self._pub = pub
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()
        return self

    def publish(self, events: Sequence[AnyKvEvent], *, ts: float | None = None) -> bool:
        """Queue one batch of `events` stamped `ts` (default now); False if it was dropped."""
        batch = KvEventBatch(
            ts=time.time() if ts is None else ts, events=list(events), attn_dp_rank=None
        )
        return self.publish_batch(batch)

    def publish_batch(self, batch: KvEventBatch) -> bool:
        """Queue `batch` without blocking; its `attn_dp_rank` defaults to the publisher's."""
        if not self._running:
            raise PublisherClosedError("publisher is not running")
        if batch.attn_dp_rank is None:
            batch = msgspec.structs.replace(batch, attn_dp_rank=self.attn_dp_rank)
        try:
            self._queue.put_nowait(encode_batch(batch))
        except queue.Full:
            self.dropped += 1
            log.warning("kv event queue full (%d); batch dropped", self.config.max_queue_size)
            return False
        return True

    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued (up to `timeout`), stop the thread and close the sockets."""
        if not self._running:
            return
        self._running = False
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            log.warning("kv event queue still full after %.1fs; closing anyway", timeout)
            return
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("kv event publisher thread did not stop within %.1fs", timeout)
                return  # the daemon thread still owns the sockets; leave them to it
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        if self._own_ctx:
            self._ctx.term()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- publisher thread ----------------------------------------------------------------------

    def _run(self) -> None:
        seq = 0
        assert self._pub is not None
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except zmq.ZMQError:
                    log.exception("replay request failed")
            try:
                item = self._queue.get(timeout=QUEUE_POLL_S)
            except queue.Empty:
                continue
            if item is _STOP:
                return
            payload = item
            assert isinstance(payload, bytes)
            try:
                self._pub.send_multipart((self._topic, seq_to_bytes(seq), payload))
            except zmq.ZMQError:
                log.exception("kv event batch %d not sent", seq)
            self._buffer.append((seq, payload))
            self.published += 1
            seq += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("invalid replay request with %d frames ignored", len(frames))
            return
        client, _, start_frame = frames
        start = int.from_bytes(start_frame, "big")
        for seq, payload in self._buffer:
            if seq >= start:
                self._replay.send_multipart((client, b"", self._topic, seq_to_bytes(seq), payload))
        self._replay.send_multipart((client, b"", b"", REPLAY_END_SEQ, b""))


def start_rank_publishers(
    text: str | bytes, dp_size: int, *, tries: int = 20
) -> list[ZmqKvEventPublisher]:
    """One started publisher per data-parallel rank, on consecutive ports from rank 0's, as
    SGLang lays them out (subscribers derive rank r's port as rank 0's + r); [] for "null".

    A wildcard port (``tcp://host:*``) is resolved by rank 0 and the others take the ports after
    it; when one of those is taken, all close and rank 0 draws another (up to ``tries`` times)."""
    config = KvEventsConfig.from_cli(text)
    if config.publisher == "null":
        return []
    taken: zmq.ZMQError | None = None
    for _ in range(tries):
        started = [ZmqKvEventPublisher(config).start()]
        # the addresses rank 0 got: rank r offsets a concrete port, not a second wildcard
        pinned = msgspec.structs.replace(
            config,
            endpoint=started[0].endpoint or config.endpoint,
            replay_endpoint=started[0].replay_endpoint or config.replay_endpoint,
        )
        try:
            for rank in range(1, dp_size):
                started.append(ZmqKvEventPublisher(pinned, attn_dp_rank=rank).start())
            return started
        except zmq.ZMQError as err:
            for publisher in started:
                publisher.close()
            if pinned == config:  # fixed ports: no other to draw
                raise
            taken = err
    raise taken or ValueError(f"tries must be at least 1, not {tries}")
