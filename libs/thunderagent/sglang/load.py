"""SGLang's load answers, both ways: what a (simulated) engine serves and what the worker adapter
reads from it. The virtual-time replay goes through the same pair, so a load figure means the
same thing live and in replay.

SGLang 0.5 serves ``/v1/loads`` (``{"loads": [one object per data-parallel rank]}``, the fields
of its ``LoadSnapshot``); releases before it served ``/get_load`` (a list of per-rank objects with
other names), which the adapter falls back to. An adapter in front of the whole engine sums
the ranks; one in front of one rank (``--dp-size``: each rank is a worker of its own, with its
own KV cache) reads its rank's entry.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from thunderagent.engine import EngineLoad

LOADS_PATH: Final = "/v1/loads?include=core"
"""SGLang 0.5's load endpoint, its flat per-rank fields only."""
OLD_LOAD_PATH: Final = "/get_load"
"""The same before SGLang 0.5 (and what sglang-router 0.3 polls)."""


def v1_loads_payload(load: EngineLoad, block_size: int) -> dict[str, Any]:
    """``/v1/loads`` for an engine of one rank."""
    return {"loads": [v1_load_snapshot(load, block_size)]}


def v1_load_snapshot(load: EngineLoad, block_size: int, dp_rank: int = 0) -> dict[str, Any]:
    """One rank's entry in ``/v1/loads``'s ``loads`` list: SGLang's ``LoadSnapshot`` names for
    what the simulated engine knows, plus its KV block counts (SGLang reports tokens only)."""
    return {
        "dp_rank": dp_rank,
        "num_running_reqs": load.num_running,
        "num_waiting_reqs": load.num_waiting,
        "num_used_tokens": load.num_tokens,
        "max_total_num_tokens": load.kv_total_blocks * block_size,
        "kv_used_blocks": load.kv_used_blocks,
        "kv_total_blocks": load.kv_total_blocks,
        "cached_blocks": load.cached_blocks,
    }


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


def parse_v1_loads(payload: Any, block_size: int, dp_rank: int | None = None) -> EngineLoadFigures:
    """Read ``/v1/loads``, all ranks or ``dp_rank``'s; missing fields count 0. ValueError when it
    is not such an answer or names no such rank."""
    ranks = _of_rank(_v1_ranks(payload), dp_rank)
    tokens = _total(ranks, "num_used_tokens")
    bs = max(block_size, 1)
    return EngineLoadFigures(
        running=_total(ranks, "num_running_reqs"),
        queued=_total(ranks, "num_waiting_reqs"),
        num_tokens=tokens,
        kv_used_blocks=_total(ranks, "kv_used_blocks") or tokens // bs,
        kv_total_blocks=_total(ranks, "kv_total_blocks")
        or _total(ranks, "max_total_num_tokens") // bs,
    )


def v1_loads_max_running(payload: Any, dp_rank: int | None = None) -> int:
    """The running-request cap SGLang derived, summed over the ranks of a ``/v1/loads`` answer
    or ``dp_rank``'s (0 when it names none). ValueError when it is not such an answer."""
    return _total(_of_rank(_v1_ranks(payload), dp_rank), "max_running_requests")


def _v1_ranks(payload: Any) -> list:
    ranks = payload.get("loads") if isinstance(payload, Mapping) else None
    if not isinstance(ranks, list):
        raise ValueError(f"not a /v1/loads answer (no 'loads' list): {str(payload)[:120]}")
    return ranks


def _of_rank(ranks: Sequence[Any], dp_rank: int | None) -> Sequence[Any]:
    """Every rank's entry (None), or the one of ``dp_rank`` (an entry naming none is rank 0's,
    as SGLang's ``dp_rank`` defaults to 0)."""
    if dp_rank is None:
        return ranks
    mine = [r for r in ranks if isinstance(r, Mapping) and int(r.get("dp_rank") or 0) == dp_rank]
    if not mine:
        raise ValueError(f"the load answer has no entry for DP rank {dp_rank}")
    return mine


def _total(ranks: Sequence[Any], key: str) -> int:
    return sum(int(r.get(key, 0) or 0) for r in ranks if isinstance(r, Mapping))


def parse_get_load(payload: Any, block_size: int, dp_rank: int | None = None) -> EngineLoadFigures:
    """Read ``/get_load`` (an object or a list of per-rank objects), all ranks or ``dp_rank``'s;
    missing fields count 0."""
    ranks = _of_rank(payload if isinstance(payload, list) else [payload], dp_rank)
    tokens = _total(ranks, "num_tokens")
    return EngineLoadFigures(
        running=_total(ranks, "num_reqs"),
        queued=_total(ranks, "num_waiting_reqs"),
        num_tokens=tokens,
        kv_used_blocks=_total(ranks, "kv_used_blocks") or tokens // max(block_size, 1),
        kv_total_blocks=_total(ranks, "kv_total_blocks"),
    )
