"""A hand-off that got no answer in time may still reach its worker later, after its sender gave
the run to another worker. Each offer is named: the worker refuses one an abort voided (even if
the abort came first), answers one that already ran as taken without running it again, and the
scheduler and the router name their unanswered offers so they are voided where the request
does not run. Real NATS; the adapters are the real ones in front of simulated engines, or a
worker that never answers, where that is the case under test."""

from __future__ import annotations

import asyncio
import contextlib

import msgspec
import pytest
from opentelemetry import context as otel_context

from tests.integration.inproc import MODEL, inproc_stack, start_full_stack
from tests.integration.test_kv_routing import wait_for
from tests.integration.test_worker_lifecycle import _sender_with_inbox
from thunderagent.bus import Bus, connect
from thunderagent.bus.bus import encode
from thunderagent.client import ThunderClient
from thunderagent.scheduler.handoff import Handoff
from thunderagent.scheduler.pending import Pending
from thunderagent.schemas import (
    AbortRequest,
    Ack,
    Candidate,
    FinalReply,
    GenerateRequest,
    Preempted,
    ProgressBatch,
    RouteDecision,
    ScheduleRequest,
    TokenChunk,
    UnansweredOffer,
    WorkerGenerate,
    subjects,
)
from thunderagent.worker.metrics import adapter_metrics

pytestmark = pytest.mark.integration


async def _answers(got: asyncio.Queue, quiet_s: float = 0.3) -> list[TokenChunk | FinalReply]:
    """What reached the client's inbox until it was quiet for ``quiet_s``."""
    out = []
    while True:
        try:
            msg = await asyncio.wait_for(got.get(), quiet_s)
        except TimeoutError:
            return out
        out.append(msgspec.json.decode(msg.data, type=TokenChunk | FinalReply))


async def _until_final(got: asyncio.Queue) -> list[TokenChunk | FinalReply]:
    out: list[TokenChunk | FinalReply] = []
    while not out or not isinstance(out[-1], FinalReply):
        msg = await asyncio.wait_for(got.get(), 10)
        out.append(msgspec.json.decode(msg.data, type=TokenChunk | FinalReply))
    return out


class _Counted:
    """Stands in for a counter: the outcome attribute of every ``add``."""

    def __init__(self) -> None:
        self.outcomes: list[str] = []

    def add(self, amount: int, attributes: dict) -> None:
        self.outcomes += [attributes["outcome"]] * amount


@contextlib.asynccontextmanager
async def _one_adapter(url: str, rid: str, late: _Counted):
    """A real adapter (w0, no scheduler) counting late offers into ``late``, a sender with
    its inbox, and an 8-token request."""
    metrics = adapter_metrics()
    counter, metrics.late_offers = metrics.late_offers, late
    try:
        async with inproc_stack(url) as stack:
            await start_full_stack(stack, workers=1, profile="tiny", block_size=16,
                                   speedup=5.0, with_scheduler=False)  # fmt: skip
            nc, bus, inbox, got = await _sender_with_inbox(url, f"{rid}-test")
            request = GenerateRequest(model=MODEL, request_id=rid, token_ids=[5] * 16,
                                      max_tokens=8)  # fmt: skip
            try:
                yield bus, inbox, got, request
            finally:
                await nc.close()
    finally:
        metrics.late_offers = counter


async def test_an_offer_an_abort_voided_before_it_arrived_never_runs(nats_server):
    counted = _Counted()
    async with _one_adapter(nats_server.url, "late1", counted) as (bus, inbox, got, request):
        # the abort overtook its offer: nothing to stop yet, but the offer is voided
        abort = AbortRequest(request_id="late1", reason="test", offers=["s-1"])
        stopped = await bus.request(subjects.worker_abort("w0"), abort, Preempted, timeout=5)
        assert not stopped.found
        late = WorkerGenerate(request=request, reply_subject=inbox, offer="s-1")
        ack = await bus.request(subjects.worker_generate("w0"), late, Ack, timeout=5)
        assert not ack.accepted and "aborted" in ack.reason
        assert await _answers(got) == [], "the voided offer ran"
        # the request itself is not barred: a new offer of it runs
        fresh = WorkerGenerate(request=request, reply_subject=inbox, offer="s-2")
        assert (await bus.request(subjects.worker_generate("w0"), fresh, Ack, timeout=5)).accepted
        answers = await _until_final(got)
        assert sum(len(a.token_ids) for a in answers if isinstance(a, TokenChunk)) == 8
    assert counted.outcomes == ["refused"]


