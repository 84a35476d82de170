"""Scheduler shell: the waiting queue lives here, decided by a pure policy from
``thunderagent.scheduling`` (the same objects the virtual-time replay drives).

The shell only translates: submissions, load reports, KV events (prefix cached), run progress,
cancellations and program releases go in (through ``thunderagent.fleet``'s translation and run
model, shared with the replay); ``Dispatch`` becomes a hand-off to the worker (request/ack, the
next candidate when a worker refuses) and a ``Dispatched`` notice to the routing replica;
``Preempt`` becomes an abort at the worker and a continuation that the client sees as one
unbroken stream; ``Reject`` becomes an ``ErrorReply``. Every submission ends in a worker's ack,
an error reply, or a cancellation the client asked for. The wire side of those hand-offs is
``handoff``; the books kept per request, ``pending``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from opentelemetry import context as otel_context

from thunderagent.bus import Bus, Delivery
from thunderagent.fleet import WorkerRegistry, progress_refusal, worker_room
from thunderagent.migration import MigrationParams
from thunderagent.migration.pull import PullPlanner
from thunderagent.prefix_index.feed import stored_hashes
from thunderagent.scheduler.drain import DrainRate
from thunderagent.scheduler.handoff import Handoff, in_use
from thunderagent.scheduler.metrics import register_metrics
from thunderagent.scheduler.pending import (
    DirectRun,
    EarlyProgress,
    Pending,
    direct_run,
    may_be_unreported,
)
from thunderagent.scheduling import SCHEDULERS, Dispatch, Preempt, Reject
from thunderagent.scheduling.credits import CreditIssuer
from thunderagent.schemas import (
    Ack,
    CancelRequest,
    CreditGrant,
    DirectDispatch,
    ErrorCode,
    KvEventBatch,
    LoadReport,
    ProgramRelease,
    ProgressBatch,
    RequestProgress,
    RouterHello,
    RunFailed,
    ScheduleRequest,
    relayed,
    subjects,
)
from thunderagent.shell import FleetWatcher, ServiceContext, TaskSet

log = logging.getLogger(__name__)
GRANT_EVERY_S = 1.0
"""Every router gets a fresh grant this often even when nothing changed: its credits expire
when a scheduler falls silent."""
MAX_FINISHED = 100_000
"""Ended request ids remembered, each with its client's reply subject, so that a client's
retry of a request that ended is not run again: minutes of traffic at high rates."""
MAX_RESUMES = 2
"""A request whose worker or engine failed it this many times is not tried again."""


@dataclass(kw_only=True)
class SchedulerConfig:
    scheduler: str = "thunder"
    """A name from ``thunderagent.scheduling.SCHEDULERS``."""
    params: dict = field(default_factory=dict)
    """Knob overrides for it (``SchedParams`` fields)."""
    handoff_timeout_s: float = 2.0
    max_waiting_per_model: int = 4096
    """Requests of one model waiting for a worker beyond this are refused with ``overloaded``
    and a retry hint: at thousands of requests the queue takes minutes to drain, and clients
    backing off beats unbounded memory here."""
    max_sleep_s: float = 0.05
    """Longest wait between polls when nothing happens (load reports also wake the loop)."""
    models: tuple[str, ...] = ()
    """The models this scheduler owns (empty: every model). Schedulers partitioned by model
    share nothing: each takes only its models' submissions, workers and credits."""
    scheduler_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    pull: MigrationParams = field(default_factory=MigrationParams)
    """What a pull at dispatch is decided on (``migration.pull``: ``pull_min_tokens``, KV bytes
    per token, link speed, prefill rate); the adapter makes the copy only with a NIXL pool."""


