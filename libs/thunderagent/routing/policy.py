"""The routing-policy contract and the registry.

A policy sees one request (``RouteQuery``: its block hashes, length and the prefix each worker is
believed to hold) and a snapshot of every candidate worker (``WorkerView``), and returns the
workers ranked best first with scores. It may keep state of its own (``on_dispatched`` names the
worker that got the request), which is how SGLang's cache-aware policy tracks what it sent where.
Policies
are pure: no I/O, no clock; randomness only through the ``rng`` they are given. The same policy
objects run in the router service and in the virtual-time replay benchmark.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from thunderagent.plugins import Registry
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
    now: float = 0.0
    """The caller's clock (seconds) when the request is routed."""

    @property
    def prompt_blocks(self) -> int:
        return len(self.block_hashes)


@dataclass(slots=True)
class WorkerView:
    """A worker's load as the router last heard it (plus what it sent since). Policies only
    read it. Not frozen: a frozen dataclass sets each field through ``object.__setattr__``,
    and building the views took 15 µs of a 50 µs decision for 8 workers (7 µs unfrozen)."""

    worker_id: str
    running: int = 0
    queued: int = 0
    kv_used_blocks: int = 0
    kv_total_blocks: int = 0
    active_tokens: int = 0
    """Tokens held by running requests (decode load)."""
    pending: int = 0
    """Requests routed here since the last load report (not yet visible in it)."""
    pending_kv_tokens: int = -1
    """Context tokens (prompt, cached or not) of those requests, and of requests routed before
    the report that have started since: the KV they hold or will hold there beyond what the
    report counts (-1: unknown)."""
    pending_prefill_tokens: int = -1
    """Prompt tokens of those requests the router expects the worker to prefill (their
    predicted cache hits taken off; -1: unknown, policies then estimate from ``pending``)."""
    prefill_tokens: int = -1
    """Prompt tokens waiting for prefill on the worker, as it last reported (-1: not reported,
    as with stock SGLang; policies then estimate it from ``queued``)."""
    prefill_started_tokens: int = 0
    """Of ``prefill_tokens``, the prompts whose first token the router has seen since that
    report: work the worker has done, though the report still counts it."""
    cached_blocks: int = -1
    """Blocks the prefix index holds for the worker on its GPU: how full its cache is, the
    evictable prefixes included, from the engine's own KV events (-1: unknown). SGLang's
    ``/get_load`` counts only running requests' KV, so this is the one engine-independent
    figure for it."""

    @property
    def outstanding(self) -> int:
        return self.running + self.queued + self.pending

    @property
    def free_blocks(self) -> int:
        return max(self.kv_total_blocks - self.kv_used_blocks, 0)


class RoutingPolicy(Protocol):
    """What the router core calls; every hook is called by the live router and by the replay
    alike (``thunderagent.router_core``), so a policy learns the same way in both."""

    name: ClassVar[str]

    def rank(
        self, query: RouteQuery, workers: Sequence[WorkerView], rng: random.Random
    ) -> list[Candidate]:
        """All ``workers``, best first. ``workers`` is non-empty. Does not change state."""
        ...

    def on_dispatched(self, query: RouteQuery, worker_id: str) -> None:
        """The request counts on ``worker_id`` from now: called at the decision with the first
        candidate (a peer's router counts a request at selection, and a burst is decided before
        its first hand-off is answered), and again with the worker that took it when that is
        another (the scheduler's choice): stateful policies move it there."""
        ...

    def on_started(self, request_id: str, worker_id: str, now: float) -> None:
        """The request's run on ``worker_id`` gave its first token: its prompt is prefilled."""
        ...

    def on_finished(self, request_id: str, worker_id: str, now: float) -> None:
        """The request left ``worker_id`` (completed, failed, aborted or preempted)."""
        ...

    def observe(self, feedback: RoutingFeedback) -> None:
        """Once per feedback window: what the fleet measured (online tuning)."""
        ...

    def load_poll_s(self) -> float:
        """Seconds between the engine loads this policy reads: a peer that polls the engines
        on its own schedule sees a report only once per poll (0: every report, as it comes)."""
        ...

    def keeps_approximate_cache(self) -> bool:
        """For a worker whose engine publishes no KV events: whether the router keeps its own
        record of the prompts prefilled there (``thunderagent.prefix_index.prefilled``), as
        Dynamo's router does. ThunderAgent's adapters announce such an engine's cache in its
        place (``thunderagent.sglang.shadow``), for every router replica alike."""
        ...

    def reads_dispatch_overlay(self) -> bool:
        """Whether ``RouteQuery.overlaps`` include the router's in-flight overlay: the prompts
        it dispatched in the last ``inflight_ttl_s``, credited before their KV events arrive
        (``thunderagent.prefix_index.inflight``). ThunderAgent's design; a peer reads it only
        where its upstream predicts on route (Dynamo's ``router_predicted_ttl_secs``, off by
        default). Without it a policy sees the engines' confirmed prefixes only."""
        ...


@dataclass
class PolicyHooks:
    """No-op hooks for policies that learn nothing from them (subclass and override)."""

    def on_dispatched(self, query: RouteQuery, worker_id: str) -> None:
        pass

    def on_started(self, request_id: str, worker_id: str, now: float) -> None:
        pass

    def on_finished(self, request_id: str, worker_id: str, now: float) -> None:
        pass

    def observe(self, feedback: RoutingFeedback) -> None:
        pass

    def load_poll_s(self) -> float:
        return 0.0

    def keeps_approximate_cache(self) -> bool:
        return False

    def reads_dispatch_overlay(self) -> bool:
        return False


@dataclass(slots=True, frozen=True)
class RoutingFeedback:
    """What the fleet measured over the last window, fed to ``observe``."""

    queue_depths: Mapping[str, int]
    """worker id -> outstanding requests (running + waiting): engines admit requests into their
    running batch at once, so waiting queues alone stay near zero and say nothing."""
    false_hit_rate: float = 0.0
    """Share of the blocks the router predicted as cached that the engine had to prefill anyway
    (1 - measured hit / predicted hit), in [0, 1]."""


POLICIES: Registry[RoutingPolicy] = Registry("routing policy")
"""Every routing policy, registered with ``@POLICIES.register(name)`` in its module; the
package imports them all, so the registry is complete once ``thunderagent.routing`` is."""
