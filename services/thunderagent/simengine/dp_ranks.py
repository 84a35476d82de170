"""An engine's data-parallel ranks, each with its own scheduler and KV cache, as SGLang runs
them under ``--dp-size``: a request names its rank (``routed_dp_rank``, or the older spelling
``data_parallel_rank`` that SGLang still takes and sgl-model-gateway sends) or is handed to
the next rank in turn (SGLang's ``round_robin`` load balancing)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from thunderagent.simengine.driver import EngineDriver

RANK_FIELDS = ("routed_dp_rank", "data_parallel_rank")


class DpRanks:
    def __init__(self, engines: Sequence[EngineDriver]) -> None:
        if not engines:
            raise ValueError("an engine has at least one data-parallel rank")
        self.engines = list(engines)
        self._next = 0

    def __len__(self) -> int:
        return len(self.engines)

    def pick(self, body: Mapping[str, Any]) -> EngineDriver:
        """The rank ``body`` names, else the next in turn; ValueError for a rank that is not
        one of this engine's (SGLang answers it the same way: "DP rank N is not active")."""
        named = next((body[f] for f in RANK_FIELDS if body.get(f) is not None), None)
        if named is None:
            engine = self.engines[self._next]
            self._next = (self._next + 1) % len(self.engines)
            return engine
        if isinstance(named, bool) or not isinstance(named, int):
            raise ValueError(f"routed_dp_rank must be an integer, not {named!r}")
        if not 0 <= named < len(self.engines):
            raise ValueError(f"DP rank {named} is not active (dp_size {len(self.engines)})")
        return self.engines[named]
