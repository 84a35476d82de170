"""Simulated engine core: roofline timing, paged prefix cache, continuous batching, virtual time.

Pure logic: no asyncio, sockets or clocks. The wall-clock HTTP shell and the replay benchmarks
drive ``EngineCore``: one engine in wall time, many in virtual time (``thunderagent.replay``).
"""

from thunderagent.engine.core import (
    EngineCore,
    EngineLoad,
    FinishedRequest,
    Request,
    StepOutcome,
    derived_key,
)
from thunderagent.engine.events import AllCleared, CacheEvent, Medium, Removed, Stored
from thunderagent.engine.prefix_cache import Match, PrefixCache
from thunderagent.engine.profiles import PRESETS, Profile, get_profile
from thunderagent.engine.timing import TimingModel

__all__ = [
    "PRESETS",
    "AllCleared",
    "CacheEvent",
    "EngineCore",
    "EngineLoad",
    "FinishedRequest",
    "Match",
    "Medium",
    "PrefixCache",
    "Profile",
    "Removed",
    "Request",
    "StepOutcome",
    "Stored",
    "TimingModel",
    "derived_key",
    "get_profile",
]
