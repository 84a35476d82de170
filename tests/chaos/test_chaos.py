"""Nothing lost across faults, over real servers and processes: each test breaks one part while
requests stream, and checks what every client saw. A request ends completed, or with a clear
error within the lease; none hangs; a retried request is generated once.

Each test appends its figures (fault, requests, lost, time to recover) to the JSON file named by
``THUNDERAGENT_CHAOS_REPORT`` when set (docs/reliability.md is written from that).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.integration.inproc import MODEL, inproc_stack, start_full_stack
from thunderagent.bus import Bus, connect
from thunderagent.client import ThunderClient
from thunderagent.hashing import BlockHasher
from thunderagent.schemas import (
    Ack,
    ErrorCode,
    ErrorReply,
    FinalReply,
    GenerateRequest,
    ProgressBatch,
    RunFailed,
    TokenChunk,
    subjects,
)

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

LEASE_S = 2.0


def report(fault: str, **figures) -> None:
    path = os.environ.get("THUNDERAGENT_CHAOS_REPORT")
    if path:
        rows = json.loads(Path(path).read_text()) if Path(path).exists() else []
        rows.append({"fault": fault, **figures})
        Path(path).write_text(json.dumps(rows, indent=2) + "\n")


def thunderagent(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "thunderagent.cli.main", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def wait_for(predicate, what: str, timeout_s: float = 15.0) -> None:
    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + timeout_s
    while not predicate():
        if loop.time() > give_up_at:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


class Outcome:
    """What one client saw: its chunks, and the final reply or error."""

    def __init__(self) -> None:
        self.chunks: list[TokenChunk] = []
        self.end: FinalReply | ErrorReply | None = None
        self.ended_at = 0.0

    @property
    def tokens(self) -> list[int]:
        return [t for c in self.chunks for t in c.token_ids]

    def contiguous(self) -> bool:
        """Chunk indices run on without a hole or a repeat (one unbroken stream)."""
        at = 0
        for c in self.chunks:
            if c.index != at:
                return False
            at += len(c.token_ids)
        return True


async def run(
    client: ThunderClient, request: GenerateRequest, out: Outcome | None = None
) -> Outcome:
    out = out or Outcome()
    async for reply in client.stream(request):
        if isinstance(reply, TokenChunk):
            out.chunks.append(reply)
        else:
            out.end = reply
    out.ended_at = time.monotonic()
    return out


async def count_starts(nats_url: str, where: dict | None = None) -> tuple[Counter, object]:
    """request id -> runs started (one run per generation); ``where``: request id -> the
    worker of its latest start."""
    nc = await connect(nats_url, name="chaos-watch")
    starts: Counter = Counter()

    async def on_progress(batch: ProgressBatch, _) -> None:
        for p in batch.events:
            if p.phase == "started":
                starts[p.request_id] += 1
                if where is not None:
                    where[p.request_id] = p.worker_id

    await Bus(nc, service="chaos-watch").subscribe(
        subjects.PROGRESS_WILDCARD, ProgressBatch, on_progress
    )
    return starts, nc


def slow(i: int, prompt: int = 32, out: int = 160, **kw) -> GenerateRequest:
    return GenerateRequest(model=MODEL, request_id=f"r{i}", token_ids=[7 + i] * prompt,
                           max_tokens=out, **kw)  # fmt: skip


async def test_adapter_killed_mid_stream(nats_server):
    """A worker adapter SIGKILLed while streaming: what had started ends with a clear error
    within the lease; what had not started runs on another worker; nothing hangs."""
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=1, profile="tiny", block_size=16,
                               policy="least_loaded", adapter={"lease_s": LEASE_S})  # fmt: skip
        url = await stack.start_engine("wk", profile="tiny", block_size=16)
        adapter = thunderagent("worker", "--nats", nats_server.url, "--worker-id", "wk",
                               "--engine-url", url, "--lease-s", str(LEASE_S))  # fmt: skip
        try:
            router = stack.services["router"].runtime
            await wait_for(lambda: "wk" in router.core.fleet, "wk to register")
            where: dict[str, str] = {}
            _, watch = await count_starts(nats_server.url, where)
            client = await ThunderClient.connect(nats_server.url, idle_timeout_s=30,
                                                 retry_after_s=60)  # fmt: skip
            seen = [Outcome() for _ in range(10)]
            tasks = [asyncio.create_task(run(client, slow(i), seen[i])) for i in range(10)]
            # killed once a client holds tokens that wk streamed: that answer cannot be rebuilt
            await wait_for(
                lambda: any(where.get(f"r{i}") == "wk" and o.chunks for i, o in enumerate(seen)),
                "a client streaming from wk",
            )
            os.kill(adapter.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        finally:
            adapter.kill()
            adapter.wait()
        await client.close()
        await watch.close()
    done = [o for o in outcomes if isinstance(o.end, FinalReply)]
    failed = [o for o in outcomes if isinstance(o.end, ErrorReply)]
    assert len(done) + len(failed) == len(outcomes), "every request ended"
    assert all(o.end.code == ErrorCode.UNAVAILABLE and "wk" in o.end.message for o in failed)
    assert all(o.ended_at - killed_at <= LEASE_S + 2.0 for o in failed), "errors within the lease"
    assert all(o.contiguous() and len(o.tokens) == 160 for o in done)
    moved = [o for o in done if o.end.worker_id == "w0" and not o.chunks[0].index]
    assert failed, "some runs had started on wk"
    report("worker adapter killed (SIGKILL) mid-stream", requests=len(outcomes),
           completed=len(done), clear_errors=len(failed), lost=0,
           worst_error_after_s=round(max(o.ended_at - killed_at for o in failed), 2),
           not_started_moved=len(moved))  # fmt: skip


async def test_engine_killed_mid_stream_resumes_as_continuation(nats_server):
    """The engine dies under its adapter: every affected request goes on as a continuation on
    the other worker; each client sees one unbroken stream of the full length."""
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=2, profile="tiny", block_size=16,
                               policy="round_robin", adapter={"lease_s": LEASE_S})  # fmt: skip
        client = await ThunderClient.connect(nats_server.url, idle_timeout_s=30,
                                             retry_after_s=60)  # fmt: skip
        tasks = [asyncio.create_task(run(client, slow(i, out=200))) for i in range(4)]
        engine = stack.engines["w1"]
        await wait_for(lambda: engine.core.load().num_running >= 1, "w1 running")
        await asyncio.sleep(0.3)  # well into decode
        killed_at = time.monotonic()
        await stack.kill_engine("w1")
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        await client.close()
    assert all(isinstance(o.end, FinalReply) for o in outcomes), [
        o.end for o in outcomes if not isinstance(o.end, FinalReply)
    ]
    assert all(o.contiguous() and len(o.tokens) == 200 for o in outcomes)
    resumed = [o for o in outcomes if {c.index for c in o.chunks} and o.end.worker_id == "w0"
               and any(c.index for c in o.chunks)]  # fmt: skip
    assert resumed, "the runs on w1 went on, on w0"
    report("engine killed mid-stream (adapter alive)", requests=len(outcomes),
           completed=len(outcomes), lost=0, resumed_as_continuation=len(resumed),
           recover_s=round(max(o.ended_at for o in outcomes) - killed_at, 2))  # fmt: skip


async def test_decode_engine_killed_under_sglang_pd_resumes_every_run(nats_server):
    """SGLang's PD, one prefill and two decode engines: the decode engine under some runs dies,
    before or after its prefill side handed them over. Every run goes on as a continuation,
    paired with the other decode engine; each client sees one unbroken stream."""
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(
            stack, workers=3, pd_modes=["prefill", "decode", "decode"], scheduler="pd_capped",
            policy="thunder", profile="tiny", block_size=16, adapter={"lease_s": LEASE_S},
        )  # fmt: skip
        client = await ThunderClient.connect(nats_server.url, idle_timeout_s=30,
                                             retry_after_s=60)  # fmt: skip
        tasks = [asyncio.create_task(run(client, slow(i, out=200))) for i in range(6)]
        engine = stack.engines["w1"]
        await wait_for(lambda: engine.core.load().num_running >= 1, "w1 decoding")
        await asyncio.sleep(0.3)
        killed_at = time.monotonic()
        await stack.kill_engine("w1")
        # a failure report that comes after its run was replaced (both sides of a pairing can
        # fail) is old news: accepted, so that worker does not end the client's stream
        pending = stack.services["scheduler"].runtime.pending
        await wait_for(lambda: any(p.replaced for p in pending.values()), "a run replaced")
        rid, replaced = next((r, p.replaced) for r, p in pending.items() if p.replaced)
        nc = await connect(nats_server.url, name="late-report")
        for worker in sorted(replaced):
            late = RunFailed(request_id=rid, worker_id=worker, reason="late report")
            ack = await Bus(nc, service="late").request(
                subjects.sched_run_failed(MODEL), late, Ack, timeout=2.0
            )
            assert ack.accepted, (worker, ack)
        await nc.close()
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 40)
        await client.close()
    assert all(isinstance(o.end, FinalReply) for o in outcomes), [
        o.end for o in outcomes if not isinstance(o.end, FinalReply)
    ]
    assert all(o.contiguous() and len(o.tokens) == 200 for o in outcomes)
    assert all(o.end.worker_id == "w2" for o in outcomes), [o.end.worker_id for o in outcomes]
    report("decode engine killed under SGLang's PD", requests=len(outcomes),
           completed=len(outcomes), lost=0,
           recover_s=round(max(o.ended_at for o in outcomes) - killed_at, 2))  # fmt: skip


async def test_scheduler_killed_with_requests_queued(nats_server):
    """The scheduler is SIGKILLed holding a queue, then started again: clients resend what got
    no answer and every request completes, the queued ones run once."""
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=1, profile="tiny", block_size=16,
                               with_scheduler=False)  # fmt: skip
        starts, watch = await count_starts(nats_server.url)
        sched = ["scheduler", "--nats", nats_server.url, "--policy", "fcfs",
                 "--param", "max_running=1"]  # fmt: skip
        first = thunderagent(*sched)
        # ten resends 2 s apart: a scheduler process starts in seconds on a loaded 2-core
        # machine (beside another test runner), longer than the default three cover
        client = await ThunderClient.connect(nats_server.url, idle_timeout_s=30,
                                             retry_after_s=2.0, retries=10)  # fmt: skip
        try:
            await client.generate(GenerateRequest(model=MODEL, token_ids=[3], max_tokens=1))
            tasks = [asyncio.create_task(run(client, slow(200 + i, out=60))) for i in range(6)]
            await asyncio.sleep(0.5)  # one runs, five wait in the scheduler
            os.kill(first.pid, signal.SIGKILL)
            first.wait()
            killed_at = time.monotonic()
            second = thunderagent(*sched)
            outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 45)
        finally:
            for p in (first, locals().get("second")):
                if p is not None:
                    p.kill()
                    p.wait()
        await client.close()
        await watch.close()
    assert all(isinstance(o.end, FinalReply) for o in outcomes), [o.end for o in outcomes]
    assert all(o.contiguous() and len(o.tokens) == 60 for o in outcomes)
    assert all(starts[f"r{200 + i}"] == 1 for i in range(6)), dict(starts)
    report("scheduler killed (SIGKILL) with requests queued, then restarted", requests=6,
           completed=6, lost=0, generated_twice=0,
           recover_s=round(max(o.ended_at for o in outcomes) - killed_at, 2))  # fmt: skip


async def test_scheduler_stopping_answers_its_queue_and_clients_retry(nats_server):
    """A scheduler stopped (SIGTERM) answers every waiting request with ``unavailable``; the
    clients resend them to the next scheduler, where they run."""
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=1, profile="tiny", block_size=16,
                               scheduler="fcfs", scheduler_params={"max_running": 1})  # fmt: skip
        client = await ThunderClient.connect(nats_server.url, idle_timeout_s=30,
                                             retry_after_s=30)  # fmt: skip
        await client.generate(GenerateRequest(model=MODEL, token_ids=[3], max_tokens=1))
        tasks = [asyncio.create_task(run(client, slow(300 + i, out=60))) for i in range(5)]
        await asyncio.sleep(0.5)
        waiting = len(stack.services["scheduler"].runtime.pending)
        await stack.stop_service("scheduler")
        stopped_at = time.monotonic()
        from thunderagent.scheduler.service import SchedulerConfig, SchedulerService

        config = SchedulerConfig(scheduler="fcfs", params={"max_running": 1})
        await stack.start_service("scheduler", lambda ctx, svc: svc.run_service(ctx),
                                  build=lambda ctx: SchedulerService(config, ctx.bus))  # fmt: skip
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 45)
        await client.close()
    assert waiting >= 2
    assert all(isinstance(o.end, FinalReply) for o in outcomes), [o.end for o in outcomes]
    report("scheduler stopped (SIGTERM) with requests queued, then restarted", requests=5,
           completed=5, lost=0, answered_at_stop=waiting - 1,
           recover_s=round(max(o.ended_at for o in outcomes) - stopped_at, 2))  # fmt: skip


async def test_a_quiet_run_is_held_and_runs_once_across_a_scheduler_restart(nats_server):
    """A run that has sent its client nothing yet (its answer is not streamed) outlasts the
    client's ``retry_after_s`` while the scheduler that dispatched it is replaced. The worker
    tells the client the request is held, so it is not resent: a resend would reach the new
    scheduler, which does not know the run, and run it a second time on the other worker
    (without the held reply this test fails so: two starts)."""
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=2, profile="tiny", block_size=16, speedup=0.1,
                               scheduler="fcfs", adapter={"held_after_s": 0.4})  # fmt: skip
        starts, watch = await count_starts(nats_server.url)
        client = await ThunderClient.connect(nats_server.url, idle_timeout_s=30,
                                             retry_after_s=1.5)  # fmt: skip
        await client.generate(GenerateRequest(model=MODEL, token_ids=[3], max_tokens=1))
        sent_at = time.monotonic()
        task = asyncio.create_task(run(client, slow(500, out=60, stream=False)))
        await wait_for(lambda: starts["r500"] >= 1, "the run's first token")
        await stack.stop_service("scheduler")
        from thunderagent.scheduler.service import SchedulerConfig, SchedulerService

        config = SchedulerConfig(scheduler="fcfs")
        await stack.start_service("scheduler", lambda ctx, svc: svc.run_service(ctx),
                                  build=lambda ctx: SchedulerService(config, ctx.bus))  # fmt: skip
        outcome = await asyncio.wait_for(task, 30)
        await client.close()
        await watch.close()
    assert isinstance(outcome.end, FinalReply), outcome.end
    assert outcome.end.usage.completion_tokens == 60
    assert outcome.ended_at - sent_at > 1.5 + 0.5, "the run outlasted the client's resend timer"
    assert starts["r500"] == 1, "generated once"
    report("scheduler replaced while a quiet run (not streamed) outlasts the resend timer",
           requests=1, completed=1, lost=0, generated_twice=0)  # fmt: skip


async def test_nats_restart(nats_server, redis_server):
    """NATS restarts (same port, same JetStream store): every service reconnects, requests flow
    again, and the KV stream resumes where it was (no resync needed)."""
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=2, profile="tiny", block_size=16,
                               redis_url=redis_server.url, policy="thunder")  # fmt: skip
        client = await ThunderClient.connect(nats_server.url, idle_timeout_s=30)
        for i in range(4):
            await client.generate(GenerateRequest(model=MODEL, token_ids=[9, i] * 40, max_tokens=2))
        index = stack.services["index"].runtime
        seq_before = index.follower.stream_seq
        nats_server.stop()
        down_at = time.monotonic()
        await asyncio.sleep(1.0)
        nats_server.start()
        done = None
        for _ in range(100):  # the first requests may meet reconnecting services
            try:
                done = await client.generate(  # a new prompt: new blocks, new KV events
                    GenerateRequest(model=MODEL, token_ids=[11, 12] * 40, max_tokens=2)
                )
                break
            except Exception:
                await asyncio.sleep(0.1)
        recovered_s = time.monotonic() - down_at
        assert done is not None and done.final is not None
        await wait_for(lambda: index.follower.stream_seq > seq_before, "the KV stream to resume")
        # the router's replica (an ephemeral consumer the restart forgot) follows again too
        fresh = BlockHasher(16).hash_tokens([11, 12] * 40)
        router = stack.services["router"].runtime
        await wait_for(
            lambda: router.core.feeder.index.overlap(fresh.primary, fresh.check),
            "the router's index to see blocks stored after the restart",
        )
        resyncs = index.resyncs_requested
        await client.close()
    assert resyncs == 0, "the stream resumed: no full resync"
    report("NATS restarted (1 s down)", requests=5, completed=5, lost=0, resyncs=resyncs,
           recover_s=round(recovered_s, 2))  # fmt: skip


async def test_redis_down_and_back(nats_server, redis_server):
    """Redis stops: routing goes on; Redis returns: the index writes snapshots again."""
    import redis.asyncio as aioredis

    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=1, profile="tiny", block_size=16,
                               redis_url=redis_server.url)  # fmt: skip
        client = await ThunderClient.connect(nats_server.url, idle_timeout_s=30)
        redis_server.stop()
        for i in range(3):
            done = await client.generate(GenerateRequest(model=MODEL, token_ids=[5, i] * 20,
                                                         max_tokens=2))  # fmt: skip
            assert done.final is not None
        redis_server.start()
        back_at = time.monotonic()
        r = aioredis.from_url(redis_server.url)
        for _ in range(100):
            if await r.get(subjects.REDIS_INDEX_SNAPSHOT):
                break
            await asyncio.sleep(0.1)
        snapshot = await r.get(subjects.REDIS_INDEX_SNAPSHOT)
        await r.aclose()
        await client.close()
    assert snapshot, "snapshots resumed"
    report("Redis down, then back", requests=3, completed=3, lost=0,
           snapshots_resume_after_s=round(time.monotonic() - back_at, 2))  # fmt: skip


async def test_frozen_adapter_is_dropped_then_rejoins(nats_server):
    """An adapter frozen (SIGSTOP) past its lease is treated as dead; thawed (SIGCONT) it
    registers again and serves."""
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=1, profile="tiny", block_size=16,
                               policy="round_robin")  # fmt: skip
        url = await stack.start_engine("wk", profile="tiny", block_size=16)
        adapter = thunderagent("worker", "--nats", nats_server.url, "--worker-id", "wk",
                               "--engine-url", url, "--lease-s", str(LEASE_S))  # fmt: skip
        router = stack.services["router"].runtime
        try:
            await wait_for(lambda: "wk" in router.core.fleet, "wk to register")
            os.kill(adapter.pid, signal.SIGSTOP)
            frozen_at = time.monotonic()
            await wait_for(lambda: "wk" not in router.core.fleet, "wk dropped", LEASE_S + 5)
            dropped_s = time.monotonic() - frozen_at
            os.kill(adapter.pid, signal.SIGCONT)
            thawed_at = time.monotonic()
            await wait_for(lambda: "wk" in router.core.fleet, "wk back", 10)
            rejoined_s = time.monotonic() - thawed_at
            client = await ThunderClient.connect(nats_server.url, idle_timeout_s=30)
            served = {(await client.generate(
                GenerateRequest(model=MODEL, token_ids=[4, i], max_tokens=1))).final.worker_id
                for i in range(6)}  # fmt: skip
            await client.close()
        finally:
            os.kill(adapter.pid, signal.SIGCONT)
            adapter.kill()
            adapter.wait()
    assert dropped_s <= LEASE_S + 1.5
    assert "wk" in served, "the thawed worker serves again"
    report("worker adapter frozen (SIGSTOP) past its lease, then thawed", requests=6,
           completed=6, lost=0, dropped_after_s=round(dropped_s, 2),
           rejoined_after_s=round(rejoined_s, 2))  # fmt: skip
