"""KV-aware routing over real NATS + JetStream + Redis: cache hits follow the prefix, late
router replicas agree, lost events are repaired, and Redis going away stops nothing."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import aiohttp
import msgspec
import pytest
import redis.asyncio as aioredis

from tests.integration.inproc import MODEL, inproc_stack, start_full_stack
from thunderagent.client import ThunderClient
from thunderagent.hashing import BlockHasher
from thunderagent.prefix_index.state import IndexState
from thunderagent.router.service import RouterConfig, RouterService
from thunderagent.router_core import RouterParams
from thunderagent.schemas import GenerateRequest, subjects

pytestmark = pytest.mark.integration
PAGE = 16


async def wait_for(predicate, timeout_s: float = 20.0, what: str = "condition"):
    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if loop.time() > give_up_at:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def wait_for_async(predicate, timeout_s: float = 20.0, what: str = "condition"):
    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + timeout_s
    while not await predicate():
        if loop.time() > give_up_at:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def holder_known(core, prefix: list[int], worker_id: str) -> None:
    """Wait until a router core knows ``worker_id`` holds all of ``prefix`` from the KV events
    (its event-fed index, not the in-flight overlay that covers the time before they arrive),
    and has a load report taken after that run ended: one taken during its prefill still shows
    the prompt as queued prefill for up to a report interval, enough for an idle worker to look
    as cheap (a report's lag, not what the callers test)."""
    blocks = BlockHasher(PAGE).hash_tokens(prefix)
    expected = {worker_id: len(prefix) // PAGE}
    await wait_for(
        lambda: core.feeder.gpu_index.overlap(blocks.primary, blocks.check) == expected,
        what="the first request's KV events in the router's index",
    )
    holder = core.fleet.get(worker_id)
    await wait_for(
        lambda: holder.load is not None and holder.load.inflight == 0,
        what="a load report of the holder after the first run",
    )


async def _snapshot_covers(redis, stream_seq: int) -> bool:
    data = await redis.get(subjects.REDIS_INDEX_SNAPSHOT)
    return bool(data) and msgspec.msgpack.decode(data, type=IndexState).stream_seq >= stream_seq


async def routable(nats_url: str, workers: int) -> ThunderClient:
    client = await ThunderClient.connect(nats_url, idle_timeout_s=20)
    for i in range(200):
        try:
            await client.generate(GenerateRequest(model=MODEL, token_ids=[3, i], max_tokens=1))
            return client
        except Exception:
            await asyncio.sleep(0.05)
    raise AssertionError("stack never became routable")


def conversation(seed: int, blocks: int) -> list[int]:
    return [(seed * 7919 + i) % 50_000 + 4 for i in range(blocks * PAGE)]


async def start_router(stack, name: str, redis_url: str | None) -> RouterService:
    config = RouterConfig(params=RouterParams(policy="thunder", seed=1), redis_url=redis_url)
    running = await stack.start_service(
        name, lambda ctx, svc: svc.run(), build=lambda ctx: RouterService(ctx, config)
    )
    return running.runtime


async def test_shared_prefix_lands_on_the_same_worker_with_cached_tokens(nats_server):
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=3, policy="thunder", profile="llama-3.1-8b-h100",
                               speedup=50)  # fmt: skip
        client = await routable(nats_server.url, 3)
        prefix = conversation(1, 12)  # 192 tokens, 12 full blocks
        first = await client.generate(
            GenerateRequest(model=MODEL, token_ids=prefix + [9, 9], max_tokens=4)
        )
        await holder_known(stack.services["router"].runtime.core, prefix, first.final.worker_id)
        second = await client.generate(
            GenerateRequest(model=MODEL, token_ids=prefix + [8, 8, 8], max_tokens=4)
        )
        await client.close()
    assert second.final.worker_id == first.final.worker_id
    assert second.final.usage.cached_tokens == 12 * PAGE
    assert second.final.predicted_cached_tokens == 12 * PAGE


async def test_a_burst_of_new_prompts_spreads_evenly_over_the_fleet(nats_server):
    """Sixteen distinct prompts sent at once to a fleet nobody has used: the router decides
    each before the first hand-off is answered, so it must count its own decisions to spread
    them four to a worker. It booked a request on its worker only once the hand-off was
    answered: here the seeded tie-breaks then gave 3/4/4/5, and in the demo, where one worker's
    load report had come first (it alone showed free KV), all sixteen went to that one."""
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=4, policy="thunder", profile="llama-3.1-8b-h100")
        client = await ThunderClient.connect(nats_server.url, idle_timeout_s=20)
        burst = [  # 4k tokens: ~0.2 s of prefill each, longer than routing all sixteen
            GenerateRequest(model=MODEL, token_ids=conversation(k, 256), max_tokens=2)
            for k in range(16)
        ]
        done = await asyncio.gather(*(client.generate(r) for r in burst))
        await client.close()
    places = Counter(d.final.worker_id for d in done)
    assert sorted(places.values()) == [4, 4, 4, 4], places


