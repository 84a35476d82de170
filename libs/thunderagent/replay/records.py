"""What a replay is given and what it gives back: its settings, one record per request, the
run's result (pure data; the loop that fills them is ``driver.py``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from thunderagent.engine import Profile
from thunderagent.fleet import LOAD_REPORT_INTERVAL_S, Run
from thunderagent.prefix_index.prefilled import APPROXIMATE_TTL_S
from thunderagent.router_core import RouterParams


@dataclass(kw_only=True)
class ReplayConfig:
    profile: Profile
    policy: str
    workers: int = 8
    policy_params: dict = field(default_factory=dict)
    scheduler: str = "direct"
    seed: int = 0
    load_interval: float = LOAD_REPORT_INTERVAL_S
    """Virtual seconds between load reports: the live adapter's beat unless a study changes it."""
    feedback_interval: float = 1.0
    """Virtual seconds between ``observe`` calls on the policy (and index TTL expiry)."""
    handoff_s: float = 0.0
    """Virtual seconds from a hand-off to a worker (the router's on credit, the scheduler's) to
    the worker's answer: the run starts there, and the router hears it was taken, that much
    later (0: at once). Live it is a NATS request/reply to the adapter, ~1 ms on an idle
    machine, tens under load."""
    timeline_interval: float = 10.0
    """Virtual seconds between per-worker load samples kept for plots."""
    index_ttl: float | None = None
    """Prefix index TTL; None: off (events are lossless here, so TTL only loses hits)."""
    kv_events: bool = True
    """Whether the engines publish KV events. False: their own never reach the router and the
    scheduler; the adapters announce what each run leaves cached (``sglang.shadow``), unless
    the policy keeps its own record (``RouterCore.approximate``, Dynamo's approximate mode)."""
    approximate_ttl: float = APPROXIMATE_TTL_S
    """With ``kv_events`` off, for such a policy: how long a prefilled prompt counts there."""
    prior_output_tokens: int = 128
    """Expected output length before any request has finished."""
    max_tokens: int = 16384
    """The ``max_tokens`` a replayed client sends (a trace's output length is what the engine
    generates, as if it met its stop token; it is never shown to the router)."""
    scheduler_params: dict = field(default_factory=dict)
    """Knobs for the scheduler factory (``SchedParams`` fields)."""
    roles: Sequence[str] | None = None
    """Per-worker role, "prefill" / "decode" / "both" (PD disaggregation); None: all "both"."""
    link_bytes_per_s: float = 25e9
    """PD KV-transfer bandwidth out of each prefill worker (25 GB/s: one 200 Gb/s RDMA NIC)."""
    pd_via: str = "workers"
    """How PD runs move their KV (``pd.py``): "workers" (the workers' hand-off: the prefill's
    first token streams at once) or "sglang" (SGLang's own PD: the decode engine reserves the
    prompt's pages before the prefill starts and streams every token)."""
    pd_reserved_decode_tokens: int = 512
    """SGLang's PD: a decode engine reserves a prompt's pages only while this many tokens per
    request it holds (running, waiting, or reserved and not landed) stay free for their decode
    (SGLang's ``SGLANG_NUM_RESERVED_DECODE_TOKENS``, 512 by default)."""

    def router_params(self) -> RouterParams:
        return RouterParams(
            policy=self.policy,
            policy_params=dict(self.policy_params),
            seed=self.seed,
            index_ttl_s=self.index_ttl,
            approximate_ttl_s=self.approximate_ttl,
            feedback_interval_s=self.feedback_interval,
            prior_output_tokens=self.prior_output_tokens,
        )


@dataclass(slots=True)
class Record:
    """One request's life in virtual seconds, and what the router believed about it."""

    request_id: str
    arrival: float
    prompt_tokens: int
    output_tokens: int
    worker: int = -1
    first_token: float = math.nan
    finish: float = math.nan
    cached_tokens: int = -1
    completion_tokens: int = 0
    preemptions: int = 0
    sched_preemptions: int = 0
    """Scheduler ``Preempt``s (also counted in ``preemptions`` with the engine's retractions)."""
    resume_prompt_tokens: int = 0
    """Prompt tokens (prompt + generated) of continuation runs after a preemption."""
    resume_cached_tokens: int = 0
    """Of those, tokens found cached when the continuation was admitted."""
    status: str = "queued"
    """"queued", "bootstrapping" (SGLang's PD: waiting for its decode worker's reservation),
    "running", "transferring", "completed" or "rejected"."""
    reason: str = ""
    """Why it was rejected."""
    best_overlap_tokens: int = 0
    """Most prompt tokens any worker was indexed as holding at routing time (usable part)."""
    predicted_tokens: int = 0
    """Prompt tokens the chosen worker was indexed as holding at routing time (usable part)."""
    routed_to: int = -1
    """The router's first candidate for its first run, as ``worker`` (the scheduler may have
    sent it on)."""
    dispatched: float = math.nan
    """When its first run went to a worker (the time before it: the scheduler's queue)."""

    @property
    def run(self) -> Run:
        return Run(self.prompt_tokens, self.output_tokens, self.completion_tokens)


@dataclass(slots=True)
class ReplayResult:
    records: list[Record]
    busy_s: list[float]
    """Per-worker time spent in engine steps."""
    timeline: list[tuple[float, list[int]]]
    """(virtual time, per-worker running + waiting requests)."""
    steps: int
    makespan: float
    prefill_tokens: int = 0
    """Prompt tokens the engines computed (cache misses, re-prefills and retractions)."""
    transfers_s: list[float] = field(default_factory=list)
    """PD: each KV transfer's duration on the link, queueing behind earlier ones included."""
    bootstrap_waits_s: list[float] = field(default_factory=list)
    """SGLang's PD: each run's wait for its decode worker's reservation (0: at once)."""
    sched_stats: dict = field(default_factory=dict)
    in_flight: int = 0
    """Requests neither completed nor rejected when a bounded run (``until``) stopped."""


class LostRequests(RuntimeError):
    """The replay ended with requests that never completed nor were rejected: a bug."""