async def test_an_offer_that_ran_is_answered_as_taken_and_not_run_again(nats_server):
    counted = _Counted()
    async with _one_adapter(nats_server.url, "ran1", counted) as (bus, inbox, got, request):
        work = WorkerGenerate(request=request, reply_subject=inbox, offer="r-1")
        assert (await bus.request(subjects.worker_generate("w0"), work, Ack, timeout=5)).accepted
        await _until_final(got)
        # the sender's second try of the same offer, arriving after the run ended
        again = await bus.request(subjects.worker_generate("w0"), work, Ack, timeout=5)
        assert again.accepted and "ran here already" in again.reason
        assert await _answers(got) == [], "the offer ran twice"
        # a later offer supersedes an earlier one that got no answer: the earlier is refused
        later = WorkerGenerate(request=request, reply_subject=inbox, offer="r-3",
                               supersedes=["r-2"])  # fmt: skip
        assert (await bus.request(subjects.worker_generate("w0"), later, Ack, timeout=5)).accepted
        await _until_final(got)
        earlier = WorkerGenerate(request=request, reply_subject=inbox, offer="r-2")
        refused = await bus.request(subjects.worker_generate("w0"), earlier, Ack, timeout=5)
        assert not refused.accepted and "aborted" in refused.reason
        assert await _answers(got) == []
    assert counted.outcomes == ["ran", "refused"]


def _submit(rid: str, workers: list[str], unanswered: list[UnansweredOffer]) -> ScheduleRequest:
    decision = RouteDecision(
        request_id=rid, model=MODEL, worker_id=workers[0], overlap_blocks=0, prompt_blocks=1,
        candidates=[Candidate(worker_id=w, score=1.0) for w in workers], policy="test",
        decided_at=0.0,
    )  # fmt: skip
    request = GenerateRequest(model=MODEL, request_id=rid, token_ids=[7] * 17, max_tokens=2)
    return ScheduleRequest(request=request, reply_subject="_INBOX.none", decision=decision,
                           block_size=16, unanswered=unanswered)  # fmt: skip


class _Workers:
    """Fake adapters on one connection: ``silent`` ones never answer an offer (and, if
    ``deaf``, not an abort either), the others take every offer; every offer and abort is
    recorded by worker."""

    def __init__(self, nc, silent: set[str], deaf: set[str]) -> None:
        self.nc, self.silent, self.deaf = nc, silent, deaf
        self.offers: dict[str, list[WorkerGenerate]] = {}
        self.aborts: dict[str, list[AbortRequest]] = {}

    async def add(self, wid: str) -> None:
        async def on_generate(msg) -> None:
            work = msgspec.json.decode(msg.data, type=WorkerGenerate)
            self.offers.setdefault(wid, []).append(work)
            if wid not in self.silent:
                await self.nc.publish(msg.reply, encode(Ack(accepted=True)))

        async def on_abort(msg) -> None:
            abort = msgspec.json.decode(msg.data, type=AbortRequest)
            self.aborts.setdefault(wid, []).append(abort)
            if wid not in self.deaf:
                answer = Preempted(request_id=abort.request_id, found=False)
                await self.nc.publish(msg.reply, encode(answer))

        await self.nc.subscribe(subjects.worker_generate(wid), cb=on_generate)
        await self.nc.subscribe(subjects.worker_abort(wid), cb=on_abort)


async def test_the_scheduler_voids_each_offer_left_unanswered_where_the_run_is_not(nats_server):
    """The router's own offer to w2 got no answer (its fast path); the scheduler's to w0 gets
    none either, nor does its abort. w1 takes the run. The abort at the time-out names w0's
    offer; afterwards w0 (its abort unanswered) and w2 get aborts naming every offer they may
    still take late; w1's offer supersedes nothing."""
    nc = await connect(nats_server.url, name="void-test")
    workers = _Workers(nc, silent={"w0", "w2"}, deaf={"w0"})
    for wid in ("w0", "w1", "w2"):
        await workers.add(wid)
    handoff = Handoff(Bus(nc, service="void-test"), timeout_s=0.3)
    pending = Pending(
        _submit("v1", ["w0", "w1"], [UnansweredOffer(worker_id="w2", offer="router-7")]),
        otel_context.get_current(),
    )
    took, reasons = await handoff.dispatch(pending, "w0")
    assert took == "w1" and len(reasons) == 1 and reasons[0].startswith("w0: ")
    w0_offer = workers.offers["w0"][0].offer
    assert w0_offer and workers.offers["w1"][0].supersedes == []
    await wait_for(lambda: len(workers.aborts.get("w0", [])) == 2 and "w2" in workers.aborts,
                   what="the voiding aborts")  # fmt: skip
    assert [a.offers for a in workers.aborts["w0"]] == [[w0_offer], [w0_offer]]
    assert [a.offers for a in workers.aborts["w2"]] == [["router-7"]]
    assert "runs on w1" in workers.aborts["w2"][0].reason
    assert pending.unanswered == {}
    await nc.close()


