"""Connect to NATS with exponential backoff on the first connection and reconnects after it."""

from __future__ import annotations

import asyncio
import logging
import random

from nats.aio.client import Client as NATS

log = logging.getLogger(__name__)


async def connect(
    url: str,
    *,
    name: str,
    deadline_s: float = 30.0,
    first_delay_s: float = 0.05,
    max_delay_s: float = 2.0,
) -> NATS:
    """Connect, retrying with jittered exponential backoff until ``deadline_s`` has passed.

    nats-py reconnects by itself once connected (forever here, every ``reconnect_time_wait`` with
    jitter), but it gives up on a failed *first* connection, which is common while an embedded
    server is still starting; hence the loop.
    """

    async def on_error(err: Exception) -> None:
        log.info("nats %s: %s", name, err)

    async def on_disconnect() -> None:
        log.info("nats %s: disconnected", name)

    async def on_reconnect() -> None:
        log.info("nats %s: reconnected", name)

    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + deadline_s
    delay = first_delay_s
    while True:
        client = NATS()
        try:
            # nats-py retries a refused first connection itself when reconnects are allowed,
            # without a deadline: the attempt is bounded here, and retried with our backoff.
            await asyncio.wait_for(
                client.connect(
                    url,
                    name=name,
                    connect_timeout=2,
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=0.5,
                    error_cb=on_error,
                    disconnected_cb=on_disconnect,
                    reconnected_cb=on_reconnect,
                ),
                timeout=max(0.05, min(give_up_at - loop.time(), 5.0)),
            )
            return client
        except Exception as err:  # nats-py raises several unrelated types for a refused connect
            await _discard(client)
            if loop.time() + delay > give_up_at:
                raise ConnectionError(f"cannot connect to NATS at {url}: {err!r}") from err
            log.info("nats %s: connect failed (%r), retry in %.2fs", name, err, delay)
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, max_delay_s)


async def _discard(client: NATS) -> None:
    try:
        await client.close()
    except Exception:  # never connected: nothing to close
        pass
