"""The router's request path: a client's request -> resolve the prompt -> ``RouterCore.route`` ->
the hand-off (on credit straight to the adapter, else to the scheduler) -> the ack.

Everything the router decides or learns lives in the pure ``RouterCore`` (the virtual-time replay
runs the same object); ``Router`` feeds it what the replica hears (``Dispatched``,
``ProgressBatch``, credit grants) and answers clients on their reply subjects, errors included.
It bounds the hand-offs it waits on (``HandoffLimit``): past the bound a request is answered
``overloaded`` unrouted. ``RouterService`` (``service``) wires it to NATS.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from msgspec import structs
from opentelemetry import trace

from thunderagent.bus import Bus, BusError, Delivery, PayloadTooLarge
from thunderagent.bus.batches import BatchSender
from thunderagent.fleet import OfferIds, WorkerState, check_limits, progress_refusal
from thunderagent.hashing import pack_tokens
from thunderagent.migration import MigrationParams
from thunderagent.migration.pull import PullPlanner
from thunderagent.router.metrics import RouterMetrics, watch_handoffs
from thunderagent.router_core import Routed, RouterCore, RouterParams, Verdict
from thunderagent.scheduling.credits import CreditWallet, Grant, StallGuard
from thunderagent.scheduling.handoff_limit import HandoffLimit
from thunderagent.schemas import (
    RUN_END_PHASES,
    Ack,
    CreditGrant,
    DirectDispatch,
    Dispatched,
    Dropped,
    ErrorCode,
    ErrorReply,
    GenerateRequest,
    HeldReply,
    ProgressBatch,
    RequestProgress,
    RouteDecision,
    RouteDecisionBatch,
    ScheduleRequest,
    UnansweredOffer,
    WorkerGenerate,
    relayed,
    subjects,
)
from thunderagent.telemetry.propagation import child_span
from thunderagent.tokenizer import load_tokenizer

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("thunderagent.router")

FLEET_WAIT_S = 5.0
"""Longest a request waits for a starting replica to load the fleet's registrations."""
DECISION_WINDOW_S = 0.05
"""Route decisions go to observers in batches, the first of each waiting at most this long (the
migration planner counts demand over seconds)."""


def submit_deadline(req: GenerateRequest) -> float | None:
    return req.deadline_ms / 1e3 if req.deadline_ms is not None else None


@dataclass(kw_only=True)
class RouterConfig:
    params: RouterParams = field(default_factory=RouterParams)
    """The core's configuration: policy, its parameters, TTLs, feedback window."""
    submit_timeout_s: float = 2.0
    redis_url: str | None = None
    """Where the index service keeps its snapshot; None starts from a full stream replay."""
    router_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    """This replica's name on the bus (the scheduler tells it where its requests went)."""
    pull: MigrationParams = field(default_factory=MigrationParams)
    """What a pull at dispatch is decided on, for the runs this replica hands to a worker
    itself (the fast path; ``SchedulerConfig.pull``)."""
    handoffs: HandoffLimit = field(default_factory=HandoffLimit)
    """How many requests may wait for their hand-off's ack at once; more are answered
    ``overloaded`` unrouted (a client's resend never is)."""


