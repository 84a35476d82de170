"""Admission credits: the scheduler lends router replicas the room it has measured, so a router
holding credit for a worker dispatches there itself, one hop shorter, while every request that
must wait, be grouped behind a prefix leader, be paused with its program or be checked against
a deadline still goes through the scheduler's queue. The scheduler stays the one place that
decides when work is held: it grants nothing while anything waits, and it books every direct
dispatch (``Scheduler.admitted``) when the router reports it.

Flow control as in credit-based networks: a grant carries, per worker, the room the scheduler
gives this router and how many of this router's direct dispatches it had already booked when it
issued the grant. The router may dispatch ``credits - (dispatched - booked)`` more: a grant that
crosses the router's own dispatches in flight never lets it count the same room twice.

Pure: the scheduler service and the router service exchange grants and dispatch notices over
NATS; the replay passes them by hand, with no delay.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

ROUTER_TTL_S: Final = 3.0
"""A router replica that has not said hello for this long gets no more credit (its share goes
to the others); it says hello every second."""

REGRANT_SLACK: Final = 4
"""A router's share of a worker is re-sent at once when it falls below what the router still
holds there (a router must never hold more room than there is), but when it grows only past a
quarter of that (any growth while it holds 3 or fewer, and always from none). Room grows with
every run that ends, and a grant per change was more than one message per request; a direct
dispatch moves nothing (the share drops by one as the booking rises by one). Room not yet lent
costs only a hop (the request goes through the scheduler's queue); the periodic grant (every
second) lends it all again."""


@dataclass(slots=True, frozen=True)
class Grant:
    """What one router may dispatch by itself."""

    credits: Mapping[str, int]
    """worker id -> room lent to this router (absent: none)."""
    booked: Mapping[str, int]
    """worker id -> this router's direct dispatches the scheduler had booked at grant time."""


@dataclass(slots=True)
class CreditIssuer:
    """The scheduler's side: which routers exist, what each dispatched directly, what to lend."""

    routers: dict[str, float] = field(default_factory=dict)
    """router id -> when it last said hello."""
    booked: dict[str, dict[str, int]] = field(default_factory=dict)
    """router id -> worker id -> its direct dispatches booked so far."""
    _last: dict[str, Grant] = field(default_factory=dict)
    """router id -> the last grant it was sent."""

    def hello(self, router_id: str, now: float) -> bool:
        """A router is alive; True when it is new (the shares change)."""
        new = router_id not in self.routers
        self.routers[router_id] = now
        self.booked.setdefault(router_id, {})
        return new

    def expire(self, now: float, ttl_s: float = ROUTER_TTL_S) -> list[str]:
        gone = [r for r, seen in self.routers.items() if now - seen > ttl_s]
        for r in gone:
            del self.routers[r]
            self.booked.pop(r, None)
            self._last.pop(r, None)
        return gone

    def book(self, router_id: str, worker_id: str) -> None:
        """A direct dispatch the router reported has been booked by the scheduler."""
        per = self.booked.setdefault(router_id, {})
        per[worker_id] = per.get(worker_id, 0) + 1

    def grants(self, rooms: Mapping[str, int], *, force: bool = False) -> dict[str, Grant]:
        """Per router, its share of every worker's room; only routers whose share moved past
        ``REGRANT_SLACK`` allows from what they still hold (or all with ``force``) get a new
        one."""
        if not self.routers:
            return {}
        n = len(self.routers)
        order = sorted(self.routers)
        out: dict[str, Grant] = {}
        for i, router in enumerate(order):
            # the remainder goes to the first routers, so the shares add up to the room
            share = {w: room // n + (1 if i < room % n else 0) for w, room in rooms.items()}
            share = {w: c for w, c in share.items() if c > 0}
            if force or self._moved(router, share):
                grant = Grant(share, dict(self.booked.get(router, {})))
                self._last[router] = out[router] = grant
        return out

    def in_hand(self, router_id: str, worker_id: str) -> int:
        """What the router's last grant still lets it dispatch to the worker, as far as the
        scheduler knows (its direct dispatches not yet booked here are unknown to both sides
        of the comparison in ``_moved``, so they cancel out)."""
        last = self._last.get(router_id)
        if last is None:
            return 0
        booked_since = self.booked.get(router_id, {}).get(worker_id, 0) - last.booked.get(
            worker_id, 0
        )
        return max(0, last.credits.get(worker_id, 0) - booked_since)

    def _moved(self, router_id: str, share: Mapping[str, int]) -> bool:
        last = self._last.get(router_id)
        if last is None:
            return True
        for worker in share.keys() | last.credits.keys():
            held, new = self.in_hand(router_id, worker), share.get(worker, 0)
            if new < held or (new > held and (held == 0 or new - held > held // REGRANT_SLACK)):
                return True
        return False


@dataclass(slots=True)
class CreditWallet:
    """One router's side: the latest grant of each scheduler and its own direct dispatches
    since. Schedulers partitioned by model own disjoint workers, so their grants add up."""

    credits: dict[str, int] = field(default_factory=dict)
    booked: dict[str, int] = field(default_factory=dict)
    dispatched: dict[str, int] = field(default_factory=dict)
    """worker id -> direct dispatches this router made (ever)."""
    grants: dict[str, Grant] = field(default_factory=dict)
    """scheduler id -> its latest grant."""

    def update(self, grant: Grant, scheduler_id: str = "") -> None:
        self.grants[scheduler_id] = grant
        self.credits, self.booked = {}, {}
        for g in self.grants.values():
            self.credits.update(g.credits)
            self.booked.update(g.booked)

    def available(self, worker_id: str) -> int:
        unbooked = max(0, self.dispatched.get(worker_id, 0) - self.booked.get(worker_id, 0))
        return max(0, self.credits.get(worker_id, 0) - unbooked)

    def take(self, worker_id: str) -> bool:
        """Use one credit for ``worker_id``; False (nothing taken) when none is left."""
        if self.available(worker_id) <= 0:
            return False
        self.dispatched[worker_id] = self.dispatched.get(worker_id, 0) + 1
        return True

    def give_back(self, worker_id: str) -> None:
        """The worker refused the dispatch: it never happened."""
        self.dispatched[worker_id] = max(0, self.dispatched.get(worker_id, 0) - 1)

    def drop(self) -> None:
        """The schedulers are gone or restarted: dispatch nothing by ourselves until they
        grant again."""
        self.credits, self.grants = {}, {}


def may_dispatch_directly(
    *,
    deadline: float | None,
    program_id: str | None,
    confirmed_blocks: int,
    predicted_blocks: int,
    group_min_blocks: int = 4,
) -> bool:
    """Whether a routed request may skip the scheduler's queue when its router holds credit.

    Requests with a deadline (the scheduler checks it can be met) or of an agent program (it
    places, pauses and resumes programs) always queue. So does a *follower*: a request whose
    predicted hit on its first choice rests on prompts dispatched moments ago rather than on
    blocks the engine has reported (the in-flight overlay), by at least ``group_min_blocks``:
    the scheduler holds it until its leader's prefix is cached instead of prefilling it twice.
    """
    if deadline is not None or program_id is not None:
        return False
    return predicted_blocks - confirmed_blocks < group_min_blocks
