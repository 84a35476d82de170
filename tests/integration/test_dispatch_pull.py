"""A pull at dispatch over real NATS: a run whose ``PullHint`` names the worker holding its
prefix starts only once the adapter copied the prefix from there with NIXL (the bytes checked
block by block), a second run for the same prefix waits for that copy instead of making
another, a source holding part of the prefix gives that part, a copy slower than its budget and
a hint the source cannot honour leave the run to prefill, and the scheduler service sends the
hint with the run."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from tests.integration.inproc import MODEL
from tests.integration.migration_stack import (
    BLOCK,
    engine_json,
    pooled_stack,
    prefill,
    prefix_hash,
    prefix_tokens,
    skip_without_nixl,
    start_adapter,
    start_pooled_engine,
    wait_for,
)
from thunderagent.bus import Bus, connect
from thunderagent.hashing import BlockHasher
from thunderagent.schemas import (
    Ack,
    Candidate,
    FinalReply,
    GenerateRequest,
    HeldReply,
    PullHint,
    RouteDecision,
    ScheduleRequest,
    TokenChunk,
    WorkerGenerate,
    subjects,
)

skip_without_nixl()

pytestmark = pytest.mark.integration

BLOCKS = 8


async def run_on(
    bus: Bus, nc, worker: str, rid: str, tokens: list[int], pull=None, **fields
) -> FinalReply:
    """Hand one run to ``worker``'s adapter as the scheduler does; its final reply. ``fields``:
    more of its ``GenerateRequest`` (``cache_salt``, ``lora_name``)."""
    inbox = nc.new_inbox()
    got: asyncio.Queue = asyncio.Queue()
    sub = await nc.subscribe(inbox, cb=got.put)
    request = GenerateRequest(model=MODEL, request_id=rid, token_ids=tokens, max_tokens=2,
                              **fields)  # fmt: skip
    work = WorkerGenerate(request=request, reply_subject=inbox, pull=pull)
    ack = await bus.request(subjects.worker_generate(worker), work, Ack, timeout=5)
    assert ack.accepted, ack.reason
    try:
        while True:
            msg = await asyncio.wait_for(got.get(), 20)
            reply = msgspec.json.decode(msg.data, type=TokenChunk | HeldReply | FinalReply)
            if isinstance(reply, FinalReply):
                return reply
    finally:
        await sub.unsubscribe()


async def two_pooled_workers(stack, runners: list, pull_gbps: float = 0.0, lora_adapters=()):
    engines, adapters = {}, {}
    for wid in ("w0", "w1"):
        engines[wid] = await start_pooled_engine(stack, wid, runners=runners, pull_gbps=pull_gbps,
                                                 lora_adapters=lora_adapters)  # fmt: skip
        adapters[wid] = (await start_adapter(stack, wid, engines[wid].url)).runtime
    await stack.wait_for_workers(2)
    return engines, adapters


async def held_by_w0(engines: dict, adapters: dict, seed: int) -> tuple[list[int], int]:
    """A prefix of ``BLOCKS`` blocks prefilled on w0, once w0's adapter has seen it: its
    tokens and our hash of its deepest block."""
    tokens = prefix_tokens(BLOCKS, seed=seed)
    p = prefix_hash(tokens)
    await prefill(engines["w0"].url, [*tokens, 9], f"fill-{seed}")
    await wait_for(lambda: adapters["w0"].relay.mirror.chain_to(p),
                   what="w0's adapter to see the prefix")  # fmt: skip
    return tokens, p


async def test_a_run_copies_its_prefix_from_the_holder_before_it_starts(nats_server):
    async with pooled_stack(nats_server.url) as (stack, runners):
        # 8 blocks of 64 KiB paced at 2 MB/s: the copy takes ~0.26 s
        engines, adapters = await two_pooled_workers(stack, runners, pull_gbps=0.002)
        tokens, p = await held_by_w0(engines, adapters, seed=3)
        nc = await connect(nats_server.url, name="pull-test")
        bus = Bus(nc, service="pull-test")
        hint = PullHint(source_worker="w0", prefix_hash=p, blocks=BLOCKS)
        copying = asyncio.create_task(run_on(bus, nc, "w1", "r1", [*tokens, 5, 5], pull=hint))
        await wait_for(lambda: adapters["w1"].migration._incoming, what="the copy to start")
        joined = await run_on(bus, nc, "w1", "r2", [*tokens, 6, 6, 6])  # no hint: it waits
        first = await copying
        assert first.worker_id == joined.worker_id == "w1"
        assert first.usage.cached_tokens == joined.usage.cached_tokens == BLOCKS * BLOCK
        assert adapters["w1"].migration.pulls == {"done": 1}
        src, dst = engines["w0"].driver, engines["w1"].driver
        status = await engine_json(engines["w1"].url, "/kv/status")
        assert (status["pulled_blocks"], status["failed_pulls"]) == (BLOCKS, 0)
        copied = [k for k in dst.kv_pool.slot_of if k in src.kv_pool.slot_of]
        assert len(copied) == BLOCKS
        for key in copied:  # every block byte-equal to the source's
            assert dst.kv_pool.checksum(dst.kv_pool.slot_of[key]) == (
                src.kv_pool.expected_checksum(key)
            )
        assert src.core.cache.refcount(copied[0]) == 0  # the source was released
        await nc.close()


@pytest.mark.parametrize(
    ("salt", "lora"), [("tenant-a", None), (None, "sql-adapter")], ids=["tenant", "lora adapter"]
)
async def test_a_tenants_or_an_adapters_run_copies_its_prefix_in_its_namespace(
    nats_server, salt, lora
):
    """The hint names the prefix by its namespaced hash (the router hashes such a prompt in
    its namespace): the source offers it with its salt and adapter, the target's engine caches
    the copy there and says so in its events, and the run is served from it. The same tokens
    for the base model find nothing on the target."""
    async with pooled_stack(nats_server.url) as (stack, runners):
        engines, adapters = await two_pooled_workers(stack, runners, lora_adapters=["sql-adapter"])
        tokens = prefix_tokens(BLOCKS, seed=8)
        p = prefix_hash(tokens, salt, lora)
        body = {k: v for k, v in (("cache_salt", salt), ("lora_path", lora)) if v}
        await prefill(engines["w0"].url, [*tokens, 9], "fill", **body)
        await wait_for(lambda: adapters["w0"].relay.mirror.chain_to(p),
                       what="w0's adapter to see the prefix")  # fmt: skip
        nc = await connect(nats_server.url, name="pull-test")
        bus = Bus(nc, service="pull-test")
        hint = PullHint(source_worker="w0", prefix_hash=p, blocks=BLOCKS)
        final = await run_on(bus, nc, "w1", "r1", [*tokens, 5], pull=hint,
                             cache_salt=salt, lora_name=lora)  # fmt: skip
        assert final.usage.cached_tokens == BLOCKS * BLOCK
        assert adapters["w1"].migration.pulls == {"done": 1}
        mirror = adapters["w1"].relay.mirror  # the copy's events named its namespace
        chain = await wait_for(lambda: mirror.chain_to(p), what="w1's adapter to see the copy")
        assert mirror.namespace_of(chain) == (salt, lora)
        base = await run_on(bus, nc, "w1", "r2", [*tokens, 5])
        assert base.usage.cached_tokens == 0
        await nc.close()


async def test_a_source_holding_part_of_the_prefix_gives_that_part(nats_server):
    """The source holds the first 4 of the hinted 8 blocks (as a prompt it is still prefilling
    holds its finished chunks): the run copies those 4 and computes the rest."""
    async with pooled_stack(nats_server.url) as (stack, runners):
        engines, adapters = await two_pooled_workers(stack, runners)
        tokens = prefix_tokens(BLOCKS, seed=4)
        await prefill(engines["w0"].url, tokens[: 4 * BLOCK + 1], "part")
        half = prefix_hash(tokens[: 4 * BLOCK])
        await wait_for(lambda: adapters["w0"].relay.mirror.chain_to(half),
                       what="w0's adapter to see the first half")  # fmt: skip
        nc = await connect(nats_server.url, name="pull-test")
        bus = Bus(nc, service="pull-test")
        hint = PullHint(source_worker="w0", prefix_hash=prefix_hash(tokens), blocks=BLOCKS)
        final = await run_on(bus, nc, "w1", "r1", [*tokens, 5], pull=hint)
        assert final.usage.cached_tokens == 4 * BLOCK
        assert adapters["w1"].migration.pulls == {"done": 1}
        status = await engine_json(engines["w1"].url, "/kv/status")
        assert status["pulled_blocks"] == 4
        await nc.close()


async def test_a_copy_slower_than_its_budget_is_given_up_and_the_run_prefills(nats_server):
    """The hint's budget is the prefill it saves: a copy paced to ~2.6 s (512 KiB at 200 KB/s)
    with a 0.3 s budget is abandoned at the target's engine, nothing is inserted there, the
    source is released, and the run prefills at once."""
    async with pooled_stack(nats_server.url) as (stack, runners):
        engines, adapters = await two_pooled_workers(stack, runners, pull_gbps=0.0002)
        tokens, p = await held_by_w0(engines, adapters, seed=6)
        nc = await connect(nats_server.url, name="pull-test")
        bus = Bus(nc, service="pull-test")
        hint = PullHint(source_worker="w0", prefix_hash=p, blocks=BLOCKS, budget_s=0.3)
        started = asyncio.get_running_loop().time()
        final = await run_on(bus, nc, "w1", "r1", [*tokens, 5], pull=hint)
        assert asyncio.get_running_loop().time() - started < 2.0
        assert final.usage.cached_tokens == 0
        assert adapters["w1"].migration.pulls == {"failed": 1}
        status = await engine_json(engines["w1"].url, "/kv/status")
        assert (status["pulled_blocks"], status["failed_pulls"]) == (0, 1)
        src = engines["w0"].driver
        await wait_for(lambda: all(src.core.cache.refcount(k) == 0 for k in src.kv_pool.slot_of),
                       what="the source to be released")  # fmt: skip
        await nc.close()


async def test_a_hint_the_source_cannot_honour_leaves_the_run_to_prefill(nats_server):
    async with pooled_stack(nats_server.url) as (stack, runners):
        _, adapters = await two_pooled_workers(stack, runners)
        tokens = prefix_tokens(BLOCKS, seed=5)  # nobody holds it
        nc = await connect(nats_server.url, name="pull-test")
        bus = Bus(nc, service="pull-test")
        hint = PullHint(source_worker="w0", prefix_hash=prefix_hash(tokens), blocks=BLOCKS)
        final = await run_on(bus, nc, "w1", "r1", [*tokens, 5], pull=hint)
        assert final.usage.cached_tokens == 0 and final.usage.completion_tokens == 2
        gone = PullHint(source_worker="w9", prefix_hash=prefix_hash(tokens), blocks=BLOCKS)
        final = await run_on(bus, nc, "w0", "r2", [*tokens, 6], pull=gone)  # no such worker
        assert final.usage.cached_tokens == 0 and final.usage.completion_tokens == 2
        assert adapters["w1"].migration.pulls == {"refused": 1}
        assert adapters["w0"].migration.pulls == {"failed": 1}
        assert not adapters["w0"].migration._incoming and not adapters["w1"].migration._incoming
        await nc.close()


async def test_the_scheduler_orders_the_copy_with_the_run(nats_server):
    """Through the scheduler service: a request whose decision names w1 first, w0 holding its
    prefix, reaches w1 with a ``PullHint`` and is served there from the copied prefix."""
    from thunderagent.migration import MigrationParams
    from thunderagent.scheduler.service import SchedulerConfig, SchedulerService

    async with pooled_stack(nats_server.url) as (stack, runners):
        engines, adapters = await two_pooled_workers(stack, runners)
        # 128 tokens of prefix: at the H100 rate (20,000 tokens/s) the copy's budget would be
        # 6.4 ms, less than this machine's hops; the simulated engine's rate is the one to use
        slow = MigrationParams(pull_min_tokens=1, prefill_tokens_per_s=100.0)
        config = SchedulerConfig(scheduler="direct", pull=slow)
        await stack.start_service(
            "scheduler", lambda ctx, svc: svc.run_service(ctx),
            build=lambda ctx: SchedulerService(config, ctx.bus),
        )  # fmt: skip
        tokens, p = await held_by_w0(engines, adapters, seed=9)
        prompt = [*tokens, 4, 4]
        hashes = BlockHasher(BLOCK).hash_tokens(prompt).primary
        assert hashes[BLOCKS - 1] == p
        decision = RouteDecision(
            request_id="s1", model=MODEL, worker_id="w1", overlap_blocks=0,
            prompt_blocks=len(hashes), policy="test", decided_at=time.time(),
            candidates=[Candidate(worker_id="w1", score=1.0),
                        Candidate(worker_id="w0", score=0.5, overlap_blocks=BLOCKS)],
        )  # fmt: skip
        nc = await connect(nats_server.url, name="pull-test")
        bus = Bus(nc, service="pull-test")
        inbox = nc.new_inbox()
        got: asyncio.Queue = asyncio.Queue()
        await nc.subscribe(inbox, cb=got.put)
        request = GenerateRequest(model=MODEL, request_id="s1", token_ids=prompt, max_tokens=2)
        submit = ScheduleRequest(request=request, reply_subject=inbox, decision=decision,
                                 block_size=BLOCK, block_hashes=hashes)  # fmt: skip
        ack = await bus.request(subjects.sched_submit(MODEL), submit, Ack, timeout=5)
        assert ack.accepted, ack.reason
        while True:
            msg = await asyncio.wait_for(got.get(), 20)
            final = msgspec.json.decode(msg.data, type=TokenChunk | FinalReply)
            if isinstance(final, FinalReply):
                break
        assert final.worker_id == "w1" and final.usage.cached_tokens == BLOCKS * BLOCK
        assert adapters["w1"].migration.pulls == {"done": 1}
        await nc.close()


async def test_a_pull_works_with_every_worker_on_its_own_nats_login(tmp_path, monkeypatch):
    """As `thunderagent up` runs it: NATS logins on, each adapter on its own worker login. The
    run's adapter asks the holder's adapter for the prefix and releases it afterwards; before
    stop 47 a worker's login could not, and every hinted run waited out its budget."""
    import shutil

    from thunderagent.embedded import NatsServer, stack_users, write_credentials

    users = stack_users(["w0", "w1"])
    server = NatsServer(tmp_path / "nats", users=users).start()
    creds = write_credentials(tmp_path / "creds", users)
    for helper in ("wait", "pull-test"):  # the harness's own connections: full rights
        shutil.copy(creds / "admin.json", creds / f"{helper}.json")
    monkeypatch.setenv("THUNDERAGENT_NATS_CREDS", str(creds))
    try:
        async with pooled_stack(server.url) as (stack, runners):
            engines, adapters = await two_pooled_workers(stack, runners)
            tokens, p = await held_by_w0(engines, adapters, seed=11)
            nc = await connect(server.url, name="pull-test")
            bus = Bus(nc, service="pull-test")
            hint = PullHint(source_worker="w0", prefix_hash=p, blocks=BLOCKS, budget_s=5.0)
            started = time.monotonic()
            final = await run_on(bus, nc, "w1", "r1", [*tokens, 7, 7], pull=hint)
            assert final.usage.cached_tokens == BLOCKS * BLOCK
            assert adapters["w1"].migration.pulls == {"done": 1}
            assert time.monotonic() - started < 4.0, "the copy did not wait out its budget"
            src = engines["w0"].driver
            released = lambda: all(src.core.cache.refcount(k) == 0 for k in src.kv_pool.slot_of)  # noqa: E731
            await wait_for(released, what="the source released")
            await nc.close()
    finally:
        server.stop()
