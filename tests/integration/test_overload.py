"""A router in front of a scheduler that acks late: past its bound on hand-offs in flight it
answers ``overloaded`` at once, unrouted, with a retry hint; a client's resend is never refused;
what it took runs to the end; and once acks are fast again it takes everything. Each router's
bound and the hand-offs it waits on are on its /metrics."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.integration.inproc import MODEL, inproc_stack, start_full_stack
from tests.integration.metrics_probe import scrape_after
from tests.integration.test_kv_routing import wait_for
from thunderagent.client import RequestFailed, ThunderClient
from thunderagent.scheduler.service import SchedulerConfig, SchedulerService
from thunderagent.scheduling.handoff_limit import HandoffLimit
from thunderagent.schemas import ErrorCode, GenerateRequest

pytestmark = pytest.mark.integration


class LateScheduler(SchedulerService):
    """The real scheduler, its acks held back ``delay_s`` (a starved process's)."""

    delay_s = 0.0

    async def on_submit(self, submit, delivery) -> None:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        await super().on_submit(submit, delivery)


def _request(tokens: list[int], retry: int = 0) -> GenerateRequest:
    # a deadline keeps the request off the credit fast path: its hand-off is the scheduler's
    deadline_ms = (time.time() + 60) * 1e3
    return GenerateRequest(
        model=MODEL, token_ids=tokens, max_tokens=2, deadline_ms=deadline_ms, retry=retry
    )


async def test_a_router_past_its_hand_off_bound_refuses_at_once_and_serves_the_rest(nats_server):
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=1, with_scheduler=False, speedup=50)
        running = await stack.start_service(
            "scheduler",
            lambda ctx, service: service.run_service(ctx),
            build=lambda ctx: LateScheduler(SchedulerConfig(), ctx.bus),
        )
        scheduler: LateScheduler = running.runtime
        router = stack.services["router"].runtime.router
        router.handoffs = HandoffLimit(initial=1, minimum=1, slow_s=0.25)
        client = await ThunderClient.connect(nats_server.url, idle_timeout_s=20, retries=0)
        try:
            scheduler.delay_s = 0.4  # over slow_s; two in a row stay well under the 2 s wait
            first = asyncio.create_task(client.generate(_request([1, 2, 3])))
            await wait_for(lambda: router.handoffs.in_flight == 1, what="the first hand-off")

            started = time.monotonic()
            with pytest.raises(RequestFailed) as refused:
                await client.generate(_request([4, 5, 6]))
            took = time.monotonic() - started
            error = refused.value.error
            assert (error.code, error.service, error.retry_after_s) == (
                ErrorCode.OVERLOADED, "router", 1.0,
            )  # fmt: skip
            assert "overloaded" in error.message
            assert took < 0.4, f"refused after {took:.2f} s: it waited for the scheduler"

            # a resend goes on though the bound is taken: its first send may be running
            resend = await client.generate(_request([7, 8, 9], retry=1))
            assert resend.final.usage.completion_tokens == 2
            done = await first
            assert done.final.usage.completion_tokens == 2
            assert router.handoffs.shed == 1
            assert router.handoffs.limit == 1.0  # the slow ack cut it (to its minimum)

            scheduler.delay_s = 0.0  # acks fast again: every request is taken
            results = await asyncio.gather(
                *(client.generate(_request([10 + i, 11, 12])) for i in range(6)),
                return_exceptions=True,
            )
            refusals = [r for r in results if isinstance(r, RequestFailed)]
            answered = [r for r in results if not isinstance(r, BaseException)]
            assert len(refusals) + len(answered) == 6  # each got exactly one outcome
            assert all(r.error.code == ErrorCode.OVERLOADED for r in refusals)
            # the bound grows by one per fast ack while in use: the burst gets through in part
            # at once, and one at a time everything does
            for i in range(6):
                await client.generate(_request([20 + i, 11, 12]))
            assert router.handoffs.in_flight == 0
            assert router.handoffs.limit > 1.0
        finally:
            await client.close()


def test_each_router_exports_its_hand_offs_in_flight_and_their_bound() -> None:
    text = scrape_after("""
        from thunderagent.router.request_path import Router, RouterConfig
        from thunderagent.scheduling.handoff_limit import HandoffLimit
        routers = []  # kept: the gauges read live routers only (a weak set)
        for rid in ("r1", "r2"):
            router = Router(RouterConfig(router_id=rid, handoffs=HandoffLimit(initial=8)), None)
            assert router.handoffs.acquire() and router.handoffs.acquire()
            routers.append(router)
    """)
    rows = {
        (line.split("{", 1)[0], line.split('router_id="', 1)[1].split('"', 1)[0]): float(
            line.rsplit(" ", 1)[1]
        )
        for line in text.splitlines()
        if line.startswith("thunderagent_router_handoff")
    }
    for rid in ("r1", "r2"):  # two routers in one process: both read, not only the first
        assert rows[("thunderagent_router_handoffs_in_flight", rid)] == 2.0
        assert rows[("thunderagent_router_handoff_bound", rid)] == 8.0
