"""Worker adapter lifecycle: a killed adapter's worker leaves routing within its lease, and a
restarted engine (event sequence back to 0, cache empty) is resynced, not misread."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import msgspec
import pytest

from tests.integration.inproc import MODEL, inproc_stack, start_full_stack
from tests.integration.test_kv_routing import conversation, routable, start_router, wait_for
from thunderagent.hashing import BlockHasher
from thunderagent.schemas import GenerateRequest
from thunderagent.sglang.load import LOADS_PATH, OLD_LOAD_PATH

pytestmark = pytest.mark.integration


async def test_killed_adapter_drops_out_within_its_lease(nats_server, redis_server):
    lease_s = 2.0
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=1, redis_url=redis_server.url)
        router = await start_router(stack, "router-watch", None)
        url = await stack.start_engine("wk")
        adapter = subprocess.Popen(
            [sys.executable, "-m", "thunderagent.cli.main", "worker", "--nats", nats_server.url,
             "--worker-id", "wk", "--engine-url", url, "--lease-s", str(lease_s)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            await wait_for(lambda: "wk" in router.core.fleet, timeout_s=20, what="wk to register")
            index = stack.services["index"]
            warm = await routable(nats_server.url, 2)  # a prompt cached on wk: the index has it
            for i in range(8):  # least loaded: some land on wk
                await warm.generate(GenerateRequest(model=MODEL, token_ids=[9 + i] * 64,
                                                    max_tokens=1))  # fmt: skip
            await warm.close()
            await wait_for(lambda: "wk" in index.runtime.follower.index.workers, timeout_s=10,
                           what="the index to learn wk's blocks")  # fmt: skip
            os.kill(adapter.pid, signal.SIGKILL)
            adapter.wait()
            killed_at = time.monotonic()
            await wait_for(lambda: "wk" not in router.core.fleet, timeout_s=lease_s + 5,
                           what="wk to leave the registry")  # fmt: skip
            gone_after = time.monotonic() - killed_at
            await wait_for(lambda: "wk" not in index.runtime.follower.index.workers,
                           timeout_s=5, what="the index service to drop wk")  # fmt: skip
            assert not index.task.done(), "the index service outlives a worker's departure"
        finally:
            if adapter.poll() is None:
                adapter.kill()
        client = await routable(nats_server.url, 1)
        workers = set()
        for i in range(6):
            done = await client.generate(
                GenerateRequest(model=MODEL, token_ids=[5, i], max_tokens=1)
            )
            workers.add(done.final.worker_id)
        await client.close()
    # load reports stop at once; the lease (plus one expiry tick) bounds the time to forget it
    assert gone_after <= lease_s + 1.0
    assert workers == {"w0"}


async def test_restarted_engine_is_resynced(nats_server, redis_server):
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=1, redis_url=redis_server.url, policy="thunder")
        client = await routable(nats_server.url, 1)
        for s in range(3):
            await client.generate(
                GenerateRequest(model=MODEL, token_ids=conversation(s, 4), max_tokens=2)
            )
        relay = stack.relays["w0"]
        index = stack.services["index"].runtime.follower.index
        await wait_for(lambda: len(index.dump_worker("w0").primary) > 0, what="indexed blocks")
        old_blocks = set(index.dump_worker("w0").primary)
        await stack.restart_engine("w0")
        await asyncio.sleep(0.5)  # ZMQ SUB reconnects every 100 ms (a real restart takes minutes)
        done = await client.generate(
            GenerateRequest(model=MODEL, token_ids=conversation(0, 4), max_tokens=2)
        )
        assert done.final.usage.cached_tokens == 0  # the restarted engine really is empty
        # its first KV batch restarts at seq 0: the relay reads that as a restart, clears its
        # mirror and the index's entries, then indexes the new engine's blocks only
        await wait_for(
            lambda: (
                set(index.dump_worker("w0").primary)
                == {b.primary for b in relay.mirror.blocks.values()}
                and relay.mirror.blocks
            ),
            what="the index to follow the new engine",
        )
        stale = old_blocks & set(index.dump_worker("w0").primary)
        fresh = set(BlockHasher(16).hash_tokens(conversation(0, 4)).primary)
        assert stale <= fresh, "blocks of the old engine's other prompts are still indexed"
        await client.close()


async def _sender_with_inbox(url: str, name: str):
    """A connection that hands runs to adapters itself, and the inbox their answers reach."""
    from thunderagent.bus import Bus, connect

    nc = await connect(url, name=name)
    got: asyncio.Queue = asyncio.Queue()
    inbox = nc.new_inbox()
    await nc.subscribe(inbox, cb=got.put)
    return nc, Bus(nc, service=name), inbox, got


async def test_a_repeated_hand_off_is_idempotent(nats_server):
    """A sender whose ack came late asks again: the same hand-off (same reply subject) is
    acked without a second run; the same id for another client is refused."""
    from thunderagent.schemas import Ack, FinalReply, TokenChunk, WorkerGenerate, subjects

    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=1, profile="tiny", block_size=16, speedup=5.0,
                               with_scheduler=False)  # fmt: skip
        nc, bus, inbox, got = await _sender_with_inbox(nats_server.url, "handoff-test")
        request = GenerateRequest(model=MODEL, request_id="h1", token_ids=[5] * 16, max_tokens=40)
        work = WorkerGenerate(request=request, reply_subject=inbox)
        first = await bus.request(subjects.worker_generate("w0"), work, Ack, timeout=5)
        again = await bus.request(subjects.worker_generate("w0"), work, Ack, timeout=5)
        other = WorkerGenerate(request=request, reply_subject=nc.new_inbox())
        refused = await bus.request(subjects.worker_generate("w0"), other, Ack, timeout=5)
        assert first.accepted and again.accepted
        assert not refused.accepted and "another client" in refused.reason
        finals, tokens = 0, []
        while True:
            msg = await asyncio.wait_for(got.get(), 10)
            reply = msgspec.json.decode(msg.data, type=TokenChunk | FinalReply)
            if isinstance(reply, FinalReply):
                finals += 1
                break
            tokens.extend(reply.token_ids)
        await asyncio.sleep(0.3)  # a second run would stream more by now
        assert finals == 1 and got.empty() and len(tokens) == 40
        await nc.close()


async def test_an_engine_without_v1_loads_is_read_through_get_load(nats_server):
    """SGLang before 0.5 has no ``/v1/loads``: on its 404 the adapter reads ``/get_load``
    from then on and the worker stays in the fleet with its load reported."""
    from thunderagent.worker.engine_client import EngineError

    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=1, profile="tiny", with_scheduler=False)
        adapter = stack.services["worker-w0"].runtime
        real = adapter.engine.get_json
        asked: list[str] = []

        async def older_sglang(path: str):
            asked.append(path)
            if path == LOADS_PATH:
                raise EngineError(404, "Not Found")
            return await real(path)

        adapter.engine.get_json = older_sglang
        await wait_for(lambda: asked.count(OLD_LOAD_PATH) >= 3, what="three /get_load polls")
        report = await adapter.read_load()
    assert asked.count(LOADS_PATH) == 1 and adapter.engine_healthy.is_set()
    assert report.kv_total_blocks > 0 and report.running == 0


async def test_an_engine_load_that_is_not_a_load_makes_it_unhealthy_not_the_adapter_die(
    nats_server,
):
    """``/get_load`` answering garbage counts as a failed poll: the adapter marks the engine
    unhealthy (leaves the fleet) and lives; a good answer brings it back."""
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=1, profile="tiny", with_scheduler=False)
        svc = stack.services["worker-w0"]
        adapter = svc.runtime
        real = adapter.engine.get_json

        async def garbage(path: str):
            if path == LOADS_PATH:
                return {"loads": [{"num_running_reqs": "lots", "num_waiting_reqs": {"a": 1}}]}
            return await real(path)

        adapter.engine.get_json = garbage
        for _ in range(200):
            if not adapter.engine_healthy.is_set():
                break
            await asyncio.sleep(0.02)
        assert not adapter.engine_healthy.is_set(), "garbage loads make the engine unhealthy"
        assert not svc.task.done(), "the adapter must outlive its engine's bad answers"
        adapter.engine.get_json = real
        for _ in range(200):
            if adapter.engine_healthy.is_set():
                break
            await asyncio.sleep(0.02)
        assert adapter.engine_healthy.is_set() and not svc.task.done()


async def test_a_run_that_raises_unforeseen_still_answers_its_client(nats_server):
    """Whatever breaks inside a run (here the engine client raising what no handler names),
    the client hears an error instead of waiting out its timeout, and the run leaves the
    adapter's books."""
    from thunderagent.schemas import Ack, ErrorCode, ErrorReply, WorkerGenerate, subjects

    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=1, profile="tiny", with_scheduler=False)
        svc = stack.services["worker-w0"]
        adapter = svc.runtime

        async def broken_stream(*_args, **_kwargs):
            raise AttributeError("a shape nobody foresaw")
            yield  # an async generator, as the engine client's is

        adapter.engine.generate = broken_stream
        nc, bus, inbox, got = await _sender_with_inbox(nats_server.url, "unforeseen-test")
        request = GenerateRequest(model=MODEL, request_id="u1", token_ids=[5] * 16, max_tokens=4)
        ack = await bus.request(subjects.worker_generate("w0"), WorkerGenerate(
            request=request, reply_subject=inbox), Ack, timeout=5)  # fmt: skip
        assert ack.accepted
        msg = await asyncio.wait_for(got.get(), 10)
        reply = msgspec.json.decode(msg.data, type=ErrorReply)
        assert reply.code == ErrorCode.ENGINE_ERROR and "foresaw" in reply.message
        for _ in range(100):
            if not adapter.running:
                break
            await asyncio.sleep(0.02)
        assert not adapter.running and not svc.task.done()
        await nc.close()


