"""Scheduler shell. This version dispatches in arrival order (FIFO): each accepted request is
offered to the router's candidates in rank order until a worker acknowledges it; when none
does, the client gets an ``ErrorReply`` instead of a silent timeout."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from opentelemetry import context as otel_context
from opentelemetry import trace

from thunderagent.bus import Bus, BusError, Delivery
from thunderagent.runtime import ServiceContext
from thunderagent.schemas import (
    Ack,
    ErrorCode,
    ErrorReply,
    ScheduleRequest,
    WorkerGenerate,
    subjects,
)

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("thunderagent.scheduler")


@dataclass(kw_only=True)
class SchedulerConfig:
    handoff_timeout_s: float = 2.0
    max_queue: int = 100_000
    """Requests waiting beyond this are refused at submit (the router tells the client)."""


@dataclass(slots=True)
class Waiting:
    submit: ScheduleRequest
    context: otel_context.Context


class FifoScheduler:
    def __init__(self, config: SchedulerConfig, bus: Bus) -> None:
        self.config = config
        self.bus = bus
        self.queue: asyncio.Queue[Waiting] = asyncio.Queue()
        self._tasks: set[asyncio.Task] = set()

    async def on_submit(self, submit: ScheduleRequest, delivery: Delivery) -> None:
        if self.queue.qsize() >= self.config.max_queue:
            await self.bus.publish(delivery.reply, Ack(accepted=False, reason="queue full"))
            return
        self.queue.put_nowait(Waiting(submit, otel_context.get_current()))
        if delivery.reply:
            await self.bus.publish(delivery.reply, Ack(accepted=True))

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            getter = asyncio.ensure_future(self.queue.get())
            stopper = asyncio.ensure_future(stop.wait())
            done, _ = await asyncio.wait({getter, stopper}, return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            if getter not in done:
                getter.cancel()
                break
            task = asyncio.create_task(self.dispatch(getter.result()))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=self.config.handoff_timeout_s * 2)

    async def dispatch(self, waiting: Waiting) -> None:
        submit = waiting.submit
        token = otel_context.attach(waiting.context)
        try:
            with _tracer.start_as_current_span("scheduler dispatch") as span:
                span.set_attribute("thunderagent.request_id", submit.request.request_id)
                reasons = []
                for attempt, cand in enumerate(submit.decision.candidates):
                    work = WorkerGenerate(
                        request=submit.request,
                        reply_subject=submit.reply_subject,
                        predicted_cached_tokens=cand.overlap_blocks * submit.page_size,
                        attempt=attempt,
                    )
                    try:
                        ack = await self.bus.request(
                            subjects.worker_generate(cand.worker_id),
                            work,
                            Ack,
                            timeout=self.config.handoff_timeout_s,
                        )
                    except BusError as err:
                        reasons.append(f"{cand.worker_id}: {err}")
                        continue
                    if ack.accepted:
                        span.set_attribute("thunderagent.worker_id", cand.worker_id)
                        return
                    reasons.append(f"{cand.worker_id}: refused ({ack.reason})")
                error = ErrorReply(
                    code=ErrorCode.UNAVAILABLE,
                    message="no worker accepted the request: " + "; ".join(reasons),
                    request_id=submit.request.request_id,
                    service="scheduler",
                )
                await self.bus.publish(submit.reply_subject, error)
        finally:
            otel_context.detach(token)


async def main(ctx: ServiceContext, config: SchedulerConfig) -> None:
    sched = FifoScheduler(config, ctx.bus)
    await ctx.bus.subscribe(
        subjects.SCHED_SUBMIT, ScheduleRequest, sched.on_submit, queue=subjects.SCHEDULER_QUEUE
    )
    await sched.run(ctx.stop)
