"""How the worker adapter's loops wait: a pause that a stop (or a health change) cuts short,
and an engine that does not answer yet."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from thunderagent.worker.engine_client import EngineError

log = logging.getLogger(__name__)
T = TypeVar("T")


async def wait_any(stop: asyncio.Event, other: asyncio.Event, seconds: float) -> None:
    """Sleep ``seconds``, or less when either event is set."""
    waits = {asyncio.ensure_future(stop.wait()), asyncio.ensure_future(other.wait())}
    try:
        await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


async def sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        pass


async def once_ready(
    engine_url: str, stop: asyncio.Event, ask: Callable[[], Awaitable[T]]
) -> T | None:
    """``ask()``'s answer once the engine gives one, asking again with backoff while it does
    not answer (starting up); None when stopped first."""
    delay = 0.1
    while not stop.is_set():
        try:
            return await ask()
        except (TimeoutError, OSError, EngineError) as err:
            log.info("engine %s not ready (%s)", engine_url, err)
        await sleep_or_stop(stop, delay)
        delay = min(delay * 2, 2.0)
    return None
