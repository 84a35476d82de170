"""The scheduler service over real NATS: preemption keeps the client's stream whole, deadlines
are answered early, and every submission ends in tokens or an error."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from tests.integration.inproc import MODEL, inproc_stack, start_full_stack
from tests.integration.test_kv_routing import routable, wait_for
from thunderagent.bus import Bus, connect
from thunderagent.bus.bus import encode
from thunderagent.client import RequestFailed
from thunderagent.scheduler.metrics import events_by_kind
from thunderagent.schemas import (
    REPLY_DECODER,
    Ack,
    CancelRequest,
    Candidate,
    DeadLetter,
    DirectDispatch,
    ErrorCode,
    FinalReply,
    GenerateRequest,
    HeldReply,
    ProgramRelease,
    RouteDecision,
    SamplingParams,
    ScheduleRequest,
    TokenChunk,
    WorkerGenerate,
    subjects,
)

pytestmark = pytest.mark.integration


async def collect(client, request):
    chunks, final = [], None
    async for reply in client.stream(request):
        if isinstance(reply, TokenChunk):
            chunks.append(reply)
        elif isinstance(reply, FinalReply):
            final = reply
        else:
            raise AssertionError(f"unexpected {reply}")
    return chunks, final, time.monotonic()


async def test_preempted_long_request_streams_unbroken_and_short_one_goes_first(nats_server):
    async with inproc_stack(nats_server.url) as stack:
        # one worker that runs one request at a time: a short urgent request must preempt
        await start_full_stack(
            stack,
            workers=1,
            scheduler="preempt",
            scheduler_params={"max_running": 1, "preempt_min_remaining_tokens": 32},
            profile="tiny",
        )
        client = await routable(nats_server.url, 1)
        long_req = GenerateRequest(model=MODEL, token_ids=list(range(10, 74)), max_tokens=400,
                                   priority=5)  # fmt: skip
        long_task = asyncio.create_task(collect(client, long_req))
        await asyncio.sleep(0.3)  # the long request is decoding
        short_req = GenerateRequest(model=MODEL, token_ids=[7, 8, 9], max_tokens=3, priority=0)
        short_chunks, short_final, short_done = await collect(client, short_req)
        assert short_final.usage.completion_tokens == 3
        long_chunks, long_final, long_done = await long_task
        sched = stack.services["scheduler"].runtime
        await client.close()
    assert sched.core.stats()["preempted"] >= 1
    assert short_done < long_done
    assert sum(len(c.token_ids) for c in short_chunks) == 3
    # the long request's client saw one stream: contiguous indices, every token once
    indices = []
    for c in long_chunks:
        indices.extend(range(c.index, c.index + len(c.token_ids)))
    assert indices == list(range(400))
    assert long_final.usage.completion_tokens == 400
    assert long_final.usage.prompt_tokens == 64
    # the continuation found the KV the preempted run left behind
    assert long_final.usage.cached_tokens >= 48


async def test_deadline_in_the_past_is_answered_at_once(nats_server):
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=1)
        client = await routable(nats_server.url, 1)
        late = GenerateRequest(
            model=MODEL, token_ids=[5] * 20, max_tokens=8, deadline_ms=time.time() * 1e3 - 1000
        )
        with pytest.raises(RequestFailed) as info:
            await client.generate(late)
        await client.close()
        # the router counted it as load on its first candidate from the decision: the
        # scheduler's ``Dropped`` lets that go now, not when the booking lapses (30 s)
        fleet = stack.services["router"].runtime.router.core.fleet
        await wait_for(lambda: not any(w.booked for w in fleet.all()), 5.0, "the booking gone")
        # what an operator's dashboard reads: the scheduler's decisions, by kind
        scheduler = stack.services["scheduler"].runtime
        events = {o.attributes["event"]: o.value for o in events_by_kind(scheduler)}
    assert info.value.error.code == ErrorCode.DEADLINE
    assert events["rejected"] == 1 and events["submitted"] >= 1
    assert "waiting" not in events  # a level, not a count


async def test_a_request_cancelled_while_it_waits_stops_counting_on_its_worker(nats_server):
    """The router counts a request as load on its first candidate from the decision until a
    worker takes it. One the scheduler holds (its worker is full) and the client then cancels
    never reaches a worker: the scheduler's ``Dropped`` lets the router's booking go."""
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=1, profile="tiny", scheduler="fcfs",
                               scheduler_params={"max_running": 1})  # fmt: skip
        client = await routable(nats_server.url, 1)
        slow = SamplingParams(ignore_eos=True)
        running = asyncio.create_task(client.generate(
            GenerateRequest(model=MODEL, token_ids=[11] * 8, max_tokens=300, sampling=slow)
        ))  # fmt: skip
        await asyncio.sleep(0.3)  # it holds the only slot
        held = GenerateRequest(request_id="held-1", model=MODEL, token_ids=[12] * 8, max_tokens=2)
        waiting = asyncio.create_task(client.generate(held))
        fleet = stack.services["router"].runtime.router.core.fleet
        await wait_for(lambda: "held-1" in fleet.get("w0").booked, 5.0, "its booking")
        waiting.cancel()  # the client stops waiting (and will not resend it)
        await client.nc.publish(subjects.SCHED_CANCEL, encode(CancelRequest(request_id="held-1")))
        await wait_for(lambda: not fleet.get("w0").booked, 2.0, "the booking gone")
        await running
        await client.close()


async def test_a_resend_of_a_running_request_stops_counting_as_new_load(nats_server):
    """A client resends a request that is running (it heard nothing in time): its router routes
    the resend and books it on a worker, and the scheduler answers that the run it holds is the
    request's one. The resend is no new load: the scheduler's ``Dropped`` lets that booking go
    while the run goes on (else it counted on its worker until the run ended)."""
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=2, speedup=0.05)  # a run of seconds
        client = await routable(nats_server.url, 2)
        await client.close()
        nc = await connect(nats_server.url, name="resender")
        inbox, replies = nc.new_inbox(), asyncio.Queue()

        async def on_reply(msg) -> None:
            replies.put_nowait(REPLY_DECODER.decode(msg.data))

        await nc.subscribe(inbox, cb=on_reply)
        slow = SamplingParams(ignore_eos=True)
        request = GenerateRequest(request_id="resent-1", model=MODEL, token_ids=[13] * 40,
                                  max_tokens=300, sampling=slow)  # fmt: skip
        subject = subjects.requests(MODEL)
        await nc.publish(subject, encode(request), reply=inbox)
        assert isinstance(await asyncio.wait_for(replies.get(), 10), TokenChunk)
        fleet = stack.services["router"].runtime.router.core.fleet
        await nc.publish(subject, encode(msgspec.structs.replace(request, retry=1)), reply=inbox)
        got = []
        while not any(isinstance(r, HeldReply) for r in got):
            got.append(await asyncio.wait_for(replies.get(), 10))
        await wait_for(lambda: not any(s.booked for s in fleet.all()), 2.0, "the booking gone")
        got.append(await asyncio.wait_for(replies.get(), 10))
        assert isinstance(got[-1], TokenChunk)  # the run goes on
        await nc.publish(subjects.SCHED_CANCEL, encode(CancelRequest(request_id="resent-1")))
        sched = stack.services["scheduler"].runtime
        await wait_for(lambda: not sched.pending, 5.0, "the run stopped")  # the client left
        await nc.close()


async def test_a_hand_off_that_raises_is_answered_and_forgotten(nats_server):
    """A bug in carrying out a decision reaches the client as an error: nothing waits forever
    and the scheduler's books do not keep the request."""
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=1)
        client = await routable(nats_server.url, 1)
        sched = stack.services["scheduler"].runtime

        async def broken(*_args, **_kwargs):
            raise RuntimeError("a bug in the hand-off")

        sched.handoff.dispatch = broken
        # a program step goes through the scheduler's queue, not the router's credit
        req = GenerateRequest(model=MODEL, token_ids=[5] * 20, max_tokens=4, program_id="p-bug")
        with pytest.raises(RequestFailed) as info:
            await client.generate(req)
        await client.close()
    assert info.value.error.code == ErrorCode.INTERNAL
    assert not sched.pending and sum(sched.waiting.values()) == 0
    assert sched.core.stats()["running"] == 0


