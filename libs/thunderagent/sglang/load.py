"""SGLang's ``/get_load`` answer, both ways: what a (simulated) engine serves and what the worker
adapter reads from it. The virtual-time replay goes through the same pair, so a load figure
means the same thing live and in replay.

SGLang answers one JSON object per data-parallel rank; the adapter sums them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from thunderagent.engine import EngineLoad


def get_load_payload(load: EngineLoad, dp_rank: int = 0) -> dict[str, Any]:
    """One rank's ``/get_load`` entry (SGLang's field names, plus the KV block counts the
    simulated engine knows; SGLang itself reports ``num_tokens`` only)."""
    return {
        "dp_rank": dp_rank,
        "num_reqs": load.num_running,
        "num_waiting_reqs": load.num_waiting,
        "num_tokens": load.num_tokens,
        "kv_used_blocks": load.kv_used_blocks,
        "kv_total_blocks": load.kv_total_blocks,
        "cached_blocks": load.cached_blocks,
    }


@dataclass(slots=True, frozen=True)
class EngineLoadFigures:
    """What the adapter learns from ``/get_load``, summed over ranks."""

    running: int
    queued: int
    num_tokens: int
    """Tokens whose KV running requests hold."""
    kv_used_blocks: int
    """Used KV blocks; from ``num_tokens`` when the engine reports no block count (SGLang)."""
    kv_total_blocks: int
    """0 when the engine does not report it (the registration's capacity is used then)."""


def parse_get_load(payload: Any, block_size: int) -> EngineLoadFigures:
    """Read ``/get_load`` (an object or a list of per-rank objects); missing fields count 0."""
    ranks: Sequence[Mapping[str, Any]] = payload if isinstance(payload, list) else [payload]

    def total(key: str) -> int:
        return sum(int(r.get(key, 0) or 0) for r in ranks if isinstance(r, Mapping))

    tokens = total("num_tokens")
    return EngineLoadFigures(
        running=total("num_reqs"),
        queued=total("num_waiting_reqs"),
        num_tokens=tokens,
        kv_used_blocks=total("kv_used_blocks") or tokens // max(block_size, 1),
        kv_total_blocks=total("kv_total_blocks"),
    )
