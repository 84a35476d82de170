"""Router shell: decode -> resolve prompt -> hash -> overlap -> rank -> decision -> submit.

Stateless apart from what it rebuilds from NATS (fleet view, prefix index), so any number of
replicas share the ``router`` queue group. Each replica keeps its own copy of the prefix index,
started from the index service's Redis snapshot and the KV-event stream.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from dataclasses import dataclass

import redis.asyncio as aioredis
from msgspec import structs
from opentelemetry import trace

from thunderagent.bus import Bus, BusError, Delivery
from thunderagent.fleet import WorkerRegistry, WorkerState
from thunderagent.hashing import BlockHasher
from thunderagent.prefix_index import DEFAULT_TTL_S, PrefixIndex
from thunderagent.prefix_index.inflight import InflightPrefixes
from thunderagent.router.metrics import RouterMetrics
from thunderagent.router.verification import Routed, Verifier
from thunderagent.routing import POLICIES, RouteQuery
from thunderagent.schemas import (
    Ack,
    ErrorCode,
    ErrorReply,
    FinalReply,
    GenerateRequest,
    RouteDecision,
    ScheduleRequest,
    subjects,
)
from thunderagent.shell import FleetWatcher, ServiceContext
from thunderagent.shell.index_follower import IndexFollower
from thunderagent.tokenizer import load_tokenizer, render_chat

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("thunderagent.router")


@dataclass(kw_only=True)
class RouterConfig:
    policy: str = "thunder"
    submit_timeout_s: float = 2.0
    seed: int | None = None
    redis_url: str | None = None
    """Where the index service keeps its snapshot; None starts from a full stream replay."""
    ttl_s: float = DEFAULT_TTL_S


class Router:
    def __init__(
        self, config: RouterConfig, bus: Bus, registry: WorkerRegistry, follower: IndexFollower
    ) -> None:
        self.config = config
        self.bus = bus
        self.registry = registry
        self.follower = follower
        self.policy = POLICIES.create(config.policy)
        self.rng = random.Random(config.seed)
        self.verifier = Verifier()
        self.inflight = InflightPrefixes()
        self.metrics = RouterMetrics()
        self._hashers: dict[int, BlockHasher] = {}

    def hasher(self, block_size: int) -> BlockHasher:
        hasher = self._hashers.get(block_size)
        if hasher is None:
            hasher = self._hashers[block_size] = BlockHasher(block_size)
        return hasher

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
            message = f"no worker serves model {req.model!r} (served: {known})"
            await self._fail(reply, req, ErrorCode.UNKNOWN_MODEL, message)
            return
        try:
            req = self._resolve_prompt(req, workers[0])
        except (OSError, RuntimeError, ValueError) as err:
            await self._fail(reply, req, ErrorCode.BAD_REQUEST, f"cannot tokenize: {err}")
            return
        with _tracer.start_as_current_span("router route") as span:
            submit = self.route(req, reply, workers)
            span.set_attribute("thunderagent.request_id", req.request_id)
            span.set_attribute("thunderagent.worker_id", submit.decision.worker_id)
            span.set_attribute("thunderagent.overlap_blocks", submit.decision.overlap_blocks)
            await self.bus.publish(subjects.ROUTE_DECISIONS, submit.decision)
            await self._submit(submit)

    def route(
        self, req: GenerateRequest, reply: str, workers: list[WorkerState]
    ) -> ScheduleRequest:
        """The pure part of a routing decision (hash, overlap, rank), timed."""
        started = time.perf_counter()
        block_size = workers[0].registration.block_size
        hashes = self.hasher(block_size).hash_tokens(req.token_ids or [])
        query = self._query(req, block_size, hashes, {w.worker_id for w in workers})
        ranked = self.policy.rank(query, [w.view() for w in workers], self.rng)
        best = ranked[0].worker_id
        self._remember(query, best, hashes, req.model)
        overlap = query.overlaps.get(best, 0)
        elapsed = time.perf_counter() - started
        decision = RouteDecision(
            request_id=req.request_id,
            model=req.model,
            worker_id=best,
            overlap_blocks=overlap,
            prompt_blocks=len(hashes.primary),
            candidates=ranked,
            policy=self.policy.name,
            decided_at=time.time(),
            decision_us=elapsed * 1e6,
            prefix_hash=hashes.primary[overlap - 1] if overlap else None,
        )
        self.metrics.decision_latency.record(elapsed, {"policy": decision.policy})
        return ScheduleRequest(
            request=req,
            reply_subject=reply,
            decision=decision,
            block_size=block_size,
            block_hashes=hashes.primary,
        )

    def _query(self, req: GenerateRequest, block_size: int, hashes, serving: set) -> RouteQuery:
        overlaps, any_tier = self._overlaps(hashes.primary, hashes.check)
        return RouteQuery(
            request_id=req.request_id,
            prompt_tokens=len(req.token_ids or []),
            block_size=block_size,
            block_hashes=hashes.primary,
            overlaps={w: n for w, n in overlaps.items() if w in serving},
            host_overlaps={w: n for w, n in any_tier.items() if w in serving},
            expected_output_tokens=req.max_tokens,
            priority=req.priority,
        )

    def _remember(self, query: RouteQuery, worker_id: str, hashes, model: str) -> None:
        """Everything that learns from the choice: the policy, the in-flight overlay, the
        pending count until the next load report, and lazy verification."""
        self.policy.on_dispatched(query, worker_id)
        if hashes.primary:
            self.inflight.record(worker_id, hashes.primary, hashes.check, time.time())
        chosen = self.registry.get(worker_id)
        if chosen is not None:
            chosen.assigned_since_report += 1
        routed = Routed(
            worker_id,
            hashes.primary,
            query.overlaps.get(worker_id, 0),
            query.block_size,
            max(query.overlaps.values(), default=0),
            model,
        )
        self.verifier.remember(query.request_id, routed)

    def _overlaps(self, primary: list[int], check: list[int]) -> tuple[dict, dict]:
        """(GPU-resident prefix, prefix including the host tier) per worker, each merged with
        what this replica has in flight (assumed to land on the GPU)."""
        if not primary:
            return {}, {}
        feeder = self.follower.feeder
        now = time.time()
        gpu = self.inflight.merge(feeder.gpu_index.overlap(primary, check), primary, check, now)
        if feeder.gpu is None:
            return gpu, gpu
        any_tier = dict(feeder.index.overlap(primary, check))
        for worker, blocks in gpu.items():
            any_tier[worker] = max(any_tier.get(worker, 0), blocks)
        return gpu, any_tier

    async def on_completion(self, final: FinalReply, _: Delivery) -> None:
        verdict = self.verifier.verify(final.request_id, final.worker_id, final.usage.cached_tokens)
        if verdict is None:
            return
        m = self.metrics
        attrs = {"worker_id": verdict.worker_id, "model": verdict.model}
        m.recomputed_tokens.add(verdict.recomputed_tokens, attrs)
        if verdict.predicted_tokens:
            m.predicted_hits.add(1, attrs)
        if verdict.false_hit:
            m.false_hits.add(1, attrs)
            self.follower.feeder.evict_locally(verdict.worker_id, verdict.stale_hashes, time.time())
        elif verdict.missed_hit:
            m.missed_hits.add(1, attrs)

    async def _submit(self, submit: ScheduleRequest) -> None:
        try:
            ack = await self.bus.request(
                subjects.SCHED_SUBMIT, submit, Ack, timeout=self.config.submit_timeout_s
            )
        except BusError as err:
            message = f"scheduler unavailable: {err}"
            await self._fail(submit.reply_subject, submit.request, ErrorCode.UNAVAILABLE, message)
            return
        if not ack.accepted:
            message = f"scheduler refused: {ack.reason}"
            await self._fail(submit.reply_subject, submit.request, ErrorCode.UNAVAILABLE, message)

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


class RouterService:
    """One router replica: fleet view, local index follower, request subscription."""

    def __init__(self, ctx: ServiceContext, config: RouterConfig) -> None:
        self.ctx = ctx
        self.registry = WorkerRegistry()
        self.redis = None
        if config.redis_url:
            self.redis = aioredis.from_url(
                config.redis_url, socket_timeout=2, socket_connect_timeout=2
            )
        self.follower = IndexFollower(ctx.bus, PrefixIndex(config.ttl_s), redis=self.redis)
        self.router = Router(config, ctx.bus, self.registry, self.follower)
        self.fleet = FleetWatcher(ctx.bus, self.registry, on_change=self._on_fleet_change)

    def _on_fleet_change(self, worker_id: str, what: str) -> None:
        if what in ("expired", "removed"):
            self.follower.forget_worker(worker_id)
            self.router.inflight.forget(worker_id)

    async def run(self) -> None:
        bus = self.ctx.bus
        await self.follower.start()
        await bus.subscribe(subjects.COMPLETIONS, FinalReply, self.router.on_completion)
        # Concurrent: a request waits for the scheduler's ack without holding up the next one;
        # the routing decision itself runs without an await, so policy state stays consistent.
        await bus.subscribe(
            subjects.REQUESTS_WILDCARD,
            GenerateRequest,
            self.router.on_request,
            queue=subjects.ROUTER_QUEUE,
            concurrent=True,
        )
        try:
            await self.fleet.run(self.ctx.stop)
        finally:
            await self.follower.stop()
            if self.redis is not None:
                await self.redis.aclose()


async def main(ctx: ServiceContext, config: RouterConfig) -> None:
    await RouterService(ctx, config).run()