async def test_program_steps_and_release(nats_server):
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=2, policy="thunder", profile="tiny")
        client = await routable(nats_server.url, 2)
        context = list(range(100, 132))
        workers = []
        for step in range(3):
            req = GenerateRequest(model=MODEL, token_ids=context, max_tokens=8, program_id="p1")
            done = await client.generate(req)
            workers.append(done.final.worker_id)
            context = context + done.token_ids + [300 + step] * 8
        nc = await connect(nats_server.url, name="release")
        await nc.publish(subjects.PROGRAM_RELEASE, encode(ProgramRelease(program_id="p1")))
        await nc.flush()
        sched = stack.services["scheduler"].runtime
        await wait_for(lambda: not sched.core.programs.programs, what="the program release")
        await nc.close()
        await client.close()
    assert len(set(workers)) == 1, f"a program should stay on the worker with its KV: {workers}"


async def test_a_follower_goes_through_admission_and_hits_its_leaders_prefix(nats_server):
    """A request for a long prefix the previous one is still prefilling: the router's overlay
    predicts the hit, the engine has not confirmed it, so it skips the credit fast path and goes
    through the scheduler's queue, to the leader's worker, where it finds the whole prefix."""
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=1, policy="thunder", profile="llama-3.1-8b-h100")
        client = await routable(nats_server.url, 1)
        sched = stack.services["scheduler"].runtime.core
        prefix = list(range(1000, 1000 + 8192))  # 512 blocks: ~0.4 s of prefill
        leader = asyncio.create_task(
            client.generate(
                GenerateRequest(
                    model=MODEL, token_ids=[*prefix, 1], max_tokens=2, request_id="leader"
                )
            )
        )
        await wait_for(lambda: "leader" in sched.running, what="the leader's dispatch")
        before = sched.stats()
        follower = await client.generate(
            GenerateRequest(model=MODEL, token_ids=[*prefix, 2], max_tokens=2)
        )
        first = await leader
        after = sched.stats()
        await client.close()
    assert first.final.usage.cached_tokens == 0
    queued = (after["submitted"] - after["direct"]) - (before["submitted"] - before["direct"])
    assert queued == 1, "the follower went through the queue, not on credit"
    assert follower.final.usage.cached_tokens == len(prefix)


