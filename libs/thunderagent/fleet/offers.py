"""Hand-offs a worker must not run: each offer of a run names itself, and the worker keeps the
names of the offers it ran or was told to drop.

A hand-off is a request/reply with a timeout. No answer is not "no": the offer may be queued
behind other work at the worker and taken later, after its sender gave the run to someone
else. The sender then aborts it there, but the abort travels on another subject and may be
handled first, find nothing, and the late offer would start a second run of the request (its
client gets two streams; a GPU computes it twice). So the abort names the offers it voids, and
an offer the worker has already handled is not run again when it comes again: one voided (by
an abort, or superseded by a later offer of the same run) is refused, one that ran here is
answered as taken (its sender asked twice; the run happened). Names are kept ``keep_s`` (far
longer than any delay a message survives in NATS) and at most ``limit`` of them.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Iterator
from typing import Final

OFFER_MEMORY_S: Final = 120.0
"""How long a worker remembers an offer it handled: a hand-off is given up after seconds
(the sender's ack timeout, then its abort's), so a copy of one arriving minutes later is not
a case to cover."""
MAX_OFFERS: Final = 65_536
"""Offer names a worker keeps at most (oldest dropped first): ~11 MB when full, minutes of
offers at hundreds per second."""


class OfferIds:
    """Names for one sender's offers: a random prefix per process (a restarted sender must not
    reuse a name its workers still remember) and a counter."""

    def __init__(self, prefix: str | None = None) -> None:
        self.prefix = secrets.token_hex(6) if prefix is None else prefix
        self._n: Iterator[int] = itertools.count()

    def next(self) -> str:
        return f"{self.prefix}-{next(self._n):x}"


class HandledOffers:
    """The offers a worker ran or was told to drop, each with when it learned of it."""

    def __init__(self, keep_s: float = OFFER_MEMORY_S, limit: int = MAX_OFFERS) -> None:
        if not keep_s > 0:
            raise ValueError(f"keep_s must be positive, got {keep_s!r}")
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit!r}")
        self.keep_s = keep_s
        self.limit = limit
        self._seen: dict[str, tuple[float, bool]] = {}
        """offer name -> (when it was handled, whether it ran here), oldest first."""

    def ran(self, now: float, offer: str) -> None:
        """``offer`` started a run here."""
        self._put(now, offer, True)

    def void(self, now: float, *offers: str) -> None:
        """``offers`` must not start a run here (one that ran stays known as run)."""
        for offer in offers:
            self._put(now, offer, self.outcome(offer, now) is True)

    def outcome(self, offer: str, now: float) -> bool | None:
        """True: ``offer`` ran here; False: it was voided; None: neither (within ``keep_s``;
        an empty name is never tracked)."""
        seen = self._seen.get(offer) if offer else None
        if seen is None or now - seen[0] >= self.keep_s:
            return None
        return seen[1]

    def __len__(self) -> int:
        return len(self._seen)

    def _put(self, now: float, offer: str, ran: bool) -> None:
        if not offer:  # from a sender that does not name its offers
            return
        seen = self._seen
        seen.pop(offer, None)  # put again: it moves to the young end
        seen[offer] = (now, ran)
        while seen:
            oldest = next(iter(seen))
            if len(seen) <= self.limit and now - seen[oldest][0] < self.keep_s:
                return
            del seen[oldest]
