"""Who holds a prefix, asked of the index service (``HoldersQuery`` on ``INDEX_HOLDERS``).

The planner needs holders only for the prefixes it tracks, once per tick; keeping an index
replica for that cost this service a delivery, a decode and an apply for every KV message
(every engine batch of every worker), 200-280 µs of CPU per request at 200 req/s on the dev VM.
"""

from __future__ import annotations

from collections.abc import Iterable

from thunderagent.bus import Bus, BusError
from thunderagent.schemas import HoldersQuery, HoldersReply, subjects
from thunderagent.schemas.kv import MAX_HOLDERS_QUERY


class IndexHolders:
    def __init__(self, bus: Bus, timeout_s: float = 2.0) -> None:
        self.bus = bus
        self.timeout_s = timeout_s

    async def of(self, prefixes: Iterable[int]) -> dict[int, list[str]]:
        """``{prefix: workers holding it}`` for every prefix asked (none: an empty list).
        Raises :class:`BusError` when the index service does not answer."""
        asked = list(dict.fromkeys(prefixes))
        held: dict[int, list[str]] = {}
        for start in range(0, len(asked), MAX_HOLDERS_QUERY):
            chunk = asked[start : start + MAX_HOLDERS_QUERY]
            reply = await self.bus.request(
                subjects.INDEX_HOLDERS, HoldersQuery(prefixes=chunk), HoldersReply,
                timeout=self.timeout_s,
            )  # fmt: skip
            if len(reply.holders) != len(chunk):
                raise BusError(
                    subjects.INDEX_HOLDERS,
                    f"{len(reply.holders)} answers to {len(chunk)} prefixes",
                )
            held.update(zip(chunk, reply.holders, strict=True))
        return held
