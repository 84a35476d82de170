"""KV export and import between simulated engines over their NIXL-registered pools.

Not an SGLang API: SGLang moves KV between engines inside its PD disaggregation (see
docs/migration.md). These endpoints are what the worker adapter's migration handlers call:

* ``POST /kv/export``  ``{export_id, block_hashes, hold_s}``: pin the leading cached run of these
  blocks, answer with their tokens, the pool's NIXL metadata, each block's address and checksum.
  The pin lapses after ``hold_s`` unless released first.
* ``POST /kv/release`` ``{export_id, block_hashes, drop}``: unpin an export; ``drop`` also frees
  the blocks nobody else uses (a migration's last step, with what hangs below the prefix), or,
  without an export, a replica dropped on its own (only when no cached prompt extends it).
* ``POST /kv/pull`` ``{export_id, token_ids, block_hashes, nixl_metadata, block_addrs,
  block_bytes, checksums, timeout_s, cache_salt, lora_name}``: reserve room, NIXL-read the
  missing blocks into staged slots, check each block's checksum, then insert the prefix
  (``BlockStored`` follows through the normal event path, naming the tenant salt and LoRA
  adapter the blocks belong to, as the source cached them; an adapter not loaded here is
  refused). Any failure gives everything back: no half-inserted prefix.
* ``GET /kv/status``: exports and imports in flight, pool occupancy, blocks filled by prefill
  and blocks / bytes pulled over NIXL.

Cache changes run between engine steps (``EngineDriver.between_steps``) so their events keep
their order; the copy itself runs while the engine keeps stepping.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from thunderagent.sglang import kv_wire
from thunderagent.simengine.kv_pool import KvPool, TransferFailed
from thunderagent.simengine.salts import CacheNamespace, cache_namespace

if TYPE_CHECKING:
    from thunderagent.simengine.driver import EngineDriver

log = logging.getLogger(__name__)


class MoveError(Exception):
    """A bad or impossible export/import, with the HTTP status to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(slots=True)
class _Export:
    keys: list[int]
    timer: asyncio.TimerHandle


@dataclass(slots=True)
class _Import:
    keys: list[int]
    present: int | None = None
    """Leading blocks already cached here (pinned); None: nothing held for this import."""
    slots: list[int] = field(default_factory=list)