async def test_a_direct_dispatch_of_text_is_dead_lettered_not_booked(nats_server):
    """The router tokenizes; a direct-dispatch notice whose request is text could never be
    resumed (a preempted or failed run continues from token ids): the scheduler used to book
    it and fail on the first continuation (found by the long fuzz run, seed 20261205)."""
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=1)
        sched = stack.services["scheduler"].runtime
        nc = await connect(nats_server.url, name="test-direct")
        dead: list[DeadLetter] = []

        async def on_dead(msg) -> None:
            dead.append(msgspec.json.decode(msg.data, type=DeadLetter))

        await nc.subscribe(subjects.dead_letter("scheduler"), cb=on_dead)
        submit = ScheduleRequest(
            request=GenerateRequest(request_id="text-1", model=MODEL, token_ids=[5], max_tokens=4),
            reply_subject="_INBOX.test.1", decision=_decision("text-1"), block_hashes=[1],
            router_id="r1",
        )  # fmt: skip
        notice = msgspec.to_builtins(DirectDispatch(submit=submit, worker_id="w0"))
        del notice["submit"]["request"]["token_ids"]  # what a publisher that skipped it sends
        notice["submit"]["request"]["text"] = "hello"
        await nc.publish(subjects.sched_direct(MODEL), msgspec.json.encode(notice))
        await wait_for(lambda: dead, what="a dead letter")
        await nc.close()
    assert "carries token ids" in dead[0].reason
    assert "text-1" not in sched.pending


async def test_a_copy_the_router_ordered_on_its_fast_path_is_booked_by_the_scheduler(nats_server):
    """A direct-dispatch notice carries the pull the router sent with the run: the scheduler
    books that copy's time on both links, so its own pull decisions see them busy."""
    from thunderagent.schemas import PullHint

    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=1)
        pulls = stack.services["scheduler"].runtime.handoff.pulls
        nc = await connect(nats_server.url, name="test-direct-pull")
        decision = RouteDecision(
            request_id="direct-1", model=MODEL, worker_id="w0", overlap_blocks=0,
            prompt_blocks=1, candidates=[Candidate(worker_id="w0", score=1.0)],
            policy="thunder", decided_at=0.0,
        )  # fmt: skip
        submit = ScheduleRequest(
            request=GenerateRequest(request_id="direct-1", model=MODEL, token_ids=[5] * 20,
                                    max_tokens=4),
            reply_subject="_INBOX.test.2", decision=decision, block_hashes=[1], router_id="r1",
        )  # fmt: skip
        # 10 s of prefill saved: 200,000 tokens, ~1 s of a 25 GB/s link at 128 KiB per token
        pull = PullHint(source_worker="w9", prefix_hash=1, blocks=1, budget_s=10.0)
        notice = DirectDispatch(submit=submit, worker_id="w0", pull=pull)
        await nc.publish(subjects.sched_direct(MODEL), encode(notice))
        await wait_for(lambda: pulls.links.wait(time.monotonic(), "w9") > 0.5,
                       what="the copy's link time booked")  # fmt: skip
        assert pulls.links.wait(time.monotonic(), "w0") > 0.5
        await nc.close()


