"""Least outstanding requests, ties broken at random (the no-cache-hit fallback of every policy)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import ClassVar

from thunderagent.registry import WorkerState
from thunderagent.routing.policy import RouteInput, register
from thunderagent.schemas import Candidate


@register("least_loaded")
class LeastLoaded:
    name: ClassVar[str] = "least_loaded"

    def rank(
        self, route: RouteInput, workers: Sequence[WorkerState], rng: random.Random
    ) -> list[Candidate]:
        keyed = sorted(workers, key=lambda w: (w.outstanding(), rng.random()))
        return [Candidate(worker_id=w.worker_id, score=-float(w.outstanding())) for w in keyed]
