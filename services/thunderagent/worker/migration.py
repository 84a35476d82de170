"""The adapter's side of a KV move ordered by the migration service, and of a copy a run's
``PullHint`` asks for before it starts (``before_run``: the same three steps, ordered here).

* ``kv_export`` (source): find the prefix in the mirror of the engine's cache (our hash of its
  deepest block -> the engine's chain of block hashes), pin it at the engine and describe it.
* ``kv_pull`` (target): take the prefix into the engine's cache, then the engine's own KV events
  announce the new holder (nothing is published here).
* ``kv_release`` (source): unpin, and for a migration free the prefix at the engine.

Two transports, chosen per engine from ``/server_info``'s ``kv_transfer``:

* ``nixl``: the simulated engine with a KV pool exports and imports the blocks themselves
  (``/kv/export``, ``/kv/pull``, ``/kv/release``; the target NIXL-reads the source's memory).
* ``warmup``: any other engine (stock SGLang has no KV import path): the target prefills the
  prefix (``/generate``, ``max_new_tokens=1``). The source's tokens come from a token tap on its
  engine's KV events (every ``BlockStored`` carries them), fed by the adapter's KV relay. It
  cannot free a prefix selectively, so a migration there leaves the source's copy to its LRU.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
import uuid
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

import aiohttp
from opentelemetry import trace
from opentelemetry.trace import Span

from thunderagent.bus import Bus, BusError, Delivery
from thunderagent.hashing import BlockHasher, BlockHashes, kv_namespace
from thunderagent.schemas import (
    KvExportOffer,
    KvExportRequest,
    KvPullRequest,
    KvPullResult,
    KvRelease,
    KvReleaseResult,
    PullHint,
    WorkerGenerate,
    subjects,
)
from thunderagent.sglang import kv_wire
from thunderagent.sglang.mirror import KvMirror
from thunderagent.sglang.zmq_subscriber import Notice, Received, Restarted
from thunderagent.telemetry.propagation import child_span
from thunderagent.worker.engine_client import EngineClient, EngineError
from thunderagent.worker.kv_relay import KvRelay

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("thunderagent.worker")

PULL_TIMEOUT_S = 10.0
"""A copy for a run without a budget gives up after this, and the run prefills instead."""
PULL_GRACE_S = 1.0
"""How long past its budget a copy's engine may take to answer before the run goes ahead (an
import that lands later is ordinary cache: its duplicate blocks give their room back)."""


class TokenTap:
    """Engine block hash -> its token ids, from the engine's KV events: what a warm-up needs to
    name a prefix to another engine. Tokens are kept packed (4 bytes each, ~150 bytes per
    16-token block with the dict entry) and bounded: the least recently stored go first."""

    def __init__(self, block_size: int, max_blocks: int = 200_000) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.blocks: OrderedDict[int, bytes] = OrderedDict()

    def apply(self, events: list[kv_wire.AnyKvEvent]) -> None:
        size = self.block_size
        for ev in events:
            if isinstance(ev, kv_wire.BlockStored):
                if len(ev.token_ids) != len(ev.block_hashes) * size:
                    continue
                try:
                    packed = array("I", ev.token_ids).tobytes()
                except OverflowError:  # a token id outside uint32: no engine vocabulary has it
                    continue
                width = size * 4
                for i, h in enumerate(ev.block_hashes):
                    self.blocks[h] = packed[i * width : (i + 1) * width]
                    self.blocks.move_to_end(h)
            elif isinstance(ev, kv_wire.BlockRemoved):
                for h in ev.block_hashes:
                    self.blocks.pop(h, None)
            elif isinstance(ev, kv_wire.AllBlocksCleared):
                self.blocks.clear()
        while len(self.blocks) > self.max_blocks:
            self.blocks.popitem(last=False)

    def tokens(self, chain: list[int]) -> list[int] | None:
        out = array("I")
        for h in chain:
            packed = self.blocks.get(h)
            if packed is None:
                return None
            out.frombytes(packed)
        return out.tolist()

    def take(self, notice: Notice) -> None:
        """One notice of the engine's event stream (a listener of the adapter's KV relay)."""
        if isinstance(notice, Received):
            self.apply(notice.batch.events)
        elif isinstance(notice, Restarted):
            self.blocks.clear()


class WorkerMigration:
    def __init__(
        self,
        worker_id: str,
        bus: Bus,
        engine: EngineClient,
        mirror: Callable[[], KvMirror | None],
        block_size: int,
    ) -> None:
        self.worker_id = worker_id
        self.bus = bus
        self.engine = engine
        self.mirror = mirror
        self.block_size = block_size
        self.kv_transfer: dict[str, Any] | None = None
        """The engine's NIXL capability (``/server_info``), None: warm-up only."""
        self.tap: TokenTap | None = None
        self._hasher = BlockHasher(block_size)
        self._chains: dict[str, list[int]] = {}
        self._incoming: dict[tuple[int, int], asyncio.Future] = {}
        """Copies under way here for runs (``before_run``): (blocks, prefix hash) -> done."""
        self.pulls: Counter[str] = Counter()
        """Copies for runs by outcome: done (all or part of the prefix), refused (the source
        held none of it, or not in a pool like ours), failed (no answer, or the pull failed)."""

    async def start(self, relay: KvRelay | None) -> None:
        """Subscribe the move subjects; without NIXL, tap ``relay``'s engine events (announced
        by the adapter for an engine that publishes none) to name a warm-up's prefixes."""
        info = await self.engine.get_json("/server_info")
        self.kv_transfer = info.get("kv_transfer") or None
        if self.kv_transfer is None and relay is not None:
            self.tap = TokenTap(self.block_size)
            relay.listeners.append(self.tap.take)
        w = self.worker_id
        await self.bus.subscribe(
            subjects.worker_kv_export(w), KvExportRequest, self.on_export, concurrent=True
        )
        await self.bus.subscribe(
            subjects.worker_kv_pull(w), KvPullRequest, self.on_pull, concurrent=True
        )
        await self.bus.subscribe(
            subjects.worker_kv_release(w), KvRelease, self.on_release, concurrent=True
        )

    # ---- source --------------------------------------------------------------------------
    async def on_export(self, req: KvExportRequest, delivery: Delivery) -> None:
        offer = await self.export(req)
        if delivery.reply:
            await self.bus.publish(delivery.reply, offer)

    async def export(self, req: KvExportRequest) -> KvExportOffer:
        def refuse(reason: str) -> KvExportOffer:
            return KvExportOffer(
                migration_id=req.migration_id, worker_id=self.worker_id, blocks=0, reason=reason
            )

        chain = self._held_chain(req)
        if chain is None:
            return refuse("the prefix is not in this worker's cache")
        mirror = self.mirror()
        space = mirror.namespace_of(chain) if mirror is not None else None
        salt, lora = space if space is not None else (None, None)
        if self.kv_transfer is not None:
            body = {"export_id": req.migration_id, "block_hashes": chain, "hold_s": req.hold_s}
            try:
                got = await self._post("/kv/export", body)
            except EngineError as err:
                return refuse(f"engine export failed: {err}")
            self._chains[req.migration_id] = got["block_hashes"]
            return self._nixl_offer(req.migration_id, got, salt, lora)
        tokens = self.tap.tokens(chain) if self.tap is not None else None
        if tokens is None:
            return refuse("the prefix's tokens are unknown here (no KV events seen for it)")
        self._chains[req.migration_id] = chain
        return KvExportOffer(
            migration_id=req.migration_id,
            worker_id=self.worker_id,
            blocks=len(chain),
            block_size=self.block_size,
            token_ids=tokens,
            transport="warmup",
            cache_salt=salt,
            lora_name=lora,
        )

    def _held_chain(self, req: KvExportRequest) -> list[int] | None:
        """The engine's hashes of what this worker holds of the requested prefix: the longest
        leading run of a run's chain, or the whole named prefix; None when nothing."""
        mirror = self.mirror()
        if mirror is None:
            return None
        if req.chain:
            return mirror.leading_run(req.chain) or None
        return mirror.chain_to(req.prefix_hash)

    def _nixl_offer(
        self, migration_id: str, got: dict[str, Any], salt: str | None, lora: str | None
    ) -> KvExportOffer:
        """The engine's pinned export (``/kv/export``) as an offer a NIXL reader can use, in
        the namespace (tenant ``salt``, adapter ``lora``) the blocks are cached under."""
        return KvExportOffer(
            migration_id=migration_id,
            worker_id=self.worker_id,
            blocks=got["blocks"],
            block_size=got["block_size"],
            token_ids=got["token_ids"],
            transport="nixl",
            nixl_agent=got["nixl_agent"],
            nixl_metadata=_b64(got["nixl_metadata"]),
            block_addrs=got["block_addrs"],
            block_bytes=got["block_bytes"],
            checksums=got["checksums"],
            block_hashes=got["block_hashes"],
            cache_salt=salt,
            lora_name=lora,
        )

    async def on_release(self, req: KvRelease, delivery: Delivery) -> None:
        result = await self.release(req)
        if delivery.reply:
            await self.bus.publish(delivery.reply, result)

    async def release(self, req: KvRelease) -> KvReleaseResult:
        chain = self._chains.pop(req.migration_id, None) if req.migration_id else None
        if chain is None and req.drop:
            mirror = self.mirror()
            chain = mirror.chain_to(req.prefix_hash) if mirror is not None else None
        if self.kv_transfer is None:
            reason = "this engine cannot free a prefix selectively" if req.drop else ""
            return KvReleaseResult(
                migration_id=req.migration_id,
                worker_id=self.worker_id,
                released=chain is not None,
                reason=reason,
            )
        body = {"export_id": req.migration_id, "block_hashes": chain or [], "drop": req.drop}
        try:
            got = await self._post("/kv/release", body)
        except EngineError as err:
            return KvReleaseResult(
                migration_id=req.migration_id,
                worker_id=self.worker_id,
                released=False,
                reason=str(err),
            )
        return KvReleaseResult(
            migration_id=req.migration_id,
            worker_id=self.worker_id,
            released=got["released"],
            dropped_blocks=got["dropped_blocks"],
        )

    # ---- a pull at dispatch (target) ---------------------------------------------------------
    async def before_run(self, work: WorkerGenerate) -> None:
        """Before a first run starts here: wait for a copy of its prefix already on its way
        (another run's), or make the copy its ``PullHint`` asks for (``migration.pull``, as the
        replay does). Only with a NIXL pool; a copy that fails leaves the run to prefill."""
        if self.kv_transfer is None or work.output_offset:
            return
        tokens = work.request.token_ids or []
        hasher = self._hasher_for(work.request.cache_salt, work.request.lora_name)
        incoming = self._incoming_for(tokens, hasher)
        if incoming is not None:
            await asyncio.shield(incoming)
        elif work.pull is not None:
            with child_span(_tracer, "worker pull") as span:  # in the run's trace, if sampled
                await self._fetch(work.pull, work.request.request_id, tokens, hasher, span)

    def _hasher_for(self, salt: str | None, lora: str | None) -> BlockHasher:
        """Our hashes of a run's prompt, in the namespace its tenant salt and its LoRA adapter
        open (as the router hashed it for the hint)."""
        if salt or lora:
            return BlockHasher(self.block_size, kv_namespace(salt, lora))
        return self._hasher

    def _incoming_for(self, tokens: list[int], hasher: BlockHasher) -> asyncio.Future | None:
        """The copy under way here whose prefix the prompt starts with, if any (hashed only
        while copies are under way)."""
        if not self._incoming:
            return None
        size = self.block_size
        deepest = min(len(tokens) // size, max(blocks for blocks, _ in self._incoming))
        primary = hasher.hash_tokens(tokens[: deepest * size]).primary
        for (blocks, prefix_hash), done in self._incoming.items():
            if blocks <= deepest and primary[blocks - 1] == prefix_hash:
                return done
        return None

    async def _fetch(
        self,
        hint: PullHint,
        request_id: str,
        tokens: list[int],
        hasher: BlockHasher,
        span: Span = trace.INVALID_SPAN,
    ) -> None:
        """Copy what the source holds of the hinted prefix: all of it, or the chunks of it
        already computed there (the source offers the longest leading run it holds); within
        the hint's budget (the prefill it saves), else the run prefills."""
        key = (hint.blocks, hint.prefix_hash)
        loop = asyncio.get_running_loop()
        done = self._incoming[key] = loop.create_future()
        mid = f"pull-{request_id}-{uuid.uuid4().hex[:6]}"
        src = hint.source_worker
        budget = hint.budget_s or PULL_TIMEOUT_S
        deadline = loop.time() + budget
        offer: KvExportOffer | None = None
        outcome = "failed"
        try:
            hashes = hasher.hash_tokens(tokens[: hint.blocks * self.block_size])
            offer = await self._export_for(hint, mid, hashes, budget)
            left = deadline - loop.time()
            if not self._copyable(offer):
                why = offer.reason or f"{offer.blocks} of {hint.blocks} blocks, {offer.transport}"
                outcome = "refused"
                log.info("pull for %s from %s not made: %s", request_id, src, why)
                return
            if left <= 0:
                log.info("pull for %s from %s: its %.3f s budget spent", request_id, src, budget)
                return
            outcome = await self._copy(mid, src, offer, left)
        except (BusError, TimeoutError) as err:
            log.info("pull for %s from %s failed: %r", request_id, src, err)
        finally:
            self._count_pull(span, request_id, src, outcome, offer)
            del self._incoming[key]
            done.set_result(None)  # before any await: the runs waiting on it must not hang
            if offer is not None and offer.blocks > 0:
                await self._release_at(src, mid, hint.prefix_hash)

    async def _copy(self, mid: str, src: str, offer: KvExportOffer, left: float) -> str:
        """The offered blocks copied here within ``left`` seconds; the pull's outcome."""
        pull = KvPullRequest(migration_id=mid, source_worker=src, offer=offer, timeout_s=left)
        # the engine gives the import up at ``left``; the grace covers one that does not
        pulled = await asyncio.wait_for(self.pull(pull), left + PULL_GRACE_S)
        return "done" if pulled.ok else "failed"

    def _count_pull(
        self, span: Span, request_id: str, source: str, outcome: str, offer: KvExportOffer | None
    ) -> None:
        """A copy for a run ended: its outcome counted (the metric) and on its span."""
        self.pulls[outcome] += 1
        span.set_attributes({
            "thunderagent.request_id": request_id, "thunderagent.pull.source": source,
            "thunderagent.pull.outcome": outcome,
            "thunderagent.pull.blocks": offer.blocks if offer else 0,
        })  # fmt: skip

    async def _export_for(
        self, hint: PullHint, migration_id: str, hashes: BlockHashes, timeout_s: float
    ) -> KvExportOffer:
        """Ask the source for the hinted prefix, named by its whole chain (our hashes of the
        run's blocks), so it can offer the leading run it holds."""
        chain = hashes.primary
        export = KvExportRequest(
            migration_id=migration_id, prefix_hash=hint.prefix_hash, blocks=hint.blocks,
            chain=chain, hold_s=PULL_TIMEOUT_S,
        )  # fmt: skip
        subject = subjects.worker_kv_export(hint.source_worker)
        return await self.bus.request(subject, export, KvExportOffer, timeout=timeout_s)

    def _copyable(self, offer: KvExportOffer) -> bool:
        """Blocks this engine can NIXL-read as they are: a NIXL offer from a pool like ours."""
        same_pool = offer.block_bytes == (self.kv_transfer or {}).get("block_bytes")
        return offer.blocks > 0 and offer.transport == "nixl" and same_pool

    async def _release_at(self, source: str, migration_id: str, prefix_hash: int) -> None:
        release = KvRelease(migration_id=migration_id, prefix_hash=prefix_hash)
        try:
            await self.bus.request(subjects.worker_kv_release(source), release, KvReleaseResult,
                                   timeout=PULL_TIMEOUT_S)  # fmt: skip
        except BusError as err:  # the source unpins by itself after hold_s
            log.info("release of %s at %s failed: %s", migration_id, source, err)

    # ---- target --------------------------------------------------------------------------
    async def on_pull(self, req: KvPullRequest, delivery: Delivery) -> None:
        result = await self.pull(req)
        if delivery.reply:
            await self.bus.publish(delivery.reply, result)

    async def pull(self, req: KvPullRequest) -> KvPullResult:
        offer = req.offer
        if offer.blocks <= 0 or not offer.token_ids:
            return self._failed(req, "the offer holds no blocks")
        if offer.block_size != self.block_size:
            return self._failed(req, f"block size {offer.block_size} != ours {self.block_size}")
        try:
            if self.kv_transfer is not None and self._copyable(offer):
                return await self._pull_nixl(req)
            return await self._warm_up(req)
        except (EngineError, OSError, TimeoutError, aiohttp.ClientError) as err:
            return self._failed(req, f"engine: {err}")

    async def _pull_nixl(self, req: KvPullRequest) -> KvPullResult:
        offer = req.offer
        body = {
            "export_id": req.migration_id,
            "token_ids": offer.token_ids,
            "nixl_metadata": base64.b64encode(offer.nixl_metadata).decode(),
            "block_hashes": offer.block_hashes,
            "block_addrs": offer.block_addrs,
            "block_bytes": offer.block_bytes,
            "checksums": offer.checksums,
            "timeout_s": req.timeout_s,
            "cache_salt": offer.cache_salt,
            "lora_name": offer.lora_name,
        }
        got = await self._post("/kv/pull", body)
        return KvPullResult(
            migration_id=req.migration_id,
            worker_id=self.worker_id,
            ok=True,
            transport="nixl",
            moved_blocks=got["moved_blocks"],
            present_blocks=got["present_blocks"],
            bytes=got["bytes"],
            transfer_s=got["transfer_s"],
            verified=got["verified"],
        )

    async def _warm_up(self, req: KvPullRequest) -> KvPullResult:
        """Prefill the prefix here: one token out, the prompt's blocks stay cached."""
        started = time.perf_counter()
        rid = f"warmup-{req.migration_id}-{uuid.uuid4().hex[:6]}"
        meta: dict = {}
        offer = req.offer
        async for chunk in self.engine.generate(
            rid, offer.token_ids, {"max_new_tokens": 1},
            cache_salt=offer.cache_salt, lora_name=offer.lora_name,
        ):  # fmt: skip
            meta = chunk.meta or meta
        cached = int(meta.get("cached_tokens", 0))
        present = min(cached // self.block_size, req.offer.blocks)
        return KvPullResult(
            migration_id=req.migration_id,
            worker_id=self.worker_id,
            ok=True,
            transport="warmup",
            moved_blocks=req.offer.blocks - present,
            present_blocks=present,
            transfer_s=time.perf_counter() - started,
        )

    def _failed(self, req: KvPullRequest, reason: str) -> KvPullResult:
        log.warning("pull %s from %s failed: %s", req.migration_id, req.source_worker, reason)
        return KvPullResult(
            migration_id=req.migration_id, worker_id=self.worker_id, ok=False, reason=reason
        )

    async def _post(self, path: str, body: dict) -> dict:
        """POST to the engine; every failure (refusal, connection lost) is an EngineError."""
        try:
            async with self.engine.session.post(self.engine.base_url + path, json=body) as resp:
                text = await resp.text()
                status = resp.status
        except (aiohttp.ClientError, OSError, TimeoutError) as err:
            raise EngineError(0, f"{path}: {err!r}") from err
        try:
            got = json.loads(text)
        except ValueError:
            got = None
        if status != 200 or not isinstance(got, dict):
            error = got.get("error") if isinstance(got, dict) else None
            message = error.get("message") if isinstance(error, dict) else text[:300]
            raise EngineError(status, f"{path}: {message}")
        return got


def _b64(text: str) -> bytes:
    return base64.b64decode(text)
