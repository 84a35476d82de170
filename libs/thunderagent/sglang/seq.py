"""Sequence tracking for one SGLang KV-event publisher (pure: no I/O).

SGLang numbers each PUB message from 0 per publisher instance, one number per batch. A live
subscriber therefore sees exactly one of: the next number (in order), a jump forward (frames
were lost: a gap to replay), or a jump back (the engine restarted: its cache is empty and its
counter began again at 0). The subscriber shell asks `SeqTracker.classify` for every live
frame and uses `plan_replay` to merge what the replay socket returned.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class SeqVerdict(enum.Enum):
    """How a live sequence number relates to the ones seen before."""

    IN_ORDER = "in_order"
    """Exactly the next number (or the first one, when nothing is expected)."""
    GAP = "gap"
    """Numbers were skipped: `[expected, seq)` is missing."""
    RESTART = "restart"
    """The number went back: a new publisher (engine restart) started counting again."""


@dataclass(slots=True)
class SeqTracker:
    """Next expected sequence number of one publisher.

    `expected` None means nothing is assumed: the first frame is taken as it comes. Set it
    to 0 to treat every frame before the first one seen as missing (replay from the start).
    """

    expected: int | None = 0

    def classify(self, seq: int) -> SeqVerdict:
        """Verdict for a live frame numbered `seq`; does not change the state."""
        if self.expected is None or seq == self.expected:
            return SeqVerdict.IN_ORDER
        if seq > self.expected:
            return SeqVerdict.GAP
        return SeqVerdict.RESTART

    def missing_before(self, seq: int) -> tuple[int, int] | None:
        """Half-open range `[start, stop)` missing before `seq`, None when nothing is."""
        if self.expected is None or seq <= self.expected:
            return None
        return (self.expected, seq)

    def delivered(self, seq: int) -> None:
        """Record that `seq` was handed on: the next expected number is `seq + 1`."""
        self.expected = seq + 1

    def restarted(self) -> None:
        """Forget the old publisher: the new one counts from 0."""
        self.expected = 0


@dataclass(frozen=True, slots=True)
class ReplayPlan:
    """What to deliver from a replay answer for the missing range `[start, stop)`."""

    deliver: list[int]
    """Replayed sequence numbers inside the range, ascending, each once."""
    lost: list[tuple[int, int]]
    """Half-open ranges of the missing range the replay did not return."""


def plan_replay(start: int, stop: int, replayed: list[int]) -> ReplayPlan:
    """Pick the replayed numbers that fill `[start, stop)` and name the holes left.

    Numbers outside the range (the publisher answers with everything from `start` on,
    including frames also received live) and duplicates are dropped.
    """
    have = sorted({s for s in replayed if start <= s < stop})
    lost: list[tuple[int, int]] = []
    cursor = start
    for s in have:
        if s > cursor:
            lost.append((cursor, s))
        cursor = s + 1
    if cursor < stop:
        lost.append((cursor, stop))
    return ReplayPlan(deliver=have, lost=lost)
