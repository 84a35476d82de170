"""An engine client's views of data-parallel ranks: each names its rank in what it sends, and
their load polls share one request to the engine (its answer holds every rank)."""

from __future__ import annotations

import asyncio

import pytest

from thunderagent.worker.engine_client import EngineClient


def test_a_rank_view_names_its_rank_and_the_engine_view_names_none() -> None:
    engine = EngineClient("http://127.0.0.1:30000")
    rank = engine.for_rank(3)
    assert rank._ranked({"rid": "r"}) == {"rid": "r", "data_parallel_rank": 3}
    assert engine._ranked({"rid": "r"}) == {"rid": "r"}
    assert rank.base_url == engine.base_url and engine.dp_rank is None


async def test_rank_views_asking_together_send_one_request() -> None:
    engine = EngineClient("http://127.0.0.1:30000")
    sent: list[str] = []

    async def get_json(path: str) -> dict:
        sent.append(path)
        await asyncio.sleep(0.01)
        if path == "/broken":
            raise ConnectionError("engine away")
        return {"loads": [{"dp_rank": 0}, {"dp_rank": 1}]}

    engine.get_json = get_json  # type: ignore[method-assign]
    ranks = [engine.for_rank(r) for r in range(4)]
    answers = await asyncio.gather(*(r.get_shared("/v1/loads", 0.1) for r in ranks))
    assert len(sent) == 1 and all(a == answers[0] for a in answers)
    await asyncio.sleep(0.15)  # older than fresh_s: asked again
    await ranks[0].get_shared("/v1/loads", 0.1)
    assert len(sent) == 2
    failed = await asyncio.gather(
        *(r.get_shared("/broken", 0.1) for r in ranks), return_exceptions=True
    )
    assert sent.count("/broken") == 1 and all(isinstance(e, ConnectionError) for e in failed)


async def test_a_cancelled_poll_leaves_the_others_their_answer() -> None:
    engine = EngineClient("http://127.0.0.1:30000")
    release = asyncio.Event()

    async def get_json(path: str) -> dict:
        await release.wait()
        return {"ok": True}

    engine.get_json = get_json  # type: ignore[method-assign]
    first = asyncio.create_task(engine.for_rank(0).get_shared("/v1/loads", 1.0))
    second = asyncio.create_task(engine.for_rank(1).get_shared("/v1/loads", 1.0))
    await asyncio.sleep(0)
    first.cancel()
    release.set()
    assert await second == {"ok": True}
    with pytest.raises(asyncio.CancelledError):
        await first
