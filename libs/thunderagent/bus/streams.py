"""JetStream streams, each created with one fixed config by whichever process needs it first."""

from __future__ import annotations

import logging

from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError

from thunderagent.schemas import subjects

log = logging.getLogger(__name__)

KV_EVENTS_MAX_AGE_S = 3600.0
"""A router replica replays from the Redis snapshot's sequence: one hour of history covers any
snapshot interval with a wide margin; older events are only needed if Redis was lost, and then a
resync from the adapters rebuilds the index anyway."""

KV_EVENTS_MAX_BYTES = 1 << 30


def kv_events_stream_config() -> StreamConfig:
    return StreamConfig(
        name=subjects.KV_EVENTS_STREAM,
        subjects=[subjects.KV_EVENTS_WILDCARD],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        max_age=KV_EVENTS_MAX_AGE_S,
        max_bytes=KV_EVENTS_MAX_BYTES,
    )


async def ensure_kv_events_stream(js: JetStreamContext) -> None:
    """Create the KV-event stream if it does not exist (same config from every process)."""
    try:
        await js.stream_info(subjects.KV_EVENTS_STREAM)
        return
    except NotFoundError:
        pass
    try:
        await js.add_stream(kv_events_stream_config())
    except Exception as err:  # created concurrently by another process: fine if it exists now
        await js.stream_info(subjects.KV_EVENTS_STREAM)
        log.debug("stream created concurrently: %s", err)
