"""A client's first send that a router reads late runs once. The client heard nothing in time
and resent the request (a resend always goes through the scheduler); the router holding the
first send, its inbox long but its loop alive (so its stall guard stays open), then hands that
send to a worker on credit. Only the scheduler sees both: it stops the late run when the resend
ran or runs, and when the resend still waits in its queue, the late run serves it and the queued
copy leaves without a run. Real NATS, the real scheduler and adapters in front of simulated
engines; the late router is played by the test, which sends what a router sends."""

from __future__ import annotations

import asyncio
import contextlib
import time

import msgspec
import pytest

from tests.integration.inproc import MODEL, inproc_stack, start_full_stack
from tests.integration.test_kv_routing import routable, wait_for
from thunderagent.bus import connect
from thunderagent.bus.bus import encode
from thunderagent.scheduler.metrics import events_by_kind
from thunderagent.schemas import (
    REPLY_DECODER,
    Ack,
    Candidate,
    DirectDispatch,
    Dropped,
    ErrorReply,
    FinalReply,
    GenerateRequest,
    ProgressBatch,
    RequestProgress,
    RouteDecision,
    SamplingParams,
    ScheduleRequest,
    TokenChunk,
    WorkerGenerate,
    subjects,
)

pytestmark = pytest.mark.integration

SLOW = SamplingParams(ignore_eos=True)


def _submit(request: GenerateRequest, reply: str, router: str, worker: str) -> ScheduleRequest:
    decision = RouteDecision(
        request_id=request.request_id, model=MODEL, worker_id=worker, overlap_blocks=0,
        prompt_blocks=1, candidates=[Candidate(worker_id=worker, score=1.0)], policy="thunder",
        decided_at=0.0,
    )  # fmt: skip
    return ScheduleRequest(request=request, reply_subject=reply, router_id=router,
                           decision=decision, block_hashes=[1])  # fmt: skip


class _Inbox:
    """Every reply on one subject, in order."""

    def __init__(self, nc, subject: str) -> None:
        self.nc, self.subject, self.replies = nc, subject, []

    async def start(self) -> _Inbox:
        async def on_msg(msg) -> None:
            self.replies.append(REPLY_DECODER.decode(msg.data))

        await self.nc.subscribe(self.subject, cb=on_msg)
        return self

    def of(self, kind) -> list:
        return [r for r in self.replies if isinstance(r, kind)]


async def _schedule(nc, request: GenerateRequest, reply: str, router: str) -> None:
    """What a router does without credit: hand the request to the scheduler, for w0 only."""
    msg = await nc.request(
        subjects.sched_submit(MODEL), encode(_submit(request, reply, router, "w0")), timeout=5
    )
    assert msgspec.json.decode(msg.data, type=Ack).accepted


async def _run_on_credit(nc, request: GenerateRequest, reply: str, router: str) -> None:
    """What a router does on credit: offer the run to w1, then tell the scheduler."""
    work = WorkerGenerate(request=request, reply_subject=reply)
    msg = await nc.request(subjects.worker_generate("w1"), encode(work), timeout=5)
    assert msgspec.json.decode(msg.data, type=Ack).accepted
    notice = DirectDispatch(submit=_submit(request, reply, router, "w1"), worker_id="w1")
    await nc.publish(subjects.sched_direct(MODEL), encode(notice))


@contextlib.asynccontextmanager
async def _w0_busy(nats_url: str, blocker_tokens: int):
    """A stack whose scheduler runs one request per worker, w0 busy with a long one: a request
    for w0 waits in the queue. Yields the stack, the scheduler, a connection and the blocker's
    inbox."""
    async with inproc_stack(nats_url) as stack:
        await start_full_stack(stack, workers=2, profile="tiny", speedup=1.0,
                               scheduler_params={"max_running": 1})  # fmt: skip
        await routable(nats_url, 2)
        nc = await connect(nats_url, name="late-router")
        blocker_inbox = await _Inbox(nc, "_INBOX.late.blocker").start()
        blocker = GenerateRequest(model=MODEL, request_id="blocker", token_ids=[6] * 20,
                                  max_tokens=blocker_tokens, sampling=SLOW)  # fmt: skip
        await _schedule(nc, blocker, blocker_inbox.subject, "r-b")
        await wait_for(lambda: blocker_inbox.of(TokenChunk), 10.0, "w0 busy")
        try:
            yield stack, stack.services["scheduler"].runtime, nc, blocker_inbox
        finally:
            await nc.close()


