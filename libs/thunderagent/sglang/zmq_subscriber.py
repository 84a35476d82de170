"""Async subscriber to an SGLang KV-event publisher, with gap replay (I/O helper).

`async for notice in subscriber` yields, in sequence order:

- `Received(seq, batch)` for every batch, live or replayed;
- `Gap(start, stop, lost)` before the replayed batches when frames `[start, stop)` were missed
  (`lost` names what the replay could not return: the consumer's view is then incomplete);
- `Restarted(seq)` when the sequence went back (a new engine, cache empty), before anything
  from the new publisher;
- `Undecodable(seq, error)` for a frame whose payload does not decode.

Frame and replay layouts are documented in this package's README and checked against SGLang by
`tests/contract/test_sglang_kv_events.py`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Self

import msgspec
import zmq
import zmq.asyncio

from thunderagent.sglang.kv_wire import REPLAY_END_SEQ, KvEventBatch, decode_batch, seq_to_bytes
from thunderagent.sglang.seq import SeqTracker, SeqVerdict, plan_replay

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Received:
    """One decoded batch."""

    seq: int
    batch: KvEventBatch
    replayed: bool = False


@dataclass(frozen=True, slots=True)
class Gap:
    """Frames `[start, stop)` were missed live; the replayed ones follow this notice."""

    start: int
    stop: int
    lost: tuple[tuple[int, int], ...]
    """Half-open ranges the replay did not return (empty: fully recovered)."""

    @property
    def recovered(self) -> bool:
        return not self.lost


@dataclass(frozen=True, slots=True)
class Restarted:
    """The publisher's sequence went back to `seq`: the engine restarted with an empty cache."""

    seq: int


@dataclass(frozen=True, slots=True)
class Undecodable:
    """Frame `seq` arrived but its payload is not a KV-event batch; its events are lost."""

    seq: int
    error: str


Notice = Received | Gap | Restarted | Undecodable


class ZmqKvEventSubscriber:
    """SUB to `endpoint` (+ `topic`); DEALER to `replay_endpoint` to fill gaps.

    `start_seq=0` treats frames before the first one seen as missing, so a late subscriber
    replays what the publisher still buffers; `start_seq=None` takes the stream as it comes.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        start_seq: int | None = 0,
        replay_timeout: float = 2.0,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode("utf-8")
        self.replay_timeout = replay_timeout
        self.tracker = SeqTracker(expected=start_seq)
        self.malformed = 0
        """Live frames skipped because they were not `[topic, seq, payload]`."""
        self._own_ctx = context is None
        self._ctx = context if context is not None else zmq.asyncio.Context()
        self._sub: zmq.asyncio.Socket | None = None
        self._dealer: zmq.asyncio.Socket | None = None

    def connect(self) -> Self:
        """Create and connect the SUB socket (ZMQ connects lazily; nothing blocks)."""
        if self._sub is None:
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, self.topic)
            sub.connect(self.endpoint)
            self._sub = sub
        return self

    def close(self) -> None:
        """Close both sockets (and the context when this subscriber made it)."""
        for sock in (self._sub, self._dealer):
            if sock is not None:
                sock.close(linger=0)
        self._sub = self._dealer = None
        if self._own_ctx:
            self._ctx.term()

    async def __aenter__(self) -> Self:
        return self.connect()

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def __aiter__(self) -> AsyncIterator[Notice]:
        return self.notices()

    async def notices(self) -> AsyncIterator[Notice]:
        """Notices in sequence order, forever (until the socket is closed)."""
        sub = self.connect()._sub
        assert sub is not None
        while True:
            frames = await sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                self.malformed += 1
                log.warning("malformed kv event frame (%d parts) skipped", len(frames))
                continue
            seq = int.from_bytes(frames[1], "big")
            for notice in await self._on_live(seq, frames[2]):
                yield notice

    async def _on_live(self, seq: int, payload: bytes) -> list[Notice]:
        out: list[Notice] = []
        if self.tracker.classify(seq) is SeqVerdict.RESTART:
            self.tracker.restarted()
            out.append(Restarted(seq))
        missing = self.tracker.missing_before(seq)
        if missing is not None:
            out.extend(await self._fill(*missing))
        out.append(_decode(seq, payload, replayed=False))
        self.tracker.delivered(seq)
        return out

    async def _fill(self, start: int, stop: int) -> list[Notice]:
        replayed = dict(await self.replay(start, stop))
        plan = plan_replay(start, stop, list(replayed))
        out: list[Notice] = [Gap(start, stop, tuple(plan.lost))]
        out.extend(_decode(s, replayed[s], replayed=True) for s in plan.deliver)
        return out

    async def replay(self, start: int, stop: int | None = None) -> list[tuple[int, bytes]]:
        """Ask the replay socket for frames from `start` on; `(seq, payload)` below `stop`.

        Returns [] without a replay endpoint. On timeout the DEALER is dropped (a late answer
        must not be read as the answer to the next request) and what arrived is returned.
        """
        if self.replay_endpoint is None:
            return []
        dealer = self._replay_socket()
        await dealer.send_multipart((b"", seq_to_bytes(start)))
        got: list[tuple[int, bytes]] = []
        deadline = time.monotonic() + self.replay_timeout
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not await dealer.poll(left_ms):
                log.warning("replay from %d timed out after %d frames", start, len(got))
                dealer.close(linger=0)
                self._dealer = None
                return got
            frames = await dealer.recv_multipart()
            if len(frames) != 4 or frames[0] != b"" or len(frames[2]) != 8:
                continue
            if frames[2] == REPLAY_END_SEQ:
                return got
            seq = int.from_bytes(frames[2], "big")
            if stop is None or seq < stop:
                got.append((seq, frames[3]))

    def _replay_socket(self) -> zmq.asyncio.Socket:
        if self._dealer is None:
            assert self.replay_endpoint is not None
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.RCVHWM, 0)  # a replay may be a whole buffer: never drop
            dealer.connect(self.replay_endpoint)
            self._dealer = dealer
        return self._dealer


def _decode(seq: int, payload: bytes, *, replayed: bool) -> Received | Undecodable:
    try:
        return Received(seq, decode_batch(payload), replayed)
    except msgspec.DecodeError as exc:
        return Undecodable(seq, str(exc))