class KvMover:
    def __init__(
        self,
        engine: EngineDriver,
        pool: KvPool,
        *,
        pace_bytes_per_s: float | None = None,
        lora_adapters: Collection[str] = (),
    ) -> None:
        self.engine = engine
        self.pool = pool
        self.lora_adapters = frozenset(lora_adapters)
        """Adapters loaded here: an import of another adapter's blocks is refused, as a request
        naming it would be."""
        self.pace_bytes_per_s = pace_bytes_per_s
        """Model a slower link than NIXL's loopback copy (None: full speed)."""
        self.exports: dict[str, _Export] = {}
        self.imports: dict[str, _Import] = {}
        self._tasks: set[asyncio.Task] = set()

    def info(self) -> dict[str, Any]:
        """What ``/server_info`` reports as ``kv_transfer`` (the adapter's capability check)."""
        return {
            "backend": "nixl",
            "agent": self.pool.name,
            "block_bytes": self.pool.slot_bytes,
            "slots": self.pool.slots,
        }

    def status(self) -> dict[str, Any]:
        return {
            "exports": len(self.exports),
            "imports": len(self.imports),
            "slots": self.pool.slots,
            "used_slots": self.pool.used,
            "filled_blocks": self.pool.stats.filled_blocks,
            "pulled_blocks": self.pool.stats.pulled_blocks,
            "pulled_bytes": self.pool.stats.pulled_bytes,
            "failed_pulls": self.pool.stats.failed_pulls,
        }

    # ---- export --------------------------------------------------------------------------
    async def export(self, export_id: str, keys: list[int], hold_s: float) -> dict[str, Any]:
        if export_id in self.exports:
            raise MoveError(409, f"export {export_id!r} already exists")
        core, pool = self.engine.core, self.pool

        def pin() -> list[int] | None:
            pinned, tokens = core.pin_prefix(keys)
            slots = [pool.slot_of.get(k) for k in pinned]
            if not pinned or None in slots:
                if pinned:
                    core.unpin_prefix(pinned)
                return None
            timer = asyncio.get_running_loop().call_later(hold_s, self._expire, export_id)
            self.exports[export_id] = _Export(pinned, timer)
            return [pinned, tokens, slots]

        pinned = await self.engine.between_steps(pin)
        if pinned is None:
            raise MoveError(404, "the prefix is not cached here (or has no bytes to send)")
        keys, tokens, slots = pinned
        return {
            "blocks": len(slots),
            "block_size": self.engine.block_size,
            "block_hashes": keys,
            "token_ids": tokens,
            "nixl_agent": pool.name,
            "nixl_metadata": base64.b64encode(pool.metadata).decode(),
            "block_addrs": [pool.addr(s) for s in slots],
            "block_bytes": pool.slot_bytes,
            "checksums": [pool.checksum(s) for s in slots],
        }

    def _expire(self, export_id: str) -> None:
        log.warning("export %s was not released in time: unpinning it", export_id)
        task = asyncio.create_task(self.release(export_id, [], drop=False))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def release(self, export_id: str, keys: list[int], *, drop: bool) -> dict[str, Any]:
        core = self.engine.core

        def unpin() -> dict[str, Any]:
            export = self.exports.pop(export_id, None) if export_id else None
            if export is not None:
                export.timer.cancel()
                return {
                    "released": True,
                    "dropped_blocks": core.unpin_prefix(export.keys, drop=drop),
                }
            # a Drop (no export): a replica gone cold; prompts built on it keep it
            dropped = core.cache.discard(list(keys), extensions=False) if drop and keys else 0
            return {"released": False, "dropped_blocks": dropped}

        return await self.engine.between_steps(unpin)

    # ---- import --------------------------------------------------------------------------
    async def pull(self, body: dict[str, Any]) -> dict[str, Any]:
        space = self._namespace(body)
        export_id, tokens, keys, addrs, sums, metadata, timeout_s = self._check_pull(body, space)
        if export_id in self.imports:
            raise MoveError(409, f"import {export_id!r} is already running")
        record = self.imports[export_id] = _Import(keys)
        if space is not None:  # the events of the blocks it stores name their namespace
            self.engine.salts.hold(keys, space)
        try:
            return await self._pull(record, tokens, addrs, sums, metadata, timeout_s)
        finally:
            if space is not None:
                self.engine.salts.release(keys, self.engine.core.cache.__contains__)
            self._give_back(record)
            self.imports.pop(export_id, None)

    async def _pull(self, record: _Import, tokens, addrs, sums, metadata, timeout_s) -> dict:
        core, pool, keys = self.engine.core, self.pool, record.keys

        def begin() -> int | None:
            present = core.begin_import(keys)
            if present is None:
                return None
            slots = pool.stage(len(keys) - present)
            if slots is None:
                core.abort_import(keys, present)
                return None
            record.present, record.slots = present, slots
            return present

        present = await self.engine.between_steps(begin)
        if present is None:
            raise MoveError(507, f"no room for {len(keys)} blocks in the KV cache")
        seconds = await self._read_verified(record, present, addrs, sums, metadata, timeout_s)
        moved = len(record.slots)

        def commit() -> None:
            core.commit_import(keys, present, tokens)
            pool.adopt(keys[present:], record.slots)
            record.present, record.slots = None, []

        await self.engine.between_steps(commit)
        return {
            "moved_blocks": moved,
            "present_blocks": present,
            "bytes": moved * pool.slot_bytes,
            "transfer_s": seconds,
            "verified": True,
        }

    async def _read_verified(
        self, record: _Import, present: int, addrs, sums, metadata, timeout_s
    ) -> float:
        """Copy the blocks missing here into the staged slots; its seconds, once every checksum
        matches the source's."""
        pool = self.pool
        try:
            seconds = await pool.read(
                metadata,
                addrs[present:],
                record.slots,
                timeout_s=timeout_s,
                pace_bytes_per_s=self.pace_bytes_per_s,
            )
        except TransferFailed as err:
            raise MoveError(502, str(err)) from err
        bad = [i for i, s in enumerate(record.slots) if pool.checksum(s) != sums[present + i]]
        if bad:
            raise MoveError(502, f"{len(bad)} blocks differ from the source's (first: {bad[0]})")
        return seconds

    def _namespace(self, body: Any) -> CacheNamespace | None:
        """The (tenant salt, LoRA adapter) the pulled blocks are cached under at the source."""
        if not isinstance(body, dict):
            raise MoveError(400, "body must be a JSON object")
        salt, lora = body.get("cache_salt"), body.get("lora_name")
        if not all(x is None or isinstance(x, str) for x in (salt, lora)):
            raise MoveError(400, "cache_salt and lora_name must be strings")
        if lora and lora not in self.lora_adapters:
            raise MoveError(400, f"LoRA adapter {lora!r} is not loaded here")
        return cache_namespace(salt, lora)

    def _give_back(self, record: _Import) -> None:
        """Undo a failed or cancelled import at once (no events: unreserve and unpin only)."""
        if record.present is None:
            return
        self.pool.unstage(record.slots)
        self.engine.give_back_import(record.keys, record.present)
        record.present, record.slots = None, []

    def _check_pull(self, body: dict[str, Any], space: CacheNamespace | None) -> tuple:
        try:
            tokens = [int(t) for t in body["token_ids"]]
            addrs = [int(a) for a in body["block_addrs"]]
            sums = [int(c) for c in body["checksums"]]
            metadata = base64.b64decode(body["nixl_metadata"])
            block_bytes = int(body["block_bytes"])
            export_id = str(body["export_id"])
            keys = [int(k) for k in body.get("block_hashes") or []]
            timeout_s = float(body.get("timeout_s", 60.0))
        except (KeyError, TypeError, ValueError) as err:
            raise MoveError(400, f"bad pull request: {err!r}") from err
        size = self.engine.block_size
        blocks = len(addrs)
        if block_bytes != self.pool.slot_bytes:
            raise MoveError(400, f"block_bytes {block_bytes} != this pool's {self.pool.slot_bytes}")
        if not blocks or len(sums) != blocks or len(tokens) != blocks * size:
            raise MoveError(400, f"{blocks} blocks, {len(sums)} checksums, {len(tokens)} tokens "
                                 f"(block size {size}) do not agree")  # fmt: skip
        if not keys:
            keys = kv_wire.sglang_block_hashes(tokens, size, space and space.seed())
        if len(keys) != blocks:
            raise MoveError(400, f"{len(keys)} block hashes for {blocks} blocks")
        return export_id, tokens, keys, addrs, sums, metadata, timeout_s

    # ---- HTTP ----------------------------------------------------------------------------
    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/kv/export", self._http_export)
        app.router.add_post("/kv/release", self._http_release)
        app.router.add_post("/kv/pull", self._http_pull)
        app.router.add_get("/kv/status", self._http_status)

    async def _http_export(self, request: web.Request) -> web.Response:
        return await _answer(request, self._export_body)

    async def _export_body(self, body: dict) -> dict:
        keys = [int(k) for k in body.get("block_hashes") or []]
        if not keys:
            raise MoveError(400, "block_hashes must be a non-empty list")
        return await self.export(str(body.get("export_id", "")), keys,
                                 float(body.get("hold_s", 30.0)))  # fmt: skip

    async def _http_release(self, request: web.Request) -> web.Response:
        async def run(body: dict) -> dict:
            keys = [int(k) for k in body.get("block_hashes") or []]
            return await self.release(str(body.get("export_id", "")), keys,
                                      drop=bool(body.get("drop")))  # fmt: skip

        return await _answer(request, run)

    async def _http_pull(self, request: web.Request) -> web.Response:
        return await _answer(request, self.pull)

    async def _http_status(self, _: web.Request) -> web.Response:
        return web.json_response(self.status())

    async def close(self) -> None:
        for export in self.exports.values():
            export.timer.cancel()
        for task in list(self._tasks):
            task.cancel()
        self.pool.close()


async def _answer(request: web.Request, handler) -> web.Response:
    try:
        body = await request.json()
    except ValueError as err:
        return _error(400, f"body is not JSON: {err}")
    if not isinstance(body, dict):
        return _error(400, "body must be a JSON object")
    try:
        return web.json_response(await handler(body))
    except MoveError as err:
        return _error(err.status, str(err))
    except (TypeError, ValueError) as err:
        return _error(400, f"bad request: {err}")


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)