async def test_a_prompt_offered_a_moment_ago_counts_before_its_worker_answers(nats_server):
    """On the credit path the router offers a request to its worker and waits for the ack; the
    next decisions see the prompt there from the offer, as the replay, which hands over at
    once, always did. Here each ack is held back 0.5 s (a busy machine's): a second question on
    the same document, decided meanwhile, finds the whole document on the first one's worker
    (before, nothing: it was priced as a full prefill everywhere)."""
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=2, policy="thunder", profile="llama-3.1-8b-h100",
                               speedup=50)  # fmt: skip
        client = await routable(nats_server.url, 2)
        router = stack.services["router"].runtime.router
        await wait_for(lambda: all(router.wallet.available(w) for w in ("w0", "w1")), 10.0,
                       "credit for both workers")  # fmt: skip
        offer, decided = router._offer, {}

        async def late_offer(worker_id, work):
            await asyncio.sleep(0.5)
            return await offer(worker_id, work)

        route = router.core.route

        def remembered(**kwargs):
            decided[kwargs["request_id"]] = routed = route(**kwargs)
            return routed

        router._offer, router.core.route = late_offer, remembered
        document = conversation(5, 32)
        first = asyncio.create_task(client.generate(
            GenerateRequest(request_id="q1", model=MODEL, token_ids=document + [1] * 8,
                            max_tokens=2)
        ))  # fmt: skip
        await wait_for(lambda: len(router.core.bookings.offered) == 1, 5.0, "the first offer")
        second = await client.generate(
            GenerateRequest(request_id="q2", model=MODEL, token_ids=document + [2] * 8,
                            max_tokens=2)
        )  # fmt: skip
        await first
        await client.close()
    holder = decided["q1"].decision.worker_id
    assert decided["q2"].expected.get(holder) == 32
    assert second.final.worker_id in ("w0", "w1")


async def test_llm_d_sends_a_shared_prefix_where_its_own_record_of_picks_says(nats_server):
    """The llm-d peer, as it ships (its direct dispatch), in the running router: it reads no
    index, only the blocks it recorded at each pick, and the second request finds its prefix
    cached on the worker the first went to."""
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=3, policy="llm_d", scheduler="direct",
                               profile="llama-3.1-8b-h100", speedup=50)  # fmt: skip
        client = await routable(nats_server.url, 3)
        prefix = conversation(2, 12)
        first = await client.generate(
            GenerateRequest(model=MODEL, token_ids=prefix + [9, 9], max_tokens=4)
        )
        policy = stack.services["router"].runtime.core.policy
        recorded = BlockHasher(PAGE).hash_tokens(prefix).primary
        assert set(recorded) <= set(policy._lrus[first.final.worker_id])
        second = await client.generate(
            GenerateRequest(model=MODEL, token_ids=prefix + [8, 8, 8], max_tokens=4)
        )
        await client.close()
    assert second.final.worker_id == first.final.worker_id
    assert second.final.usage.cached_tokens == 12 * PAGE