class Router:
    """The request path: everything between a client's message and the scheduler's ack."""

    def __init__(self, config: RouterConfig, bus: Bus) -> None:
        self.config = config
        self.bus = bus
        self.core = RouterCore(config.params, timer=time.perf_counter)
        self.metrics = RouterMetrics()
        self.wallet = CreditWallet()
        """Room the scheduler lent this replica (the fast path)."""
        self.pulls = PullPlanner(config.pull)
        self.offer_ids = OfferIds()
        """Names of this replica's own hand-offs (the fast path)."""
        self.handoffs = replace(config.handoffs)  # its own count and limit
        watch_handoffs(self)
        self._shed_logged = (0.0, 0)
        """When refusals were last logged, and the count then."""
        self.stalls = StallGuard()
        """Beaten by the service's tick; after a stall, requests go through the scheduler."""
        self.served_models: set[str] = set()
        """Models some worker registered since start (the fleet watcher adds them): asked for
        one with no worker now is ``unavailable`` (its workers left), not ``unknown_model``."""
        self.fleet_ready = asyncio.Event()
        """Set once the fleet's registrations are loaded; requests wait for it (a replica that
        just started would otherwise answer "no worker serves this model")."""
        self.decisions = BatchSender[RouteDecision](
            self._send_decisions, DECISION_WINDOW_S, what="route decisions"
        )
        """Every decision, for observers (``RouteDecisionBatch``)."""

    async def _send_decisions(self, decisions: list[RouteDecision]) -> None:
        batch = RouteDecisionBatch(router_id=self.config.router_id, decisions=decisions)
        await self.bus.publish(subjects.ROUTE_DECISIONS, batch)

    async def on_request(self, req: GenerateRequest, delivery: Delivery) -> None:
        if not delivery.reply:
            await self.bus.reject(
                delivery, "request has no reply subject: nowhere to stream tokens"
            )
            return
        await self.handle(req, delivery.reply)

    async def handle(self, req: GenerateRequest, reply: str) -> None:
        """Route ``req`` and hand it on; every answer (tokens, final reply or error) goes to
        ``reply``. Returns once the adapter or the scheduler has acknowledged it, or at once with
        ``overloaded`` when the hand-offs waiting for an ack are at their bound (``handoffs``).
        The request subscription calls this; so does a process that embeds the router
        (``Call(route=)``)."""
        # Let what this connection has already read be applied first: a run's end is published
        # before its answer, but an embedded caller that found the answer already in its inbox
        # comes straight back with the next turn, ahead of the end's handler (its worker would
        # still look busy with the finished run).
        await asyncio.sleep(0)
        if not req.request_id:
            req = structs.replace(req, request_id=uuid.uuid4().hex)
        if not self.fleet_ready.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.fleet_ready.wait(), FLEET_WAIT_S)
        workers = self.core.fleet.for_model(req.model, req.lora_name)
        if not workers:
            await self._no_worker(reply, req)
            return
        try:
            req = self._resolve_prompt(req, workers[0])
        except (OSError, RuntimeError, ValueError) as err:
            await self._fail(reply, req, ErrorCode.BAD_REQUEST, f"cannot tokenize: {err}")
            return
        tokens = pack_tokens(req.token_ids or ())  # once: the limits and the hashes read it
        refused = check_limits(tokens, req.max_tokens, workers)
        if refused is not None:
            await self._fail(reply, req, *refused)
            return
        await self._within_bound(req, tokens, reply, workers[0].registration.block_size)

    async def _within_bound(
        self, req: GenerateRequest, tokens: Sequence[int], reply: str, block_size: int
    ) -> None:
        """Route and hand on while the hand-offs waiting for an ack are under their bound, else
        answer ``overloaded``. A resend is never refused: its first send may be running, and
        "overloaded" would have its client give up on it."""
        if req.retry:
            await self._route_and_hand_on(req, tokens, reply, block_size)
            return
        if not self.handoffs.acquire():
            await self._shed(req, reply)
            return
        started = time.monotonic()
        try:
            await self._route_and_hand_on(req, tokens, reply, block_size)
        finally:
            now = time.monotonic()
            self.handoffs.release(now - started, now)

    async def _route_and_hand_on(
        self, req: GenerateRequest, tokens: Sequence[int], reply: str, block_size: int
    ) -> None:
        with child_span(_tracer, "router route") as span:
            routed = self.route(req, reply, block_size, tokens)
            if routed is None:  # the last worker left while we tokenized
                await self._fail(reply, req, ErrorCode.UNKNOWN_MODEL, "no worker serves it now")
                return
            decision = routed[0].decision
            span.set_attribute("thunderagent.request_id", req.request_id)
            span.set_attribute("thunderagent.worker_id", decision.worker_id)
            span.set_attribute("thunderagent.overlap_blocks", decision.overlap_blocks)
            self.decisions.add(decision)
            # the ids encoded once, for the worker's hand-off and the scheduler's message alike
            submit = structs.replace(routed[0], request=relayed.GenerateRequest.of(req))
            rest = await self._dispatch_directly(submit, routed[1])
            if rest is not None:
                await self._submit(rest)

    async def _shed(self, req: GenerateRequest, reply: str) -> None:
        """``overloaded``, unrouted: the stack behind this replica is not answering its
        hand-offs in time (``HandoffLimit``). Logged once a second with the count: a line per
        request would add to the load being shed."""
        self.metrics.shed.add(1)
        now = time.monotonic()
        if now - self._shed_logged[0] >= 1.0:
            refused = self.handoffs.shed - self._shed_logged[1]
            log.warning("router overloaded: %d requests refused, %d hand-offs in flight",
                        refused, self.handoffs.in_flight)  # fmt: skip
            self._shed_logged = (now, self.handoffs.shed)
        message = (f"router overloaded: {self.handoffs.in_flight} requests already wait for "
                   "the scheduler or a worker to take them; retry later")  # fmt: skip
        await self._fail(reply, req, ErrorCode.OVERLOADED, message,
                         self.handoffs.retry_after_s(), logged=False)  # fmt: skip

    async def _dispatch_directly(
        self, submit: ScheduleRequest, routed: Routed
    ) -> ScheduleRequest | None:
        """The fast path: with credit for the first candidate, hand the request to its adapter
        ourselves and tell the scheduler after (None). Otherwise what to submit to the
        scheduler: no credit, the request needs the queue (deadline, program, prefix
        follower), or the worker refused; after no answer at all, the submit names the offer,
        which the worker may still take late."""
        req = submit.request
        first = submit.decision.worker_id
        if not self._spend_credit(req, routed, first):
            return submit
        overlap = submit.decision.overlap_blocks
        pull = self.pulls.hint(
            submit.decision.candidates, first, submit.block_hashes,
            routed.query.prompt_tokens, submit.block_size, time.monotonic(),
        )  # fmt: skip
        work = WorkerGenerate(
            request=req,
            reply_subject=submit.reply_subject,
            predicted_cached_tokens=overlap * submit.block_size,
            pull=pull,
            offer=self.offer_ids.next(),
        )
        self.core.on_offered(req.request_id, first)
        ack = await self._offer(first, work)
        if ack is None or not ack.accepted:  # the scheduler will find it another worker
            self.core.on_offer_refused(req.request_id)
            self.wallet.give_back(first)
            if ack is None:
                late = UnansweredOffer(worker_id=first, offer=work.offer)
                return structs.replace(submit, unanswered=[late])
            return submit
        if pull is not None:
            self.pulls.book(pull, first, time.monotonic())
        self.core.on_dispatched(req.request_id, first, time.time())
        notice = DirectDispatch(submit=submit, worker_id=first, pull=pull)
        await self.bus.publish(subjects.sched_direct(req.model), notice)
        return None

    def _spend_credit(self, req: GenerateRequest, routed: Routed, first: str) -> bool:
        """Whether to hand ``req`` to ``first`` ourselves, one credit spent: not a resend (its
        first send may be running), nothing the scheduler must check first (a deadline, a
        program, a prefix follower), and credit this replica may spend now (none after a stall,
        ``StallGuard``, or on a grant past its lease, ``CREDIT_LEASE_S``)."""
        if req.retry or not routed.may_dispatch_directly(submit_deadline(req), req.program_id):
            return False
        now = time.monotonic()
        return self.stalls.allows(now) and self.wallet.take(first, now)

    async def _offer(self, worker_id: str, work: WorkerGenerate) -> Ack | None:
        """``worker_id``'s answer to the hand-off, or None when it gave none in time."""
        for _ in range(2):  # a late ack is not a refusal: ask again (the adapter is idempotent)
            try:
                return await self.bus.request(
                    subjects.worker_generate(worker_id), work, Ack,
                    timeout=self.config.submit_timeout_s,
                )  # fmt: skip
            except BusError:
                continue
        return None

    async def on_credits(self, grant: CreditGrant, _: Delivery) -> None:
        now = time.monotonic()  # a grant lends for CREDIT_LEASE_S: no word since, no credit
        self.wallet.update(Grant(grant.credits, grant.booked), grant.scheduler_id, now)

    def route(
        self,
        req: GenerateRequest,
        reply: str,
        block_size: int,
        tokens: Sequence[int] | None = None,
    ) -> tuple[ScheduleRequest, Routed] | None:
        """The core's decision wrapped for the scheduler (no I/O); ``tokens``: the prompt's ids
        packed (``pack_tokens``), else ``req.token_ids`` are read."""
        token_ids = tokens if tokens is not None else req.token_ids or []
        hashes = self.core.hash_tokens(token_ids, block_size, req.cache_salt, req.lora_name)
        # ignore_eos: the engine generates exactly max_tokens, so that is the output length
        hint = req.expected_output_tokens or (req.max_tokens if req.sampling.ignore_eos else None)
        expected = self.core.expected_output(req.max_tokens, hint)
        routed = self.core.route(
            request_id=req.request_id,
            model=req.model,
            hashes=hashes,
            prompt_tokens=len(token_ids),
            block_size=block_size,
            expected_output_tokens=expected,
            now=time.time(),
            priority=req.priority,
            lora_name=req.lora_name,
        )
        if routed is None:
            return None
        decision = routed.decision
        latency_s = decision.decision_us / 1e6
        self.metrics.decision_latency.record(latency_s, {"policy": decision.policy})
        submit = ScheduleRequest(
            request=req,
            reply_subject=reply,
            decision=decision,
            block_size=block_size,
            block_hashes=hashes.primary,
            expected_output_tokens=expected,
            router_id=self.config.router_id,
        )
        return submit, routed

    async def on_dispatched(self, dispatched: Dispatched, _: Delivery) -> None:
        self.core.on_dispatched(dispatched.request_id, dispatched.worker_id, time.time())

    async def on_dropped(self, dropped: Dropped, _: Delivery) -> None:
        self.core.forget(dropped.request_id)

    async def on_progress(self, batch: ProgressBatch, delivery: Delivery) -> None:
        refusal = progress_refusal(batch, delivery.subject)
        if refusal:
            await self.bus.reject(delivery, refusal)
            return
        now = time.time()
        for progress in batch.events:
            if progress.phase in RUN_END_PHASES:
                self._on_run_end(progress, now)
            elif progress.phase == "started":  # PD hand-offs book nothing here
                self.core.on_started(progress.request_id, progress.worker_id, now)

    def _on_run_end(self, progress: RequestProgress, now: float) -> None:
        usage = progress.usage
        if progress.phase == "finished" and usage is not None:
            verdict = self.core.on_finished(
                progress.request_id,
                progress.worker_id,
                now,
                cached_tokens=usage.cached_tokens,
                completion_tokens=usage.completion_tokens,
            )
            if verdict is not None:
                self._count(verdict)
        else:
            self.core.on_finished(progress.request_id, progress.worker_id, now)

    def _count(self, verdict: Verdict) -> None:
        m = self.metrics
        attrs = {"worker_id": verdict.worker_id, "model": verdict.model}
        m.recomputed_tokens.add(verdict.recomputed_tokens, attrs)
        if verdict.predicted_tokens:
            m.predicted_hits.add(1, attrs)
        if verdict.false_hit:
            m.false_hits.add(1, attrs)
        elif verdict.missed_hit:
            m.missed_hits.add(1, attrs)

    async def _submit(self, submit: ScheduleRequest) -> None:
        try:
            ack = await self.bus.request(
                subjects.sched_submit(submit.request.model),
                submit,
                Ack,
                timeout=self.config.submit_timeout_s,
            )
        except PayloadTooLarge as err:
            await self._reject(submit, ErrorCode.PAYLOAD_TOO_LARGE, str(err))
            return
        except BusError as err:
            message = f"scheduler unavailable: {err}"
            await self._reject(submit, ErrorCode.UNAVAILABLE, message)
            return
        if not ack.accepted:
            code = ack.code or ErrorCode.UNAVAILABLE
            message = f"scheduler refused: {ack.reason}"
            await self._reject(submit, code, message, retry_after_s=ack.retry_after_s)
        elif submit.request.retry:  # a resend: tell the sender it is held, so it stops resending
            held = HeldReply(request_id=submit.request.request_id)
            await self.bus.publish(submit.reply_subject, held)

    async def _reject(
        self,
        submit: ScheduleRequest,
        code: ErrorCode,
        message: str,
        retry_after_s: float | None = None,
    ) -> None:
        self.core.forget(submit.request.request_id)
        await self._fail(submit.reply_subject, submit.request, code, message, retry_after_s)

    def _resolve_prompt(self, req: GenerateRequest, worker: WorkerState) -> GenerateRequest:
        if req.token_ids is not None:
            return req
        tokenizer = load_tokenizer(worker.registration.tokenizer)
        text = req.text if req.text is not None else tokenizer.render_chat(req.messages or [])
        ids = tokenizer.encode(text)
        if not ids:
            raise ValueError("the prompt tokenizes to nothing")
        return structs.replace(req, token_ids=ids, text=None, messages=None)

    async def _no_worker(self, reply: str, req: GenerateRequest) -> None:
        """No live worker serves ``req.model``: unknown if none ever did and others are served;
        unavailable while no worker is live at all, or once its workers have left."""
        live = self.core.fleet.models()
        if req.lora_name and req.model in live:
            message = f"no worker of model {req.model!r} has LoRA adapter {req.lora_name!r} loaded"
            await self._fail(reply, req, ErrorCode.UNKNOWN_MODEL, message)
            return
        if req.model in self.served_models or not live:
            message = f"no live worker serves model {req.model!r} now (served: "
            message += f"{', '.join(sorted(live)) or 'none'}); retry"
            await self._fail(reply, req, ErrorCode.UNAVAILABLE, message)
            return
        message = f"no worker serves model {req.model!r} (served: {', '.join(sorted(live))})"
        await self._fail(reply, req, ErrorCode.UNKNOWN_MODEL, message)

    async def _fail(
        self,
        reply: str,
        req: GenerateRequest,
        code: ErrorCode,
        message: str,
        retry_after_s: float | None = None,
        *,
        logged: bool = True,
    ) -> None:
        if logged:
            log.info("request %s: %s: %s", req.request_id, code.value, message)
        error = ErrorReply(
            code=code,
            message=message,
            request_id=req.request_id,
            service="router",
            retry_after_s=retry_after_s,
        )
        await self.bus.publish(reply, error)
