"""How long a prefill takes as its context grows: the one model behind the router's cost, the
scheduler's waits and service times, and the migration planner's savings and backlogs.

A prompt token costs its dense layers (``2 * params`` FLOP) plus causal attention over every
token before it (``4 * layers * hidden`` FLOP each), so a token at depth ``d`` costs
``1 + d / parity`` short-prompt tokens, where ``parity`` is the depth at which the two are
equal. Work is counted in those short-prompt tokens: seconds = work / the short-prompt rate.
The simulated engine's clock (``engine.timing``) charges the same FLOPs. Pure: no I/O.
"""

from __future__ import annotations


def attention_parity_tokens(params: float, layers: int, hidden: int) -> float:
    """Context length at which a prompt token's causal attention (QK^T and AV: ``4 * layers *
    hidden`` FLOP per earlier token) costs as much as its dense layers (``2 * params`` FLOP)."""
    return 2.0 * params / (4.0 * layers * hidden)


LLAMA_8B_ATTENTION_PARITY_TOKENS = attention_parity_tokens(8.03e9, 32, 4096)
"""~30.6k tokens: a token at that depth of a Llama-3.1-8B prompt takes twice a short one's time."""


def prefill_work(new: float, before: float, parity: float) -> float:
    """Prefill of ``new`` tokens after ``before`` already in the context, in tokens at the
    short-prompt rate: each token's dense work plus its attention over everything before it,
    ``new * (1 + (before + new / 2) / parity)``; ``parity`` <= 0 leaves it linear."""
    if parity <= 0:
        return new
    return new * (1.0 + (before + new / 2.0) / parity)


def queued_prefill_work(tokens: float, prompts: int, parity: float) -> float:
    """``prefill_work`` of a queue of ``tokens`` uncached prompt tokens, split evenly over
    ``prompts`` (at least one) prompts with nothing cached before them. A report gives only the
    sum; an even split is the least the attention can add, so the queue is never overstated."""
    k = max(1, prompts)
    return k * prefill_work(tokens / k, 0.0, parity)
