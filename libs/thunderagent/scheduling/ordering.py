"""Queue order: priority classes, then shortest predicted work, with linear aging.

The key is a *virtual start time* in seconds, smallest first::

    key = arrival + priority * class_step_s + work_tokens / work_tokens_per_s

Every waiting request ages at the same rate (one second per second), so the order of two
waiting requests never changes while they wait: the key is fixed at enqueue and a plain heap
keeps the queue. Aging follows: a request with key ``k`` goes before any request arriving
after ``k`` - nothing starves. The four orders drop terms: ``fcfs`` keeps only the arrival,
``priority`` adds the class, ``srpt`` adds the work, ``priority_srpt`` adds both.
"""

from __future__ import annotations

from thunderagent.prefill_model import prefill_work
from thunderagent.scheduling.api import SchedRequest
from thunderagent.scheduling.params import SchedParams


def uncached_prompt_tokens(req: SchedRequest, cached_blocks: int) -> int:
    """Prompt tokens a worker holding ``cached_blocks`` leading blocks must still prefill."""
    return max(req.prompt_tokens - cached_blocks * req.block_size, 0)


def remaining_output_tokens(req: SchedRequest) -> int:
    return max(req.expected_output_tokens - req.generated_tokens, 1)


def work_tokens(req: SchedRequest, cached_blocks: int) -> int:
    """Predicted remaining work: uncached prompt + expected output still to produce."""
    return uncached_prompt_tokens(req, cached_blocks) + remaining_output_tokens(req)


def prefill_s(req: SchedRequest, cached_blocks: int, p: SchedParams) -> float:
    """Predicted prefill time on a worker holding ``cached_blocks`` leading blocks: what it
    lacks, with its attention over the whole context before it (``prefill_model``)."""
    new = uncached_prompt_tokens(req, cached_blocks)
    work = prefill_work(new, req.prompt_tokens - new, p.attention_parity_tokens)
    return work / p.prefill_tokens_per_s


def service_s(req: SchedRequest, cached_blocks: int, p: SchedParams) -> float:
    """Predicted time from dispatch to the last token (no queueing)."""
    return prefill_s(req, cached_blocks, p) + remaining_output_tokens(req) / p.decode_tokens_per_s


def order_key(req: SchedRequest, cached_blocks: int, p: SchedParams) -> float:
    key = req.arrival
    if p.order in ("priority", "priority_srpt"):
        key += req.priority * p.class_step_s
    if p.order in ("srpt", "priority_srpt"):
        key += min(work_tokens(req, cached_blocks) / p.work_tokens_per_s, p.srpt_max_delay_s)
    return key
