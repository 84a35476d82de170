"""The router service over real NATS and the pure ``RouterCore`` the replay drives make the same
decisions from the same inputs, and the online tuner moves in the live router.

One scripted sequence (registrations, load reports, KV-event batches, requests, where the
scheduler sent each one, how each run ended) is played twice: into a ``RouterService`` through
NATS and JetStream, the way the fleet, the adapters and the scheduler feed it, and straight into
a ``RouterCore``. Every ranked candidate list (order, predicted overlap, score) must match. The
script dispatches some requests to a candidate other than the first, so the in-flight overlay
and the verifier must follow the worker that actually got the request.
"""

from __future__ import annotations

import asyncio
import math
import random
import time

import msgspec
import pytest

from tests.integration.inproc import MODEL, inproc_stack
from thunderagent.bus import Bus, connect
from thunderagent.bus.bus import encode
from thunderagent.hashing import BlockHasher
from thunderagent.router.service import RouterConfig, RouterService
from thunderagent.router_core import RouterCore, RouterParams
from thunderagent.schemas import (
    Ack,
    BlocksRemoved,
    BlocksStored,
    Candidate,
    Dispatched,
    GenerateRequest,
    KvEventBatch,
    LoadReport,
    ProgressBatch,
    RequestProgress,
    ScheduleRequest,
    Usage,
    WorkerRegistration,
    subjects,
)

pytestmark = pytest.mark.integration

BS = 16
WORKERS = ["w0", "w1", "w2"]


def registration(worker: str) -> WorkerRegistration:
    return WorkerRegistration(
        worker_id=worker, model=MODEL, engine_url=f"http://{worker}", block_size=BS,
        kv_capacity_blocks=400, lease_s=60.0, registered_at=1.0, max_running_requests=64,
    )  # fmt: skip


def prompt(prefix: int, blocks: int, tail: int) -> list[int]:
    return [100 + prefix * 1000 + i for i in range(blocks * BS)] + [7] * tail


def script(seed: int = 3) -> list[tuple]:
    """The input sequence: ("load", report) | ("kv", batch) | ("request", request_id, tokens,
    pick, run) where ``pick`` chooses which candidate the scheduler dispatches to and ``run``
    how far its run got before the next step: "finished", "started" (first token out, the run
    still going) or "queued" (no first token yet)."""
    rng = random.Random(seed)
    runs = random.Random(seed + 1)
    hasher = BlockHasher(BS)
    steps: list[tuple] = []
    seqs = dict.fromkeys(WORKERS, -1)
    ts = 10.0

    def kv(worker: str, events: list) -> tuple:
        seqs[worker] += 1
        return ("kv", KvEventBatch(worker_id=worker, seq=seqs[worker], ts=ts, events=events))

    def load(worker: str, running: int, queued: int, tokens: int) -> tuple:
        return ("load", LoadReport(
            worker_id=worker, ts=ts, running=running, queued=queued, kv_used_blocks=tokens // BS,
            kv_total_blocks=400, num_tokens=tokens, inflight=running + queued,
            prefill_backlog_tokens=queued * 500,
        ))  # fmt: skip

    for w, running in zip(WORKERS, (3, 0, 1), strict=True):
        steps.append(load(w, running, 0, running * 800))
    doc = hasher.hash_tokens(prompt(1, 8, 0))
    steps.append(kv("w1", [BlocksStored(hashes=doc.primary, check_hashes=doc.check)]))
    for i in range(24):
        ts += 1.0
        prefix = rng.choice([1, 1, 2, 3, 4])
        tokens = prompt(prefix, rng.randint(4, 10), rng.randint(1, 15))
        pick = 0 if rng.random() < 0.6 else 1  # sometimes the scheduler spills to the second
        run = runs.choice(["finished", "finished", "started", "queued"])
        steps.append(("request", f"r{i}", tokens, pick, run))
        if i % 5 == 4:
            w = rng.choice(WORKERS)
            steps.append(load(w, rng.randint(0, 6), rng.randint(0, 3), rng.randint(0, 5000)))
        if i == 12:  # an eviction the router must honour
            steps.append(kv("w1", [BlocksRemoved(hashes=doc.primary[4:])]))
    return steps