async def test_an_offer_to_a_worker_with_an_unanswered_one_supersedes_it(nats_server):
    """The router's offer to w0 got no answer; the scheduler offers w0 the run again: its
    offer names the router's as superseded (w0 refuses it should it come late), and nothing
    is left to void."""
    nc = await connect(nats_server.url, name="supersede-test")
    workers = _Workers(nc, silent=set(), deaf=set())
    await workers.add("w0")
    handoff = Handoff(Bus(nc, service="supersede-test"), timeout_s=1.0)
    pending = Pending(
        _submit("v2", ["w0"], [UnansweredOffer(worker_id="w0", offer="router-9")]),
        otel_context.get_current(),
    )
    took, _ = await handoff.dispatch(pending, "w0")
    assert took == "w0" and workers.offers["w0"][0].supersedes == ["router-9"]
    await asyncio.sleep(0.2)
    assert workers.aborts == {} and pending.unanswered == {}
    await nc.close()


async def test_a_fast_path_offer_with_no_answer_runs_once_when_the_worker_takes_it_late(
    nats_server,
):
    """The router's direct hand-off reaches w0, which takes it, but both acks come too late
    for the router (its wait cut to nothing here): it submits to the scheduler naming its
    offer (held here until the run has ended), and the scheduler's offer to w0 supersedes
    it: w0 answers it as taken without running it again. The request runs once (one start,
    one answer, every token once) and the scheduler, which learns of the run's end from the
    progress that came before its offer, keeps nothing of it."""
    async with inproc_stack(nats_server.url) as stack:
        await start_full_stack(stack, workers=1, profile="tiny", block_size=16, speedup=5.0)
        router = stack.services["router"].runtime.router
        scheduler = stack.services["scheduler"].runtime
        await wait_for(lambda: router.wallet.credits.get("w0", 0) > 0, what="credit for w0")
        real_request = router.bus.request
        ended = asyncio.Event()

        async def late_acks(subject, message, reply_type, **kwargs):
            if subject == subjects.worker_generate("w0"):
                kwargs["timeout"] = 1e-4
            elif subject == subjects.sched_submit(MODEL):
                await asyncio.wait_for(ended.wait(), 10)
            return await real_request(subject, message, reply_type, **kwargs)

        router.bus.request = late_acks
        spy = await connect(nats_server.url, name="late-ack-spy")
        offers: list[WorkerGenerate] = []
        starts: list[str] = []

        async def on_offer(msg) -> None:
            offers.append(msgspec.json.decode(msg.data, type=WorkerGenerate))

        async def on_progress(msg) -> None:
            batch = msgspec.json.decode(msg.data, type=ProgressBatch)
            starts.extend(e.worker_id for e in batch.events if e.phase == "started")
            if batch.ends_runs:
                ended.set()

        await spy.subscribe(subjects.worker_generate("w0"), cb=on_offer)
        await spy.subscribe(subjects.progress("w0", ended=False), cb=on_progress)
        await spy.subscribe(subjects.progress("w0", ended=True), cb=on_progress)
        client = await ThunderClient.connect(nats_server.url, idle_timeout_s=20, retries=0)
        try:
            request = GenerateRequest(model=MODEL, token_ids=[9] * 20, max_tokens=6)
            result = await client.generate(request)
            assert result.final.usage.completion_tokens == 6
            assert len(result.token_ids) == 6
            await asyncio.sleep(0.3)  # a second run would have started by now
        finally:
            await client.close()
            await spy.close()
        router_offer = offers[0].offer
        assert router_offer and offers[1].offer == router_offer  # its second try
        assert len(offers) == 3 and offers[2].supersedes == [router_offer]  # the scheduler's
        assert starts == ["w0"]
        await wait_for(lambda: not scheduler.pending, what="the scheduler to forget the run")


async def test_a_run_aborted_before_it_started_never_reaches_its_engine(nats_server):
    """The adapter books a run before it acks it; an abort handled in between (the ack's
    write had to wait) stops it: the run ends ``aborted`` at once and the engine, here an
    address nobody listens on, is never asked for it."""
    from thunderagent.fleet import AcceptedRuns
    from thunderagent.worker.engine_client import EngineClient
    from thunderagent.worker.generation import Generation

    nc = await connect(nats_server.url, name="early-abort")
    phases: list[str] = []

    async def on_progress(msg) -> None:
        phases.extend(e.phase for e in msgspec.json.decode(msg.data, type=ProgressBatch).events)

    await nc.subscribe(subjects.progress("w9", ended=True), cb=on_progress)
    await nc.subscribe(subjects.progress("w9", ended=False), cb=on_progress)
    await nc.flush()
    request = GenerateRequest(model=MODEL, request_id="early1", token_ids=[5] * 16, max_tokens=8)
    work = WorkerGenerate(request=request, reply_subject="_INBOX.early1", offer="e-1")
    engine = EngineClient("http://127.0.0.1:9")  # the discard port: nothing answers there
    generation = Generation(work, "w9", Bus(nc, service="worker"), engine, AcceptedRuns())
    await generation.stop()
    assert await asyncio.wait_for(generation.run(), 2) is None
    await wait_for(lambda: phases == ["aborted"], what="the run's end")
    await nc.close()
