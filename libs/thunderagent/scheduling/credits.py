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

Shares follow demand: each router's requests (dispatched on credit or queued) are counted with
a few seconds' memory, and the room is split in proportion, so a gateway with the router inside
it that takes all the HTTP traffic is not held to half the room because an idle router service
also said hello. The proportions are refreshed once a second (``reweigh``), not per request,
so demand's noise does not turn into grant messages.

Pure: the scheduler service and the router service exchange grants and dispatch notices over
NATS; the replay passes them by hand, with no delay.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

ROUTER_TTL_S: Final = 3.0
"""A router replica that has not said hello for this long gets no more credit (its share goes
to the others); it says hello every second."""

CREDIT_LEASE_S: Final = 3.0
"""A grant lends nothing once this old on the router's clock (the scheduler re-grants every
second): credit is a lease. A router that stalled (a frozen or starved process) reads, when it
wakes, requests its clients have since resent elsewhere and seen run; only the scheduler's queue
checks a request id against those that ran, so they must go there, not out on the old room. If
the scheduler is gone, requests likewise queue for it."""

REGRANT_SLACK: Final = 4
"""A router's share of a worker is re-sent at once when it falls below what the router still
holds there (a router must never hold more room than there is), but when it grows only past a
quarter of that (any growth while it holds 3 or fewer, and always from none). Room grows with
every run that ends, and a grant per change was more than one message per request; a direct
dispatch moves nothing (the share drops by one as the booking rises by one). Room not yet lent
costs only a hop (the request goes through the scheduler's queue); the periodic grant (every
second) lends it all again."""


DEMAND_HALF_LIFE_S: Final = 2.0
"""A router's counted demand halves in this long: shares move to where requests now enter
within a few seconds, and one burst does not decide them for long."""

IDLE_WEIGHT_SHARE: Final = 0.1
"""Every live router's weight is its demand plus this share of the mean demand (at least one
request): a replica nobody sends to keeps a sliver of room, and its first requests, queued
meanwhile, count as demand at the next reweigh."""


