"""The policy contract and the registry; one small module per policy registers itself here."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

from thunderagent.registry import WorkerState
from thunderagent.schemas import Candidate, GenerateRequest


@dataclass(slots=True, frozen=True)
class RouteInput:
    """What a policy may look at for one request."""

    request: GenerateRequest


class RoutingPolicy(Protocol):
    name: ClassVar[str]

    def rank(
        self, route: RouteInput, workers: Sequence[WorkerState], rng: random.Random
    ) -> list[Candidate]:
        """Candidates best first; ``workers`` is non-empty and all serve the request's model."""
        ...


REGISTRY: dict[str, Callable[[], RoutingPolicy]] = {}


def register(name: str) -> Callable[[type], type]:
    def add(cls: type) -> type:
        if name in REGISTRY:
            raise ValueError(f"routing policy {name!r} registered twice")
        REGISTRY[name] = cls
        return cls

    return add


def get_policy(name: str) -> RoutingPolicy:
    from thunderagent.routing import least_loaded  # noqa: F401  (registers itself)

    try:
        return REGISTRY[name]()
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {sorted(REGISTRY)}") from None
