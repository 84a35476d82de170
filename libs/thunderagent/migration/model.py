"""What the planner observes and what it decides: plain frozen records, no wire types.

The live service builds observations from ``RouteDecision`` and ``LoadReport`` messages; the
virtual-time replay builds them from its simulated engines. Either way the planner sees the same
(``RouteSeen.of`` is the one translation of a decision).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from thunderagent.schemas import RouteDecision


@dataclass(frozen=True, slots=True)
class RouteSeen:
    """One routed request, as the router decided it."""

    worker_id: str
    """Where the router sent it."""
    prefix_hash: int | None
    """Hash of the deepest prompt block cached on that worker (None: no hit there)."""
    blocks: int
    """Cached leading blocks on that worker (the prefix's length when ``prefix_hash`` is set)."""
    model: str = ""
    lora_name: str | None = None
    """The LoRA adapter the request named (a copy needs a target with it loaded)."""
    candidates: tuple[tuple[str, int], ...] = ()
    """(worker, cached leading blocks) of every ranked candidate: a request sent away from a
    worker that held its prefix is demand that worker could not take."""

    @classmethod
    def of(cls, decision: RouteDecision) -> RouteSeen:
        """The router's decision as the planner sees it (live and in the replay alike)."""
        return cls(
            worker_id=decision.worker_id,
            prefix_hash=decision.prefix_hash,
            blocks=decision.overlap_blocks,
            model=decision.model,
            lora_name=decision.lora_name,
            candidates=tuple((c.worker_id, c.overlap_blocks) for c in decision.candidates),
        )


@dataclass(frozen=True, slots=True)
class WorkerSeen:
    """One worker's load report."""

    worker_id: str
    model: str = ""
    lora_adapters: frozenset[str] = frozenset()
    """LoRA adapters loaded there (registered)."""
    running: int = 0
    queued: int = 0
    """Requests waiting inside the engine."""
    prefill_backlog_tokens: int = -1
    """Prompt tokens accepted and not prefilled yet (-1: unknown)."""
    live_tokens: int = 0
    """Tokens whose KV running requests hold (not the evictable cache)."""
    kv_total_blocks: int = 0
    block_size: int = 16


@dataclass(frozen=True, slots=True)
class _Copy:
    """``blocks`` blocks of ``prefix_hash`` copied from ``source`` to ``target``."""

    action_id: str
    prefix_hash: int
    blocks: int
    source: str
    target: str
    bytes: int = 0
    transfer_s: float = 0.0
    """Estimated transfer time, link wait included."""
    benefit_s: float = 0.0
    """Estimated prefill time the copy saves over the horizon."""
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Replicate(_Copy):
    """Copy the prefix to ``target``; both keep it."""


@dataclass(frozen=True, slots=True)
class Migrate(_Copy):
    """Move the prefix: copy it to ``target``, then free it at ``source``."""


@dataclass(frozen=True, slots=True)
class Drop:
    """Free a replica the planner made once its prefix went cold."""

    action_id: str
    prefix_hash: int
    blocks: int
    worker: str
    reason: str = ""


Action = Replicate | Migrate | Drop
Move = Replicate | Migrate


@dataclass(slots=True)
class PlannerStats:
    """Counters a shell exports as metrics (never reset)."""

    ordered: dict[str, int] = field(
        default_factory=lambda: {"replicate": 0, "migrate": 0, "drop": 0}
    )
    done: int = 0
    failed: int = 0
    """Moves (and drops) that did not happen, refused drops apart."""
    timed_out: int = 0
    drops_refused: int = 0
    """Drops the worker refused: the replica is in use or other prompts extend it."""
    abandoned_prefixes: int = 0
    moved_bytes: int = 0
