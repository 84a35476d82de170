"""How many hand-offs a router keeps waiting for an answer: a bound that follows their answer times.

A router hands each request on (to the scheduler, or to a worker's adapter on credit) and waits
for the ack. When the stack behind it cannot keep up (its processes starved of CPU, a NATS
server behind), the acks slow down while requests keep coming: thousands wait at once, each
times out after seconds, the client resends it (more work), and the stack spends its CPU on
requests whose clients were already told it failed. Little's law says where that goes: at a
fixed rate the hand-offs in flight grow with their answer time, so the router bounds them, as
TCP bounds the bytes in flight on a congested link. The bound follows the answers: each fast one
while the bound is half used raises it by one (it doubles per round trip in use, so a rate that
steps up is not refused while the stack keeps up), and an answer slower than ``slow_s`` cuts it
to ``backoff`` x the hand-offs then in flight (at most once per ``slow_s``, so one backlog's late
answers count once). A request over the bound is answered ``overloaded`` at once, before any
routing work; the stack drains, answers speed up, and the bound grows back.

Pure: the caller passes the answer times and a monotonic clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(slots=True)
class HandoffLimit:
    initial: int = 64
    """Hand-offs in flight at start: 32,000 requests per second at a 2 ms ack; it grows as
    fast as it is used."""
    minimum: int = 4
    """Never below: some hand-offs always go, so their answer times show when the stack has
    recovered."""
    maximum: int = 4096
    slow_s: float = 0.25
    """An ack slower than this is a backlog, not a busy moment (a hand-off takes 2-10 ms on an
    idle stack, up to ~55 ms at 400 req/s of ``bench live`` on this 2-core VM). Under overload
    the answers settle near it, so it is also the wait a refused request is spared. Chosen on
    ``bench throughput``'s generated load (instant engines, 2,000-4,000 req/s, one run each):
    0.1 s refused 1,486 of 9,000 at 3,000 req/s, which 0.25 and 0.5 s served whole (added p99
    136 / 86 ms); at 4,000 req/s, past what the stack holds, 0.25 s kept added p99 at 363 ms
    (1,961 of 12,000 refused) and 0.5 s let it reach 1,041 ms (1,527 refused)."""
    backoff: float = 0.7
    """After a slow ack the bound is this share of what it was, or of the hand-offs then in
    flight where they are fewer."""
    limit: float = field(init=False)
    """The bound now (its whole part counts)."""
    in_flight: int = field(default=0, init=False)
    shed: int = field(default=0, init=False)
    """Requests refused so far."""
    _cut_at: float = field(default=-math.inf, init=False, repr=False)

    def __post_init__(self) -> None:
        if not (isinstance(self.minimum, int) and self.minimum >= 1):
            raise ValueError(f"HandoffLimit.minimum must be an integer >= 1, got {self.minimum!r}")
        if not self.minimum <= self.initial <= self.maximum:
            raise ValueError(
                f"HandoffLimit needs minimum <= initial <= maximum, got {self.minimum}, "
                f"{self.initial}, {self.maximum}"
            )
        if not (math.isfinite(self.slow_s) and self.slow_s > 0):
            raise ValueError(f"HandoffLimit.slow_s must be positive, got {self.slow_s!r}")
        if not 0 < self.backoff < 1:
            raise ValueError(f"HandoffLimit.backoff must lie in (0, 1), got {self.backoff!r}")
        self.limit = float(self.initial)

    def acquire(self) -> bool:
        """Take a place for one hand-off; False (counted in ``shed``) when all are taken."""
        if self.in_flight >= int(self.limit):
            self.shed += 1
            return False
        self.in_flight += 1
        return True

    def release(self, answered_in_s: float, now: float) -> None:
        """A hand-off taken with ``acquire`` got its answer (or gave up) after
        ``answered_in_s``."""
        self.in_flight = max(0, self.in_flight - 1)
        if answered_in_s > self.slow_s:
            if now - self._cut_at >= self.slow_s:
                cut = min(self.limit, self.in_flight + 1.0) * self.backoff
                self.limit = max(float(self.minimum), cut)
                self._cut_at = now
        elif self.in_flight + 1 >= self.limit / 2:  # only a limit in use grows
            self.limit = min(float(self.maximum), self.limit + 1.0)

    def retry_after_s(self) -> float:
        """A hint for a refused sender: about one slow answer's time, in whole seconds."""
        return float(max(1, math.ceil(self.slow_s)))
