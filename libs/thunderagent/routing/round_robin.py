"""Round robin over the workers sorted by id; ignores cache and load (the blind baseline)."""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from thunderagent.routing.policy import POLICIES, PolicyHooks, RouteQuery, WorkerView
from thunderagent.schemas import Candidate

_REMEMBERED = 100_000
"""Requests in flight whose turn is remembered (one whose end never came is forgotten after)."""


@POLICIES.register("round_robin")
@dataclass
class RoundRobin(PolicyHooks):
    """The i-th routed request goes to worker ``i mod n`` of the id-sorted worker list.

    Sorting by id makes the cycle independent of the order the registry lists workers in. The
    counter advances in ``on_dispatched``, once per routed request (the router calls it at the
    decision, and again when the scheduler moves the request to another worker: no new turn, as
    SGLang's counter turns once per selection), so ``rank`` is a pure query. No parameters.
    """

    name: ClassVar[str] = "round_robin"
    _next: int = field(default=0, init=False, repr=False)
    _counted: OrderedDict[str, None] = field(default_factory=OrderedDict, init=False, repr=False)
    """Requests that turned the cycle and have not ended, oldest first (at most ``_REMEMBERED``)."""

    def rank(
        self, query: RouteQuery, workers: Sequence[WorkerView], rng: random.Random
    ) -> list[Candidate]:
        ordered = sorted(workers, key=lambda w: w.worker_id)
        start = self._next % len(ordered)
        turn = ordered[start:] + ordered[:start]
        return [
            Candidate(
                worker_id=w.worker_id,
                score=float(-i),
                overlap_blocks=query.overlaps.get(w.worker_id, 0),
            )
            for i, w in enumerate(turn)
        ]

    def on_dispatched(self, query: RouteQuery, worker_id: str) -> None:
        if query.request_id in self._counted:
            return
        self._counted[query.request_id] = None
        if len(self._counted) > _REMEMBERED:
            self._counted.popitem(last=False)
        self._next += 1

    def on_finished(self, request_id: str, worker_id: str, now: float) -> None:
        self._counted.pop(request_id, None)
