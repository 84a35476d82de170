"""Knobs of the migration planner, with their defaults and the reasoning behind them.

``MigrationParams.validate`` rejects a bad value with a ``ParamError`` naming the field, the
value and the reason. Defaults describe Llama-3.1-8B on an H100 behind a 200 Gb/s NIC.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from thunderagent.prefill_model import LLAMA_8B_ATTENTION_PARITY_TOKENS


class ParamError(ValueError):
    """A migration knob with a bad value."""

    def __init__(self, field: str, value: object, reason: str) -> None:
        super().__init__(f"migration param {field}={value!r}: {reason}")
        self.field = field
        self.value = value
        self.reason = reason


@dataclass(slots=True, kw_only=True)
class MigrationParams:
    # --- cost model
    kv_bytes_per_token: int = 131_072
    """KV bytes per token: 2 (K, V) x 32 layers x 8 KV heads x 128 dims x 2 bytes (Llama-3.1-8B
    in bf16). A 16-token block is 2 MiB."""
    prefill_tokens_per_s: float = 20_000.0
    """Prefill throughput of one worker, the router's estimate (``routing.cost.
    PREFILL_S_PER_TOKEN``, Llama-3.1-8B on an H100; a test keeps the two equal). A hit on a
    prefix saves its tokens / this. It was 30,000 until stop 44 (half of the H100's peak): on
    the warm hot spot and agent workloads the same copies were made either way."""
    attention_parity_tokens: float = LLAMA_8B_ATTENTION_PARITY_TOKENS
    """Context length at which a prompt token's attention costs as much as its dense layers
    (``prefill_model``; the router's value): a hit on a long prefix saves more than its tokens
    at the short-prompt rate, and a backlog of long prompts takes longer. 0: linear."""
    link_bytes_per_s: float = 25e9
    """Worker-to-worker KV link: one 200 Gb/s RDMA NIC. ~2 GB/s measured over NIXL/UCX on this
    machine's loopback; the live service sets it from its flag."""
    link_latency_s: float = 0.005
    """Fixed cost of one move: three request/replies over NATS, pinning, registration lookups."""
    horizon_s: float = 30.0
    """Future demand a replica is credited with: hits expected in the next 30 s. Short, so a
    burst that is about to end does not justify a copy."""
    benefit_margin: float = 2.0
    """Act only when the prefill time saved is at least twice the transfer time: the estimate
    is rough, and a move that barely pays is not worth the churn."""
    # --- demand
    window_s: float = 10.0
    """Request rate per prefix is counted over this sliding window."""
    min_rate: float = 1.0
    """A prefix hit less than once a second is not hot, whatever the load."""
    min_blocks: int = 4
    """Prefixes shorter than this are cheaper to re-prefill than to track and move."""
    max_tracked: int = 4096
    """Prefixes followed at once; the least recently hit ones are forgotten first."""
    # --- load and hysteresis
    busy_s: float = 0.5
    """A worker is saturated once it has queued requests or this much prefill queued."""
    idle_s: float = 0.1
    """... and clear again only when its queue is empty and its prefill backlog is below this
    (two thresholds, so a worker near one line does not flip on every report)."""
    hot_for_s: float = 1.0
    """Saturation gate: a copy is also ordered once every holder has been saturated this long
    (0: no such gate). It opens behind a router that lets a hot prefix's holders queue
    (cache-first routers such as sglang's); thunder's router spreads load before its holders
    queue, so behind it the demand gate (``min_rate_per_holder``) is the one that acts."""
    min_rate_per_holder: float = 3.0
    """Demand gate: while a prefix is requested at least this often per holder (copies in
    flight and just landed count as holders), it gets more copies, whether or not its holders
    queue (0: no such gate). Behind a load-aware router each request the holders cannot take
    is a re-prefill elsewhere, which a copy replaces. Chosen on generated workloads (thunder,
    NIXL moves; ``bench gen --kind hotspot --param hot_lead_s=60`` seeds 0-2 at 1-6x, agent
    seeds 0-1 at 1-4x): 2 copies the agent workload's shared tool prompt at 2-4x (TTFT p99
    -4% to +7%, the replay's placement noise), 3 and 4 never touch it; on the hot spot 3 is
    level with 2 (hot TTFT p99 34 / 44 / 78 / 103 / 190 ms at seed 0 against 29 / 45 / 75 /
    106 / 206) and ahead of 4 (40 / 64 / 76 / 211 / 205)."""
    max_moves_per_prefix: int = 4
    """Copies of one prefix under way at once (each from a different holder): a burst fans
    out in rounds of one transfer, 1 -> 2 -> 4 -> 8 holders."""
    target_max_live: float = 0.7
    """A target must keep this fraction of its KV for running requests free of them."""
    pressure_live: float = 0.8
    """A source whose running requests hold this fraction of its KV is under pressure: its hot
    prefix is moved (freed at the source) instead of copied."""
    cooldown_s: float = 1.0
    """No new action on a prefix this long after its last one ended (the index and the router
    see a landed copy within a load report or two, well under a second)."""
    # --- replicas and drops
    replica_cap: int = 8
    """Holders per prefix the planner copies up to; past it, demand is spread, not copied. The
    cost model (``benefit_margin``) stops copies that do not pay well before this."""
    drop_rate: float = 0.2
    """A replica the planner made is dropped once its prefix is hit less than this per second
    ... (well under ``min_rate``: a prefix between the two is left alone)."""
    cold_for_s: float = 30.0
    """... for this long."""
    drain_min_hits: int = 1
    """A leaving worker's prefix is worth saving when it was hit this often in the window and no
    other worker holds it."""
    # --- execution
    pull_min_tokens: int = 8192
    """A run handed to a worker that lacks at least this many prompt tokens of a prefix
    another worker holds copies them from there before it starts (``pull``; 0: never; a copy
    must also save time, ``pull.plan_pull``). Needs a KV import path (NIXL). Chosen on the
    generated warm hot spot (seeds 0-2, 1-6x) and agent workloads (seeds 0-1, 1-4x), thunder,
    NIXL: 1 / 2,048 / 4,096 / 8,192 tokens gave 9 / 9 / 9 / 10 of 15 hot-spot cells at <= 0.6 x
    no migration (8 without pulls) and 13 / 14 / 14 / 14 at <= 0.8 x re-prefill copies (12);
    agent TTFT p99 against no migration 0.86-1.05 / 0.92-1.08 / 0.87-1.08 / 0.89-1.07 x."""
    max_inflight: int = 4
    """Moves running at once across the fleet."""
    max_moves_per_worker: int = 1
    """Moves a worker takes part in at once (its NIC and engine serve requests too)."""
    transfer_timeout_s: float = 60.0
    """A move not reported done or failed by then counts as failed."""
    max_failures: int = 3
    """A prefix whose moves failed this many times in a row is given up until it goes cold."""
    target_backoff_s: float = 30.0
    """A target whose move failed is not chosen again for this long (doubling per failure)."""

    def validate(self) -> MigrationParams:
        for f in fields(self):  # overrides come from command lines: JSON or strings
            value, integral = getattr(self, f.name), isinstance(f.default, int)
            if isinstance(value, bool) or not isinstance(value, int if integral else int | float):
                raise ParamError(
                    f.name, value, "must be an integer" if integral else "must be a number"
                )
        positive = (
            "kv_bytes_per_token", "prefill_tokens_per_s", "link_bytes_per_s", "horizon_s",
            "window_s", "busy_s", "transfer_timeout_s", "max_tracked", "max_inflight",
            "max_moves_per_worker", "max_moves_per_prefix", "replica_cap", "max_failures",
        )  # fmt: skip
        for name in positive:
            if not getattr(self, name) > 0:
                raise ParamError(name, getattr(self, name), "must be > 0")
        for f in fields(self):
            if getattr(self, f.name) < 0:
                raise ParamError(f.name, getattr(self, f.name), "must be >= 0")
        if self.idle_s > self.busy_s:
            raise ParamError("idle_s", self.idle_s, f"must be <= busy_s ({self.busy_s})")
        if self.drop_rate > self.min_rate:
            raise ParamError("drop_rate", self.drop_rate, f"must be <= min_rate ({self.min_rate})")
        for name in ("target_max_live", "pressure_live"):
            if getattr(self, name) > 1:
                raise ParamError(name, getattr(self, name), "is a fraction: must be <= 1")
        return self

    @classmethod
    def from_dict(cls, values: dict) -> MigrationParams:
        known = {f.name for f in fields(cls)}
        for name in values:
            if name not in known:
                raise ParamError(name, values[name], f"unknown; known: {sorted(known)}")
        return cls(**values).validate()
