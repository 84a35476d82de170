"""Trace replay in virtual time: the real routing policies and schedulers in front of simulated
engine cores, and the metrics to compare them (pure logic; only the trace loaders read files)."""

from thunderagent.replay.driver import SCHEDULERS, Replay
from thunderagent.replay.metrics import (
    ideal_hit_ratio,
    load_imbalance,
    pooled_hit_ratio,
)
from thunderagent.replay.records import Record, ReplayConfig, ReplayResult
from thunderagent.replay.traces import (
    TraceError,
    TraceRequest,
    load_azure,
    load_mooncake,
    load_trace,
)

__all__ = [
    "SCHEDULERS",
    "Record",
    "Replay",
    "ReplayConfig",
    "ReplayResult",
    "TraceError",
    "TraceRequest",
    "ideal_hit_ratio",
    "load_azure",
    "load_imbalance",
    "load_mooncake",
    "load_trace",
    "pooled_hit_ratio",
]
