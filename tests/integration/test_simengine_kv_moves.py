"""KV moves between two simulated engines over their NIXL-registered host pools, through the
engines' own HTTP endpoints (no NATS): bytes arrive equal, a failed pull leaves nothing behind,
an export that is never released unpins itself."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from tests.integration.inproc import serve_engine
from tests.integration.migration_stack import skip_without_nixl
from thunderagent.engine import get_profile
from thunderagent.simengine.driver import EngineDriver
from thunderagent.simengine.kv_pool import KvPool, pool_for
from thunderagent.simengine.salts import cache_namespace
from thunderagent.simengine.server import EngineInfo

skip_without_nixl()

pytestmark = pytest.mark.integration
BLOCK = 16
PROFILE = get_profile("tiny").with_engine(block_size=BLOCK, kv_blocks_override=32)


@dataclass
class Engine:
    driver: EngineDriver
    url: str
    runner: web.AppRunner

    @property
    def pool(self):
        return self.driver.kv_pool

    def slot_bytes(self, key: int) -> np.ndarray:
        return self.pool.view(self.pool.slot_of[key]).copy()


@contextlib.asynccontextmanager
async def engines(n: int = 2) -> AsyncIterator[list[Engine]]:
    out: list[Engine] = []
    try:
        for _ in range(n):
            driver = EngineDriver(PROFILE, kv_pool=pool_for(PROFILE))
            runner, port = await serve_engine(driver, EngineInfo("m", BLOCK))
            out.append(Engine(driver, f"http://127.0.0.1:{port}", runner))
        yield out
    finally:
        for e in out:
            await e.runner.cleanup()
            await e.driver.close()


def prefix(blocks: int, seed: int = 1) -> list[int]:
    return [(seed * 131 + i) % 30_000 + 4 for i in range(blocks * BLOCK)]


async def post(url: str, path: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
        return r.status, await r.json()


def pull_body(offer: dict, export_id: str = "m1") -> dict:
    return {"export_id": export_id, "timeout_s": 10, **offer}


async def test_a_pulled_prefix_arrives_byte_equal_and_is_cached() -> None:
    async with engines() as (src, dst):
        tokens = prefix(8)
        src.driver.import_kv(tokens)
        keys = [k for k in src.pool.slot_of]
        assert len(keys) == 8
        code, offer = await post(src.url, "/kv/export", {"export_id": "m1", "block_hashes": keys})
        assert code == 200 and offer["blocks"] == 8 and offer["token_ids"] == tokens
        assert [src.driver.core.cache.refcount(k) for k in keys] == [1] * 8
        code, result = await post(dst.url, "/kv/pull", pull_body(offer))
        assert code == 200, result
        assert result["moved_blocks"] == 8 and result["present_blocks"] == 0
        assert result["bytes"] == 8 * dst.pool.slot_bytes and result["verified"]
        assert set(dst.driver.core.cache.contents()) == set(keys)
        for key in keys:  # the very bytes, and the checksum every engine agrees on
            assert np.array_equal(dst.slot_bytes(key), src.slot_bytes(key))
            assert dst.pool.checksum(dst.pool.slot_of[key]) == src.pool.expected_checksum(key)
        assert dst.driver.core.cache.reserved == 0
        code, rel = await post(src.url, "/kv/release", {"export_id": "m1", "drop": True})
        assert code == 200 and rel == {"released": True, "dropped_blocks": 8}
        assert src.driver.core.cache.contents() == {} and src.pool.used == 0


async def test_a_pull_in_a_namespace_names_it_and_an_unloaded_adapter_is_refused() -> None:
    """A tenant's blocks land under the source's keys and stay the tenant's: the target's
    events for them name the salt. An adapter this engine has not loaded is refused (as a
    request naming it would be), and nothing is reserved."""
    async with engines() as (src, dst):
        tokens = prefix(3, seed=5)
        src.driver.import_kv(tokens, cache_namespace("tenant-a", None))
        keys = list(src.pool.slot_of)
        _, offer = await post(src.url, "/kv/export", {"export_id": "n1", "block_hashes": keys})
        code, result = await post(dst.url, "/kv/pull",
                                  pull_body(offer, "n1") | {"lora_name": "sql"})  # fmt: skip
        assert code == 400 and "'sql' is not loaded" in result["error"]["message"]
        assert dst.driver.core.cache.contents() == {} and dst.driver.core.cache.reserved == 0
        code, result = await post(dst.url, "/kv/pull",
                                  pull_body(offer, "n2") | {"cache_salt": "tenant-a"})  # fmt: skip
        assert code == 200 and result["moved_blocks"] == 3, result
        assert set(dst.driver.core.cache.contents()) == set(keys)
        assert all(dst.driver.salts.salt_of(k) == ("tenant-a", None) for k in keys)


async def test_blocks_the_target_already_has_are_not_copied_again() -> None:
    async with engines() as (src, dst):
        tokens = prefix(6)
        src.driver.import_kv(tokens)
        dst.driver.import_kv(tokens[: 2 * BLOCK])
        keys = list(src.pool.slot_of)
        _, offer = await post(src.url, "/kv/export", {"export_id": "m2", "block_hashes": keys})
        code, result = await post(dst.url, "/kv/pull", pull_body(offer, "m2"))
        assert code == 200, result
        assert (result["present_blocks"], result["moved_blocks"]) == (2, 4)
        assert set(dst.driver.core.cache.contents()) == set(keys)
        code, rel = await post(src.url, "/kv/release", {"export_id": "m2"})
        assert rel == {"released": True, "dropped_blocks": 0}
        assert [src.driver.core.cache.refcount(k) for k in keys] == [0] * 6


async def test_a_corrupted_block_fails_the_pull_and_leaves_nothing_behind() -> None:
    async with engines() as (src, dst):
        tokens = prefix(5)
        src.driver.import_kv(tokens)
        dst.driver.import_kv(tokens[:BLOCK])
        keys = list(src.pool.slot_of)
        _, offer = await post(src.url, "/kv/export", {"export_id": "m3", "block_hashes": keys})
        src.pool.view(src.pool.slot_of[keys[3]])[100] ^= 0xFF  # flipped after the checksum
        before = dst.driver.core.cache.contents()
        used = dst.pool.used
        code, result = await post(dst.url, "/kv/pull", pull_body(offer, "m3"))
        assert code == 502 and "differ" in result["error"]["message"]
        assert dst.driver.core.cache.contents() == before
        assert dst.driver.core.cache.reserved == 0 and dst.pool.used == used
        assert dst.driver.core.cache.refcount(keys[0]) == 0


async def test_an_unreachable_source_fails_the_pull_cleanly() -> None:
    async with engines() as (src, dst):
        src.driver.import_kv(prefix(4))
        keys = list(src.pool.slot_of)
        _, offer = await post(src.url, "/kv/export", {"export_id": "m4", "block_hashes": keys})
        offer["block_addrs"] = [1 << 40] * 4  # outside anything the source registered
        code, result = await post(dst.url, "/kv/pull", pull_body(offer, "m4"))
        assert code == 502, result
        assert dst.driver.core.cache.contents() == {} and dst.pool.used == 0
        assert dst.driver.core.cache.reserved == 0


async def test_an_export_nobody_releases_unpins_itself() -> None:
    async with engines(1) as (src,):
        src.driver.import_kv(prefix(3))
        keys = list(src.pool.slot_of)
        body = {"export_id": "m5", "block_hashes": keys, "hold_s": 0.05}
        code, _ = await post(src.url, "/kv/export", body)
        assert code == 200
        assert src.driver.core.cache.refcount(keys[0]) == 1
        for _ in range(100):
            if src.driver.core.cache.refcount(keys[0]) == 0:
                break
            await asyncio.sleep(0.02)
        assert [src.driver.core.cache.refcount(k) for k in keys] == [0, 0, 0]
        code, result = await post(src.url, "/kv/export", {"export_id": "x", "block_hashes": [7]})
        assert code == 404 and "not cached" in result["error"]["message"]


async def test_a_drop_frees_a_cold_replica_but_not_one_other_prompts_extend() -> None:
    """``/kv/release`` without an export: the planner's Drop of a replica gone cold."""
    async with engines(1) as (eng,):
        eng.driver.import_kv(prefix(4))
        keys = list(eng.pool.slot_of)
        body = {"block_hashes": keys[:2], "drop": True}  # the replica: two blocks, two extend it
        code, rel = await post(eng.url, "/kv/release", body)
        assert code == 200 and rel == {"released": False, "dropped_blocks": 0}
        assert set(eng.driver.core.cache.contents()) == set(keys)
        code, rel = await post(eng.url, "/kv/release", {"block_hashes": keys, "drop": True})
        assert code == 200 and rel == {"released": False, "dropped_blocks": 4}
        assert eng.driver.core.cache.contents() == {} and eng.pool.used == 0


def test_an_idle_pool_leaves_the_cpu_alone() -> None:
    """NIXL's progress thread, started by its Python wrapper without a wait between rounds,
    spun a whole core per engine with nothing to move. The pool's agent waits between rounds:
    idle for 1.5 s, this process uses a small part of one core (it used all of it before)."""
    pool = KvPool(16, 4096)
    try:
        time.sleep(0.2)  # the agent's start
        before = time.process_time()
        time.sleep(1.5)
        assert time.process_time() - before < 0.5
    finally:
        pool.close()
