"""The worker adapters' shadows of engines that publish no KV events, in the replay.

Each worker's cache as its adapter infers it (``thunderagent.sglang.shadow``): its clock read
when a run is handed to the engine, and at the run's first output checked against the prompt
tokens the engine reports found, then the prompt stored; the events go to the router as the
adapter announces them (``worker/inferred_cache.py`` does the same live).
"""

from __future__ import annotations

from collections.abc import Sequence

from thunderagent.engine import CacheEvent, EngineCore, StepOutcome
from thunderagent.replay.records import Record
from thunderagent.sglang.shadow import CacheShadow


class ReplayShadows:
    def __init__(self, capacities: Sequence[int]) -> None:
        self.shadows = [CacheShadow(blocks) for blocks in capacities]
        self._marks: dict[str, int] = {}
        """Per run handed to an engine: its shadow's clock then."""

    def handed_over(self, w: int, request_id: str) -> None:
        self._marks[request_id] = self.shadows[w].mark()

    def started(
        self, w: int, rec: Record, keys: Sequence[int], block_size: int, found_tokens: int
    ) -> list[CacheEvent]:
        """``rec``'s run gave its first output: its prompt's blocks ``keys`` are cached now,
        the shadow first checked against the ``found_tokens`` its engine reported (not for a
        continuation, whose prompt ends with output the engine computed before)."""
        shadow = self.shadows[w]
        mark = self._marks.pop(rec.request_id, None)
        if mark is None or rec.run.output_offset:
            return shadow.cached(keys)
        usable = (rec.prompt_tokens - 1) // block_size
        return shadow.started(keys, usable, found_tokens // block_size, mark)


def found_tokens(core: EngineCore, outcome: StepOutcome, request_id: str) -> int:
    """The prompt tokens a run found cached, as its engine reports them with its first output
    (a run that also ended in that step is in the step's finished records)."""
    for fin in outcome.finished:
        if fin.request_id == request_id:
            return fin.cached_tokens
    return core.cached_tokens(request_id)
