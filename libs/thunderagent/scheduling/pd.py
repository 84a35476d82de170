"""PD disaggregation: prefill on one pool, decode on another, KV moved in between.

In ``disaggregated`` mode a request's prefill worker is its best router candidate whose role is
``prefill`` or ``both`` (KV-aware: the router ranked them; prefill and decode share one index),
and its decode worker the ``decode``/``both`` worker with the most room (fewest running, then
lowest KV use, then id) other than the prefill worker. The ``Dispatch`` names both.

A transfer counts as in flight from that dispatch until ``on_transfer_done`` (or
``on_finished`` as a fallback): a prefill already running will become a transfer, so counting
only started transfers would let a burst of prefills saturate the link together. While
``pd_max_inflight`` (> 0) transfers are in flight no new prefill is dispatched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

PREFILL_ROLES = frozenset({"prefill", "both"})
DECODE_ROLES = frozenset({"decode", "both"})


@dataclass(slots=True)
class TransferGate:
    cap: int = 0
    inflight: dict[str, str] = field(default_factory=dict)
    """request id -> decode worker, for transfers not yet landed."""
    transfers: int = 0
    held_polls: int = 0
    """Polls in which the cap stopped new prefills (a counter for the benchmark)."""

    def full(self) -> bool:
        return self.cap > 0 and len(self.inflight) >= self.cap

    def start(self, rid: str, decode_worker: str) -> None:
        self.inflight[rid] = decode_worker
        self.transfers += 1

    def done(self, rid: str) -> bool:
        return self.inflight.pop(rid, None) is not None


def pick_decode_worker(
    workers: Iterable[tuple[str, str]],
    prefill_worker: str,
    load: Callable[[str], tuple[float, float]],
    has_room: Callable[[str], bool],
) -> str | None:
    """``workers``: (worker id, role). ``load``: (running share, KV share) of a worker."""
    pool = sorted(
        w for w, role in workers if role in DECODE_ROLES and w != prefill_worker and has_room(w)
    )
    if not pool:
        return None
    return min(pool, key=lambda w: (*load(w), w))
