"""Identifier types shared by every message.

They are plain ``str``/``int`` on the wire; the NewTypes only document intent and let a type
checker catch a worker id passed where a request id belongs.
"""

from __future__ import annotations

import re
from typing import Annotated, NewType

from msgspec import Meta

RequestId = NewType("RequestId", str)
WorkerId = NewType("WorkerId", str)
ModelName = NewType("ModelName", str)
ProgramId = NewType("ProgramId", str)
BlockHash = NewType("BlockHash", int)
"""64-bit chained block hash (xxh3 over parent hash + token ids), as an unsigned int."""

WORKER_ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
"""Worker ids become one NATS subject token, so they may not hold '.', '*', '>' or spaces."""

_WORKER_ID_RE = re.compile(WORKER_ID_PATTERN)

RouterId = Annotated[str, Meta(pattern=WORKER_ID_PATTERN)]
"""A router replica's id: one subject token (its credits subject), like a worker id."""
RouterIdOrNone = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{0,64}$")]
"""A router id, or empty where no router is named."""
ReplySubject = Annotated[str, Meta(pattern=r"^[^\s*>]{1,512}$")]
"""A concrete subject to publish answers on: no wildcards, no white space, not empty."""
PositiveInt = Annotated[int, Meta(gt=0)]
OfferName = Annotated[str, Meta(max_length=64)]
"""One hand-off of a run to a worker (``fleet.offers``); empty: not named."""
OfferNames = Annotated[list[OfferName], Meta(max_length=64)]
"""Offers of one run to one worker: a handful (the router's, then the scheduler's tries)."""


def is_valid_worker_id(worker_id: str) -> bool:
    return bool(_WORKER_ID_RE.match(worker_id))


def dp_rank_worker_ids(worker_id: str, dp_size: int) -> list[str]:
    """The fleet's worker ids for an engine of ``dp_size`` data-parallel ranks: the engine's own
    id for one rank, ``<id>-dp<r>`` for rank r of several (each rank has its own KV cache, so
    each is a worker to the router)."""
    if dp_size <= 1:
        return [worker_id]
    return [f"{worker_id}-dp{rank}" for rank in range(dp_size)]
