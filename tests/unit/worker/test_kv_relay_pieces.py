"""The relay cuts what would pass NATS's payload limit into batches under it, in order: a list
of events between events, one long chain (or removal) inside it; a dump goes a piece at a time.
A stand-in bus records what would be published; the real JetStream path is
``tests/integration/test_kv_relay.py``."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from thunderagent.bus.bus import decoder_for
from thunderagent.schemas import AllCleared, BlocksRemoved, BlocksStored, KvEventBatch
from thunderagent.sglang import kv_wire
from thunderagent.sglang.mirror import DUMP_PIECE_BLOCKS
from thunderagent.worker.kv_relay import PAYLOAD_HEADROOM, KvRelay


class RecordingBus:
    def __init__(self, max_payload: int) -> None:
        self.nc = SimpleNamespace(max_payload=max_payload)
        self.payloads: list[bytes] = []

    async def stream_publish(self, subject: str, payload: bytes, headers=None) -> int:
        self.payloads.append(payload)
        return len(self.payloads)


def chain(first: int, n: int, parent: int | None) -> BlocksStored:
    hashes = list(range(first, first + n))
    return BlocksStored(hashes=hashes, check_hashes=[h + 2**40 for h in hashes], parent_hash=parent)


event = st.one_of(
    st.builds(chain, st.integers(1, 2**50), st.integers(1, 300), st.none() | st.integers(1, 2**50)),
    st.builds(lambda n: BlocksRemoved(hashes=list(range(1, n + 1))), st.integers(1, 300)),
    st.just(AllCleared()),
)


@settings(max_examples=50, deadline=None)
@given(events=st.lists(event, min_size=1, max_size=12), limit=st.integers(600, 20_000))
def test_every_batch_fits_and_the_events_come_back_whole_in_order(events, limit):
    bus = RecordingBus(PAYLOAD_HEADROOM + limit)
    relay = KvRelay(bus, "w0", 16)  # type: ignore[arg-type]
    asyncio.run(relay._send(list(events)))
    decode = decoder_for(KvEventBatch).decode
    batches = [decode(p) for p in bus.payloads]
    assert all(len(p) <= limit for p in bus.payloads)
    assert [b.seq for b in batches] == list(range(len(batches)))
    assert relay.published == len(batches) and relay.seq == len(batches) - 1
    got = [e for b in batches for e in b.events]
    assert blocks(got) == blocks(events)


def blocks(events: list) -> list[tuple]:
    """Each block an event names, with its parent where it was stored: what a cut must keep."""
    out: list[tuple] = []
    for e in events:
        if isinstance(e, BlocksStored):
            parents = [e.parent_hash, *e.hashes[:-1]]
            rows = zip(e.hashes, e.check_hashes, parents, strict=True)
            out += [("stored", h, c, p) for h, c, p in rows]
        elif isinstance(e, BlocksRemoved):
            out += [("removed", h) for h in e.hashes]
        else:
            out.append(("cleared",))
    return out


def test_a_batch_under_the_limit_is_one_message():
    bus = RecordingBus(1 << 20)
    relay = KvRelay(bus, "w0", 16)  # type: ignore[arg-type]
    asyncio.run(relay._send([chain(1, 1000, None), BlocksRemoved(hashes=[5])]))
    assert len(bus.payloads) == 1


def test_a_refresh_lets_the_adapter_run_between_pieces_of_its_dump() -> None:
    """The re-announcement of a large cache goes a piece at a time, the event loop turning
    between pieces (the engine's events are read and the runs stream on meanwhile), and every
    block goes out in order."""
    blocks = 3 * DUMP_PIECE_BLOCKS + 100
    bus = RecordingBus(8 << 20)
    relay = KvRelay(bus, "w0", 4)  # type: ignore[arg-type]
    relay.mirror.apply([kv_wire.BlockStored(
        block_hashes=list(range(1, blocks + 1)), parent_block_hash=None, block_size=4,
        token_ids=list(range(blocks * 4)), lora_id=None,
    )])  # fmt: skip
    made = 0
    dump_pieces = relay.mirror.dump_pieces

    def counted(*args):
        nonlocal made
        for piece in dump_pieces(*args):
            made += 1
            yield piece

    relay.mirror.dump_pieces = counted  # type: ignore[method-assign]
    seen: set[int] = set()  # pieces made by the time each other task ran

    async def main() -> None:
        refresh = asyncio.create_task(relay.refresh())
        while not refresh.done():
            seen.add(made)
            await asyncio.sleep(0)
        await refresh

    asyncio.run(main())
    decode = decoder_for(KvEventBatch).decode
    stored = [e for p in bus.payloads for e in decode(p).events]
    assert [h for e in stored for h in e.hashes] == [
        b.primary for b in relay.mirror.blocks.values()
    ]
    assert made == 4
    assert {1, 2, 3} <= seen, f"other work ran only with {sorted(seen)} pieces made"