async def test_a_copy_is_booked_on_the_links_only_for_the_worker_that_took_the_run(nats_server):
    """The decision names w1 first, w0 holding the whole 32-block prompt. w1 refuses the run
    that carried a pull from w0: no copy was ordered, so neither link is booked. w0 takes it
    (it holds the prefix: no hint), and the links stay free for the next run's copy."""
    from opentelemetry import context as otel_context

    from thunderagent.migration import MigrationParams
    from thunderagent.migration.pull import PullPlanner
    from thunderagent.scheduler.handoff import Handoff
    from thunderagent.scheduler.pending import Pending
    from thunderagent.schemas import Ack, WorkerGenerate

    nc = await connect(nats_server.url, name="handoff-test")
    bus = Bus(nc, service="handoff-test")
    offers: list[tuple[str, WorkerGenerate]] = []

    def worker(wid: str, accept: bool):
        async def on_generate(msg) -> None:
            offers.append((wid, msgspec.json.decode(msg.data, type=WorkerGenerate)))
            await nc.publish(msg.reply, encode(Ack(accepted=accept, reason="full")))

        return on_generate

    await nc.subscribe(subjects.worker_generate("w1"), cb=worker("w1", False))
    await nc.subscribe(subjects.worker_generate("w0"), cb=worker("w0", True))
    # a slow link (a copy books 0.67 s) and a slower prefill, so the copy still pays
    slow = MigrationParams(pull_min_tokens=1, prefill_tokens_per_s=100.0, link_bytes_per_s=1e8)
    planner = PullPlanner(slow)
    handoff = Handoff(bus, timeout_s=5.0, pulls=planner)
    hashes = list(range(1, 33))
    decision = RouteDecision(
        request_id="r1", model=MODEL, worker_id="w1", overlap_blocks=0, prompt_blocks=32,
        policy="test", decided_at=time.time(),
        candidates=[Candidate(worker_id="w1", score=1.0),
                    Candidate(worker_id="w0", score=0.5, overlap_blocks=32)],
    )  # fmt: skip
    request = GenerateRequest(model=MODEL, request_id="r1", token_ids=[7] * (32 * 16 + 1),
                              max_tokens=2)  # fmt: skip
    submit = ScheduleRequest(request=request, reply_subject="_INBOX.none", decision=decision,
                             block_size=16, block_hashes=hashes)  # fmt: skip
    took, reasons = await handoff.dispatch(Pending(submit, otel_context.get_current()), "w1")
    await nc.close()
    assert took == "w0" and reasons == ["w1: refused (full)"]
    assert [(w, o.pull is not None) for w, o in offers] == [("w1", True), ("w0", False)]
    assert planner.links.wait(time.monotonic(), "w0", "w1") == 0.0
    assert planner.hint(decision.candidates, "w1", hashes, 32 * 16 + 1, 16, time.monotonic())


async def test_a_request_id_is_free_again_once_its_request_ended(nats_server):
    """SGLang refuses a rid only while a request holds it; so does the scheduler. The
    client's own retry of a request that ended (same reply subject) is still not run again."""
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=1)
        client = await routable(nats_server.url, 1)
        sched = stack.services["scheduler"].runtime
        finals = []
        for _ in range(2):  # a deadline sends it through the scheduler's queue
            req = GenerateRequest(model=MODEL, request_id="again-1", token_ids=[5] * 20,
                                  max_tokens=4, deadline_ms=time.time() * 1e3 + 60_000)  # fmt: skip
            finals.append((await client.generate(req)).final)
        await wait_for(lambda: "again-1" not in sched.pending, what="the second run's end")
        reply_subject = sched.finished["again-1"]
        nc = await connect(nats_server.url, name="test-retry")
        retry = ScheduleRequest(request=req, reply_subject=reply_subject, router_id="r1",
                                decision=_decision("again-1"), block_hashes=[1])  # fmt: skip
        msg = await nc.request(subjects.sched_submit(MODEL), encode(retry), timeout=5)
        answer = msgspec.json.decode(msg.data, type=Ack)
        await nc.close()
        await client.close()
    assert [f.usage.completion_tokens for f in finals] == [4, 4]
    assert not answer.accepted and "already ran" in answer.reason