async def test_engines_without_kv_events_have_their_cache_announced_by_their_adapters(
    nats_server,
):
    """SGLang without ``--kv-events-config`` (its default): the adapters register so and
    announce what each run leaves cached (its prompt at the first token, prompt and output at
    the end) as the engine's own events would. Every router replica learns it, one that did
    not route the first request too; a request sent after the in-flight overlay forgot the
    first goes to its worker and finds the prompt cached."""
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=3, policy="thunder", profile="llama-3.1-8b-h100",
                               speedup=50, kv_events=False,
                               router_params={"inflight_ttl_s": 0.3})  # fmt: skip
        other = await start_router(stack, "router-b", None)
        client = await routable(nats_server.url, 3)
        core = stack.services["router"].runtime.core
        assert [s.registration.kv_events for s in core.fleet.all()] == [False] * 3
        prefix = conversation(3, 12)
        first = await client.generate(
            GenerateRequest(model=MODEL, token_ids=prefix + [9, 9], max_tokens=40)
        )
        holder = first.final.worker_id
        await holder_known(core, prefix, holder)
        await holder_known(other.core, prefix, holder)
        answer = prefix + [9, 9] + first.token_ids[:-1]  # cached at the run's end
        assert len(answer) // PAGE == 14, "two blocks past the prompt's"
        hashes = BlockHasher(PAGE).hash_tokens(answer)
        await wait_for(
            lambda: core.feeder.gpu_index.overlap(hashes.primary, hashes.check) == {holder: 14},
            what="the prompt and its answer announced as cached",
        )
        await asyncio.sleep(0.5)  # past the overlay's TTL
        overlay = core.inflight.matches(*core.hash_tokens(prefix, PAGE), time.time())
        assert overlay == {}, "the overlay has forgotten the first request"
        second = await client.generate(
            GenerateRequest(model=MODEL, token_ids=prefix + [8, 8, 8], max_tokens=4)
        )
        await client.close()
    assert second.final.worker_id == holder
    assert second.final.usage.cached_tokens == 12 * PAGE
    assert second.final.predicted_cached_tokens == 12 * PAGE


async def test_an_engine_without_events_that_stops_answering_loses_what_was_inferred(
    nats_server,
):
    """Nothing would say an eventless engine restarted with an empty cache: once it stops
    answering, its adapter withdraws everything it announced, and the routers forget it."""
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=2, policy="thunder", profile="llama-3.1-8b-h100",
                               speedup=50, kv_events=False)  # fmt: skip
        client = await routable(nats_server.url, 2)
        core = stack.services["router"].runtime.core
        prefix = conversation(5, 8)
        first = await client.generate(
            GenerateRequest(model=MODEL, token_ids=prefix + [7], max_tokens=2)
        )
        holder = first.final.worker_id
        await holder_known(core, prefix, holder)
        await client.close()
        await stack.kill_engine(holder)
        await wait_for(
            lambda: core.feeder.gpu_index.block_counts().get(holder, 0) == 0,
            what="the holder's announced blocks withdrawn",
        )
        relay = stack.relays[holder]
        assert relay.mirror.blocks == {}


async def test_an_eventless_engine_flushed_by_hand_is_corrected_by_its_own_report(nats_server):
    """A flushed cache (by hand, or by a weight update) announces nothing without events. The
    next run on that worker reports how much of its prompt the engine found (SGLang's
    ``cached_tokens``): none of the shared prefix, so what the adapter had announced under it,
    another conversation's blocks included, is withdrawn."""
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=1, policy="thunder", profile="llama-3.1-8b-h100",
                               speedup=50, kv_events=False)  # fmt: skip
        client = await routable(nats_server.url, 1)
        core = stack.services["router"].runtime.core
        shared = conversation(7, 8)
        other = shared + conversation(8, 4)
        for prompt in (other, shared + conversation(9, 4)):
            done = await client.generate(GenerateRequest(model=MODEL, token_ids=prompt + [5],
                                                         max_tokens=2))  # fmt: skip
            await holder_known(core, prompt, done.final.worker_id)
        hashes = BlockHasher(PAGE).hash_tokens(other)
        assert core.feeder.gpu_index.overlap(hashes.primary, hashes.check) == {"w0": 12}
        async with aiohttp.ClientSession() as session:
            flushed = await session.post(stack.engine_urls["w0"] + "/flush_cache")
            assert flushed.status == 200
        third = await client.generate(
            GenerateRequest(model=MODEL, token_ids=shared + conversation(10, 4) + [5], max_tokens=2)
        )
        await client.close()
        assert third.final.usage.cached_tokens == 0, "the engine had lost the shared prefix"
        await wait_for(
            lambda: core.feeder.gpu_index.overlap(hashes.primary, hashes.check) == {"w0": 8},
            what="the other conversation's blocks withdrawn, the shared prefix stored again",
        )


