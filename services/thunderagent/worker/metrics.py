"""The worker adapters' instruments, one set per process."""

from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING

from thunderagent.telemetry.setup import meter

if TYPE_CHECKING:
    from thunderagent.worker.adapter import WorkerAdapter


class AdapterMetrics:
    """The process's worker instruments, made once: an engine with several data-parallel ranks
    has an adapter per rank in one process, and OpenTelemetry answers a second instrument of a
    name with the first (a second adapter's callback would never be called)."""

    def __init__(self) -> None:
        self.adapters: weakref.WeakSet[WorkerAdapter] = weakref.WeakSet()
        m = meter("thunderagent.worker")
        self.completed = m.create_counter(
            "thunderagent_requests_completed", description="Requests finished with a FinalReply"
        )
        self.hit_requests = m.create_counter(
            "thunderagent_cache_hit_requests",
            description="Finished requests the engine served partly from its prefix cache",
        )
        self.prompt_tokens = m.create_counter(
            "thunderagent_prompt_tokens", unit="{token}", description="Prompt tokens finished"
        )
        self.cached_tokens = m.create_counter(
            "thunderagent_cached_prompt_tokens",
            unit="{token}",
            description="Prompt tokens served from the engine's KV cache",
        )
        self.late_offers = m.create_counter(
            "thunderagent_late_offers",
            description="Hand-offs that came again or after their sender gave up on them, by "
            "outcome: refused (voided first), running or ran (the run here answers for them)",
        )
        m.create_observable_counter(
            "thunderagent_kv_mirror_blocks",
            callbacks=[lambda _: [o for a in self.adapters for o in a.mirror_observations()]],
            unit="{block}",
            description="Engine KV blocks the adapter relayed to the index, or skipped and why",
        )
        m.create_observable_counter(
            "thunderagent_dispatch_pulls",
            callbacks=[lambda _: [o for a in self.adapters for o in a.pull_observations()]],
            description="Prefix copies made for runs before they started (PullHint), by outcome",
        )


@functools.cache
def adapter_metrics() -> AdapterMetrics:
    return AdapterMetrics()