class SchedulerService:
    def __init__(self, config: SchedulerConfig, bus: Bus, *, clock=time.time) -> None:
        self.config = config
        self.bus = bus
        self.clock = clock
        self.core = SCHEDULERS.create(config.scheduler, **config.params)
        self.pending: dict[str, Pending] = {}
        self.finished: OrderedDict[str, str] = OrderedDict()
        """Recently ended request ids (a late retry of one must not run it twice)."""
        self.waiting = Counter[str]()
        """model -> requests not on a worker yet (the bounded global queue)."""
        self.second_runs = 0
        """Runs on credit of a request whose resend ran or runs (``DirectRun``), each stopped
        where it still ran."""
        self.drain = DrainRate()
        self.registry = WorkerRegistry()
        self.issuer = CreditIssuer()
        self._tasks = TaskSet("scheduler")
        self.handoff = Handoff(
            bus, config.handoff_timeout_s, PullPlanner(config.pull), spawn=self._tasks.spawn
        )
        self._early = EarlyProgress()
        self.wake = asyncio.Event()
        register_metrics(self)

    # ---- inputs ----------------------------------------------------------------------------
    async def on_submit(self, submit: ScheduleRequest, delivery: Delivery) -> None:
        rid, model = submit.request.request_id, submit.request.model
        refusal = None
        if rid in self.pending:
            same = self.pending[rid].submit.reply_subject == submit.reply_subject
            if same:  # the client's retry of a request that is here: it runs once
                if delivery.reply:
                    await self.bus.publish(delivery.reply, Ack(accepted=True))
                await self.handoff.resent(self.pending[rid], submit)
                return
            refusal = Ack(accepted=False, reason=in_use(rid), code=ErrorCode.BAD_REQUEST)
        elif self.finished.get(rid) == submit.reply_subject:
            # the client's retry of a request that ended: its answer is out already. Another
            # client may use the id again, as with SGLang's rid once its request has finished.
            refusal = Ack(
                accepted=False,
                reason=f"request {rid} already ran; its answer went to its reply subject",
                code=ErrorCode.BAD_REQUEST,
            )
        elif self.waiting[model] >= self.config.max_waiting_per_model:
            refusal = Ack(
                accepted=False,
                reason=f"{self.waiting[model]} requests of {model} are already waiting",
                code=ErrorCode.OVERLOADED,
                retry_after_s=self.drain.seconds(self.waiting[model], self.clock()),
            )
        if refusal is not None:
            if delivery.reply:
                await self.bus.publish(delivery.reply, refusal)
            return
        pending = self.pending[rid] = Pending(submit, otel_context.get_current())
        self.waiting[model] += 1
        self.issuer.routed(submit.router_id, self.clock())
        self.core.submit(pending.sched_request(), self.clock())
        if delivery.reply:
            await self.bus.publish(delivery.reply, Ack(accepted=True))
        self.poll_now()  # no loop hop: a request with room goes out in this same callback

    async def on_direct(self, direct: DirectDispatch, _: Delivery) -> None:
        """A router dispatched on credit: book the run as one of ours, unless the id's request
        holds another run (``DirectRun``)."""
        submit = direct.submit
        rid = submit.request.request_id
        self.issuer.book(submit.router_id, direct.worker_id)
        kind = direct_run(direct, self.pending.get(rid), self.finished.get(rid))
        if kind in (DirectRun.OTHER_CLIENT, DirectRun.SECOND_RUN):
            self.second_runs += kind is DirectRun.SECOND_RUN
            self._spawn(self.handoff.stop_direct_run(direct, kind is DirectRun.OTHER_CLIENT))
        if kind not in (DirectRun.NEW, DirectRun.TAKES_OVER):
            return
        if kind is DirectRun.TAKES_OVER:  # the queued resend leaves without a run
            queued = self.pending.pop(rid)
            self.core.cancel(rid, self.clock())
            self._leaves_queue(queued)
            if queued.submit.router_id != submit.router_id:  # one router: the run keeps it
                self._spawn(self.handoff.dropped(queued))
        self.handoff.book_pull(direct.pull, direct.worker_id)
        self.issuer.routed(submit.router_id, self.clock())
        pending = self.pending[rid] = Pending(
            submit, otel_context.get_current(), worker_id=direct.worker_id
        )
        self.core.admitted(pending.sched_request(), direct.worker_id, self.clock())
        self.drain.dispatched(self.clock())
        for progress in self._early.take(rid):
            self._on_run_event(progress)
        self.wake.set()

    async def on_hello(self, hello: RouterHello, _: Delivery) -> None:
        if self.issuer.hello(hello.router_id, self.clock()):
            self._grant(force=True)

    def _grant(self, *, force: bool = False) -> None:
        """Lend the routers the room the scheduling core has now (only changed shares)."""
        grants = self.issuer.grants(self.core.rooms(), force=force)
        now = self.clock()
        for router, g in grants.items():
            grant = CreditGrant(
                router_id=router, credits=dict(g.credits), booked=dict(g.booked), issued_at=now,
                scheduler_id=self.config.scheduler_id,
            )  # fmt: skip
            self._spawn(self.bus.publish(subjects.router_credits(router), grant))

    def _leaves_queue(self, pending: Pending) -> None:
        model = pending.submit.request.model
        self.waiting[model] = max(0, self.waiting[model] - 1)

    def owns(self, worker_id: str) -> bool:
        """A worker of one of this scheduler's models (any, when it owns every model)."""
        if not self.config.models:
            return True
        state = self.registry.get(worker_id)
        return state is not None and state.registration.model in self.config.models

    def on_load(self, load: LoadReport) -> None:
        state = self.registry.get(load.worker_id)
        if state is not None and self.owns(load.worker_id):
            self.core.update_worker(worker_room(state), self.clock())
            self.wake.set()

    def on_fleet_change(self, worker_id: str, what: str) -> None:
        if what == "registered":  # (back) in the fleet: a candidate again before its first report
            state = self.registry.get(worker_id)
            if state is not None and self.owns(worker_id):
                self.core.update_worker(worker_room(state), self.clock())
                self.wake.set()
            return
        if what not in ("expired", "removed"):
            return
        self.core.remove_worker(worker_id, self.clock())
        for pending in [p for p in self.pending.values() if p.worker_id == worker_id]:
            if pending.started:  # the client has part of an answer we cannot rebuild
                self._forget(pending)
                why = f"worker {worker_id} left ({what}) while streaming this answer; retry"
                self._spawn(self.handoff.fail(pending, ErrorCode.UNAVAILABLE, why))
            else:  # nothing reached the client yet: run it elsewhere
                self._resume(pending, worker_id, pending.output)
        self.wake.set()

    def _resume(self, pending: Pending, failed_worker: str, output: list[int]) -> bool:
        """Queue the request again, away from ``failed_worker``, after ``output`` (what the
        client has); False when it failed too often to try again."""
        if pending.resumes >= MAX_RESUMES:
            return False
        pending.resumes += 1
        pending.excluded.add(failed_worker)
        pending.replaced.update({failed_worker, pending.worker_id, pending.decode_worker} - {""})
        pending.output = list(output)
        pending.worker_id, pending.decode_worker, pending.started = "", "", False
        self.waiting[pending.submit.request.model] += 1
        self.core.submit(pending.sched_request(), self.clock())
        return True

    def _forget(self, pending: Pending, *, retryable: bool = False) -> None:
        """The request is over here. ``retryable``: it was answered ``unavailable`` (nothing
        ran), so the client's resend is taken as new rather than refused as already run."""
        rid = pending.submit.request.request_id
        self.pending.pop(rid, None)
        if retryable:
            return
        self.finished[rid] = pending.submit.reply_subject
        if len(self.finished) > MAX_FINISHED:
            self.finished.popitem(last=False)

    async def on_run_failed(self, failed: RunFailed, delivery: Delivery) -> None:
        """An engine failed a run: resume it elsewhere as a continuation, if we can."""
        pending = self.pending.get(failed.request_id)
        by = failed.worker_id  # "" from a waiting request: no worker ran it, nothing failed
        running = pending is not None and by != "" and pending.worker_id != ""
        # SGLang's PD: the decode side failed before the prefill side handed the run over
        paired = running and by == pending.decode_worker and pending.worker_id != by
        if paired:
            await self.handoff.abort(pending.worker_id, failed.request_id,
                                     f"its decode side on {by} failed")  # fmt: skip
        current = running and (pending.worker_id == by or paired)
        ok = current and self._resume(pending, by, failed.output_token_ids)
        # a run this scheduler already replaced: the request goes on, its worker ends quietly
        # (telling the client would end a stream its continuation is still feeding)
        old_news = not current and pending is not None and by in pending.replaced
        if ok:
            pending.failure = f"{failed.worker_id}: {failed.reason}"
            log.info("request %s: engine of %s failed (%s): resuming elsewhere",
                     failed.request_id, failed.worker_id, failed.reason)  # fmt: skip
            self.core.on_finished(failed.request_id, failed.worker_id, self.clock())
            self.wake.set()
        if delivery.reply:
            unknown = pending is None  # maybe dispatched on credit, its report on its way
            taken = ok or old_news
            answer = Ack(
                accepted=taken,
                code=ErrorCode.UNAVAILABLE if unknown else None,
                reason="unknown request" if unknown else ("" if taken else "not resumable"),
            )
            await self.bus.publish(delivery.reply, answer)

    async def on_progress(self, batch: ProgressBatch, delivery: Delivery) -> None:
        refusal = progress_refusal(batch, delivery.subject)
        if refusal:
            await self.bus.reject(delivery, refusal)
            return
        for progress in batch.events:
            self._on_run_event(progress)
        self.wake.set()

    def _on_run_event(self, progress: RequestProgress) -> None:
        now, rid = self.clock(), progress.request_id
        pending = self.pending.get(rid)
        if may_be_unreported(pending) and self._early.hold(progress, now):
            return  # a router's report of its run on credit may be on its way
        if progress.phase == "started":
            if pending is not None and pending.worker_id == progress.worker_id:
                pending.started = True
            self.core.on_started(rid, progress.worker_id, now)
        elif progress.phase == "transferred":  # PD: the decode worker runs the rest
            if (
                pending is not None
                and pending.worker_id == progress.from_worker
                and pending.decode_worker == progress.worker_id
            ):  # of the current run: not one this scheduler stopped and resumed elsewhere
                pending.worker_id = progress.worker_id
            self.core.on_transfer_done(rid, progress.worker_id, now)
        elif pending is not None and (
            pending.worker_id == progress.worker_id
            or (progress.phase == "finished" and progress.worker_id == pending.decode_worker)
        ):
            self._forget(pending)  # ends of runs this scheduler no longer tracks are stale
            if progress.phase == "failed":  # the engine failed it for good: the step never ran
                self.core.on_failed(rid, progress.worker_id, now)
            else:
                self.core.on_finished(rid, progress.worker_id, now)

    async def on_cancel(self, cancel: CancelRequest, _: Delivery) -> None:
        pending = self.pending.get(cancel.request_id)
        if pending is None:
            return  # it ended already
        self._forget(pending)
        waiting = self.core.cancel(cancel.request_id, self.clock())
        if waiting:
            self._leaves_queue(pending)
            await self.handoff.dropped(pending)
        log.info("request %s cancelled (%s)", cancel.request_id, cancel.reason or "client")
        if not waiting and pending.worker_id:
            self._spawn(self.handoff.abort(pending.worker_id, cancel.request_id, "cancelled"))
        self.wake.set()

    async def on_release(self, release: ProgramRelease, _: Delivery) -> None:
        release_program = getattr(self.core, "release_program", None)
        if release_program is not None:
            release_program(release.program_id, self.clock())
            self.wake.set()

    async def on_kv_batch(self, batch: KvEventBatch, _seq: int) -> None:
        if not self.owns(batch.worker_id):
            return
        for hashes in stored_hashes(batch):
            self.core.on_prefix_cached(batch.worker_id, hashes, self.clock())
        if self.core.waiting():  # a cached prefix only matters to requests waiting here
            self.wake.set()

    # ---- the loop -------------------------------------------------------------------------
    def poll_now(self) -> None:
        for action in self.core.poll(self.clock()):
            self._spawn(self._carry_out(action))
        self._grant()

    async def run(self, stop: asyncio.Event) -> None:
        next_regrant = 0.0
        while not stop.is_set():
            self.poll_now()
            if self.clock() >= next_regrant:
                next_regrant = self.clock() + GRANT_EVERY_S
                self.issuer.expire(self.clock())
                self.issuer.reweigh(self.clock())
                self._grant(force=True)
                self._early.forget_old(time.time())
            wake_at = self.core.next_wakeup(self.clock())
            timeout = self.config.max_sleep_s
            if wake_at is not None:
                timeout = min(timeout, max(0.0, wake_at - self.clock()))
            self.wake.clear()
            # A timer that sets the event, not ``wait_for``: that wraps the wait in a new task
            # on every pass, and the loop passes once per message (~7 us more each).
            timer = asyncio.get_running_loop().call_later(timeout, self.wake.set)
            try:
                await self.wake.wait()
            finally:
                timer.cancel()
        await self._answer_waiting_on_stop()
        await self._tasks.wait(self.config.handoff_timeout_s * 2)

    async def _answer_waiting_on_stop(self) -> None:
        """Going down: every request still waiting here gets an error its client can act on
        (a retry reaches the next scheduler); runs already on workers go on streaming."""
        waiting = [p for p in self.pending.values() if not p.worker_id]
        for pending in waiting:
            self._forget(pending)
            message = "the scheduler is restarting; retry this request (same id)"
            await self.handoff.fail(pending, ErrorCode.UNAVAILABLE, message)
        if waiting:
            log.info("stopping: answered %d waiting requests", len(waiting))

    def _spawn(self, coro) -> None:
        self._tasks.spawn(coro)

    async def _carry_out(self, action) -> None:
        pending = self.pending.get(action.request_id)
        if pending is None:
            return
        if not isinstance(action, Preempt):  # it leaves the queue
            self._leaves_queue(pending)
        if isinstance(action, Dispatch):
            self.drain.dispatched(self.clock())
        token = otel_context.attach(pending.context)
        try:
            if isinstance(action, Dispatch):
                await self._dispatch(pending, action.worker_id, action.decode_worker or "")
            elif isinstance(action, Preempt):
                await self._preempt(pending, action.worker_id, action.reason)
            elif isinstance(action, Reject):
                self._forget(pending, retryable=action.unavailable)
                code = ErrorCode.UNAVAILABLE if action.unavailable else ErrorCode.DEADLINE
                why = action.reason
                if pending.failure:  # the workers it would have gone to failed it already
                    why += f" (it failed on {pending.failure})"
                await self.handoff.fail(pending, code, why)
        except Exception:  # a bug: the client hears of it rather than waiting forever
            log.exception("request %s: %s failed", pending.request_id, type(action).__name__)
            if self.pending.get(pending.request_id) is pending:
                self._forget(pending)
                if self.core.cancel(pending.request_id, self.clock()):
                    self._leaves_queue(pending)
                await self.handoff.fail(pending, ErrorCode.INTERNAL, "the scheduler failed it")
        finally:
            otel_context.detach(token)

    async def _dispatch(self, pending: Pending, worker_id: str, decode_worker: str = "") -> None:
        pending.decode_worker = decode_worker
        took, reasons = await self.handoff.dispatch(pending, worker_id, decode_worker)
        late = {offer.worker_id for offer in pending.submit.unanswered}
        if late:  # the router's own offer, with no answer in time, may have run it there
            for progress in self._early.take(pending.request_id):
                if progress.worker_id in late:  # not an earlier request's under the same id
                    self._on_run_event(progress)
        if took == worker_id:
            return
        # the policy's choice failed: account where it went
        self.core.on_failed(pending.request_id, worker_id, self.clock())
        if took is None:
            self._forget(pending, retryable=True)
            why = "no worker accepted the request: " + "; ".join(reasons)
            await self.handoff.fail(pending, ErrorCode.UNAVAILABLE, why)

    async def _preempt(self, pending: Pending, worker_id: str, reason: str) -> None:
        rid = pending.submit.request.request_id
        pending.worker_id = ""  # the aborted run's end notice is stale from here on
        answer = await self.handoff.abort(worker_id, rid, reason)
        if answer is None:  # the adapter did not answer: the run goes on there
            pending.worker_id = worker_id
            return
        if not answer.found:  # it finished before the abort reached it
            self._forget(pending)
            return
        pending.output = list(answer.output_token_ids)
        self.waiting[pending.submit.request.model] += 1
        self.core.submit(pending.sched_request(), self.clock())
        self.wake.set()

    async def run_service(self, ctx: ServiceContext) -> None:
        """Subscribe everything and run until ``ctx.stop``."""
        bus = ctx.bus
        fleet = FleetWatcher(
            bus, self.registry, on_change=self.on_fleet_change, on_load=self.on_load
        )
        for model in self.config.models or (None,):
            submits, directs, failures = subjects.scheduler_inbound(model)
            queue = subjects.SCHEDULER_QUEUE
            await bus.subscribe(submits, relayed.ScheduleRequest, self.on_submit, queue=queue)
            await bus.subscribe(failures, RunFailed, self.on_run_failed)
            await bus.subscribe(directs, relayed.DirectDispatch, self.on_direct)
        await bus.subscribe(subjects.PROGRESS_WILDCARD, ProgressBatch, self.on_progress)
        await bus.subscribe(subjects.SCHED_CANCEL, CancelRequest, self.on_cancel)
        await bus.subscribe(subjects.ROUTER_PRESENCE, RouterHello, self.on_hello)
        await bus.subscribe(subjects.PROGRAM_RELEASE, ProgramRelease, self.on_release)
        await bus.ensure_kv_events_stream()
        consumer = await bus.consume(
            subjects.KV_EVENTS_STREAM,
            subjects.KV_EVENTS_WILDCARD,
            KvEventBatch,
            self.on_kv_batch,
            new_only=True,
        )
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(fleet.run(ctx.stop))
                tg.create_task(self.run(ctx.stop))
        finally:
            await consumer.stop()


async def main(ctx: ServiceContext, config: SchedulerConfig) -> None:
    await SchedulerService(config, ctx.bus).run_service(ctx)
