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
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from thunderagent.engine import AllCleared, CacheEvent, EngineCore, Profile, Removed, Request
from thunderagent.sglang import kv_wire
from thunderagent.sglang.cache_events import to_wire
from thunderagent.sglang.load import get_load_payload, v1_load_snapshot
from thunderagent.sglang.zmq_publisher import ZmqKvEventPublisher
from thunderagent.simengine.salts import CacheNamespace, SaltBook, cache_namespace

if TYPE_CHECKING:  # the pool pulls in numpy and NIXL; engines without one never load them
    from thunderagent.simengine.kv_pool import KvPool

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
    cache_salt: str | None = None
    """Tenant namespace (SGLang's ``cache_salt``): blocks are shared only within one salt."""
    lora_name: str | None = None
    """LoRA adapter (SGLang's ``lora_path``): its blocks are its own, shared within the adapter."""
    stop_matched: str | None = None
    """The stop string the output reaches first (``max_new_tokens`` then ends before it)."""


def stop_strings(value: object) -> list[str] | None:
    """A request's ``stop`` (absent, a string or a list of strings) as a list; None if it is
    anything else."""
    stops = [value] if isinstance(value, str) else (value or [])
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        return None
    return stops


def first_stop(stops: list[str], max_new_tokens: int) -> tuple[int, str] | None:
    """Where the simulated output meets the first of ``stops`` within ``max_new_tokens``:
    (tokens before it, the string). The output is fixed text, one byte per token.

    The text repeats every ``len(_OUTPUT_TEXT)`` bytes, so a string found at all is found first
    within one period of the start: only that much text (plus the longest stop string) is
    built. Building all ``max_new_tokens`` of it let one request asking for 10^9 tokens hold
    the engine's event loop and gigabytes of memory before the context-length check refused
    it (found by the long fuzz run)."""
    stops = [s for s in stops if s]
    if not stops:
        return None
    period = len(_OUTPUT_TEXT)
    n = min(max_new_tokens, period + max(map(len, stops)))
    text = (_OUTPUT_TEXT * (n // period + 1))[:n].decode("latin-1")
    hits = [(at, s) for s in stops if (at := text.find(s)) >= 0]
    return min(hits, key=lambda hit: hit[0] + len(hit[1])) if hits else None


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


class EngineDriver:
    def __init__(
        self,
        profile: Profile,
        *,
        publisher: ZmqKvEventPublisher | None = None,
        speedup: float = 1.0,
        link_bytes_per_s: float = 25e9,
        kv_pool: KvPool | None = None,
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
        self.kv_pool = kv_pool
        """Real bytes per cached block, registered with NIXL (None: blocks are counts only)."""
        self._in_step = False
        self._between: list[tuple[Callable[[], Any], asyncio.Future]] = []
        self.salts = SaltBook()
        self._changed: asyncio.Future | None = None
        """Resolved when a step ends or a cache change runs: room may have been freed."""

    @property
    def capacity_blocks(self) -> int:
        return self.core.cache.capacity

    @property
    def context_length(self) -> int:
        return self.profile.model.context_length

    @property
    def max_running(self) -> int:
        return self.profile.engine.max_running_requests

    def now(self) -> float:
        """Engine time: wall time since start, times ``speedup``."""
        return (time.monotonic() - self._epoch) * self.speedup

    def load(self, dp_rank: int = 0) -> dict:
        """SGLang's ``/get_load`` entry for this engine, data-parallel rank ``dp_rank``."""
        return get_load_payload(self.core.load(), dp_rank)

    def load_snapshot(self, dp_rank: int = 0) -> dict:
        """SGLang 0.5's ``/v1/loads`` entry (a ``LoadSnapshot``) for rank ``dp_rank``."""
        return v1_load_snapshot(self.core.load(), self.block_size, dp_rank)

    def flush(self) -> bool:
        flushed = self.core.flush(self.now())
        self._publish(self.core.drain_events())
        return flushed

    async def generate(self, req: GenerateInput) -> AsyncIterator[TokenEvent]:
        if req.rid in self._streams:
            raise ValueError(f"request id {req.rid!r} is already running")
        if len(req.input_ids) + req.max_new_tokens > self.context_length:
            raise EngineRejected(
                f"prompt ({len(req.input_ids)}) + max_new_tokens ({req.max_new_tokens}) exceeds "
                f"the model's context length ({self.context_length} tokens)"
            )
        output = [output_token(i) for i in range(req.max_new_tokens)]
        token_ids = req.input_ids + output
        # SGLang seeds a salted (or an adapter's) request's block hashes with its namespace: no
        # tenant or adapter shares a block with another
        space = cache_namespace(req.cache_salt, req.lora_name)
        keys = kv_wire.sglang_block_hashes(token_ids, self.block_size, space and space.seed())
        request = Request(req.rid, len(req.input_ids), keys, req.max_new_tokens, token_ids)
        if space:
            self.salts.hold(keys, space)
        try:  # aclosing: a client that goes away aborts the run at once, not at GC
            async with contextlib.aclosing(self._run_request(req, request, output)) as events:
                async for event in events:
                    yield event
        finally:
            if space:
                self.salts.release(keys, self.core.cache.__contains__)

    async def _run_request(
        self, req: GenerateInput, request: Request, output: list[int]
    ) -> AsyncIterator[TokenEvent]:
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

    def import_kv(
        self, token_ids: list[int], space: CacheNamespace | None = None
    ) -> tuple[int, float]:
        """PD: the full blocks of ``token_ids`` arrive from a prefill engine and become cached
        here, in ``space`` (the request's salt and adapter) as the prefill engine cached them.
        Returns (blocks imported, modelled transfer seconds at ``link_bytes_per_s``)."""
        keys, full = self.full_block_keys(token_ids, space)
        if space:  # the events of the imported blocks name the namespace
            self.salts.hold(keys, space)
        blocks = self.core.import_blocks(keys, token_ids[:full])
        self._publish(self.core.drain_events())
        if space:
            self.salts.release(keys, self.core.cache.__contains__)
        return blocks, self.copy_s(blocks)

    def full_block_keys(
        self, token_ids: list[int], space: CacheNamespace | None
    ) -> tuple[list[int], int]:
        """The keys of the full blocks of ``token_ids`` in ``space``, as this engine caches
        them, and how many tokens those blocks hold."""
        full = len(token_ids) - len(token_ids) % self.block_size
        return kv_wire.sglang_block_hashes(
            token_ids[:full], self.block_size, space and space.seed()
        ), full

    def copy_s(self, blocks: int) -> float:
        """Modelled seconds to copy ``blocks`` KV blocks over the PD link."""
        return blocks * self.profile.kv_bytes_per_block / self.link_bytes_per_s

    def unpin(self, keys: list[int]) -> None:
        """Blocks pinned outside any request (a copy's source) are free to go; an engine that
        stalled for want of room goes on."""
        self.core.unpin_prefix(keys)
        self._signal_change()
        self._wake.set()

    def give_back_import(self, keys: list[int], present: int) -> None:
        """An import that will not land gives its pages back at once (no event to order), and
        an engine that stalled for want of them goes on."""
        self.core.abort_import(keys, present)
        self._signal_change()
        self._wake.set()

    def next_change(self) -> asyncio.Future:
        """Resolved at the next step's end or cache change: room may have been freed then."""
        if self._changed is None or self._changed.done():
            self._changed = asyncio.get_running_loop().create_future()
        return self._changed

    def _signal_change(self) -> None:
        if self._changed is not None and not self._changed.done():
            self._changed.set_result(None)

    async def between_steps(self, change: Callable[[], Any]) -> Any:
        """Run a cache change made outside any request (a KV export or import) between two
        engine steps, then publish its events: a step's events go out when the step ends, so a
        change made while one is in flight would otherwise be published before events that
        happened earlier."""
        if not self._in_step:
            return self._change_now(change)
        future = asyncio.get_running_loop().create_future()
        self._between.append((change, future))
        return await future

    def _change_now(self, change: Callable[[], Any]) -> Any:
        result = change()
        self._publish(self.core.drain_events())
        self._signal_change()
        self._wake.set()  # an engine stalled on memory may go on now
        return result

    def _run_between(self) -> None:
        queued, self._between = self._between, []
        for change, future in queued:
            if future.cancelled():  # its caller gave up before the change ran: skip it
                continue
            try:
                future.set_result(self._change_now(change))
            except Exception as err:
                future.set_exception(err)

    def abort(self, rid: str) -> bool:
        """Drop every running request whose rid starts with ``rid``, as SGLang's
        ``/abort_request`` does (0.5.23, ``Scheduler.abort_request``); each stream ends with an
        abort. False when none matched."""
        matched = [r for r in self._streams if r.startswith(rid)]
        for r in matched:
            self._abort_one(r)
        return bool(matched)

    def _abort_one(self, rid: str) -> None:
        stream = self._streams.pop(rid)
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
                if outcome.kind == "idle":  # no room until reserved KV lands: wait for it
                    break
                target = started + outcome.duration / self.speedup
                self._in_step = True
                try:
                    await asyncio.sleep(max(0.0, target - time.monotonic()))
                finally:
                    self._in_step = False
                self._deliver(outcome)
                self._publish(outcome.events)
                self._signal_change()
                self._run_between()
            self._run_between()

    def _deliver(self, outcome) -> None:
        """One event per request per step, as SGLang streams: a request that finishes in this
        step gets its last tokens and its finish reason in the same event (a separate empty
        finish event would be one more chunk, and one more wake-up of whoever reads it)."""
        ended = {fin.request_id: fin for fin in outcome.finished}
        for rid, count in outcome.tokens.items():
            stream = self._streams.get(rid)
            if stream is None:
                continue
            ids = stream.output[stream.sent : stream.sent + count]
            stream.sent += count
            fin = ended.pop(rid, None)
            if fin is None:  # SGLang's meta_info carries the prompt's accounting in every output
                stream.queue.put_nowait(TokenEvent(
                    token_ids=ids, prompt_tokens=len(stream.request.input_ids),
                    cached_tokens=self.core.cached_tokens(rid), completion_tokens=stream.sent,
                ))  # fmt: skip
            else:
                self._end_stream(stream, fin, ids)
        for fin in ended.values():  # finished without a token in this step
            stream = self._streams.get(fin.request_id)
            if stream is not None:
                self._end_stream(stream, fin, [])

    def _end_stream(self, stream: _Stream, fin, ids: list[int]) -> None:
        stream.queue.put_nowait(
            TokenEvent(
                token_ids=ids,
                finished=True,
                prompt_tokens=fin.prompt_tokens,
                cached_tokens=fin.cached_tokens,
                completion_tokens=fin.completion_tokens,
                finish_reason=fin.finish_reason,
            )
        )
        del self._streams[fin.request_id]

    def _publish(self, events: list[CacheEvent]) -> None:
        if self.kv_pool is not None and events:
            self.kv_pool.follow(events)
        if self.publisher is not None and events:
            wire = to_wire(events, self.block_size, self.salts.salt_of)
            if not self.publisher.publish(wire):
                log.warning("KV event queue full: a batch was dropped (subscribers will resync)")
        if len(self.salts):
            self._forget_salts(events)

    def _forget_salts(self, events: list[CacheEvent]) -> None:
        cached = self.core.cache.__contains__
        for ev in events:
            if isinstance(ev, Removed):
                self.salts.forget(ev.block_hashes, cached)
            elif isinstance(ev, AllCleared):
                self.salts.forget(self.salts.keys(), cached)

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        if self.publisher is not None:
            self.publisher.close()
