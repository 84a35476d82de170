"""Router replicas broken while requests stream (killed, frozen): clients resend what got no
answer, with the same id, and no request is generated twice. Shares the fault harness of
``test_chaos.py``."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections import Counter

import msgspec
import pytest

from tests.chaos.test_chaos import count_starts, report, run, slow, thunderagent
from tests.integration.inproc import MODEL, inproc_stack, start_full_stack
from thunderagent.bus import connect
from thunderagent.client import ThunderClient
from thunderagent.schemas import (
    ErrorCode,
    ErrorReply,
    FinalReply,
    GenerateRequest,
    RouteDecisionBatch,
    subjects,
)

pytestmark = [pytest.mark.integration, pytest.mark.chaos]


@contextlib.asynccontextmanager
async def two_router_replicas(nats_url: str, **client_settings):
    """A full in-process stack (its router runs ``least_loaded``), a second router replica in
    its own process running ``round_robin``, and a client that has seen the second route: yields
    (client, the second's process, request id -> runs started)."""
    async with inproc_stack(nats_url) as stack:
        await start_full_stack(stack, workers=2, profile="tiny", block_size=16)
        starts, watch = await count_starts(nats_url)
        second = thunderagent("router", "--nats", nats_url, "--policy", "round_robin")
        client = await ThunderClient.connect(nats_url, **client_settings)
        try:
            await until_the_second_replica_routes(client, nats_url, "round_robin")
            yield client, second, starts
        finally:
            os.kill(second.pid, signal.SIGCONT)
            second.kill()
            second.wait()
            await client.close()
            await asyncio.sleep(0.2)
            await watch.close()


async def until_the_second_replica_routes(client: ThunderClient, nats_url: str, policy: str):
    """Send requests until one is routed by the replica running ``policy`` (it has started
    and subscribed): its decisions name its policy."""
    watcher = await connect(nats_url, name="chaos-decisions")
    seen: list[str] = []

    async def on_batch(msg) -> None:
        seen.extend(
            d.policy for d in msgspec.json.decode(msg.data, type=RouteDecisionBatch).decisions
        )

    await watcher.subscribe(subjects.ROUTE_DECISIONS, cb=on_batch)
    await watcher.flush()
    try:
        for i in range(600):
            await client.generate(GenerateRequest(model=MODEL, token_ids=[3, i], max_tokens=1))
            if policy in seen:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"no request was routed by the {policy} replica")
    finally:
        await watcher.close()


async def test_router_replica_killed_with_requests_in_flight(nats_server):
    """Two router replicas; one is SIGKILLed in a burst. Clients resend what got no answer
    (same id): everything completes, and no request is generated twice."""
    async with two_router_replicas(nats_server.url, idle_timeout_s=30, retry_after_s=1.0) as (
        client,
        second,
        starts,
    ):
        burst = [asyncio.create_task(run(client, slow(100 + i, out=8))) for i in range(40)]
        await asyncio.sleep(0.005)
        os.kill(second.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        outcomes = await asyncio.wait_for(asyncio.gather(*burst), 30)
    assert all(isinstance(o.end, FinalReply) for o in outcomes), [o.end for o in outcomes]
    ran = Counter({rid: n for rid, n in starts.items() if rid.startswith("r1")})
    assert all(starts[f"r{100 + i}"] == 1 for i in range(40)), "each generated exactly once"
    report("router replica killed (SIGKILL) with requests in flight", requests=40,
           completed=40, lost=0, generated_twice=sum(n > 1 for n in ran.values()),
           recover_s=round(max(o.ended_at for o in outcomes) - killed_at, 2))  # fmt: skip


async def test_a_frozen_router_replica_costs_a_resend_not_the_idle_timeout(nats_server):
    """Two router replicas, one frozen (SIGSTOP): it still holds its subscription, so NATS
    keeps giving it requests, which it reads and never answers. A client resends what it has
    not heard of within ``retry_after_s``; a request every send of which went to the frozen
    replica is answered ``unavailable`` after the last resend's wait (it waited out the idle
    timeout before: 120 s at the gateway). Thawed, the replica serves again."""
    settings = {"idle_timeout_s": 60, "retries": 3, "retry_after_s": 1.0}
    async with two_router_replicas(nats_server.url, **settings) as (client, second, starts):
        # Its share of the demand earns the replica credit, granted within a second: it could
        # then dispatch, on waking, what its clients have since resent and seen run (2-4 of 40
        # ran twice before its stall guard); without credit that went through the scheduler.
        for i in range(30):
            await client.generate(GenerateRequest(model=MODEL, token_ids=[6, i], max_tokens=1))
        await asyncio.sleep(1.5)
        os.kill(second.pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        outcomes = await asyncio.wait_for(
            asyncio.gather(*(run(client, slow(200 + i, out=8)) for i in range(40))), 30
        )
        worst_s = max(o.ended_at for o in outcomes) - frozen_at
        os.kill(second.pid, signal.SIGCONT)
        probes = [GenerateRequest(model=MODEL, token_ids=[5, i], max_tokens=1) for i in range(10)]
        after = [await client.generate(p) for p in probes]
    done = [o for o in outcomes if isinstance(o.end, FinalReply)]
    unheard = [o for o in outcomes if isinstance(o.end, ErrorReply)]
    assert len(done) + len(unheard) == 40
    for o in unheard:  # all four sends met the frozen replica: about one request in 16
        assert o.end.code == ErrorCode.UNAVAILABLE and o.end.service == "router", o.end
        assert "no router answered" in o.end.message
    assert len(unheard) <= 12, "most requests are resent to the live replica"
    assert worst_s < 10, "no request waits for the idle timeout (60 s here)"
    assert all(starts[f"r{200 + i}"] <= 1 for i in range(40)), "none generated twice"
    assert all(a.final is not None for a in after), "the thawed replica serves again"
    report("router replica frozen (SIGSTOP) with requests arriving", requests=40,
           completed=len(done), unavailable=len(unheard), lost=0,
           worst_s=round(worst_s, 2))  # fmt: skip