async def test_late_replica_agrees_dropped_events_repair_and_redis_loss(nats_server, redis_server):
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=3, policy="thunder", profile="llama-3.1-8b-h100",
                               speedup=50, redis_url=redis_server.url)  # fmt: skip
        first_router = await start_router(stack, "router-a", redis_server.url)
        client = await routable(nats_server.url, 3)
        prompts = [conversation(s, 6 + s % 5) for s in range(12)]
        for p in prompts:
            await client.generate(GenerateRequest(model=MODEL, token_ids=p + [1], max_tokens=3))
        hasher = BlockHasher(PAGE)
        probes = [hasher.hash_tokens(p) for p in prompts]

        def overlaps(svc):
            return [svc.core.feeder.index.overlap(h.primary, h.check) for h in probes]

        # 1. a replica started now (snapshot from Redis + stream replay) sees what the others see
        index_svc = stack.services["index"].runtime
        redis = aioredis.from_url(redis_server.url)
        await wait_for_async(
            lambda: _snapshot_covers(redis, index_svc.follower.stream_seq), what="a snapshot"
        )
        await redis.aclose()
        late = await start_router(stack, "router-late", redis_server.url)
        await wait_for(lambda: late.follower.caught_up.is_set(), what="late replica catch-up")
        await wait_for(lambda: overlaps(late) == overlaps(first_router), what="replicas to agree")
        assert late.follower.restored_from > 0, "the late replica should start from the snapshot"
        assert any(overlaps(late)), "the probes should hit somewhere"

        # 2. a lost KV event is detected by the index service and repaired by a resync
        for relay in stack.relays.values():
            relay.seq += 1  # each worker's next batch skips a number, as if one was lost
        before = index_svc.resyncs_requested
        await client.generate(
            GenerateRequest(model=MODEL, token_ids=conversation(99, 8), max_tokens=2)
        )
        await wait_for(lambda: index_svc.resyncs_requested > before, what="a resync request")

        def index_matches_mirrors():
            return all(
                set(index_svc.follower.index.dump_worker(wid).primary)
                == {b.primary for b in relay.mirror.blocks.values()}
                for wid, relay in stack.relays.items()
            )

        await wait_for(index_matches_mirrors, what="the index to match every adapter's mirror")

        # 3. Redis dies: routing goes on, and a replica started now replays the whole stream
        redis_server.stop()
        done = await client.generate(
            GenerateRequest(model=MODEL, token_ids=prompts[0] + [2], max_tokens=2)
        )
        assert done.final.usage.cached_tokens >= 6 * PAGE
        cold = await start_router(stack, "router-cold", redis_server.url)
        await wait_for(lambda: cold.follower.caught_up.is_set(), what="cold replica catch-up")
        assert cold.follower.restored_from == 0
        await wait_for(
            lambda: overlaps(cold) == overlaps(first_router), what="cold replica to agree"
        )
        await client.close()


async def test_host_tier_blocks_reach_the_router_as_host_only(nats_server):
    async with inproc_stack(nats_server.url) as stack:
        # tiny profile: 32 GPU blocks of 16 tokens; 64 more blocks in host memory
        await start_full_stack(stack, workers=1, policy="thunder", profile="tiny", host_blocks=64)
        router = await start_router(stack, "router-tiers", None)
        client = await routable(nats_server.url, 1)
        first = conversation(7, 8)
        await client.generate(GenerateRequest(model=MODEL, token_ids=first, max_tokens=2))
        for s in range(20, 26):  # other prompts push the first one's blocks out of the GPU
            await client.generate(
                GenerateRequest(model=MODEL, token_ids=conversation(s, 8), max_tokens=2)
            )
        h = BlockHasher(PAGE).hash_tokens(first)

        def tiers():
            feeder = router.core.feeder
            gpu = feeder.gpu_index.overlap(h.primary, h.check).get("w0", 0)
            return gpu, feeder.index.overlap(h.primary, h.check).get("w0", 0)

        await wait_for(lambda: router.core.feeder.gpu is not None, what="a host-tier event")
        await wait_for(lambda: tiers()[1] > tiers()[0], what="host-only blocks in the index")
        again = await client.generate(GenerateRequest(model=MODEL, token_ids=first, max_tokens=2))
        await client.close()
    assert (
        again.final.usage.cached_tokens >= tiers()[1] * PAGE - PAGE
    )  # loaded back, not recomputed