async def test_a_second_adapter_on_a_live_worker_id_refuses_to_start(nats_server):
    """Two adapters on one id both took every request sent to it: each answer streamed twice,
    interleaved, and the registrations and KV events of the two engines overwrote each other."""
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=1)  # w0, lease 2 s, renewed every 0.67 s
        url = await stack.start_engine("other")
        started = time.monotonic()
        second = await asyncio.create_subprocess_exec(  # the stack in this loop keeps renewing
            sys.executable, "-m", "thunderagent.cli.main", "worker", "--nats", nats_server.url,
            "--worker-id", "w0", "--engine-url", url, "--lease-s", "2",
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            _, err = await asyncio.wait_for(second.communicate(), 30)
        finally:
            if second.returncode is None:
                second.kill()
        assert second.returncode == 1, err
        assert err.decode().strip().splitlines()[-1] == (
            f"worker id 'w0' is in use by a live adapter in front of {stack.engine_urls['w0']}: "
            "give this one another --worker-id"
        )
        assert time.monotonic() - started < 20
        client = await routable(nats_server.url, 1)
        done = await client.generate(GenerateRequest(model=MODEL, token_ids=[5, 6], max_tokens=8))
        await client.close()
        assert done.final.worker_id == "w0" and len(done.token_ids) == 8  # once, from one engine
        assert stack.engines["other"].core.load().num_running == 0


async def test_a_registration_nobody_renews_is_taken_over(nats_server):
    """An adapter that died left its key: the next one on that id waits one renewal, then
    registers."""
    from thunderagent.bus import Bus, connect
    from thunderagent.shell.fleet import workers_bucket

    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=1)
        url = await stack.start_engine("wz")
        nc = await connect(nats_server.url, name="test")
        bucket = await workers_bucket(Bus(nc, service="test"))
        stale = {"worker_id": "wz", "model": MODEL, "engine_url": "http://gone:1", "block_size": 16,
                 "kv_capacity_blocks": 10, "lease_s": 2.0, "registered_at": 1.0}  # fmt: skip
        await bucket.put("wz", msgspec.json.encode(stale))
        adapter = subprocess.Popen(
            [sys.executable, "-m", "thunderagent.cli.main", "worker", "--nats", nats_server.url,
             "--worker-id", "wz", "--engine-url", url, "--lease-s", "2"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:

            async def registered_here() -> bool:
                seen = await bucket.get("wz")
                return seen is not None and msgspec.json.decode(seen[1])["engine_url"] == url

            give_up = time.monotonic() + 20
            while not await registered_here():
                assert adapter.poll() is None, adapter.stderr.read()
                assert time.monotonic() < give_up, "the adapter never took over wz"
                await asyncio.sleep(0.1)
        finally:
            adapter.terminate()
            adapter.wait(timeout=10)
            await nc.close()


async def test_an_engine_down_for_long_is_logged_once_per_doubling_and_its_return_once(
    nats_server, caplog
):
    """The adapter logged every failed load poll: five warnings a second for as long as the
    engine stayed down, and nothing when it came back."""
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=1)  # load polls every 0.05 s
        with caplog.at_level("WARNING", logger="thunderagent.worker.adapter"):
            _, port, events, *_ = stack._engine_setup["w0"]
            await stack.kill_engine("w0")
            await asyncio.sleep(3.0)  # ~60 failed polls
            await stack.start_engine("w0", port=port, events_config=events)  # back, same place
            back = [r for r in caplog.records if "answers again" in r.getMessage()]
            give_up = time.monotonic() + 10
            while not back and time.monotonic() < give_up:
                await asyncio.sleep(0.1)
                back = [r for r in caplog.records if "answers again" in r.getMessage()]
    failed = [r for r in caplog.records if "load poll failed" in r.getMessage()]
    assert 4 <= len(failed) <= 8, [r.getMessage() for r in failed]  # 1, 2, 4, ... 32 (64)
    assert len(back) == 1


async def test_stopping_one_run_leaves_a_run_whose_id_it_begins(nats_server):
    """The simulated engine aborts by rid prefix, as SGLang's /abort_request does: stopping
    ``req-1`` must not stop ``req-10`` on the same engine (the adapter's engine ids are
    prefix-free)."""
    from thunderagent.schemas import (
        AbortRequest,
        Ack,
        FinalReply,
        Preempted,
        TokenChunk,
        WorkerGenerate,
        subjects,
    )

    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=1, profile="tiny", block_size=16, speedup=1.0,
                               with_scheduler=False)  # fmt: skip
        nc, bus, inbox, got = await _sender_with_inbox(nats_server.url, "prefix-abort-test")
        for rid in ("req-1", "req-10"):
            request = GenerateRequest(model=MODEL, request_id=rid, token_ids=[7] * 16,
                                      max_tokens=200)  # fmt: skip
            work = WorkerGenerate(request=request, reply_subject=f"{inbox}.{rid}")
            await nc.subscribe(work.reply_subject, cb=got.put)
            assert (await bus.request(subjects.worker_generate("w0"), work, Ack)).accepted
        stop = AbortRequest(request_id="req-1", reason="test")
        stopped = await bus.request(subjects.worker_abort("w0"), stop, Preempted)
        assert stopped.found
        tokens: dict[str, int] = {"req-1": 0, "req-10": 0}
        final = None
        while final is None:
            msg = await asyncio.wait_for(got.get(), 20)
            reply = msgspec.json.decode(msg.data, type=TokenChunk | FinalReply)
            if isinstance(reply, FinalReply):
                final = reply
            else:
                tokens[reply.request_id] += len(reply.token_ids)
        await nc.close()
    assert final.request_id == "req-10" and final.usage.completion_tokens == 200
    assert tokens["req-10"] == 200 and tokens["req-1"] < 200
