"""Router shell: decode -> resolve prompt -> rank workers -> publish decision -> submit.

Stateless apart from caches rebuilt from NATS, so any number of replicas share the ``router``
queue group.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from dataclasses import dataclass

from msgspec import structs
from opentelemetry import trace

from thunderagent.bus import Bus, BusError, Delivery
from thunderagent.registry import WorkerRegistry, WorkerState
from thunderagent.routing import RouteInput, get_policy
from thunderagent.runtime import FleetWatcher, ServiceContext
from thunderagent.schemas import (
    Ack,
    ErrorCode,
    ErrorReply,
    GenerateRequest,
    RouteDecision,
    ScheduleRequest,
    subjects,
)
from thunderagent.tokenizer import load_tokenizer, render_chat

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("thunderagent.router")


@dataclass(kw_only=True)
class RouterConfig:
    policy: str = "least_loaded"
    submit_timeout_s: float = 2.0
    seed: int | None = None


class Router:
    def __init__(self, config: RouterConfig, bus: Bus, registry: WorkerRegistry) -> None:
        self.config = config
        self.bus = bus
        self.registry = registry
        self.policy = get_policy(config.policy)
        self.rng = random.Random(config.seed)

    async def on_request(self, req: GenerateRequest, delivery: Delivery) -> None:
        reply = delivery.reply
        if not reply:
            await self.bus.reject(
                delivery, "request has no reply subject: nowhere to stream tokens"
            )
            return
        if not req.request_id:
            req = structs.replace(req, request_id=uuid.uuid4().hex)
        workers = self.registry.for_model(req.model)
        if not workers:
            known = ", ".join(sorted(self.registry.models())) or "none"
            await self._fail(reply, req, ErrorCode.UNKNOWN_MODEL,
                             f"no worker serves model {req.model!r} (served: {known})")  # fmt: skip
            return
        try:
            req = self._resolve_prompt(req, workers[0])
        except (OSError, RuntimeError, ValueError) as err:
            await self._fail(reply, req, ErrorCode.BAD_REQUEST, f"cannot tokenize: {err}")
            return
        with _tracer.start_as_current_span("router route") as span:
            started = time.perf_counter()
            ranked = self.policy.rank(RouteInput(request=req), workers, self.rng)
            decision = RouteDecision(
                request_id=req.request_id,
                model=req.model,
                worker_id=ranked[0].worker_id,
                overlap_blocks=ranked[0].overlap_blocks,
                prompt_blocks=len(req.token_ids or []) // workers[0].registration.page_size,
                candidates=ranked,
                policy=self.policy.name,
                decided_at=time.time(),
                decision_us=(time.perf_counter() - started) * 1e6,
            )
            chosen = self.registry.get(decision.worker_id)
            if chosen is not None:
                chosen.assigned_since_report += 1
            span.set_attribute("thunderagent.worker_id", decision.worker_id)
            span.set_attribute("thunderagent.request_id", req.request_id)
            await self.bus.publish(subjects.ROUTE_DECISIONS, decision)
            submit = ScheduleRequest(request=req, reply_subject=reply, decision=decision)
            await self._submit(submit)

    async def _submit(self, submit: ScheduleRequest) -> None:
        try:
            ack = await self.bus.request(
                subjects.SCHED_SUBMIT, submit, Ack, timeout=self.config.submit_timeout_s
            )
        except BusError as err:
            await self._fail(submit.reply_subject, submit.request, ErrorCode.UNAVAILABLE,
                             f"scheduler unavailable: {err}")  # fmt: skip
            return
        if not ack.accepted:
            await self._fail(submit.reply_subject, submit.request, ErrorCode.UNAVAILABLE,
                             f"scheduler refused: {ack.reason}")  # fmt: skip

    def _resolve_prompt(self, req: GenerateRequest, worker: WorkerState) -> GenerateRequest:
        if req.token_ids is not None:
            return req
        tokenizer = load_tokenizer(worker.registration.tokenizer)
        text = req.text if req.text is not None else render_chat(req.messages or [])
        ids = tokenizer.encode(text)
        if not ids:
            raise ValueError("the prompt tokenizes to nothing")
        return structs.replace(req, token_ids=ids, text=None, messages=None)

    async def _fail(self, reply: str, req: GenerateRequest, code: ErrorCode, message: str) -> None:
        log.info("request %s: %s: %s", req.request_id, code.value, message)
        error = ErrorReply(code=code, message=message, request_id=req.request_id, service="router")
        await self.bus.publish(reply, error)


async def main(ctx: ServiceContext, config: RouterConfig) -> None:
    registry = WorkerRegistry()
    fleet = FleetWatcher(ctx.bus, registry)
    router = Router(config, ctx.bus, registry)
    await ctx.bus.subscribe(
        subjects.REQUESTS_WILDCARD, GenerateRequest, router.on_request, queue=subjects.ROUTER_QUEUE
    )
    await fleet.run(ctx.stop)
