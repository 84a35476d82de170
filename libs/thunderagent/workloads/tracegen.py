"""The trace generators by kind: one parameter class and one function each.

``generate(kind, seed, scale, overrides)`` builds the parameters (defaults, then ``scale`` via the
class's ``scaled``, then field overrides), checks them and runs the generator. Every generator is
deterministic for a seed: it draws only from its own ``random.Random(seed)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from thunderagent.workloads.agent_trace import AgentTraceParams, agent_trace
from thunderagent.workloads.bursty import BurstyParams, bursty_trace
from thunderagent.workloads.coding import CodingParams, coding_trace
from thunderagent.workloads.hotspot import HotspotParams, hotspot_trace
from thunderagent.workloads.mooncake import GeneratedTrace
from thunderagent.workloads.rag import RagParams, rag_trace

KINDS: dict[str, tuple[type, Callable[[Any, int], GeneratedTrace]]] = {
    "agent": (AgentTraceParams, agent_trace),
    "bursty": (BurstyParams, bursty_trace),
    "hotspot": (HotspotParams, hotspot_trace),
    "coding": (CodingParams, coding_trace),
    "rag": (RagParams, rag_trace),
}


MAY_BE_ZERO = frozenset(
    {
        "hot_start_s",
        "hot_duration_s",
        "hot_clients",
        "hot_lead_s",
        "system_prompt_tokens",
        "tool_prompt_tokens",
        "rate_swing",
        "think_min_s",
    }
)
"""Fields where 0 means "none" (no hot spot, no shared prompt); every other number is > 0."""


class ParamError(ValueError):
    """A generator parameter is unknown or out of range; ``field`` names it."""

    def __init__(self, field: str, value: object, reason: str) -> None:
        super().__init__(f"{field}={value!r}: {reason}")
        self.field = field
        self.value = value
        self.reason = reason


def make_params(kind: str, scale: float = 1.0, overrides: Mapping[str, Any] | None = None):
    """The parameters of ``kind``: defaults, scaled, then overridden field by field."""
    if kind not in KINDS:
        raise ParamError("kind", kind, f"known kinds: {sorted(KINDS)}")
    if not scale > 0:
        raise ParamError("scale", scale, "must be > 0")
    cls = KINDS[kind][0]
    names = {f.name for f in dataclasses.fields(cls)}
    for key in overrides or {}:
        if key not in names:
            raise ParamError(
                key, overrides[key], f"not a parameter of {kind}; known: {sorted(names)}"
            )
    params = dataclasses.replace(cls().scaled(scale), **dict(overrides or {}))
    check(params)
    return params


def check(params: object) -> None:
    """Numbers must be positive (probabilities in [0, 1]); lengths must fit the max context."""
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ParamError(f.name, value, "must be a number")
        if f.name == "doc_reuse":
            if not 0.0 <= value <= 1.0:
                raise ParamError(f.name, value, "must be in [0, 1]")
        elif f.name.endswith("_sigma") or f.name in MAY_BE_ZERO:
            if value < 0:
                raise ParamError(f.name, value, "must be >= 0")
        elif not value > 0:
            raise ParamError(f.name, value, "must be > 0")
    _check_fit(params)


def _check_fit(params: object) -> None:
    ctx = params.max_context_tokens
    out = getattr(params, "output_tokens_max", 0)
    for name in (
        "tool_prompt_tokens",
        "system_prompt_tokens",
        "hot_prefix_tokens",
        "repo_tokens_max",
    ):
        value = getattr(params, name, 0)
        if value + out + 2048 > ctx:
            raise ParamError(
                name, value, f"plus max output and 2048 question tokens exceeds {ctx=}"
            )
    if hasattr(params, "hot_start_s"):  # a hot window past the traffic would be the trace's end
        end = params.hot_start_s + params.hot_duration_s
        if end > params.duration_s:
            raise ParamError(
                "hot_start_s", params.hot_start_s,
                f"the hot window ({params.hot_start_s:g}-{end:g} s) must end within "
                f"duration_s ({params.duration_s:g} s)",
            )  # fmt: skip
    for f in dataclasses.fields(params):  # every range: steps, repository, question lengths
        if f.name.endswith("_min") and hasattr(params, top := f.name[:-4] + "_max"):
            lo = getattr(params, f.name)
            if lo > getattr(params, top):
                raise ParamError(f.name, lo, f"must be <= {top}")


def generate(
    kind: str, seed: int = 0, scale: float = 1.0, overrides: Mapping[str, Any] | None = None
) -> tuple[object, GeneratedTrace]:
    """(the parameters used, the trace)."""
    params = make_params(kind, scale, overrides)
    return params, KINDS[kind][1](params, seed)