def _decision(rid: str) -> RouteDecision:
    return RouteDecision(
        request_id=rid, model=MODEL, worker_id="w0", overlap_blocks=0, prompt_blocks=1,
        candidates=[Candidate(worker_id="w0", score=1.0)], policy="thunder", decided_at=0.0,
    )  # fmt: skip


async def test_a_second_request_under_an_id_in_use_is_stopped_even_when_sent_on_credit(
    nats_server,
):
    """Two clients use one request id at once and two routers hand them to two workers on
    credit (neither can know of the other). The scheduler, told of both, stops the second and
    tells its client why; the first runs to its end."""
    from thunderagent.schemas import ErrorReply, WorkerGenerate

    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=2, profile="tiny", speedup=1.0)
        await routable(nats_server.url, 2)
        nc = await connect(nats_server.url, name="test-two-routers")
        replies: dict[str, list] = {"a": [], "b": []}
        reply_type = TokenChunk | FinalReply | ErrorReply

        def collect_into(into: list):
            async def on_msg(msg) -> None:
                into.append(msgspec.json.decode(msg.data, type=reply_type))

            return on_msg

        for key, into in replies.items():
            await nc.subscribe(f"_INBOX.dup.{key}", cb=collect_into(into))
        for key, worker, prompt in (("a", "w0", [5] * 20), ("b", "w1", [6] * 20)):
            req = GenerateRequest(model=MODEL, request_id="dup-1", token_ids=prompt,
                                  max_tokens=300)  # fmt: skip
            work = WorkerGenerate(request=req, reply_subject=f"_INBOX.dup.{key}")
            msg = await nc.request(subjects.worker_generate(worker), encode(work), timeout=5)
            assert msgspec.json.decode(msg.data, type=Ack).accepted
            submit = ScheduleRequest(request=req, reply_subject=work.reply_subject,
                                     decision=_decision("dup-1"), block_hashes=[1],
                                     router_id=f"r-{key}")  # fmt: skip
            await nc.publish(subjects.sched_direct(MODEL), encode(DirectDispatch(
                submit=submit, worker_id=worker)))  # fmt: skip
        ends = lambda: all(r and not isinstance(r[-1], TokenChunk) for r in replies.values())  # noqa: E731
        await wait_for(ends, what="both clients answered")
        second = stack.services["worker-w1"].runtime
        await nc.close()
    assert isinstance(replies["a"][-1], FinalReply)
    assert replies["a"][-1].usage.completion_tokens == 300
    assert isinstance(replies["b"][-1], ErrorReply)
    assert replies["b"][-1].code == ErrorCode.BAD_REQUEST and "in use" in replies["b"][-1].message
    assert sum(len(c.token_ids) for c in replies["b"][:-1]) < 300  # stopped, not run to its end
    assert "dup-1" not in second.running


async def test_an_id_past_32_bits_the_scheduler_passed_on_is_refused_by_the_worker(nats_server):
    """The scheduler keeps a prompt's ids unparsed (``schemas.relayed``): it checks they are
    non-negative integers, not their bound. An id past 32 bits, which only a publisher other
    than the router could send, is refused by the adapter in front of the engine, and the
    request ends with an error its client hears; nothing stays booked."""
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=1)
        sched = stack.services["scheduler"].runtime
        nc = await connect(nats_server.url, name="test-bound")
        replies: list[bytes] = []

        async def on_reply(msg) -> None:
            replies.append(msg.data)

        await nc.subscribe("_INBOX.test.bound", cb=on_reply)
        submit = ScheduleRequest(
            request=GenerateRequest(request_id="big-1", model=MODEL, token_ids=[5], max_tokens=2),
            reply_subject="_INBOX.test.bound", decision=_decision("big-1"), router_id="r1",
        )  # fmt: skip
        payload = encode(submit).replace(b'"token_ids":[5]', b'"token_ids":[5,4294967296]')
        ack = await nc.request(subjects.sched_submit(MODEL), payload, timeout=5)
        assert msgspec.json.decode(ack.data, type=Ack).accepted
        await wait_for(lambda: replies, what="the client's answer")
        await wait_for(lambda: "big-1" not in sched.pending, what="the request forgotten")
        await nc.close()
    answer = msgspec.json.decode(replies[-1])
    assert answer["type"] == "error", answer
    assert "<= 4294967295" in answer["message"], answer  # the adapter's refusal, passed on
