"""Schedulers partitioned by model: each takes only its models' submissions, workers and
credit; the router adds their credits up; requests of both models complete, none is seen by
the other model's scheduler."""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.inproc import MODEL, inproc_stack, start_full_stack
from thunderagent.client import ThunderClient
from thunderagent.scheduler.service import SchedulerConfig, SchedulerService
from thunderagent.schemas import GenerateRequest

pytestmark = pytest.mark.integration

OTHER = "sim/other-model"


async def test_two_schedulers_each_own_a_model(nats_server):
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=4, models=[MODEL, MODEL, OTHER, OTHER],
                               scheduler_config={"models": (MODEL,)})  # fmt: skip
        other = SchedulerConfig(scheduler="thunder", models=(OTHER,))
        await stack.start_service(
            "scheduler-other",
            lambda ctx, service: service.run_service(ctx),
            build=lambda ctx: SchedulerService(other, ctx.bus),
        )
        mine = stack.services["scheduler"].runtime
        theirs = stack.services["scheduler-other"].runtime
        router = stack.services["router"].runtime.router
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + 10
        while len(router.wallet.grants) < 2:  # both schedulers lend the router room
            assert loop.time() < give_up_at, router.wallet.grants
            await asyncio.sleep(0.05)
        assert set(router.wallet.credits) == {"w0", "w1", "w2", "w3"}
        client = await ThunderClient.connect(nats_server.url, idle_timeout_s=20)
        seen = {MODEL: set(), OTHER: set()}
        for i in range(12):
            model = (MODEL, OTHER)[i % 2]
            # a program id keeps each request on the scheduler's queue (no credit fast path)
            req = GenerateRequest(model=model, token_ids=[5, i, 7] * 8, max_tokens=2,
                                  program_id=f"p{i}" if i < 6 else None)  # fmt: skip
            done = await client.generate(req)
            seen[model].add(done.final.worker_id)
        await client.close()
    assert seen[MODEL] and seen[MODEL] <= {"w0", "w1"}, "each model ran on its own workers"
    assert seen[OTHER] and seen[OTHER] <= {"w2", "w3"}
    assert set(mine.core.rooms()) <= {"w0", "w1"}, "a scheduler schedules only its workers"
    assert set(theirs.core.rooms()) <= {"w2", "w3"}
    assert len(mine.finished) == 6
    assert len(theirs.finished) == 6, "each scheduler saw exactly its model's six requests"
