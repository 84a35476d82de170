"""A pull at dispatch: the worker that takes a run first copies the part of its prompt's prefix
another worker holds, instead of computing it again.

Routing by load sometimes sends a request away from the worker holding its prefix (the holder
is queued); without a copy the new worker prefills the whole prefix again. With a KV import
path (NIXL) it can read those blocks from the holder instead: Llama-3.1-8B's 128 KiB of KV per
token crosses a 25 GB/s link in ~5 µs, against ~50 µs of prefill on an H100. The holder lends
its link, not its compute.

Decided by whoever hands the run to a worker (the scheduler service, a router on the fast path,
the replay) from the routing decision's candidates, what every worker was believed to hold when
the request was routed: ``PullPlanner.hint`` gives the ``PullHint`` that goes with the run. The
holder may have lost part of the prefix since, or still be computing it (an engine caches a
prompt's blocks chunk by chunk): the source offers the leading run it holds, and what is not
copied is prefilled, as without a hint. A hint's budget is the prefill it saves: a copy stalled
past it is given up and the run prefills. Each sender books the copies it orders on a
per-worker link timeline (``PullLinks``), once the worker took the run, and counts the wait
for both ends in the decision. The scheduler books the routers' fast-path copies as well
(their direct-dispatch notices carry them); a router sees only its own, and no sender sees
the migration service's moves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from thunderagent.migration.params import MigrationParams
from thunderagent.schemas import Candidate, PullHint


@dataclass(frozen=True, slots=True)
class PullPlan:
    source: str
    """The worker to copy from."""
    blocks: int
    """The prompt's leading blocks it holds (the target then holds as many)."""
    present: int
    """Leading blocks the target holds already (not copied)."""


def plan_pull(
    candidates: Iterable[Candidate],
    target: str,
    usable_blocks: int,
    *,
    min_blocks: int,
    block_bytes: int,
    link_bytes_per_s: float,
    prefill_s_per_block: float,
    link_wait_s: Callable[[str], float] = lambda _source: 0.0,
) -> PullPlan | None:
    """Whether ``target`` should copy its prompt's prefix from another candidate first, and
    from which: the one whose copy saves the most time, the prefill it spares less the wait for
    the link (``link_wait_s(source)``) and the bytes' time on it. Only sources holding at
    least ``min_blocks`` (0: never) more of the prompt's ``usable_blocks`` (its last token is
    always computed) than the target count, and only a copy that saves time."""
    held = {c.worker_id: min(c.overlap_blocks, usable_blocks) for c in candidates}
    present = held.pop(target, 0)
    best: PullPlan | None = None
    most = 0.0
    per_block = prefill_s_per_block - block_bytes / link_bytes_per_s
    for source, blocks in held.items():
        extra = blocks - present
        if min_blocks <= 0 or extra < min_blocks:
            continue
        saved = extra * per_block - link_wait_s(source)
        if saved > most:
            best, most = PullPlan(source, blocks, present), saved
    return best


class PullLinks:
    """When each worker's link is free of the copies this sender ordered: one copy at a time
    per link, both ends held (the replay's link model)."""

    def __init__(self) -> None:
        self._free_at: dict[str, float] = {}

    def wait(self, now: float, *workers: str) -> float:
        return max([0.0, *(self._free_at.get(w, 0.0) - now for w in workers)])

    def book(self, now: float, seconds: float, *workers: str) -> None:
        end = now + self.wait(now, *workers) + seconds
        for w in workers:
            self._free_at[w] = end


class PullPlanner:
    """One sender's pull decisions (see the module docstring); the clock is the caller's."""

    def __init__(self, params: MigrationParams) -> None:
        self.params = params
        self.links = PullLinks()

    def hint(
        self,
        candidates: Iterable[Candidate],
        target: str,
        block_hashes: Sequence[int],
        prompt_tokens: int,
        block_size: int,
        now: float,
    ) -> PullHint | None:
        """The copy to order with a first run on ``target``; None when no other candidate holds
        enough more of the prompt for a copy to pay. Its budget is the prefill it saves: a copy
        that stalls longer is given up and the run prefills. Nothing is booked: the sender
        calls ``book`` once the worker has taken the run (a refused offer orders no copy)."""
        p = self.params
        if p.pull_min_tokens <= 0:
            return None
        usable = min(len(block_hashes), max(0, (prompt_tokens - 1) // block_size))
        block_bytes = block_size * p.kv_bytes_per_token
        latency = p.link_latency_s
        plan = plan_pull(
            candidates,
            target,
            usable,
            min_blocks=-(-p.pull_min_tokens // block_size),
            block_bytes=block_bytes,
            link_bytes_per_s=p.link_bytes_per_s,
            prefill_s_per_block=block_size / p.prefill_tokens_per_s,
            link_wait_s=lambda source: self.links.wait(now, source, target) + latency,
        )
        if plan is None:
            return None
        missing = plan.blocks - plan.present
        return PullHint(
            source_worker=plan.source,
            prefix_hash=block_hashes[plan.blocks - 1],
            blocks=plan.blocks,
            budget_s=missing * block_size / p.prefill_tokens_per_s,
        )

    def book(self, hint: PullHint, target: str, now: float) -> None:
        """The run carrying ``hint`` went to ``target``: its copy holds both links for the
        bytes of the tokens it copies (the budget's prefill tokens)."""
        p = self.params
        tokens = hint.budget_s * p.prefill_tokens_per_s
        seconds = tokens * p.kv_bytes_per_token / p.link_bytes_per_s
        self.links.book(now, seconds, hint.source_worker, target)
