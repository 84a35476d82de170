"""Least outstanding requests, then most free KV; ties broken at random. Ignores the cache."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from thunderagent.routing.policy import POLICIES, PolicyHooks, RouteQuery, WorkerView
from thunderagent.schemas import Candidate


def by_load(workers: Sequence[WorkerView], rng: random.Random) -> list[WorkerView]:
    """Workers by outstanding requests, then by free KV (more first), ties at random."""
    return sorted(workers, key=lambda w: (w.outstanding, -w.free_blocks, rng.random()))


@POLICIES.register("least_loaded")
@dataclass
class LeastLoaded(PolicyHooks):
    name: ClassVar[str] = "least_loaded"

    def rank(
        self, query: RouteQuery, workers: Sequence[WorkerView], rng: random.Random
    ) -> list[Candidate]:
        return [
            Candidate(
                worker_id=w.worker_id,
                score=-float(w.outstanding),
                overlap_blocks=query.overlaps.get(w.worker_id, 0),
            )
            for w in by_load(workers, rng)
        ]

    def on_dispatched(self, query: RouteQuery, worker_id: str) -> None:
        pass
