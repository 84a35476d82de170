"""Wall-clock driver of the simulated engine: turns engine steps into per-request token streams.

Placeholder timing until the engine core lands: a fixed per-token prefill cost for uncached
tokens and a fixed delay per decode token, with an exact prefix cache over chained page hashes.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import xxhash

_OUTPUT_TEXT = (
    b"Simulated output: the KV cache of this prompt now lives on this worker, so a follow-up "
    b"that shares the prefix is cheaper here than anywhere else. "
)


def output_token(index: int) -> int:
    """Readable filler text in the byte tokenizer's ids (specials are 0..3)."""
    return 4 + _OUTPUT_TEXT[index % len(_OUTPUT_TEXT)]


@dataclass(slots=True)
class GenerateInput:
    rid: str
    input_ids: list[int]
    max_new_tokens: int


@dataclass(slots=True)
class TokenEvent:
    """Tokens produced for one request; ``finished`` on the last one, with the accounting."""

    token_ids: list[int]
    finished: bool = False
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = "length"


@dataclass
class SimpleEngine:
    page_size: int = 16
    capacity_blocks: int = 4096
    prefill_us_per_token: float = 20.0
    decode_ms_per_token: float = 2.0
    max_running: int = 64
    _cache: OrderedDict[int, None] = field(default_factory=OrderedDict)
    _running: int = 0
    _queued: int = 0
    _tokens_in_use: int = 0
    _sem: asyncio.Semaphore | None = None

    def _page_hashes(self, ids: list[int]) -> list[int]:
        out, parent = [], 0
        for i in range(0, len(ids) - len(ids) % self.page_size, self.page_size):
            h = xxhash.xxh3_64(parent.to_bytes(8, "little"))
            for t in ids[i : i + self.page_size]:
                h.update(t.to_bytes(4, "little"))
            parent = h.intdigest()
            out.append(parent)
        return out

    def load(self) -> dict:
        return {
            "num_reqs": self._running,
            "num_waiting_reqs": self._queued,
            "num_tokens": self._tokens_in_use,
            "kv_used_blocks": len(self._cache),
            "kv_total_blocks": self.capacity_blocks,
        }

    def flush(self) -> None:
        self._cache.clear()

    async def generate(self, req: GenerateInput) -> AsyncIterator[TokenEvent]:
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.max_running)
        self._queued += 1
        async with self._sem:
            self._queued -= 1
            self._running += 1
            self._tokens_in_use += len(req.input_ids)
            try:
                async for ev in self._run(req):
                    yield ev
            finally:
                self._running -= 1
                self._tokens_in_use -= len(req.input_ids)

    async def _run(self, req: GenerateInput) -> AsyncIterator[TokenEvent]:
        hashes = self._page_hashes(req.input_ids)
        cached_blocks = 0
        for h in hashes:
            if h not in self._cache:
                break
            self._cache.move_to_end(h)
            cached_blocks += 1
        cached = cached_blocks * self.page_size
        await asyncio.sleep((len(req.input_ids) - cached) * self.prefill_us_per_token / 1e6)
        for h in hashes[cached_blocks:]:
            self._cache[h] = None
        while len(self._cache) > self.capacity_blocks:
            self._cache.popitem(last=False)
        started = time.monotonic()
        for i in itertools.count():
            token = output_token(i)
            last = i + 1 == req.max_new_tokens
            yield TokenEvent(
                token_ids=[token],
                finished=last,
                prompt_tokens=len(req.input_ids),
                cached_tokens=cached,
                completion_tokens=i + 1,
            )
            if last:
                return
            target = started + (i + 1) * self.decode_ms_per_token / 1e3
            await asyncio.sleep(max(0.0, target - time.monotonic()))