async def test_a_first_send_read_after_its_resend_ran_is_stopped(nats_server):
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=2, profile="tiny", speedup=1.0)
        await routable(nats_server.url, 2)
        sched = stack.services["scheduler"].runtime
        nc = await connect(nats_server.url, name="late-router")
        inbox = await _Inbox(nc, "_INBOX.late.a").start()
        request = GenerateRequest(model=MODEL, request_id="late-1", token_ids=[5] * 20,
                                  max_tokens=300, sampling=SLOW)  # fmt: skip
        resend = msgspec.structs.replace(request, retry=1)
        await _schedule(nc, resend, inbox.subject, "r-b")
        await wait_for(lambda: inbox.of(FinalReply), 30.0, "the resend's answer")
        assert "late-1" in sched.finished
        await _run_on_credit(nc, request, inbox.subject, "r-a")
        second = stack.services["worker-w1"].runtime
        await wait_for(lambda: "late-1" not in second.running, 30.0, "the late run's end")
        await asyncio.sleep(0.3)
        await nc.close()
    final = inbox.of(FinalReply)
    assert len(final) == 1 and final[0].usage.completion_tokens == 300
    assert not inbox.of(ErrorReply), "the client's answer came from the resend: no error"
    late_tokens = sum(len(c.token_ids) for c in inbox.of(TokenChunk)) - 300
    assert late_tokens < 300, "the late run was stopped, not run to its end"
    events = {o.attributes["event"]: o.value for o in events_by_kind(sched)}
    assert sched.second_runs == 1 and events["second_runs"] == 1


async def test_a_first_send_read_while_its_resend_waits_serves_it_once(nats_server):
    async with _w0_busy(nats_server.url, 200) as (stack, sched, nc, blocker_inbox):
        inbox = await _Inbox(nc, "_INBOX.late.b").start()
        dropped: list[Dropped] = []

        async def on_dropped(msg) -> None:
            dropped.append(msgspec.json.decode(msg.data, type=Dropped))

        await nc.subscribe(subjects.router_dropped("r-b"), cb=on_dropped)
        request = GenerateRequest(model=MODEL, request_id="late-2", token_ids=[5] * 20,
                                  max_tokens=20, sampling=SLOW)  # fmt: skip
        resend = msgspec.structs.replace(request, retry=1)
        await _schedule(nc, resend, inbox.subject, "r-b")
        assert sched.pending["late-2"].worker_id == "", "it waits for w0 (one run at a time)"
        await _run_on_credit(nc, request, inbox.subject, "r-a")
        took_over = lambda: getattr(sched.pending.get("late-2"), "worker_id", "") == "w1"  # noqa: E731
        await wait_for(took_over, 5.0, "the run on credit serving the resend")
        assert sched.waiting[MODEL] == 0 and sched.second_runs == 0
        await wait_for(lambda: [d.request_id for d in dropped] == ["late-2"], 5.0,
                       "the resend's router lets its booking go")  # fmt: skip
        await wait_for(lambda: blocker_inbox.of(FinalReply), 30.0, "w0 free again")
        await wait_for(lambda: "late-2" not in sched.pending, 10.0, "its one run's end")
        await asyncio.sleep(0.5)  # a queued copy would start on w0 now
        ran_on_w0 = "late-2" in stack.services["worker-w0"].runtime.running
    final = inbox.of(FinalReply)
    assert len(final) == 1 and final[0].usage.completion_tokens == 20
    assert sum(len(c.token_ids) for c in inbox.of(TokenChunk)) == 20, "one run streamed"
    assert not ran_on_w0 and not inbox.of(ErrorReply)


async def test_a_run_on_credit_that_ends_before_its_report_ends_its_resend_too(nats_server):
    """The run on credit's progress and the router's report of it travel apart: a short run
    can end before the report reaches the scheduler. Its progress is kept for the report, so
    the resend it serves ends with it instead of being booked as running for good."""
    async with _w0_busy(nats_server.url, 100) as (_, sched, nc, blocker_inbox):
        inbox = await _Inbox(nc, "_INBOX.late.c").start()
        request = GenerateRequest(model=MODEL, request_id="late-3", token_ids=[5] * 20,
                                  max_tokens=4)  # fmt: skip
        await _schedule(nc, msgspec.structs.replace(request, retry=1), inbox.subject, "r-b")
        now = time.time()
        events = [RequestProgress(request_id="late-3", worker_id="w1", phase=phase, ts=now)
                  for phase in ("started", "finished")]  # fmt: skip
        batch = ProgressBatch(worker_id="w1", events=events)
        await nc.publish(subjects.progress("w1", ended=True), encode(batch))
        await asyncio.sleep(0.2)  # the report comes after the run's end
        notice = DirectDispatch(submit=_submit(request, inbox.subject, "r-a", "w1"),
                                worker_id="w1")  # fmt: skip
        await nc.publish(subjects.sched_direct(MODEL), encode(notice))
        await wait_for(lambda: "late-3" not in sched.pending, 5.0, "the request's end")
        assert sched.waiting[MODEL] == 0
        await wait_for(lambda: blocker_inbox.of(FinalReply), 30.0, "w0 free again")
        await asyncio.sleep(0.5)  # a queued copy would start on w0 now
    assert not inbox.replies, "the resend never ran: the run on credit served it"
