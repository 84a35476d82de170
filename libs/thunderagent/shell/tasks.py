"""Background tasks a service starts and does not await where it starts them."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable

log = logging.getLogger(__name__)


class TaskSet:
    """Holds a reference to each task until it ends (the loop keeps only weak ones) and logs a
    task's exception when it ends, with its traceback: otherwise it surfaces only when the task
    is garbage-collected, if ever, and whatever the task was doing stops without a word."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._tasks: set[asyncio.Task] = set()
        self.failed = 0
        """Tasks that ended with an exception."""

    def spawn(self, coro: Awaitable[None], name: str | None = None) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        if name is not None:
            task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        err = task.exception()
        if err is not None:
            self.failed += 1
            log.error("%s: task %s failed", self.what, task.get_name(), exc_info=err)

    def __len__(self) -> int:
        return len(self._tasks)

    async def wait(self, timeout_s: float) -> None:
        """Until every task ends or ``timeout_s`` passes (stopping: let hand-offs finish)."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)

    def cancel(self) -> None:
        for task in list(self._tasks):
            task.cancel()
