"""SGLang's PD as the simulated engines play it, through their own HTTP endpoints (no NATS):
the decode engine reserves the prompt's pages before the prefill engine may start (a full
decode pool holds the prefill back), and every wait ends: a decode side that never comes, a
decode pool that never has room, an abort during the bootstrap."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest
from aiohttp import web

from tests.integration.inproc import serve_engine
from thunderagent.embedded import free_port
from thunderagent.engine import get_profile
from thunderagent.simengine import pd_bootstrap, server
from thunderagent.simengine.driver import EngineDriver, GenerateInput
from thunderagent.simengine.pd_bootstrap import reserved_decode_tokens
from thunderagent.simengine.pd_pages import KvNotReserved, release_kv, reserve_kv
from thunderagent.simengine.server import EngineInfo

pytestmark = pytest.mark.integration
BLOCK = 16
PROFILE = get_profile("tiny").with_engine(block_size=BLOCK, kv_blocks_override=32)


@dataclass
class Engine:
    driver: EngineDriver
    url: str
    port: int
    runner: web.AppRunner


@contextlib.asynccontextmanager
async def pd_pair(
    reserved: int = 0, link_bytes_per_s: float = 25e9
) -> AsyncIterator[tuple[Engine, Engine]]:
    """A prefill engine and a decode engine (32 blocks of 16 tokens each), 20 x real time."""
    out: list[Engine] = []
    try:
        for mode in ("prefill", "decode"):
            driver = EngineDriver(PROFILE, speedup=20.0, link_bytes_per_s=link_bytes_per_s)
            info = EngineInfo("m", BLOCK)
            info.disaggregation_mode, info.reserved_decode_tokens = mode, reserved
            port = free_port()
            info.bootstrap_port = port if mode == "prefill" else 0
            runner, port = await serve_engine(driver, info, port)
            out.append(Engine(driver, f"http://127.0.0.1:{port}", port, runner))
        yield out[0], out[1]
    finally:
        for e in out:
            await e.runner.cleanup()
            await e.driver.close()


def paired(prefill: Engine, rid: str, blocks: int, max_new: int = 4) -> dict:
    rng = random.Random(rid)
    return {
        "rid": rid,
        "input_ids": [rng.randrange(4, 30_000) for _ in range(blocks * BLOCK + 3)],
        "sampling_params": {"max_new_tokens": max_new},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": prefill.port,
        "bootstrap_room": rng.getrandbits(63),
    }


async def post(url: str, body: dict, path: str = "/generate") -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
        return r.status, await r.json(content_type=None)


async def test_a_full_decode_pool_holds_the_prefill_until_it_has_room() -> None:
    async with pd_pair() as (pre, dec):
        # 28 of the decode engine's 32 blocks taken by a transfer in flight
        held = await reserve_kv(dec.driver, list(range(4, 4 + 28 * BLOCK)), None, 0, 1.0)
        body = paired(pre, "r1", blocks=10)
        both = asyncio.gather(post(pre.url, body), post(dec.url, body))
        await asyncio.sleep(0.3)
        # no room on the decode side: it has not bootstrapped the room, so nothing prefills
        assert not pre.driver.core.has_work and not pre.driver.core.cache.contents()
        assert not both.done()
        release_kv(dec.driver, held)
        (p_status, p_body), (d_status, d_body) = await asyncio.wait_for(both, 10)
    assert p_status == d_status == 200, (p_body, d_body)
    assert len(p_body["output_ids"]) == 1  # the prefill engine's answer is its first token
    assert len(d_body["output_ids"]) == 4  # the decode engine streams the whole answer
    assert d_body["meta_info"]["cached_tokens"] == 10 * BLOCK  # the transferred prompt


async def test_the_decode_engine_keeps_room_for_the_requests_it_holds() -> None:
    # 512 tokens kept per request held: with one transfer in flight (32 blocks of room
    # wanted) a 10-block prompt cannot be reserved on this 32-block pool until it lands
    async with pd_pair(reserved=512) as (_, dec):
        first = await reserve_kv(dec.driver, list(range(4, 4 + 2 * BLOCK)), None, 512, 1.0)
        with pytest.raises(KvNotReserved, match="keeps 512 tokens"):
            await reserve_kv(dec.driver, list(range(9_000, 9_000 + 10 * BLOCK)), None, 512, 0.2)
        assert dec.driver.core.imports_pending == 1  # the refused one reserved nothing
        release_kv(dec.driver, first)
        ok = await reserve_kv(dec.driver, list(range(9_000, 9_000 + 10 * BLOCK)), None, 512, 0.2)
        assert ok.present == 0 and len(ok.keys) == 10
        release_kv(dec.driver, ok)
        assert dec.driver.core.imports_pending == 0 and dec.driver.core.cache.reserved == 0


async def test_a_decode_pool_that_never_has_room_answers_503_and_keeps_nothing(
    monkeypatch,
) -> None:
    monkeypatch.setattr(server, "WAIT_S", 0.3)
    monkeypatch.setattr(pd_bootstrap, "WAIT_S", 0.3)
    async with pd_pair() as (pre, dec):
        held = await reserve_kv(dec.driver, list(range(4, 4 + 30 * BLOCK)), None, 0, 1.0)
        body = paired(pre, "r2", blocks=10)
        (p_status, p_body), (d_status, d_body) = await asyncio.gather(
            post(pre.url, body), post(dec.url, body)
        )
        assert d_status == 503 and "no room for 10 KV blocks" in d_body["error"]["message"]
        # its prefill never started: the decode side never asked for the room
        assert p_status == 502
        assert "no decode engine bootstrapped room" in p_body["error"]["message"]
        assert not pre.driver.core.cache.contents()
        assert dec.driver.core.imports_pending == 1  # only the test's own reservation
        release_kv(dec.driver, held)


async def test_an_abort_ends_a_prefill_waiting_for_its_decode_side() -> None:
    async with pd_pair() as (pre, _):
        body = paired(pre, "r3", blocks=4)
        waiting = asyncio.ensure_future(post(pre.url, body))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        started = time.monotonic()
        status, _ = await post(pre.url, {"rid": "r3"}, path="/abort_request")
        assert status == 200
        status, answer = await asyncio.wait_for(waiting, 5)
        assert time.monotonic() - started < 2
    assert status == 502 and "aborted during its PD bootstrap" in answer["error"]["message"]
    assert not pre.driver.core.cache.contents()


async def test_the_prefill_engine_keeps_the_pages_it_hands_over_while_they_are_copied() -> None:
    # 10 blocks of 64 KiB at 100 kB/s: a 6.5 s copy, 0.33 s at 20 x
    async with pd_pair(link_bytes_per_s=1e5) as (pre, dec):
        body = paired(pre, "r5", blocks=10)
        prefill = asyncio.ensure_future(post(pre.url, body))
        decode = asyncio.ensure_future(post(dec.url, body))
        status, _ = await asyncio.wait_for(prefill, 5)  # its first token: the prompt is computed
        await asyncio.sleep(0.05)
        assert status == 200 and not decode.done()
        assert pre.driver.core.cache.pinned == 10  # the copy's source, kept while it lasts
        status, answer = await asyncio.wait_for(decode, 10)
        assert status == 200 and answer["meta_info"]["cached_tokens"] == 10 * BLOCK
        await asyncio.sleep(0.1)
        assert pre.driver.core.cache.pinned == 0  # freed once copied, still cached
        assert len(pre.driver.core.cache.contents()) >= 10


def test_reserved_decode_tokens_is_read_as_sglang_reads_it() -> None:
    assert reserved_decode_tokens({}) == 512
    assert reserved_decode_tokens({"SGLANG_NUM_RESERVED_DECODE_TOKENS": "64"}) == 64
    with pytest.raises(ValueError, match="must be an integer"):
        reserved_decode_tokens({"SGLANG_NUM_RESERVED_DECODE_TOKENS": "lots"})
    with pytest.raises(ValueError, match=">= 0"):
        reserved_decode_tokens({"SGLANG_NUM_RESERVED_DECODE_TOKENS": "-1"})


async def test_an_abort_gives_back_what_a_waiting_decode_side_reserved(monkeypatch) -> None:
    monkeypatch.setattr(pd_bootstrap, "WAIT_S", 1.0)  # the registry's own wait, at shutdown
    async with pd_pair() as (pre, dec):
        # the prefill engine never gets this request: the decode side reserves, then waits at
        # the prefill engine's registry for a prefill that does not come
        body = paired(pre, "r4", blocks=6)
        waiting = asyncio.ensure_future(post(dec.url, body))
        await asyncio.sleep(0.3)
        assert dec.driver.core.imports_pending == 1 and dec.driver.core.cache.reserved == 6
        status, _ = await post(dec.url, {"rid": "r4"}, path="/abort_request")
        status, answer = await asyncio.wait_for(waiting, 5)
        assert status == 502 and "aborted during its PD bootstrap" in answer["error"]["message"]
        assert dec.driver.core.imports_pending == 0 and dec.driver.core.cache.reserved == 0
        assert not dec.driver.core.has_work and not dec.driver.core.cache.contents()


async def test_an_engine_out_of_pages_waits_for_the_import_without_spinning() -> None:
    driver = EngineDriver(PROFILE, speedup=20.0)
    try:
        # 10 prompt blocks + 300 tokens out (~29 blocks in all) on a 32-block pool
        request = GenerateInput("g", list(range(4, 4 + 10 * BLOCK)), 300)
        events = driver.generate(request)
        await anext(events)
        held = await reserve_kv(driver, list(range(9_000, 9_000 + 20 * BLOCK)), None, 0, 1.0)
        drained = asyncio.ensure_future(_drain(events))
        await asyncio.sleep(0.3)
        cpu = time.process_time()
        await asyncio.sleep(0.5)  # the decode cannot get a page: retracted, the engine stalls
        assert not drained.done()
        # waiting, not spinning: a spinning engine thread burns ~0.5 s of CPU here; the
        # process's other threads took up to 0.103 s on a loaded 2-core VM (stop 67)
        assert time.process_time() - cpu < 0.25
        release_kv(driver, held)
        last = await asyncio.wait_for(drained, 10)
        assert last.finished and last.completion_tokens == 300
    finally:
        await driver.close()


async def _drain(events):
    last = None
    async for event in events:
        last = event
    return last
