"""Snapshot of an index *and* its feed position, as stored in Redis, so a replica starts warm:
restore, then replay the KV-event stream from ``stream_seq + 1``."""

from __future__ import annotations

import msgspec

from thunderagent.prefix_index.feed import IndexFeeder, _Cursor
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
    taken_at: float


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(IndexState)


def capture(feeder: IndexFeeder, stream_seq: int, now: float) -> bytes:
    cursors = [CursorImage(w, c.epoch, c.seq, c.counter) for w, c in feeder.cursors.items()]
    state = IndexState(
        index=feeder.index.snapshot(), cursors=cursors, stream_seq=stream_seq, taken_at=now
    )
    return _encoder.encode(state)


def restore(feeder: IndexFeeder, data: bytes, now: float) -> int:
    """Load ``data`` into ``feeder``; returns the stream sequence it covers."""
    state = _decoder.decode(data)
    feeder.index.restore(state.index, now)
    feeder.cursors = {c.worker: _Cursor(c.epoch, c.seq, c.counter) for c in state.cursors}
    return state.stream_seq
