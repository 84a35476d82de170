"""Requests a router has decided and no worker has taken yet.

From its decision a request counts as load on its first candidate, in the fleet's view and in
the policy's own counts, so the next decisions see it before any worker answers (a burst is
decided before its first hand-off is answered). The booking moves to the worker that takes the
run, or goes when none will: refused, dropped by the scheduler, or lapsed after ``ttl_s`` (a
message can be lost). A request offered on the credit path also counts as in flight on its
worker until the answer (``offered``).
"""

from __future__ import annotations

from collections import OrderedDict

from thunderagent.fleet import WorkerRegistry
from thunderagent.prefix_index.offered import OfferedPrompts
from thunderagent.routing import RouteQuery, RoutingPolicy


class Bookings:
    def __init__(self, fleet: WorkerRegistry, policy: RoutingPolicy, ttl_s: float) -> None:
        self.fleet, self.policy, self.ttl_s = fleet, policy, ttl_s
        self._booked: OrderedDict[str, tuple[str, float]] = OrderedDict()
        """request id -> (the worker it is booked on, when), oldest first (``WorkerState.book``)."""
        self.offered = OfferedPrompts()
        """Prompts offered to a worker on the credit path, its answer not in yet."""

    def book(self, query: RouteQuery, worker_id: str, prefill_tokens: int, now: float) -> None:
        """Count the request as load on ``worker_id`` from now: ``prefill_tokens`` of queued
        prefill and its prompt's KV there, and in the policy's counts, as every peer's router
        counts a request at selection. An earlier booking of it is let go first."""
        request_id = query.request_id
        self.release(request_id)
        state = self.fleet.get(worker_id)
        if state is not None:
            state.book(request_id, prefill_tokens, query.prompt_tokens)
        self._booked[request_id] = (worker_id, now)
        self.policy.on_dispatched(query, worker_id)

    def take(self, request_id: str) -> str | None:
        """A worker took the request (the caller books the run there): the worker it was
        booked on, its booking taken off there (None: none). The policy's counts stay."""
        self.offered.remove(request_id)
        booked = self._booked.pop(request_id, None)
        if booked is None:
            return None
        if (state := self.fleet.get(booked[0])) is not None:
            state.unbook(request_id)
        return booked[0]

    def release(self, request_id: str) -> None:
        """No worker will take the request on this booking: the policy's counts let it go."""
        at = self._booked.get(request_id, (None, 0.0))[1]
        worker_id = self.take(request_id)
        if worker_id is not None:
            self.policy.on_finished(request_id, worker_id, at)

    def expire(self, now: float) -> None:
        """Let go of the bookings older than ``ttl_s``."""
        booked = self._booked
        while booked and now - next(iter(booked.values()))[1] > self.ttl_s:
            self.release(next(iter(booked)))
