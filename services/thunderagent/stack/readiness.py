"""Wait until the stack serves: every service answers its health probe and every worker is
registered (its registration is in the workers bucket)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from thunderagent.bus import Bus, connect
from thunderagent.schemas import subjects


async def wait_until_ready(
    nats_url: str,
    services: list[str],
    workers: int,
    *,
    timeout_s: float = 60.0,
    check: Callable[[], None] = lambda: None,
) -> None:
    """``check`` is called on every poll; it raises when a child process died, so a broken
    service fails the start at once with its log instead of after the timeout."""
    nc = await connect(nats_url, name="thunderagent-up", identity="admin", deadline_s=timeout_s)
    try:
        give_up_at = time.monotonic() + timeout_s
        missing = list(services)
        while missing:
            still = []
            for name in missing:
                try:
                    await nc.request(subjects.health(name), b"", timeout=0.5)  # the probe is raw
                except Exception:
                    still.append(name)
            missing = still
            check()
            if missing and time.monotonic() > give_up_at:
                raise TimeoutError(f"services not answering after {timeout_s}s: {missing}")
            if missing:
                await asyncio.sleep(0.1)
        registered = 0
        bucket = await Bus(nc, service="up").bucket(subjects.WORKERS_BUCKET)
        while registered < workers:
            registered = len(await bucket.keys())
            if registered >= workers:
                break
            check()
            if time.monotonic() > give_up_at:
                raise TimeoutError(f"{registered}/{workers} workers registered after {timeout_s}s")
            await asyncio.sleep(0.1)
    finally:
        await nc.close()
