"""Wall-clock driver: runs the pure engine core in real time behind the HTTP server.

One loop task steps the core while it has work: it plans a step, sleeps the step's modelled
duration (divided by ``speedup``), then delivers the step's tokens to each request's stream and
publishes the step's cache events in SGLang's wire format. Requests join the core whenever they
arrive, exactly as in SGLang's scheduler, so batching, chunked prefill, retraction and eviction
come from the same code the virtual-time benchmark runs.

Output tokens are deterministic filler text, known in advance, so output blocks get real SGLang
block hashes and token ids: a follow-up turn that contains the previous answer hits its cache,
as it would on SGLang.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from thunderagent.engine import AllCleared, CacheEvent, EngineCore, Profile, Removed, Request
from thunderagent.sglang import kv_wire
from thunderagent.sglang.zmq_publisher import ZmqKvEventPublisher

log = logging.getLogger(__name__)

_OUTPUT_TEXT = (
    b"Simulated output: the KV cache of this prompt now lives on this worker, so a follow-up "
    b"that shares the prefix is cheaper here than anywhere else. "
)


def output_token(index: int) -> int:
    """Readable filler text in the byte tokenizer's ids (specials are 0..3)."""
    return 4 + _OUTPUT_TEXT[index % len(_OUTPUT_TEXT)]


class EngineRejected(Exception):
    """The request can never fit the engine's KV pool (SGLang answers such requests with 400)."""


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


@dataclass(slots=True)
class _Stream:
    request: GenerateInput
    output: list[int]
    queue: asyncio.Queue[TokenEvent] = field(default_factory=asyncio.Queue)
    sent: int = 0


def to_wire(events: list[CacheEvent], block_size: int) -> list[kv_wire.AnyKvEvent]:
    """Engine cache events -> SGLang 0.5.23 KV events."""
    out: list[kv_wire.AnyKvEvent] = []
    for ev in events:
        if isinstance(ev, AllCleared):
            out.append(kv_wire.AllBlocksCleared())
        elif isinstance(ev, Removed):
            out.append(kv_wire.BlockRemoved(block_hashes=ev.block_hashes, medium=ev.medium.value))
        else:
            out.append(
                kv_wire.BlockStored(
                    block_hashes=ev.block_hashes,
                    parent_block_hash=ev.parent_key,
                    token_ids=ev.token_ids or [],
                    block_size=block_size,
                    lora_id=None,
                    medium=ev.medium.value,
                )
            )
    return out


class EngineDriver:
    def __init__(
        self,
        profile: Profile,
        *,
        publisher: ZmqKvEventPublisher | None = None,
        speedup: float = 1.0,
        link_bytes_per_s: float = 25e9,
    ) -> None:
        self.profile = profile
        self.core = EngineCore(profile)
        self.block_size = profile.engine.block_size
        self.publisher = publisher
        self.speedup = speedup
        self.link_bytes_per_s = link_bytes_per_s
        """KV transfer link for PD imports (25 GB/s: one 200 Gb/s RDMA NIC)."""
        self._streams: dict[str, _Stream] = {}
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._epoch = time.monotonic()

    @property
    def capacity_blocks(self) -> int:
        return self.core.cache.capacity

    @property
    def max_running(self) -> int:
        return self.profile.engine.max_running_requests

    def now(self) -> float:
        """Engine time: wall time since start, times ``speedup``."""
        return (time.monotonic() - self._epoch) * self.speedup

    def load(self) -> dict:
        load = self.core.load()
        return {
            "num_reqs": load.num_running,
            "num_waiting_reqs": load.num_waiting,
            "num_tokens": load.num_tokens,
            "kv_used_blocks": load.kv_used_blocks,
            "kv_total_blocks": load.kv_total_blocks,
            "cached_blocks": load.cached_blocks,
        }

    def flush(self) -> bool:
        flushed = self.core.flush(self.now())
        self._publish(self.core.drain_events())
        return flushed

    async def generate(self, req: GenerateInput) -> AsyncIterator[TokenEvent]:
        if req.rid in self._streams:
            raise ValueError(f"request id {req.rid!r} is already running")
        output = [output_token(i) for i in range(req.max_new_tokens)]
        token_ids = req.input_ids + output
        keys = kv_wire.sglang_block_hashes(token_ids, self.block_size)
        request = Request(req.rid, len(req.input_ids), keys, req.max_new_tokens, token_ids)
        rejected = self.core.add(request, self.now())
        if rejected is not None:
            raise EngineRejected(
                f"prompt ({len(req.input_ids)}) + max_new_tokens ({req.max_new_tokens}) exceeds "
                f"the KV pool ({self.core.cache.capacity * self.block_size} tokens)"
            )
        stream = self._streams[req.rid] = _Stream(req, output)
        self._ensure_loop()
        self._wake.set()
        try:
            while True:
                event = await stream.queue.get()
                yield event
                if event.finished:
                    return
        finally:
            if self._streams.pop(req.rid, None) is not None:
                self.core.abort(req.rid, self.now())  # client went away mid-stream

    def import_kv(self, token_ids: list[int]) -> tuple[int, float]:
        """PD: the full blocks of ``token_ids`` arrive from a prefill engine and become cached
        here. Returns (blocks imported, modelled transfer seconds at ``link_bytes_per_s``)."""
        full = len(token_ids) - len(token_ids) % self.block_size
        keys = kv_wire.sglang_block_hashes(token_ids[:full], self.block_size)
        blocks = self.core.import_blocks(keys, token_ids[:full])
        self._publish(self.core.drain_events())
        seconds = blocks * self.profile.kv_bytes_per_block / self.link_bytes_per_s
        return blocks, seconds

    def abort(self, rid: str) -> bool:
        """Drop a running request (SGLang's /abort_request); its stream ends with an abort."""
        stream = self._streams.pop(rid, None)
        if stream is None:
            return False
        finished = self.core.abort(rid, self.now())
        stream.queue.put_nowait(
            TokenEvent(
                token_ids=[],
                finished=True,
                prompt_tokens=len(stream.request.input_ids),
                cached_tokens=finished.cached_tokens if finished else 0,
                completion_tokens=stream.sent,
                finish_reason="abort",
            )
        )
        return True

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.create_task(self._run(), name="engine-loop")

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.core.has_work:
                started = time.monotonic()
                outcome = self.core.step(self.now())
                target = started + outcome.duration / self.speedup
                await asyncio.sleep(max(0.0, target - time.monotonic()))
                self._deliver(outcome)
                self._publish(outcome.events)

    def _deliver(self, outcome) -> None:
        for rid, count in outcome.tokens.items():
            stream = self._streams.get(rid)
            if stream is None:
                continue
            ids = stream.output[stream.sent : stream.sent + count]
            stream.sent += count
            stream.queue.put_nowait(TokenEvent(token_ids=ids, completion_tokens=stream.sent))
        for fin in outcome.finished:
            stream = self._streams.get(fin.request_id)
            if stream is None:
                continue
            stream.queue.put_nowait(
                TokenEvent(
                    token_ids=[],
                    finished=True,
                    prompt_tokens=fin.prompt_tokens,
                    cached_tokens=fin.cached_tokens,
                    completion_tokens=fin.completion_tokens,
                    finish_reason=fin.finish_reason,
                )
            )
            del self._streams[fin.request_id]

    def _publish(self, events: list[CacheEvent]) -> None:
        if self.publisher is not None and events:
            if not self.publisher.publish(to_wire(events, self.block_size)):
                log.warning("KV event queue full: a batch was dropped (subscribers will resync)")

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        if self.publisher is not None:
            self.publisher.close()
