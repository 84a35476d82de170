"""Scheduling windows: arrivals of one class are collected and decided together.

A window opens at the first arrival of its class when none is open, and every request that
arrives before it closes is released at its close. Lengths by mode:

* ``none``: 0 (decide at once).
* ``fixed``: ``fixed_window_s`` for every class.
* ``adaptive``: ``min(cap, window_gain_s * waiting)``, ``waiting`` = requests the scheduler
  already holds (workers had no room for them). While every worker has room nothing waits and a
  window could not change a decision, only delay it, so arrivals go at once however fast they
  come; once requests compete for room, the window grows with the backlog so each decision sees
  more of it. ``cap`` is ``online_window_cap_s`` for priority 0 and ``batch_window_cap_s`` for
  the rest (docs/features.md, points 5 and 12: a long window is a P99 spike, so online requests
  stay at <= 10 ms).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from thunderagent.scheduling.params import SchedParams


@dataclass(slots=True)
class Window:
    params: SchedParams
    _close: dict[int, float] = field(default_factory=dict)
    """Window class (0 online, 1 batch) -> when its open window closes."""

    def length(self, priority: int, waiting: int, now: float) -> float:
        p = self.params
        if p.window == "none":
            return 0.0
        if p.window == "fixed":
            return p.fixed_window_s
        cap = p.online_window_cap_s if priority <= 0 else p.batch_window_cap_s
        return min(cap, p.window_gain_s * waiting)

    def release_at(self, priority: int, waiting: int, now: float) -> float:
        """When a request arriving now is decided. ``waiting``: requests already waiting."""
        cls = 0 if priority <= 0 else 1
        close = self._close.get(cls)
        if close is None or close <= now:
            close = now + self.length(priority, waiting, now)
            self._close[cls] = close
        return close
