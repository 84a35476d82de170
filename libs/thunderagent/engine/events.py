"""KV-cache events the engine emits, with SGLang's meaning (BlockStored / BlockRemoved /
AllBlocksCleared), as plain records.

Another layer encodes them to SGLang's msgpack wire format; keeping them plain here keeps the
engine core free of any wire library. ``token_ids`` is flat (as on SGLang's wire): ``block_size``
ids per stored block, or None when the caller gave no token ids (trace replay).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar


class Medium(StrEnum):
    """Where a block lives; the values are SGLang's medium strings."""

    GPU = "GPU"
    CPU_PINNED = "CPU_PINNED"


@dataclass(slots=True)
class Stored:
    """Blocks became cached on ``medium``; ``block_hashes[0]``'s parent is ``parent_key``."""

    kind: ClassVar[str] = "stored"
    block_hashes: list[int]
    parent_key: int | None
    token_ids: list[int] | None
    medium: Medium = Medium.GPU


@dataclass(slots=True)
class Removed:
    """Blocks left ``medium`` (evicted, or demoted to the host tier)."""

    kind: ClassVar[str] = "removed"
    block_hashes: list[int]
    medium: Medium = Medium.GPU


@dataclass(slots=True)
class AllCleared:
    """The whole cache was flushed."""

    kind: ClassVar[str] = "all_cleared"


CacheEvent = Stored | Removed | AllCleared
