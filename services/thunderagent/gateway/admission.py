"""How many generate requests one gateway process holds at once, as SMG 1.13 bounds its own.

A request takes a permit when it arrives and gives it back when its answer is written to the
end (a streamed one holds it while it streams). Past ``limit`` permits a request waits, at most
``queue_size`` of them at once and each at most ``queue_timeout_s``; a request that finds the
queue full, or waits out its time, is answered 429 with ``retry-after``. SMG's defaults
(``smg launch --max-concurrent-requests -1 --queue-size 100 --queue-timeout-secs 60``): 1,024
permits per available core, at least 4,096; a queue of 100 for 60 s. The bound is far above
what one gateway process serves at its best here (~1,000 req/s of short answers): it keeps a
flood from holding unbounded memory and coroutines, it is not load shedding (the routers'
bound on their hand-offs is, ``scheduling/handoff_limit.py``).
"""

from __future__ import annotations

import asyncio
import os
from collections import deque
from typing import Final

PERMITS_PER_CORE: Final = 1024
MIN_PERMITS: Final = 4096


def default_limit() -> int:
    """SMG's ``-1``: 1,024 permits per core this process may run on, at least 4,096."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(MIN_PERMITS, PERMITS_PER_CORE * (cores or 1))


class Admission:
    """Permits for requests in progress, with a bounded, timed wait for one."""

    def __init__(self, limit: int, queue_size: int, queue_timeout_s: float) -> None:
        """``limit`` 0: no bound (every request is admitted at once)."""
        if limit < 0 or queue_size < 0 or not queue_timeout_s > 0:
            raise ValueError(
                f"limit and queue_size must be >= 0 and queue_timeout_s > 0, got {limit!r}, "
                f"{queue_size!r}, {queue_timeout_s!r}"
            )
        self.limit = limit
        self.queue_size = queue_size
        self.queue_timeout_s = queue_timeout_s
        self.held = 0
        """Permits taken and not given back."""
        self._waiting: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        """Requests waiting for a permit. The turns of those that gave up (timed out, went
        away) are dropped here too: with no permit coming back, nothing else would."""
        if any(w.done() for w in self._waiting):
            self._waiting = deque(w for w in self._waiting if not w.done())
        return len(self._waiting)

    async def enter(self) -> str | None:
        """Take a permit (waiting for one if need be); None once taken, else why not."""
        if not self.limit or self.held < self.limit:
            self.held += 1
            return None
        if self.waiting >= self.queue_size:
            return (f"the gateway holds {self.held} requests, its limit, and "
                    f"{self.queue_size} more wait for one to end")  # fmt: skip
        turn = asyncio.get_running_loop().create_future()
        self._waiting.append(turn)
        try:
            await asyncio.wait_for(asyncio.shield(turn), self.queue_timeout_s)
        except TimeoutError:
            if turn.done():  # handed a permit as the wait ran out: it is ours
                return None
            turn.cancel()
            return f"no permit came within {self.queue_timeout_s:g} s ({self.held} held)"
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.leave()  # handed a permit, but its request went away: pass it on
            else:
                turn.cancel()
            raise
        return None

    def leave(self) -> None:
        """Give a permit back: to the first request still waiting, or to the pool."""
        while self._waiting:
            turn = self._waiting.popleft()
            if not turn.done():
                turn.set_result(None)  # the permit passes on: ``held`` stays
                return
        self.held -= 1