def split(room: int, weights: list[float]) -> list[int]:
    """``room`` in whole units in proportion to ``weights`` (all > 0): largest remainders get
    the units left, ties to the first. Equal weights give ``room // n``, plus one to the first
    ``room % n``."""
    total = sum(weights)
    exact = [room * w / total for w in weights]
    units = [int(x) for x in exact]
    left = room - sum(units)
    by_remainder = sorted(range(len(weights)), key=lambda i: (units[i] - exact[i], i))
    for i in by_remainder[:left]:
        units[i] += 1
    return units


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
    demand: dict[str, tuple[float, float]] = field(default_factory=dict)
    """router id -> (requests it routed, decayed to the time beside it)."""
    weights: dict[str, float] = field(default_factory=dict)
    """router id -> its weight in the split, as of the last ``reweigh`` (absent: 1)."""

    def hello(self, router_id: str, now: float) -> bool:
        """A router is alive; True when it is new (the shares change: reweighed here)."""
        new = router_id not in self.routers
        self.routers[router_id] = now
        self.booked.setdefault(router_id, {})
        if new:
            self.reweigh(now)
        return new

    def routed(self, router_id: str, now: float) -> None:
        """A request ``router_id`` routed reached the scheduler, on credit or queued."""
        if router_id in self.routers:
            self.demand[router_id] = (self._demand(router_id, now) + 1.0, now)

    def _demand(self, router_id: str, now: float) -> float:
        count, at = self.demand.get(router_id, (0.0, now))
        return count * 0.5 ** (max(0.0, now - at) / DEMAND_HALF_LIFE_S)

    def reweigh(self, now: float) -> None:
        """Each live router's weight: its recent demand plus an idle router's sliver."""
        demand = {r: self._demand(r, now) for r in self.routers}
        floor = max(1.0, IDLE_WEIGHT_SHARE * sum(demand.values()) / max(1, len(demand)))
        self.weights = {r: d + floor for r, d in demand.items()}

    def expire(self, now: float, ttl_s: float = ROUTER_TTL_S) -> list[str]:
        gone = [r for r, seen in self.routers.items() if now - seen > ttl_s]
        for r in gone:
            del self.routers[r]
            self.booked.pop(r, None)
            self._last.pop(r, None)
            self.demand.pop(r, None)
            self.weights.pop(r, None)
        return gone

    def book(self, router_id: str, worker_id: str) -> None:
        """A direct dispatch the router reported has been booked by the scheduler."""
        per = self.booked.setdefault(router_id, {})
        per[worker_id] = per.get(worker_id, 0) + 1

    def grants(self, rooms: Mapping[str, int], *, force: bool = False) -> dict[str, Grant]:
        """Per router, its share of every worker's room (in proportion to ``weights``; the
        shares add up to the room); only routers whose share moved past ``REGRANT_SLACK``
        allows from what they still hold (or all with ``force``) get a new one."""
        if not self.routers:
            return {}
        order = sorted(self.routers)
        if len(order) == 1:  # the usual single replica: all of it, no arithmetic per worker
            shares = [{w: room for w, room in rooms.items() if room > 0}]
        else:
            weights = [self.weights.get(r, 1.0) for r in order]
            shares = [{} for _ in order]
            for w, room in rooms.items():
                for i, units in enumerate(split(room, weights) if room > 0 else ()):
                    if units > 0:
                        shares[i][w] = units
        out: dict[str, Grant] = {}
        for router, share in zip(order, shares, strict=True):
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
        return _in_hand(last, self.booked.get(router_id, {}), worker_id)

    def _moved(self, router_id: str, share: Mapping[str, int]) -> bool:
        last = self._last.get(router_id)
        if last is None:
            return True
        booked = self.booked.get(router_id, {})
        for worker in share.keys() | last.credits.keys():
            held, new = _in_hand(last, booked, worker), share.get(worker, 0)
            if new < held or (new > held and (held == 0 or new - held > held // REGRANT_SLACK)):
                return True
        return False


def _in_hand(last: Grant, booked: Mapping[str, int], worker_id: str) -> int:
    """``last``'s credit for ``worker_id`` less the dispatches booked there since it."""
    booked_since = booked.get(worker_id, 0) - last.booked.get(worker_id, 0)
    return max(0, last.credits.get(worker_id, 0) - booked_since)


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
    received: dict[str, float] = field(default_factory=dict)
    """scheduler id -> when its latest grant came, on the caller's clock (``update``'s ``now``)."""
    lenders: dict[str, str] = field(default_factory=dict)
    """worker id -> the scheduler whose grant lends room there."""

    def update(self, grant: Grant, scheduler_id: str = "", now: float | None = None) -> None:
        self.grants[scheduler_id] = grant
        if now is not None:
            self.received[scheduler_id] = now
        self.credits, self.booked, self.lenders = {}, {}, {}
        for lender, g in self.grants.items():
            self.credits.update(g.credits)
            self.booked.update(g.booked)
            self.lenders.update(dict.fromkeys(g.credits, lender))

    def available(self, worker_id: str, now: float | None = None) -> int:
        """Dispatches ``worker_id`` may still take on this router's credit; with ``now``,
        none on a grant older than ``CREDIT_LEASE_S``."""
        if now is not None:
            lent_at = self.received.get(self.lenders.get(worker_id, ""), now)
            if now - lent_at > CREDIT_LEASE_S:
                return 0
        unbooked = max(0, self.dispatched.get(worker_id, 0) - self.booked.get(worker_id, 0))
        return max(0, self.credits.get(worker_id, 0) - unbooked)

    def take(self, worker_id: str, now: float | None = None) -> bool:
        """Use one credit for ``worker_id``; False (nothing taken) when none is left (or, with
        ``now``, its grant is older than ``CREDIT_LEASE_S``)."""
        if self.available(worker_id, now) <= 0:
            return False
        self.dispatched[worker_id] = self.dispatched.get(worker_id, 0) + 1
        return True

    def give_back(self, worker_id: str) -> None:
        """The worker refused the dispatch: it never happened."""
        self.dispatched[worker_id] = max(0, self.dispatched.get(worker_id, 0) - 1)


@dataclass(slots=True)
class StallGuard:
    """Closes a router's credit path for ``hold_s`` after its process stalled (a freeze, a
    starved event loop): the requests it reads on waking may have been resent meanwhile and run
    elsewhere, and only the scheduler's queue checks an id against those that ran. Grants read
    on waking look fresh (they were queued while it slept), so the lease alone cannot tell. A
    stall is a gap of more than ``stall_s`` between beats (the router's tick: every 0.25 s), seen
    at the next beat or at the next use, whichever comes first."""

    stall_s: float = 1.0
    hold_s: float = CREDIT_LEASE_S
    last_beat: float | None = None
    hold_until: float = -math.inf

    def beat(self, now: float) -> None:
        self._check(now)
        self.last_beat = now

    def allows(self, now: float) -> bool:
        """Whether the router may dispatch on credit now."""
        self._check(now)
        return now >= self.hold_until

    def _check(self, now: float) -> None:
        if self.last_beat is not None and now - self.last_beat > self.stall_s:
            self.hold_until = max(self.hold_until, now + self.hold_s)


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
    blocks the engine has reported (the in-flight overlay), by at least ``group_min_blocks``.
    It goes through the scheduler's admission, which books the KV it needs with the leader's
    blocks shared, and then to the leader's engine, which runs it once the leader's prefill
    has stored them. The scheduler does not hold it (``grouping``): the router's candidates
    already count the leader's blocks as cached, so there is nothing left to wait for; its
    grouping holds a queued request behind a leader the router did not see (another replica's).
    Measured in the replay (docs/benchmarks.md, "Followers"): dispatching followers on credit
    instead cost the conversation trace at 2.75x (TTFT p99 6.98 -> 7.83 s, preemptions 7 -> 18);
    holding them behind the leader cost the hot spot 16-23 % of its TTFT p99.
    """
    if deadline is not None or program_id is not None:
        return False
    return predicted_blocks - confirmed_blocks < group_min_blocks
