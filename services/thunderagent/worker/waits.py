"""How the worker adapter's loops wait: a pause that a stop (or a health change) cuts short."""

from __future__ import annotations

import asyncio


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
