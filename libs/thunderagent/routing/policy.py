"""The routing-policy contract and the registry.

A policy sees one request (``RouteQuery``: its block hashes, length and the prefix each worker is
believed to hold) and a snapshot of every candidate worker (``WorkerView``), and returns the
workers ranked best first with scores. It may keep state of its own (``on_routed`` is called with
the final choice), which is how SGLang's cache-aware policy tracks what it sent where. Policies
are pure: no I/O, no clock; randomness only through the ``rng`` they are given. The same policy
objects run in the router service and in the virtual-time replay benchmark.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from thunderagent.schemas import Candidate


@dataclass(slots=True, frozen=True)
class RouteQuery:
    """One request as the policy sees it."""

    request_id: str
    prompt_tokens: int
    block_size: int
    block_hashes: Sequence[int]
    """Primary chained hashes of the prompt's full blocks."""
    overlaps: Mapping[str, int] = field(default_factory=dict)
    """worker id -> leading blocks cached on its GPU (from the prefix index; absent = 0)."""
    host_overlaps: Mapping[str, int] = field(default_factory=dict)
    """worker id -> leading blocks cached including its host-memory tier (>= ``overlaps``)."""
    expected_output_tokens: int = 128
    priority: int = 0

    @property
    def prompt_blocks(self) -> int:
        return len(self.block_hashes)


@dataclass(slots=True, frozen=True)
class WorkerView:
    """A worker's load as the router last heard it (plus what it sent since)."""

    worker_id: str
    running: int = 0
    queued: int = 0
    kv_used_blocks: int = 0
    kv_total_blocks: int = 0
    active_tokens: int = 0
    """Tokens held by running requests (decode load)."""
    pending: int = 0
    """Requests routed here since the last load report (not yet visible in it)."""
    prefill_tokens: int = -1
    """Prompt tokens waiting for prefill on the worker, as it last reported (-1: not reported,
    as with stock SGLang; policies then estimate it from ``queued``)."""

    @property
    def outstanding(self) -> int:
        return self.running + self.queued + self.pending

    @property
    def free_blocks(self) -> int:
        return max(self.kv_total_blocks - self.kv_used_blocks, 0)


class RoutingPolicy(Protocol):
    name: ClassVar[str]

    def rank(
        self, query: RouteQuery, workers: Sequence[WorkerView], rng: random.Random
    ) -> list[Candidate]:
        """All ``workers``, best first. ``workers`` is non-empty."""
        ...

    def on_routed(self, query: RouteQuery, worker_id: str) -> None:
        """The request went to ``worker_id`` (stateful policies learn from it)."""
        ...


REGISTRY: dict[str, Callable[..., RoutingPolicy]] = {}


def register(name: str) -> Callable[[type], type]:
    """Class decorator: one line per policy; registering a name twice is a bug."""

    def add(cls: type) -> type:
        if name in REGISTRY:
            raise ValueError(f"routing policy {name!r} registered twice")
        REGISTRY[name] = cls
        return cls

    return add


def _load_builtin_policies() -> None:
    import importlib

    for module in ("least_loaded", "round_robin", "sglang_cache_aware", "dynamo_kv", "thunder"):
        try:
            importlib.import_module(f"thunderagent.routing.{module}")
        except ModuleNotFoundError as err:
            if err.name != f"thunderagent.routing.{module}":
                raise


def get_policy(name: str, **params: Any) -> RoutingPolicy:
    """A new policy instance; ``params`` override its documented defaults."""
    _load_builtin_policies()
    try:
        factory = REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {sorted(REGISTRY)}") from None
    return factory(**params)


def policy_names() -> list[str]:
    _load_builtin_policies()
    return sorted(REGISTRY)
