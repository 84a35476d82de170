"""Preemption: abort a long decode so a short, more urgent request runs now.

Fires for the head request ``R`` of a worker with no room when all of these hold:

* a victim ``V`` on that worker has started decoding, is not more urgent than ``R``
  (``V.priority >= R.priority``), has at least ``preempt_min_remaining_tokens`` left, has been
  preempted fewer than ``preempt_max_per_request`` times, and has more time left than ``R``
  needs; the one with the most time left is chosen (ties: request id);
* gain beats cost: ``wait >= preempt_gain_ratio * cost`` where ``wait`` is how long ``R``
  would wait anyway (the soonest any running request there finishes) and ``cost`` is ``R``'s
  service time (the victim is set back that much) plus re-prefilling the share
  ``resume_recompute_fraction`` of the victim's context (the rest is still cached: a
  continuation resumes on it);
* the worker's last preemption is at least ``1 / preempt_max_per_s`` seconds ago.

Time estimates use ``prefill_tokens_per_s`` (attention included, ``ordering.prefill_s``) and
``decode_tokens_per_s`` from the dispatch and ``on_started`` times this table records.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from thunderagent.prefill_model import prefill_work
from thunderagent.scheduling.api import SchedRequest
from thunderagent.scheduling.ordering import (
    prefill_s,
    remaining_output_tokens,
    service_s,
    uncached_prompt_tokens,
)
from thunderagent.scheduling.params import SchedParams


@dataclass(slots=True)
class Running:
    """One request this scheduler dispatched and has not seen finish."""

    req: SchedRequest
    worker_id: str
    cached_blocks: int
    kv_blocks: int
    dispatched_at: float
    started_at: float | None = None
    decode_worker: str | None = None

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens it prefills where it runs (its cached prefix there excluded)."""
        return uncached_prompt_tokens(self.req, self.cached_blocks)

    def left(self, now: float, p: SchedParams) -> tuple[int, float]:
        """Output tokens still to decode (below zero past the expected length) and seconds to
        the last token: what is left to prefill, if it has not started, then to decode. One
        call: ``pick`` asks it of every run on a full worker at every poll."""
        out = remaining_output_tokens(self.req)
        if self.started_at is None:
            prefill = prefill_s(self.req, self.cached_blocks, p)
            return out, max(prefill - (now - self.dispatched_at), 0.0) + out / p.decode_tokens_per_s
        tokens = out - int((now - self.started_at) * p.decode_tokens_per_s)
        return tokens, max(tokens, 0) / p.decode_tokens_per_s


PREEMPTED_REMEMBERED = 1 << 16
"""Preempted requests whose count is kept (oldest forgotten first): a request preempted that
many preemptions ago has long finished, and forgetting one only lets it be preempted again."""


@dataclass(slots=True)
class Preemptor:
    params: SchedParams
    last: dict[str, float] = field(default_factory=dict)
    """worker -> time of its last preemption (the rate limit)."""
    counts: dict[str, int] = field(default_factory=dict)
    """request id -> times preempted (kept across continuations; the most recent
    ``PREEMPTED_REMEMBERED`` requests)."""
    preemptions: int = 0

    def allowed_at(self, worker_id: str) -> float:
        last = self.last.get(worker_id)
        if last is None:
            return float("-inf")
        return last + 1.0 / self.params.preempt_max_per_s

    def pick(
        self, waiting: SchedRequest, cached: int, running: list[Running], now: float
    ) -> Running | None:
        p = self.params
        if not running or p.preempt_max_per_s <= 0:
            return None
        if now < self.allowed_at(running[0].worker_id):
            return None
        need = service_s(waiting, cached, p)
        # one pass: each running request's time left is computed once (for the victim test,
        # the choice among victims, and the soonest finish)
        victim, most, wait, victim_tokens = None, None, float("inf"), 0
        for r in running:
            tokens, left = r.left(now, p)
            if left < wait:
                wait = left
            if (
                r.started_at is not None
                and r.req.priority >= waiting.priority
                and left > need
                and tokens >= p.preempt_min_remaining_tokens
                and self.counts.get(r.req.request_id, 0) < p.preempt_max_per_request
                and (most is None or (left, r.req.request_id) > most)
            ):
                victim, most, victim_tokens = r, (left, r.req.request_id), tokens
        if victim is None:
            return None
        decoded = remaining_output_tokens(victim.req) - victim_tokens  # since it started
        context = victim.req.prompt_tokens + victim.req.generated_tokens + decoded
        # a radix cache evicts a context from its end: what is lost is its tail
        lost = context * p.resume_recompute_fraction
        resume = prefill_work(lost, context - lost, p.attention_parity_tokens)
        cost = need + resume / p.prefill_tokens_per_s
        if wait < p.preempt_gain_ratio * cost:
            return None
        return victim

    def record(self, victim: Running, now: float) -> None:
        self.last[victim.worker_id] = now
        rid = victim.req.request_id
        self.counts[rid] = self.counts.get(rid, 0) + 1
        if len(self.counts) > PREEMPTED_REMEMBERED:  # a scheduler runs for months
            del self.counts[next(iter(self.counts))]
        self.preemptions += 1