def core_decisions(params: RouterParams, steps: list[tuple]) -> list[list[Candidate]]:
    """The replay's side: the same inputs, straight into the core."""
    core = RouterCore(params)
    for w in WORKERS:
        core.register(registration(w), 0.0)
    out = []
    now = 0.0
    for step in steps:
        now += 0.01
        if step[0] == "load":
            core.report(step[1], now)
        elif step[0] == "kv":
            core.apply_kv(step[1], now)
        else:
            _, rid, tokens, pick, run = step
            hashes = core.hash_tokens(tokens, BS)
            routed = core.route(
                request_id=rid, model=MODEL, hashes=hashes, prompt_tokens=len(tokens),
                block_size=BS, expected_output_tokens=core.expected_output(4, 4), now=now,
            )  # fmt: skip
            assert routed is not None
            ranked = routed.decision.candidates
            out.append(ranked)
            worker = ranked[min(pick, len(ranked) - 1)].worker_id
            core.on_dispatched(rid, worker, now)
            if run == "started":
                core.on_started(rid, worker, now)
            elif run == "finished":
                cached = routed.query.overlaps.get(worker, 0) * BS
                core.on_finished(rid, worker, now, cached_tokens=cached, completion_tokens=4)
    return out


async def wait_for(predicate, what: str, timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + timeout_s
    while not predicate():
        if loop.time() > give_up_at:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


class FakeScheduler:
    """Takes the router's submissions (acked), as the scheduler service does."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.submits: asyncio.Queue[ScheduleRequest] = asyncio.Queue()

    async def start(self) -> None:
        async def on_submit(submit: ScheduleRequest, delivery) -> None:
            await self.bus.publish(delivery.reply, Ack(accepted=True))
            self.submits.put_nowait(submit)

        await self.bus.subscribe(subjects.SCHED_SUBMIT_WILDCARD, ScheduleRequest, on_submit)


async def live_decisions(
    nats_url: str, params: RouterParams, steps: list[tuple]
) -> tuple[list[list[Candidate]], RouterService]:
    """The service's side: the same inputs over NATS, JetStream and the workers bucket."""
    async with inproc_stack(nats_url) as stack:
        config = RouterConfig(params=params)
        running = await stack.start_service(
            "router", lambda ctx, svc: svc.run(), build=lambda ctx: RouterService(ctx, config)
        )
        router: RouterService = running.runtime
        nc = await connect(nats_url, name="parity")
        bus = Bus(nc, service="parity")
        scheduler = FakeScheduler(bus)
        await scheduler.start()
        await bus.ensure_kv_events_stream()
        bucket = await bus.bucket(subjects.WORKERS_BUCKET)
        for w in WORKERS:
            await bucket.put(w, msgspec.json.encode(registration(w)))
        await wait_for(lambda: all(w in router.core.fleet for w in WORKERS), "registrations")
        out = []
        for step in steps:
            if step[0] == "load":
                report = step[1]
                await bus.publish(subjects.worker_load(report.worker_id), report)
                state = router.core.fleet.get(report.worker_id)
                await wait_for(lambda s=state, r=report: s.load == r, "a load report")
            elif step[0] == "kv":
                batch = step[1]
                await bus.stream_publish(subjects.kv_events(batch.worker_id), encode(batch))
                await wait_for(
                    lambda b=batch, c=router.core.feeder.cursors: (
                        b.worker_id in c and c[b.worker_id].seq == b.seq
                    ),
                    "a KV batch",
                )
            else:
                _, rid, tokens, pick, run = step
                request = GenerateRequest(model=MODEL, request_id=rid, token_ids=tokens,
                                          max_tokens=4)  # fmt: skip
                await bus.publish(subjects.requests(MODEL), request, reply=nc.new_inbox())
                submit = await asyncio.wait_for(scheduler.submits.get(), 10)
                ranked = submit.decision.candidates
                out.append(ranked)
                worker = ranked[min(pick, len(ranked) - 1)].worker_id
                notice = Dispatched(request_id=rid, worker_id=worker)
                await bus.publish(subjects.router_dispatched(submit.router_id), notice)
                await wait_for(lambda r=rid: r in router.core.verifier._dispatched, "dispatch")
                if run == "started":
                    start = RequestProgress(request_id=rid, worker_id=worker, phase="started",
                                            ts=time.time())  # fmt: skip
                    batch = ProgressBatch(worker_id=worker, events=[start])
                    await bus.publish(subjects.progress(worker, ended=False), batch)
                    state = router.core.fleet.get(worker)
                    await wait_for(lambda s=state, r=rid: s.assigned[r][0] == 0, "a start")
                    continue
                if run == "queued":
                    continue
                overlap = next(c.overlap_blocks for c in ranked if c.worker_id == worker)
                usage = Usage(prompt_tokens=len(tokens), cached_tokens=overlap * BS,
                              completion_tokens=4)  # fmt: skip
                progress = RequestProgress(request_id=rid, worker_id=worker, phase="finished",
                                           ts=time.time(), usage=usage)  # fmt: skip
                batch = ProgressBatch(worker_id=worker, events=[progress])
                await bus.publish(subjects.progress(worker, ended=True), batch)
                await wait_for(lambda r=rid: r not in router.core.verifier._dispatched, "finish")
        await nc.close()
        return out, router


async def test_service_and_core_make_the_same_decisions(nats_server):
    params = RouterParams(policy="thunder", seed=11, feedback_interval_s=1e9)
    steps = script()
    expected = core_decisions(params, steps)
    got, _ = await live_decisions(nats_server.url, params, steps)
    assert len(got) == len(expected) == 24
    for i, (live, pure) in enumerate(zip(got, expected, strict=True)):
        assert [c.worker_id for c in live] == [c.worker_id for c in pure], f"request {i}"
        assert [c.overlap_blocks for c in live] == [c.overlap_blocks for c in pure]
        assert [c.score for c in live] == pytest.approx([c.score for c in pure])
    # the script made the overlay and the verifier follow a second-choice dispatch at least once
    assert any(s[0] == "request" and s[3] == 1 for s in steps)
    assert {s[4] for s in steps if s[0] == "request"} == {"finished", "started", "queued"}
    assert any(c.overlap_blocks for ranked in got for c in ranked), "some requests hit"


async def test_online_tuner_moves_in_the_live_router(nats_server):
    """Imbalanced queue depths shrink thunder's load scale (the credit decays faster) in the
    running router, from its own periodic feedback, not only in the replay."""
    params = RouterParams(policy="thunder", seed=1, feedback_interval_s=0.1)
    async with inproc_stack(nats_server.url) as stack:
        config = RouterConfig(params=params)
        running = await stack.start_service(
            "router", lambda ctx, svc: svc.run(), build=lambda ctx: RouterService(ctx, config)
        )
        core: RouterCore = running.runtime.core
        start_scale = core.policy.load_scale
        nc = await connect(nats_server.url, name="tuner")
        bus = Bus(nc, service="tuner")
        bucket = await bus.bucket(subjects.WORKERS_BUCKET)
        for w in WORKERS:
            await bucket.put(w, msgspec.json.encode(registration(w)))
        await wait_for(lambda: all(w in core.fleet for w in WORKERS), "registrations")
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + 10
        while core.policy.load_scale >= start_scale and loop.time() < give_up_at:
            for w, running_ in zip(WORKERS, (60, 0, 0), strict=True):
                report = LoadReport(worker_id=w, ts=time.time(), running=running_, queued=0,
                                    kv_used_blocks=0, kv_total_blocks=400)  # fmt: skip
                await bus.publish(subjects.worker_load(w), report)
            await asyncio.sleep(0.05)
        await nc.close()
    assert core.policy.load_scale < start_scale


@pytest.mark.parametrize(("policy", "params"), [
    ("smg_cache_aware", {"load_monitor_interval_s": 1.0}),
    ("thunder", {}),
])  # fmt: skip
async def test_the_live_router_reads_loads_as_its_policy_ships(nats_server, policy, params):
    """SMG polls engine load (every 10 s as shipped; 1 s here): the running router with its
    policy takes one report per poll, as the replay does, while ThunderAgent's policy takes
    every report the adapters send."""
    config = RouterConfig(params=RouterParams(policy=policy, seed=1, policy_params=params))
    async with inproc_stack(nats_server.url) as stack:
        running = await stack.start_service(
            "router", lambda ctx, svc: svc.run(), build=lambda ctx: RouterService(ctx, config)
        )
        core: RouterCore = running.runtime.core
        nc = await connect(nats_server.url, name="poll")
        bus = Bus(nc, service="poll")
        bucket = await bus.bucket(subjects.WORKERS_BUCKET)
        await bucket.put("w0", msgspec.json.encode(registration("w0")))
        await wait_for(lambda: "w0" in core.fleet, "the registration")
        seen: set[int] = set()
        renewed: set[float] = set()
        started = time.time()
        for queued in range(1, 51):  # 2.5 s of reports, 20 a second
            report = LoadReport(worker_id="w0", ts=time.time(), running=0, queued=queued,
                                kv_used_blocks=0, kv_total_blocks=400)  # fmt: skip
            await bus.publish(subjects.worker_load("w0"), report)
            await asyncio.sleep(0.05)
            state = core.fleet.get("w0")
            if state is not None and state.load is not None:
                seen.add(state.load.queued)
                renewed.add(state.renewed_at)
        polls = math.ceil(time.time() - started) + 1  # boundaries crossed, and the first
        await nc.close()
    if policy == "smg_cache_aware":
        assert 2 <= len(seen) <= polls, f"one report per 1 s poll, took {sorted(seen)}"
    else:
        assert len(seen) > 10, f"every report, took {len(seen)}"
    assert len(renewed) > 10, "every report renews the lease"
