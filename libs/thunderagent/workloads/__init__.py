"""Seeded workload generators for the virtual-time benchmarks (pure: no clock, no I/O).

* ``AgentWorkload``: closed-loop agent programs (steps, tool-call pauses, growing context, one
  system prompt shared by all programs). Driven by callbacks: ``start()`` then
  ``on_step_done(request_id, now)`` for every finished step.
* ``MixedWorkload``: open-loop short/long mix with Poisson arrivals and optional shared
  prefixes; ``requests()`` returns the whole arrival list.
* Trace generators (``tracegen.KINDS``: ``agent``, ``bursty``, ``hotspot``, ``coding``, ``rag``):
  open-loop Mooncake-format rows (``mooncake.TraceRow``) for ``thunderagent bench gen``, which
  writes them as JSONL for ``bench replay``; token-level lengths, block ids per ``block_size``
  tokens.

Prompts are sequences of *block ids*: one id per full block of ``block_size`` tokens; equal ids
mean equal content. ``block_tokens`` expands them into token ids for an engine or a hasher.
"""

from thunderagent.workloads.agent import AgentParams, AgentWorkload
from thunderagent.workloads.common import WorkRequest, block_tokens, request_tokens
from thunderagent.workloads.mixed import MixedParams, MixedWorkload
from thunderagent.workloads.mooncake import GeneratedTrace, TraceRow
from thunderagent.workloads.tracegen import KINDS, ParamError, generate

__all__ = [
    "KINDS",
    "AgentParams",
    "AgentWorkload",
    "GeneratedTrace",
    "MixedParams",
    "MixedWorkload",
    "ParamError",
    "TraceRow",
    "WorkRequest",
    "block_tokens",
    "generate",
    "request_tokens",
]
