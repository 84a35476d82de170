"""Scheduler shell: the waiting queue lives here, decided by a pure policy from
``thunderagent.scheduling`` (the same objects the virtual-time benchmark drives).

The shell only translates: submissions, load reports, KV events (prefix cached) and request
progress go in; ``Dispatch`` becomes a hand-off to the worker (request/ack, the next candidate
when a worker refuses), ``Preempt`` becomes an abort at the worker and a continuation that the
client sees as one unbroken stream, ``Reject`` becomes an ``ErrorReply``. Nothing a client sent
is dropped: every submission ends in a worker's ack or an error reply.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from msgspec import structs
from opentelemetry import context as otel_context
from opentelemetry import trace

from thunderagent.bus import Bus, BusError, Delivery
from thunderagent.fleet import WorkerRegistry
from thunderagent.scheduler.kv_watch import follow_stored_blocks
from thunderagent.scheduling import Dispatch, Preempt, Reject, SchedRequest, WorkerRoom
from thunderagent.scheduling.registry import SCHEDULERS
from thunderagent.schemas import (
    AbortRequest,
    Ack,
    ErrorCode,
    ErrorReply,
    LoadReport,
    Preempted,
    ProgramRelease,
    RequestProgress,
    ScheduleRequest,
    WorkerGenerate,
    subjects,
)
from thunderagent.shell import FleetWatcher, ServiceContext
from thunderagent.telemetry.setup import meter

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("thunderagent.scheduler")


@dataclass(kw_only=True)
class SchedulerConfig:
    scheduler: str = "thunder"
    """A name from ``thunderagent.scheduling.registry.SCHEDULERS``."""
    params: dict = field(default_factory=dict)
    """Knob overrides for it (``SchedParams`` fields)."""
    handoff_timeout_s: float = 2.0
    max_queue: int = 100_000
    """Requests waiting beyond this are refused at submit (the router tells the client)."""
    max_sleep_s: float = 0.05
    """Longest wait between polls when nothing happens (load reports also wake the loop)."""


@dataclass(slots=True)
class Pending:
    submit: ScheduleRequest
    context: otel_context.Context
    output: list[int] = field(default_factory=list)
    """Output tokens streamed before a preemption (a continuation carries them)."""
    worker_id: str = ""


class SchedulerService:
    def __init__(self, config: SchedulerConfig, bus: Bus, *, clock=time.time) -> None:
        self.config = config
        self.bus = bus
        self.clock = clock
        self.core = SCHEDULERS.create(config.scheduler, **config.params)
        self.pending: dict[str, Pending] = {}
        self.registry = WorkerRegistry()
        self.wake = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._depth = meter("thunderagent.scheduler").create_observable_gauge(
            "thunderagent_worker_queue_depth",
            [self._observe_depths],
            description="Requests waiting for the worker: scheduler queue + engine waiting queue",
        )

    # ---- inputs ----------------------------------------------------------------------------
    async def on_submit(self, submit: ScheduleRequest, delivery: Delivery) -> None:
        rid = submit.request.request_id
        if len(self.pending) >= self.config.max_queue or rid in self.pending:
            reason = "queue full" if rid not in self.pending else f"duplicate request id {rid}"
            if delivery.reply:
                await self.bus.publish(delivery.reply, Ack(accepted=False, reason=reason))
            return
        self.pending[rid] = Pending(submit, otel_context.get_current())
        self.core.submit(self._sched_request(submit, []), self.clock())
        if delivery.reply:
            await self.bus.publish(delivery.reply, Ack(accepted=True))
        self.poll_now()  # no loop hop: a request with room goes out in this same callback

    def _sched_request(self, submit: ScheduleRequest, output: list[int]) -> SchedRequest:
        req = submit.request
        deadline = req.deadline_ms / 1e3 if req.deadline_ms is not None else None
        return SchedRequest(
            request_id=req.request_id,
            arrival=submit.decision.decided_at,
            prompt_tokens=len(req.token_ids or []) + len(output),
            expected_output_tokens=max(1, req.max_tokens - len(output)),
            candidates=[(c.worker_id, c.overlap_blocks) for c in submit.decision.candidates],
            block_size=submit.block_size,
            block_hashes=submit.block_hashes,
            priority=req.priority,
            program_id=req.program_id,
            deadline=deadline,
            generated_tokens=len(output),
        )

    def on_load(self, load: LoadReport) -> None:
        state = self.registry.get(load.worker_id)
        if state is None:
            return
        reg = state.registration
        self.core.update_worker(
            WorkerRoom(
                worker_id=load.worker_id,
                running=load.running,
                queued=load.queued,
                kv_used_blocks=load.kv_used_blocks,
                kv_total_blocks=load.kv_total_blocks or reg.kv_capacity_blocks,
                max_running=reg.max_running_requests,
                role=reg.role.value,
                active_blocks=load.num_tokens // max(reg.block_size, 1),
            ),
            self.clock(),
        )
        self.wake.set()

    def on_fleet_change(self, worker_id: str, what: str) -> None:
        if what in ("expired", "removed"):
            self.core.remove_worker(worker_id, self.clock())
            self.wake.set()

    async def on_progress(self, progress: RequestProgress, _: Delivery) -> None:
        now = self.clock()
        if progress.phase == "started":
            self.core.on_started(progress.request_id, progress.worker_id, now)
        elif progress.phase == "transferred":
            self.core.on_transfer_done(progress.request_id, progress.worker_id, now)
        elif progress.phase in ("finished", "failed"):
            pending = self.pending.get(progress.request_id)
            if pending is not None and pending.worker_id == progress.worker_id:
                del self.pending[progress.request_id]
            self.core.on_finished(progress.request_id, progress.worker_id, now)
        self.wake.set()

    async def on_release(self, release: ProgramRelease, _: Delivery) -> None:
        release_program = getattr(self.core, "release_program", None)
        if release_program is not None:
            release_program(release.program_id, self.clock())
            self.wake.set()

    def on_blocks_stored(self, worker_id: str, hashes: list[int]) -> None:
        self.core.on_prefix_cached(worker_id, hashes, self.clock())
        self.wake.set()

    # ---- the loop -------------------------------------------------------------------------
    def poll_now(self) -> None:
        for action in self.core.poll(self.clock()):
            self._spawn(self._carry_out(action))

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.poll_now()
            wake_at = self.core.next_wakeup(self.clock())
            timeout = self.config.max_sleep_s
            if wake_at is not None:
                timeout = min(timeout, max(0.0, wake_at - self.clock()))
            self.wake.clear()
            try:
                await asyncio.wait_for(self.wake.wait(), timeout)
            except TimeoutError:
                pass
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=self.config.handoff_timeout_s * 2)

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _carry_out(self, action) -> None:
        pending = self.pending.get(action.request_id)
        if pending is None:
            return
        token = otel_context.attach(pending.context)
        try:
            if isinstance(action, Dispatch):
                await self._dispatch(pending, action.worker_id, action.decode_worker or "")
            elif isinstance(action, Preempt):
                await self._preempt(pending, action.worker_id, action.reason)
            elif isinstance(action, Reject):
                self.pending.pop(action.request_id, None)
                await self._fail(pending, ErrorCode.DEADLINE, action.reason)
        finally:
            otel_context.detach(token)

    async def _dispatch(self, pending: Pending, worker_id: str, decode_worker: str = "") -> None:
        submit = pending.submit
        rid = submit.request.request_id
        order = [worker_id] + [
            c.worker_id for c in submit.decision.candidates if c.worker_id != worker_id
        ]
        overlap = {c.worker_id: c.overlap_blocks for c in submit.decision.candidates}
        request = submit.request
        if pending.output:  # a continuation: the prompt now ends with what was generated
            request = structs.replace(
                request,
                token_ids=[*(request.token_ids or []), *pending.output],
                max_tokens=max(1, request.max_tokens - len(pending.output)),
            )
        reasons = []
        with _tracer.start_as_current_span("scheduler dispatch") as span:
            span.set_attribute("thunderagent.request_id", rid)
            for attempt, wid in enumerate(order):
                work = WorkerGenerate(
                    request=request,
                    reply_subject=submit.reply_subject,
                    predicted_cached_tokens=overlap.get(wid, 0) * submit.block_size,
                    attempt=attempt,
                    output_offset=len(pending.output),
                    decode_worker=decode_worker if wid == worker_id else "",
                )
                try:
                    ack = await self.bus.request(
                        subjects.worker_generate(wid),
                        work,
                        Ack,
                        timeout=self.config.handoff_timeout_s,
                    )
                except BusError as err:
                    reasons.append(f"{wid}: {err}")
                    continue
                if ack.accepted:
                    pending.worker_id = wid
                    span.set_attribute("thunderagent.worker_id", wid)
                    if wid != worker_id:  # the policy's choice failed: account where it went
                        self.core.on_finished(rid, worker_id, self.clock())
                    return
                reasons.append(f"{wid}: refused ({ack.reason})")
        self.core.on_finished(rid, worker_id, self.clock())
        self.pending.pop(rid, None)
        await self._fail(pending, ErrorCode.UNAVAILABLE,
                         "no worker accepted the request: " + "; ".join(reasons))  # fmt: skip

    async def _preempt(self, pending: Pending, worker_id: str, reason: str) -> None:
        rid = pending.submit.request.request_id
        try:
            answer = await self.bus.request(
                subjects.worker_abort(worker_id),
                AbortRequest(request_id=rid, reason=f"preempted {reason}"),
                Preempted,
                timeout=self.config.handoff_timeout_s,
            )
        except BusError as err:
            log.warning("preempting %s on %s failed (%s): it keeps running", rid, worker_id, err)
            return
        if not answer.found:
            return  # it finished first: its progress message ends it
        pending.output = list(answer.output_token_ids)
        pending.worker_id = ""
        self.core.submit(self._sched_request(pending.submit, pending.output), self.clock())
        self.wake.set()

    async def _fail(self, pending: Pending, code: ErrorCode, message: str) -> None:
        rid = pending.submit.request.request_id
        log.info("request %s: %s: %s", rid, code.value, message)
        error = ErrorReply(code=code, message=message, request_id=rid, service="scheduler")
        await self.bus.publish(pending.submit.reply_subject, error)

    def _observe_depths(self, _options):
        from opentelemetry.metrics import Observation

        queued: dict[str, int] = {}
        for p in self.pending.values():
            if not p.worker_id and p.submit.decision.candidates:
                first = p.submit.decision.candidates[0].worker_id
                queued[first] = queued.get(first, 0) + 1
        out = []
        for state in self.registry.all():
            engine = state.load.queued if state.load else 0
            depth = queued.get(state.worker_id, 0) + engine
            out.append(Observation(depth, {"worker_id": state.worker_id}))
        return out


async def main(ctx: ServiceContext, config: SchedulerConfig, hold: dict | None = None) -> None:
    service = SchedulerService(config, ctx.bus)
    if hold is not None:
        hold["runtime"] = service
    fleet = FleetWatcher(
        ctx.bus, service.registry, on_change=service.on_fleet_change, on_load=service.on_load
    )
    bus = ctx.bus
    await bus.subscribe(
        subjects.SCHED_SUBMIT, ScheduleRequest, service.on_submit, queue=subjects.SCHEDULER_QUEUE
    )
    await bus.subscribe(subjects.SCHED_PROGRESS, RequestProgress, service.on_progress)
    await bus.subscribe(subjects.PROGRAM_RELEASE, ProgramRelease, service.on_release)
    async with asyncio.TaskGroup() as tg:
        tg.create_task(fleet.run(ctx.stop))
        tg.create_task(follow_stored_blocks(bus, service.on_blocks_stored, ctx.stop))
        tg.create_task(service.run(ctx.stop))
