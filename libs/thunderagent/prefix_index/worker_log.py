"""One worker's state in ``PrefixIndex``, and its log: every block hash its bit was set on,
so that clearing, removing or dumping a worker costs its blocks, not a scan of the index.

Each event's hashes are appended with one ``extend`` (re-stored ones too); an item whose entry
no longer has the worker's bit is stale. Past a threshold (``index._LOG_GROWTH`` items per
block held, plus ``index._LOG_SLACK``) the log is compacted by a ``Sweep``, a few items per
block stored over the events that follow: done at once, it held the event loop of a process
with an index for the whole log, 57k items for a worker's 28k blocks in the router's in-flight
overlay under the conversation trace at 200 req/s (~6 ms alone, more on a busy machine), and
set the latency p99 of a gateway routing in its own process.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import chain
from typing import Final

from thunderagent.prefix_index.entry import Entry

SWEEP_ITEMS_PER_BLOCK: Final = 4
"""Old log items a compaction reads per block stored meanwhile: it reads ~2x the count while
~count/2 new items arrive, so the log it leaves stays under its threshold."""

SWEEP_MIN_ITEMS: Final = 64
"""Old log items a compaction reads per stored event at least (an event of one block)."""

Get = Callable[[int], Entry | None]


@dataclass(slots=True)
class Sweep:
    """A compaction in steps: ``old[pos:]`` still to read; its items held by the worker and
    not read before go to ``kept``, in order. ``seen`` is a dict, not a set: a dict of ints
    is not tracked by the cyclic GC, a set always is (a full collection would walk it)."""

    old: array
    pos: int = 0
    kept: array = field(default_factory=lambda: array("Q"))
    seen: dict[int, None] = field(default_factory=dict)


@dataclass(slots=True)
class IndexedWorker:
    """Per-worker state; ``bit`` is ``1 << slot``, cached because every store ORs it in."""

    name: str
    slot: int
    bit: int
    last_seq: int | None = None
    last_event_at: float | None = None
    count: int = 0
    """Entries whose mask has this worker's bit (exact)."""
    log: array = field(default_factory=lambda: array("Q"))
    """Primary hashes this worker's bit was set on, possibly stale or repeated."""
    sweep: Sweep | None = None
    """A compaction under way: the earlier log it reads; ``log`` takes what arrives meanwhile."""

    def logged(self) -> Iterable[int]:
        """Every item of the log, in stored order: a hash this worker holds is among them."""
        s = self.sweep
        if s is None:
            return self.log
        return chain(s.kept, s.old[s.pos :], self.log)

    def live(self, get: Get) -> list[int]:
        """The blocks this worker holds, each once, in first-stored order."""
        bit = self.bit
        return [
            p for p in dict.fromkeys(self.logged()) if (e := get(p)) is not None and e.held & bit
        ]

    def compact(self, get: Get, blocks: int) -> None:
        """After an event of ``blocks`` blocks, with a compaction under way or the log past its
        threshold (the caller's test, inline on its hot path): a step of the compaction, or
        its start."""
        if self.sweep is not None:
            self._sweep(get, max(SWEEP_ITEMS_PER_BLOCK * blocks, SWEEP_MIN_ITEMS))
        else:
            self.sweep = Sweep(self.log)
            self.log = array("Q")

    def forget_log(self) -> None:
        """Every block is gone (the caller cleared the worker's bits)."""
        self.log = array("Q")
        self.sweep = None
        self.count = 0

    def _sweep(self, get: Get, items: int) -> None:
        """Read up to ``items`` more of the compaction's old log; at its end the kept items,
        then what arrived meanwhile, become the log."""
        s = self.sweep
        assert s is not None
        end = min(s.pos + items, len(s.old))
        bit = self.bit
        seen = s.seen
        kept = s.kept
        for p in s.old[s.pos : end]:
            if p not in seen and (e := get(p)) is not None and e.held & bit:
                seen[p] = None
                kept.append(p)
        s.pos = end
        if end == len(s.old):
            kept.extend(self.log)
            self.log = kept
            self.sweep = None
