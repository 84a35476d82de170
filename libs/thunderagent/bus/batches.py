"""Messages that no one waits for, sent in batches.

Some messages are read only in aggregate (route decisions feed the migration planner's demand
counts over seconds; a durable consumer's acks are cumulative), yet one per event costs a
publish, a fan-out at the server and a wake-up in every subscriber. ``BatchWindow`` decides when
a batch goes: its first item waits at most ``window_s``, a full batch goes at once; an item after
a quiet spell therefore waits one window, never more. ``BatchSender`` runs it on the event loop
and hands each batch to ``send(items)`` (one message); a failed send is logged with its count,
like any fire-and-forget publish. A batch over the bus's payload limit (a large fleet's route
decisions each name every worker) goes in halves, in order, as often as it takes.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from thunderagent.bus.errors import PayloadTooLarge

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(slots=True)
class BatchWindow(Generic[T]):
    """When a batch must go (pure: the caller's clock)."""

    window_s: float
    max_items: int = 256
    items: list[T] = field(default_factory=list)
    first_at: float = math.inf

    def __post_init__(self) -> None:
        if not (math.isfinite(self.window_s) and self.window_s >= 0):
            raise ValueError(f"batch window must be a finite number >= 0, got {self.window_s!r}")
        if self.max_items < 1:
            raise ValueError(f"max_items must be >= 1, got {self.max_items!r}")

    def add(self, item: T, now: float) -> float:
        """Hold ``item``; returns when the batch must go (``<= now``: at once)."""
        if not self.items:
            self.first_at = now
        self.items.append(item)
        if len(self.items) >= self.max_items:
            return now
        return self.first_at + self.window_s

    def take(self) -> list[T]:
        items, self.items, self.first_at = self.items, [], math.inf
        return items


class BatchSender(Generic[T]):
    def __init__(
        self,
        send: Callable[[list[T]], Awaitable[None]],
        window_s: float,
        max_items: int = 256,
        *,
        what: str = "items",
    ) -> None:
        self.send = send
        self.what = what
        """Named in the log line of a failed send."""
        self.window = BatchWindow[T](window_s, max_items)
        self.sent = 0
        """Batches published."""
        self.dropped = 0
        """Items over the bus's payload limit on their own (logged)."""
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task] = set()

    def add(self, item: T) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        due = self.window.add(item, now)
        if due <= now:
            self._spawn()
        elif self._timer is None:
            self._timer = loop.call_at(due, self._spawn)

    def _spawn(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        items = self.window.take()
        if items:
            task = asyncio.get_running_loop().create_task(self._publish(items))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _publish(self, items: list[T]) -> None:
        try:
            await self.send(items)
            self.sent += 1
        except PayloadTooLarge as err:  # a large fleet's decisions: halves go, in order
            if len(items) == 1:
                self.dropped += 1
                log.warning("a %s item not sent: %s", self.what, err)
                return
            half = len(items) // 2
            await self._publish(items[:half])
            await self._publish(items[half:])
        except Exception:  # a closed connection: these are observations, not requests
            log.warning("%d %s not sent", len(items), self.what, exc_info=True)

    async def close(self) -> None:
        """Publish what is held and wait for it (the service is stopping)."""
        self._spawn()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=2.0)
