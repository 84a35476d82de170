"""Follow the KV-event stream from now on and report stored blocks (prefix grouping releases
requests that wait for a prefix another request is prefilling)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec
from nats.js.api import ConsumerConfig, DeliverPolicy

from thunderagent.bus import Bus
from thunderagent.bus.streams import ensure_kv_events_stream
from thunderagent.schemas import BlocksStored, KvEventBatch, subjects

log = logging.getLogger(__name__)
_decoder = msgspec.json.Decoder(KvEventBatch)


async def follow_stored_blocks(
    bus: Bus, on_stored: Callable[[str, list[int]], None], stop: asyncio.Event
) -> None:
    js = bus.nc.jetstream()
    await ensure_kv_events_stream(js)

    async def on_msg(msg) -> None:
        try:
            batch = _decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            log.warning("undecodable KV batch on %s: %s", msg.subject, err)
            return
        for ev in batch.events:
            if isinstance(ev, BlocksStored) and ev.hashes:
                on_stored(batch.worker_id, ev.hashes)

    sub = await js.subscribe(
        subjects.KV_EVENTS_WILDCARD,
        stream=subjects.KV_EVENTS_STREAM,
        ordered_consumer=True,
        config=ConsumerConfig(deliver_policy=DeliverPolicy.NEW),
        cb=on_msg,
    )
    try:
        await stop.wait()
    finally:
        try:
            await sub.unsubscribe()
        except Exception:  # the connection is closing
            pass
