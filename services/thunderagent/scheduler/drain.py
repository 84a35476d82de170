"""How long the scheduler's queue takes to drain at the recent dispatch rate: the retry hint
(``retry_after_s``) of a submission refused because too many requests already wait."""

from __future__ import annotations

from collections import deque

DRAIN_WINDOW_S = 10.0
"""The dispatches of this many seconds set the rate."""


class DrainRate:
    def __init__(self) -> None:
        self._dispatches: deque[float] = deque(maxlen=1024)

    def dispatched(self, now: float) -> None:
        self._dispatches.append(now)

    def seconds(self, waiting: int, now: float) -> float:
        """Seconds until ``waiting`` requests are dispatched at the recent rate (at least 1;
        the whole window when nothing went out in it)."""
        recent = sum(1 for t in self._dispatches if now - t <= DRAIN_WINDOW_S)
        rate = recent / DRAIN_WINDOW_S
        return round(max(1.0, waiting / rate if rate else DRAIN_WINDOW_S), 1)
