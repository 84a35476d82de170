"""The worker adapter service: registration lease, load reports, generate forwarding.

One adapter per engine. A generate hand-off is acknowledged before streaming starts, so the
scheduler knows the request has an owner; from then on every outcome, including an engine
failure, reaches the client as a ``FinalReply`` or an ``ErrorReply``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from urllib.parse import urlparse

import msgspec
from opentelemetry import trace

from thunderagent.bus import Bus, Delivery
from thunderagent.schemas import (
    AbortRequest,
    Ack,
    FinalReply,
    KvTransfer,
    LoadReport,
    Preempted,
    WorkerGenerate,
    WorkerRegistration,
    WorkerRole,
    is_valid_worker_id,
    subjects,
)
from thunderagent.shell import ServiceContext
from thunderagent.shell.fleet import workers_bucket
from thunderagent.telemetry.setup import meter
from thunderagent.tokenizer import BYTES_SPEC
from thunderagent.worker.engine_client import EngineClient, EngineError
from thunderagent.worker.generation import Generation
from thunderagent.worker.kv_relay import KvRelay

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("thunderagent.worker")


@dataclass(kw_only=True)
class AdapterConfig:
    worker_id: str
    engine_url: str
    model: str = ""
    """Override the model name the engine reports."""
    lease_s: float = 10.0
    load_interval_s: float = 0.2
    role: WorkerRole = WorkerRole.BOTH
    tokenizer: str = BYTES_SPEC
    kv_refresh_s: float = 120.0
    """Re-announce the cached blocks this often: a fifth of the index's default 10-minute TTL,
    so a resident block is re-confirmed several times before it could expire."""
    kv_events_endpoint: str | None = None
    """Engine's ZMQ KV-event PUB endpoint; None: take it from the engine's ``/server_info``."""


class WorkerAdapter:
    def __init__(self, config: AdapterConfig, bus: Bus, engine: EngineClient) -> None:
        if not is_valid_worker_id(config.worker_id):
            raise ValueError(f"worker id {config.worker_id!r} is not subject-safe ([A-Za-z0-9_-])")
        self.config = config
        self.bus = bus
        self.engine = engine
        self.inflight = 0
        self.registration: WorkerRegistration | None = None
        self.relay: KvRelay | None = None
        self.running: dict[str, Generation] = {}
        m = meter("thunderagent.worker")
        self._completed = m.create_counter(
            "thunderagent_requests_completed", description="Requests finished with a FinalReply"
        )
        self._hit_requests = m.create_counter(
            "thunderagent_cache_hit_requests",
            description="Finished requests the engine served partly from its prefix cache",
        )
        self._prompt_tokens = m.create_counter(
            "thunderagent_prompt_tokens", unit="{token}", description="Prompt tokens finished"
        )
        self._cached_tokens = m.create_counter(
            "thunderagent_cached_prompt_tokens",
            unit="{token}",
            description="Prompt tokens served from the engine's KV cache",
        )

    async def describe_engine(self) -> WorkerRegistration:
        info = await self.engine.get_json("/server_info")
        block_size = int(info.get("page_size") or 1)
        total_tokens = int(info.get("max_total_num_tokens") or 0)
        model = self.config.model or info.get("served_model_name") or info.get("model_path") or ""
        if not model:
            raise RuntimeError("engine reports no model name; pass --model")
        return WorkerRegistration(
            worker_id=self.config.worker_id,
            model=model,
            engine_url=self.engine.base_url,
            block_size=block_size,
            kv_capacity_blocks=total_tokens // block_size,
            lease_s=self.config.lease_s,
            registered_at=time.time(),
            role=self.config.role,
            tokenizer=self.config.tokenizer,
            max_running_requests=int(info.get("max_running_requests") or 0),
        )

    async def run(self, stop: asyncio.Event) -> None:
        self.registration = await self._wait_for_engine(stop)
        if self.registration is None:
            return
        await self.bus.subscribe(
            subjects.worker_generate(self.config.worker_id),
            WorkerGenerate,
            self.on_generate,
            concurrent=True,
        )
        await self.bus.subscribe(
            subjects.worker_abort(self.config.worker_id), AbortRequest, self.on_abort
        )
        await self.bus.subscribe(
            subjects.worker_kv_import(self.config.worker_id),
            KvTransfer,
            self.on_kv_import,
            concurrent=True,
        )
        kv = await workers_bucket(self.bus)
        events = await self._kv_event_source()
        relay = None
        if events is not None:
            relay = self.relay = KvRelay(
                self.bus, self.config.worker_id, self.registration.block_size
            )
            await relay.start()
        try:
            async with asyncio.TaskGroup() as tg:
                if relay is not None:
                    tg.create_task(relay.run(*events, stop))
                    tg.create_task(relay.refresh_loop(self.config.kv_refresh_s, stop))
                tg.create_task(self._lease_loop(kv, stop))
                tg.create_task(self._load_loop(stop))
        finally:
            try:
                await kv.delete(subjects.worker_key(self.config.worker_id))
            except Exception:
                log.warning("could not deregister %s", self.config.worker_id, exc_info=True)

    async def _kv_event_source(self) -> tuple[str, str | None, str] | None:
        """(endpoint, replay endpoint, topic) of the engine's KV events, or None when off.

        ``--kv-events`` wins; otherwise the engine's ``kv_events_config`` from ``/server_info``
        (SGLang reports its server args there), with a wildcard host replaced by the engine's.
        """
        info = await self.engine.get_json("/server_info")
        raw = info.get("kv_events_config")
        config = json.loads(raw) if isinstance(raw, str) and raw else (raw or {})
        endpoint = self.config.kv_events_endpoint or config.get("endpoint")
        if not endpoint or (
            config.get("publisher", "zmq") == "null" and not self.config.kv_events_endpoint
        ):
            log.warning("engine publishes no KV events: routing will not see its cache")
            return None
        host = urlparse(self.engine.base_url).hostname or "127.0.0.1"
        replay = config.get("replay_endpoint")
        return (
            _connectable(endpoint, host),
            _connectable(replay, host) if replay else None,
            config.get("topic", ""),
        )

    async def _wait_for_engine(self, stop: asyncio.Event) -> WorkerRegistration | None:
        delay = 0.1
        while not stop.is_set():
            try:
                return await self.describe_engine()
            except (TimeoutError, OSError, EngineError) as err:
                log.info("engine %s not ready (%s)", self.engine.base_url, err)
            await _sleep_or_stop(stop, delay)
            delay = min(delay * 2, 2.0)
        return None

    async def _lease_loop(self, kv, stop: asyncio.Event) -> None:
        payload = msgspec.json.encode(self.registration)
        key = subjects.worker_key(self.config.worker_id)
        while not stop.is_set():
            try:
                await kv.put(key, payload)
            except Exception:
                log.warning("lease renewal failed", exc_info=True)
            await _sleep_or_stop(stop, self.config.lease_s / 3)

    async def _load_loop(self, stop: asyncio.Event) -> None:
        subject = subjects.worker_load(self.config.worker_id)
        while not stop.is_set():
            try:
                report = await self.read_load()
                await self.bus.publish(subject, report)
            except (TimeoutError, OSError, EngineError) as err:
                log.warning("load poll failed: %s", err)
            await _sleep_or_stop(stop, self.config.load_interval_s)

    async def read_load(self) -> LoadReport:
        loads = await self.engine.get_json("/get_load")
        ranks = loads if isinstance(loads, list) else [loads]
        total = self.registration.kv_capacity_blocks if self.registration else 0

        def total_of(key: str) -> int:
            return sum(int(r.get(key, 0) or 0) for r in ranks)

        block = self.registration.block_size if self.registration else 1
        used_blocks = total_of("kv_used_blocks") or total_of("num_tokens") // max(block, 1)
        return LoadReport(
            worker_id=self.config.worker_id,
            ts=time.time(),
            running=total_of("num_reqs"),
            queued=total_of("num_waiting_reqs"),
            kv_used_blocks=used_blocks,
            kv_total_blocks=total_of("kv_total_blocks") or total,
            num_tokens=total_of("num_tokens"),
            inflight=self.inflight,
            prefill_backlog_tokens=sum(
                len(g.work.request.token_ids or []) for g in self.running.values() if not g.started
            ),
        )

    async def on_generate(self, work: WorkerGenerate, delivery: Delivery) -> None:
        rid = work.request.request_id
        if rid in self.running:
            if delivery.reply:
                await self.bus.publish(
                    delivery.reply, Ack(accepted=False, reason=f"{rid} is already running here")
                )
            return
        if delivery.reply:
            await self.bus.publish(delivery.reply, Ack(accepted=True))
        generation = Generation(work, self.config.worker_id, self.bus, self.engine)
        self.running[rid] = generation
        self.inflight += 1
        try:
            final = await generation.run()
        finally:
            self.inflight -= 1
            self.running.pop(rid, None)
        if final is not None:
            self._count(final, work.request.model)

    async def on_kv_import(self, transfer: KvTransfer, delivery: Delivery) -> None:
        """PD: the decode side takes over a prefilled prompt's KV before its continuation."""
        try:
            result = await self.engine.import_kv(transfer.token_ids)
            answer = Ack(accepted=True)
            imported = result.get("imported_blocks")
            log.debug("imported %s blocks for %s", imported, transfer.request_id)
        except (TimeoutError, EngineError, OSError) as err:
            answer = Ack(accepted=False, reason=f"KV import failed: {err}")
        if delivery.reply:
            await self.bus.publish(delivery.reply, answer)

    async def on_abort(self, abort: AbortRequest, delivery: Delivery) -> None:
        """Preemption: stop the run without telling the client, hand back what it produced."""
        generation = self.running.get(abort.request_id)
        if generation is None:
            answer = Preempted(request_id=abort.request_id, found=False)
        else:
            log.info("request %s preempted: %s", abort.request_id, abort.reason)
            await generation.preempt()
            answer = Preempted(
                request_id=abort.request_id, found=True, output_token_ids=generation.all_output()
            )
        if delivery.reply:
            await self.bus.publish(delivery.reply, answer)

    def _count(self, final: FinalReply, model: str) -> None:
        attrs = {"model": model, "worker_id": self.config.worker_id}
        self._completed.add(1, attrs)
        self._prompt_tokens.add(final.usage.prompt_tokens, attrs)
        self._cached_tokens.add(final.usage.cached_tokens, attrs)
        if final.usage.cached_tokens:
            self._hit_requests.add(1, attrs)


def _connectable(endpoint: str, host: str) -> str:
    """``tcp://*:5557`` (a bind address) -> ``tcp://<engine host>:5557``."""
    for wildcard in ("*", "0.0.0.0"):
        endpoint = endpoint.replace(f"//{wildcard}:", f"//{host}:")
    return endpoint


async def _sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        pass


async def main(ctx: ServiceContext, config: AdapterConfig, hold: dict | None = None) -> None:
    async with EngineClient(config.engine_url) as engine:
        adapter = WorkerAdapter(config, ctx.bus, engine)
        if hold is not None:
            hold["runtime"] = adapter
        await adapter.run(ctx.stop)
