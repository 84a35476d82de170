"""Snapshot of an index *and* its feed position, as stored in Redis, so a replica starts warm:
restore, then replay the KV-event stream from ``stream_seq + 1``."""

from __future__ import annotations

import msgspec

from thunderagent.prefix_index.feed import IndexFeeder, _Cursor
from thunderagent.prefix_index.index import PrefixIndex
from thunderagent.prefix_index.snapshot import IndexSnapshot


class CursorImage(msgspec.Struct, frozen=True, array_like=True):
    worker: str
    epoch: int
    seq: int
    counter: int


class IndexState(msgspec.Struct, frozen=True, kw_only=True):
    index: IndexSnapshot
    cursors: list[CursorImage]
    stream_seq: int
    """Last KV-event stream sequence folded into ``index`` (0: none)."""
    gpu: IndexSnapshot | None = None
    """The GPU-only index, once a host tier was seen (None: identical to ``index``)."""
    taken_at: float


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(IndexState)


def capture(feeder: IndexFeeder, stream_seq: int, now: float) -> bytes:
    cursors = [CursorImage(w, c.epoch, c.seq, c.counter) for w, c in feeder.cursors.items()]
    state = IndexState(
        index=feeder.index.snapshot(),
        cursors=cursors,
        stream_seq=stream_seq,
        taken_at=now,
        gpu=feeder.gpu.snapshot() if feeder.gpu is not None else None,
    )
    return _encoder.encode(state)


def restore(feeder: IndexFeeder, data: bytes, now: float) -> int:
    """Load ``data`` into ``feeder``; returns the stream sequence it covers."""
    state = _decoder.decode(data)
    feeder.index.restore(state.index, now)
    feeder.gpu = None
    if state.gpu is not None:
        feeder.gpu = PrefixIndex(feeder.index.ttl_s)
        feeder.gpu.restore(state.gpu, now)
    feeder.cursors = {c.worker: _Cursor(c.epoch, c.seq, c.counter) for c in state.cursors}
    return state.stream_seq
