"""Worker registration (leased) and load reports."""

from __future__ import annotations

import enum

from msgspec import Struct, field


class WorkerRole(enum.StrEnum):
    BOTH = "both"
    PREFILL = "prefill"
    DECODE = "decode"


class WorkerRegistration(Struct, frozen=True, kw_only=True):
    """Stored in the workers key-value bucket by the adapter and renewed before its lease lapses."""

    worker_id: str
    """Unique, subject-safe worker id."""
    model: str
    """Model the engine serves."""
    engine_url: str
    """Engine HTTP base URL (SGLang or the simulated engine)."""
    block_size: int
    """Tokens per KV block in the engine; the router hashes blocks of this size."""
    kv_capacity_blocks: int
    """Engine KV capacity in blocks (0 when unknown)."""
    lease_s: float
    """The registration is void this long after the last renewal or load report."""
    registered_at: float
    """Unix seconds when the adapter (re)registered; also its epoch."""
    role: WorkerRole = WorkerRole.BOTH
    """Prefill, decode or both (PD disaggregation)."""
    tokenizer: str = "thunderagent/bytes"
    """Tokenizer spec: ``thunderagent/bytes`` (built in) or a path to an HF ``tokenizer.json``."""
    max_running_requests: int = 0
    """Engine's running-request cap (0 when unknown)."""
    context_length: int = 0
    """Longest prompt + output the engine serves, in tokens (0 when unknown: not checked)."""
    vocab_size: int = 0
    """Token ids must be below this (0 when unknown: not checked)."""
    lora_adapters: list[str] = field(default_factory=list)
    """The LoRA adapters the engine has loaded, by name (SGLang's ``/v1/models`` cards with a
    parent); a request for an adapter goes only to workers that list it. Kept current while the
    worker serves (SGLang loads and unloads adapters at run time)."""
    bootstrap_port: int = 0
    """A prefill engine in SGLang's PD mode: the port of its KV bootstrap server
    (``disaggregation_bootstrap_port``), where a paired decode engine takes a request's KV. 0:
    not SGLang's PD; a PD hand-off then moves the KV through the workers (``KvTransfer``)."""
    kv_events: bool = True
    """Whether the engine publishes KV cache events (SGLang's ``--kv-events-config``, off by
    default). False: routers know its cache only from the prompts they sent it (an approximate
    index, as SGLang's router keeps and Dynamo's with ``use_kv_events=false``)."""


class LoadReport(Struct, frozen=True, kw_only=True):
    """Published several times a second; doubles as the lease heartbeat."""

    worker_id: str
    """Reporting worker."""
    ts: float
    """Unix seconds at the adapter."""
    running: int
    """Requests in the engine's running batch."""
    queued: int
    """Requests waiting inside the engine."""
    kv_used_blocks: int
    """KV blocks in use (running requests and cache)."""
    kv_total_blocks: int
    """KV capacity in blocks."""
    num_tokens: int = 0
    """Tokens held by running requests (SGLang's ``/v1/loads`` ``num_used_tokens``; before it,
    ``/get_load``'s ``num_tokens``)."""
    inflight: int = 0
    """Requests accepted by the adapter and not finished yet."""
    prefill_backlog_tokens: int = -1
    """Prompt tokens of accepted requests that have not produced a first token yet (the
    prefill work queued on the engine, counted by the adapter since SGLang does not report
    it; cache hits are not known in advance, so an upper bound). -1: unknown."""
