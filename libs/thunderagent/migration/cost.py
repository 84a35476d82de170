"""The cost model: what a move costs (bytes over a busy link) against the prefill it saves.

    bytes       = blocks x block_size x kv_bytes_per_token
    transfer_s  = link wait + link_latency_s + bytes / link_bytes_per_s
    prefill_s   = prefill_work(blocks x block_size) / prefill_tokens_per_s   (saved by every hit;
                  attention included, ``prefill_model``)
    hits        = rate x max(0, horizon_s - transfer_s) / (holders + 1)
    benefit_s   = hits x prefill_s

A copy pays when ``benefit_s >= benefit_margin x transfer_s``. ``hits`` credits the new replica
with its share of the demand from the moment it is ready: the holders are saturated (the
planner's precondition), so without it every one of those requests either waits in a holder's
queue or is re-prefilled elsewhere; both cost about ``prefill_s`` per request.
"""

from __future__ import annotations

from dataclasses import dataclass

from thunderagent.migration.params import MigrationParams
from thunderagent.prefill_model import prefill_work


@dataclass(frozen=True, slots=True)
class Estimate:
    bytes: int
    transfer_s: float
    """Link wait + latency + bytes over the link."""
    prefill_s: float
    """Prefill time of the prefix (saved per hit)."""
    hits: float
    """Hits expected at the new replica over the horizon."""
    benefit_s: float

    def pays(self, margin: float) -> bool:
        return self.benefit_s >= margin * self.transfer_s


def estimate(
    params: MigrationParams,
    *,
    blocks: int,
    block_size: int,
    rate: float,
    holders: int,
    link_wait_s: float = 0.0,
) -> Estimate:
    tokens = blocks * block_size
    nbytes = tokens * params.kv_bytes_per_token
    transfer = link_wait_s + params.link_latency_s + nbytes / params.link_bytes_per_s
    prefill = (
        prefill_work(tokens, 0.0, params.attention_parity_tokens) / params.prefill_tokens_per_s
    )
    hits = rate * max(0.0, params.horizon_s - transfer) / (holders + 1)
    return Estimate(nbytes, transfer, prefill, hits, hits * prefill)


class LinkBook:
    """When each worker's link is free again, from the moves booked on it: a move waits for
    both of its ends. Pure bookkeeping; the planner passes ``now``."""

    def __init__(self) -> None:
        self._ends: dict[str, dict[str, float]] = {}
        """worker -> {action id: when that move's transfer ends}"""

    def wait(self, now: float, *workers: str) -> float:
        ends = [end for w in workers for end in self._ends.get(w, {}).values()]
        return max([0.0, *(end - now for end in ends)])

    def book(self, action_id: str, now: float, seconds: float, *workers: str) -> None:
        end = now + self.wait(now, *workers) + seconds
        for w in workers:
            self._ends.setdefault(w, {})[action_id] = end

    def free(self, action_id: str) -> None:
        """A move ended (done or failed): its link time is no longer reserved."""
        for moves in self._ends.values():
            moves.pop(action_id, None)

    def moves(self, worker: str) -> int:
        """Moves booked on ``worker``'s link."""
        return len(self._ends.get(worker, {}))
