"""Retrieval-augmented queries: a tenant's system prompt, retrieved documents, a question.

* Tenants: ``tenants`` system prompts of ``system_blocks_min``-``system_blocks_max`` blocks,
  chosen by a Zipf law (exponent ``tenant_popularity``).
* Corpus: ``documents`` documents of log-normal length (median ``document_tokens_median``, whole
  blocks: retrieval chunks), retrieved by a Zipf law (``document_popularity``).
* A request: a tenant's system prompt, 1-``documents_max`` documents in the retriever's order,
  a question of ``question_tokens_min``-``question_tokens_max`` tokens; Poisson arrivals at
  ``rate_per_s`` x (1 + ``rate_swing`` sin(2 pi t / ``rate_period_s``)).

Two requests share a prefix as far as their tenant and leading documents agree: a popular
document is retrieved often, but mostly behind other documents, so most reuse is the system
prompt and the first document, and the pooled hit ratio stays far below an agent's.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

from thunderagent.workloads.mooncake import (
    BlockIds,
    GeneratedTrace,
    Prompt,
    TraceRow,
    in_order,
    lognormal,
    make_row,
    start_prompt,
    zipf_cum_weights,
)


@dataclass(slots=True, frozen=True, kw_only=True)
class RagParams:
    duration_s: float = 900.0
    rate_per_s: float = 3.0
    rate_swing: float = 0.5
    rate_period_s: float = 300.0
    tenants: int = 6
    tenant_popularity: float = 1.2
    system_blocks_min: int = 1
    system_blocks_max: int = 4
    documents: int = 3000
    document_popularity: float = 1.05
    document_tokens_median: float = 2500.0
    document_tokens_sigma: float = 0.6
    documents_max: int = 4
    question_tokens_min: int = 40
    question_tokens_max: int = 400
    output_tokens_median: float = 180.0
    output_tokens_sigma: float = 0.7
    output_tokens_max: int = 2048
    max_context_tokens: int = 131072
    block_size: int = 512

    def scaled(self, scale: float) -> RagParams:
        """``scale`` times as long, same rates."""
        return replace(self, duration_s=self.duration_s * scale)


def rag_trace(p: RagParams, seed: int) -> GeneratedTrace:
    """Queries over ``duration_s``, in arrival order."""
    rng, ids, bs = random.Random(seed), BlockIds(), p.block_size
    lo, hi = p.system_blocks_min, p.system_blocks_max
    systems = [start_prompt(rng.randint(lo, hi) * bs, ids, bs) for _ in range(p.tenants)]
    tenant_cum = zipf_cum_weights(p.tenants, p.tenant_popularity)
    doc_tokens = (
        lognormal(rng, p.document_tokens_median, p.document_tokens_sigma, 1, 1e9)
        for _ in range(p.documents)
    )
    doc_blocks = [max(1, round(n / bs)) for n in doc_tokens]
    doc_cum = zipf_cum_weights(p.documents, p.document_popularity)
    prefixes: dict[tuple[int, ...], Prompt] = {}
    rows: list[TraceRow] = []
    t = 0.0
    while (t := t + rng.expovariate(_rate(p, t))) < p.duration_s:
        tenant = rng.choices(range(p.tenants), cum_weights=tenant_cum)[0]
        k = rng.randint(1, p.documents_max)
        key: tuple[int, ...] = (tenant,)
        prompt = systems[tenant]
        for d in rng.choices(range(p.documents), cum_weights=doc_cum, k=k):
            key += (d,)
            if key not in prefixes:  # one id per prefix: the same documents behind the same
                prefixes[key] = prompt.extend(doc_blocks[d] * bs, ids, bs)  # ones share it
            prompt = prefixes[key]
        question = rng.randint(p.question_tokens_min, p.question_tokens_max)
        out = p.output_tokens_max
        answer = lognormal(rng, p.output_tokens_median, p.output_tokens_sigma, 1, out)
        if prompt.tokens + question + answer <= p.max_context_tokens:
            rows.append(make_row(t, prompt.extend(question, ids, bs), answer, ids, bs))
    in_order(rows)
    return GeneratedTrace(rows, {"distinct_prefixes": len(prefixes)})


def _rate(p: RagParams, t: float) -> float:
    """Arrivals per second at ``t``: the base rate swinging over ``rate_period_s``."""
    swing = p.rate_swing * math.sin(2 * math.pi * t / p.rate_period_s)
    return p.rate_per_s * max(0.05, 1.0 + swing)
