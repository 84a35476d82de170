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
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlparse

import msgspec
from opentelemetry.metrics import Observation

from thunderagent.bus import Bus, BusError, Delivery
from thunderagent.fleet import LOAD_REPORT_INTERVAL_S, AcceptedRuns, load_report
from thunderagent.schemas import (
    AbortRequest,
    Ack,
    FinalReply,
    HeldReply,
    KvTransfer,
    LoadReport,
    Preempted,
    WorkerGenerate,
    WorkerRegistration,
    WorkerRole,
    is_valid_worker_id,
    subjects,
)
from thunderagent.sglang.load import (
    LOADS_PATH,
    OLD_LOAD_PATH,
    EngineLoadFigures,
    parse_get_load,
    parse_v1_loads,
    v1_loads_max_running,
)
from thunderagent.sglang.zmq_publisher import offset_endpoint_port, publisher_binds
from thunderagent.shell.fleet import workers_bucket
from thunderagent.tokenizer import BYTES_SPEC
from thunderagent.worker.engine_client import EngineClient, EngineError
from thunderagent.worker.engine_info import connectable, context_length, vocab_size
from thunderagent.worker.generation import Generation
from thunderagent.worker.id_lease import IdLease
from thunderagent.worker.inferred_cache import InferredCache
from thunderagent.worker.kv_relay import KvRelay
from thunderagent.worker.metrics import adapter_metrics
from thunderagent.worker.migration import WorkerMigration
from thunderagent.worker.offer_screen import OfferScreen
from thunderagent.worker.pd_mode import pd_mode, pd_refusal
from thunderagent.worker.waits import once_ready, sleep_or_stop, wait_any

log = logging.getLogger(__name__)


UNHEALTHY_AFTER = 3
"""Load polls failing in a row before the engine counts as gone (with the default 0.2 s poll,
0.6 s: long enough to ride out one slow answer, short against the 10 s lease)."""


@dataclass(kw_only=True)
class AdapterConfig:
    worker_id: str
    engine_url: str
    model: str = ""
    """Override the model name the engine reports."""
    lease_s: float = 10.0
    load_interval_s: float = LOAD_REPORT_INTERVAL_S
    role: WorkerRole = WorkerRole.BOTH
    tokenizer: str = BYTES_SPEC
    kv_refresh_s: float = 120.0
    """Re-announce the cached blocks this often: a fifth of the index's default 10-minute TTL,
    so a resident block is re-confirmed several times before it could expire."""
    max_request_s: float = 600.0
    """A run still going after this long is aborted at the engine (its slot freed) and the
    client told why; ten minutes covers any sane generation, a runaway one is caught."""
    kv_events_endpoint: str | None = None
    """Engine's ZMQ KV-event PUB endpoint; None: take it from the engine's ``/server_info``."""
    held_after_s: float = 1.0
    """A run that has sent its client nothing for this long (no token yet, or an answer that
    is not streamed) tells it ``HeldReply``, so the client stops resending. A resend goes
    through the scheduler, and one that does not know the run (restarted since, or never told
    of a router's direct dispatch) would run it a second time. Under the clients' 5 s
    ``retry_after_s``; runs that answer sooner send nothing extra."""
    dp_rank: int | None = None
    """The engine's data-parallel rank this adapter stands for (``main`` runs one per rank of an
    engine with several): its runs go there, its load and KV events are that rank's."""


class WorkerAdapter:
    def __init__(self, config: AdapterConfig, bus: Bus, engine: EngineClient) -> None:
        if not is_valid_worker_id(config.worker_id):
            raise ValueError(f"worker id {config.worker_id!r} is not subject-safe ([A-Za-z0-9_-])")
        self.config = config
        self.bus = bus
        self.engine = engine
        self.runs = AcceptedRuns()
        self.offer_screen = OfferScreen(config.worker_id)
        self.engine_healthy = asyncio.Event()
        self.engine_healthy.set()  # it answered /server_info before we registered
        self.lease: IdLease | None = None
        """Its hold on the worker id, taken in ``run`` once the engine has described itself."""
        self._health_changed = asyncio.Event()
        self.registration: WorkerRegistration | None = None
        self.relay: KvRelay | None = None
        self.inferred: InferredCache | None = None
        """The engine's cache as inferred from its runs, when it publishes no KV events."""
        self.running: dict[str, Generation] = {}
        self.migration: WorkerMigration | None = None
        self._old_load_api = False
        """The engine answered 404 to ``/v1/loads``: it is read through ``/get_load``."""
        self._lora = False
        """The engine serves LoRA adapters (``enable_lora``): which ones is read as it runs."""
        self.pd_mode = "null"
        """The engine's SGLang PD mode (``disaggregation_mode``): a ``prefill`` or ``decode``
        engine serves a request only as one side of a pairing."""
        self._adapter_failures = 0
        """Reads of the engine's adapters failed in a row (said on the 1st, 2nd, 4th...)."""
        self.metrics = adapter_metrics()
        self.metrics.adapters.add(self)

    def mirror_observations(self) -> list[Observation]:
        """The mirror's counts: a block skipped here is one the router never learns of, so an
        operator must see them (a lost event, a block size that does not match, a tier the
        index does not track)."""
        return self._by_outcome(self.relay.mirror.stats.by_outcome() if self.relay else {})

    def pull_observations(self) -> list[Observation]:
        return self._by_outcome(self.migration.pulls if self.migration is not None else {})

    def _by_outcome(self, counts: Mapping[str, int]) -> list[Observation]:
        wid = self.config.worker_id
        return [Observation(n, {"worker_id": wid, "outcome": o}) for o, n in counts.items()]

    async def describe_engine(self) -> WorkerRegistration:
        info = await self.engine.get_json("/server_info")
        # the block its KV events name: page_size, or page_size x dcp_size under decode context
        # parallelism, as SGLang 0.5 advertises it in kv_events (routers hash prompts in these)
        events = info.get("kv_events") if isinstance(info.get("kv_events"), dict) else {}
        block_size = int(events.get("block_size") or info.get("page_size") or 1)
        total_tokens = int(info.get("max_total_num_tokens") or 0)
        self._lora = bool(info.get("enable_lora"))
        model = self.config.model or info.get("served_model_name") or info.get("model_path") or ""
        if not model:
            raise RuntimeError("engine reports no model name; pass --model")
        pd = pd_mode(info, self.config.role)
        self.pd_mode, self.engine.bootstrap_port = pd.mode, pd.bootstrap_port
        return WorkerRegistration(
            worker_id=self.config.worker_id,
            model=model,
            engine_url=self.engine.base_url,
            block_size=block_size,
            kv_capacity_blocks=total_tokens // block_size,
            lease_s=self.config.lease_s,
            registered_at=time.time(),
            role=pd.role,
            tokenizer=self.config.tokenizer,
            # the cap SGLang derived (per rank: under DP attention it divides the argument by
            # the ranks, and it bounds it by the KV pool), else the argument as given
            max_running_requests=await self._effective_max_running()
            or int(info.get("max_running_requests") or 0),
            context_length=context_length(info),
            vocab_size=int(info.get("vocab_size") or 0) or vocab_size(self.config.tokenizer),
            lora_adapters=(await self._read_adapters() or []) if self._lora else [],
            bootstrap_port=self.engine.bootstrap_port,
        )

    async def _lora_adapters(self) -> list[str]:
        """The LoRA adapters the engine lists in ``/v1/models`` (a card whose ``parent`` is the
        base model), each loaded now."""
        answer = await self._shared_answer("/v1/models")
        cards = answer.get("data") if isinstance(answer, dict) else None
        if not isinstance(cards, list):
            raise ValueError(f"not a /v1/models answer: {str(answer)[:120]}")
        return sorted(
            str(c["id"]) for c in cards if isinstance(c, dict) and c.get("parent") and c.get("id")
        )

    async def _read_adapters(self) -> list[str] | None:
        """``_lora_adapters``, or None when the engine did not tell (the last known list holds)."""
        try:
            adapters = await self._lora_adapters()
        except (TimeoutError, OSError, EngineError, ValueError) as err:
            self._adapter_failures += 1
            if _doubled(self._adapter_failures):
                log.warning("LoRA adapters of %s not read (%d in a row): %s",
                            self.engine.base_url, self._adapter_failures, err)  # fmt: skip
            return None
        self._adapter_failures = 0
        return adapters

    async def _refresh_adapters(self) -> None:
        """Follow adapters loaded at run time: the next renewal carries them. One that leaves
        the list stays registered: SGLang unloads adapters (``--max-loaded-loras`` evicts the
        least used) but serves any it has ever loaded, loading it again on demand."""
        listed = await self._read_adapters()
        reg = self.registration
        if listed is None or reg is None or self.lease is None:
            return
        adapters = sorted(set(listed) | set(reg.lora_adapters))
        if adapters != reg.lora_adapters:
            log.info("LoRA adapters now %s", adapters)
            self.registration = msgspec.structs.replace(reg, lora_adapters=adapters)
            self.lease.amend(self.registration)

    async def _effective_max_running(self) -> int:
        """SGLang's ``/server_info`` holds ``--max-running-requests`` as given (None unless set);
        the cap it derived is in ``/v1/loads``, summed over its ranks. 0 when unknown."""
        try:
            return v1_loads_max_running(await self.engine.get_json(LOADS_PATH), self.config.dp_rank)
        except (TimeoutError, OSError, EngineError, ValueError, TypeError):
            return 0

    async def run(self, stop: asyncio.Event) -> None:
        self.registration = await once_ready(self.engine.base_url, stop, self.describe_engine)
        if self.registration is None:
            return
        events = await self._kv_event_source()
        if events is None:  # announce what the runs here leave cached instead (an inference)
            self.registration = msgspec.structs.replace(self.registration, kv_events=False)
        reg = self.registration
        self.lease = IdLease(await workers_bucket(self.bus), self.registration)
        await self.lease.claim(stop)  # before taking any of the id's messages
        await self._subscribe()
        relay = self.relay = KvRelay(self.bus, self.config.worker_id, reg.block_size)
        await relay.start()
        if events is None:
            self.inferred = InferredCache(relay, reg.kv_capacity_blocks, reg.block_size)
        migration = WorkerMigration(self.config.worker_id, self.bus, self.engine,
                                    lambda: self.relay and self.relay.mirror,
                                    self.registration.block_size)  # fmt: skip
        await migration.start(relay)
        self.migration = migration
        try:
            async with asyncio.TaskGroup() as tg:
                if events is not None:
                    tg.create_task(relay.run(*events, stop))
                tg.create_task(relay.refresh_loop(self.config.kv_refresh_s, stop))
                tg.create_task(self._lease_loop(stop))
                tg.create_task(self._load_loop(stop))
                tg.create_task(self._held_loop(stop))
        finally:
            await relay.close()
            await self.lease.release()
        if self.lease.taken is not None:
            raise SystemExit(self.lease.taken)

    async def _subscribe(self) -> None:
        wid = self.config.worker_id
        await self.bus.subscribe(
            subjects.worker_generate(wid), WorkerGenerate, self.on_generate, concurrent=True
        )
        await self.bus.subscribe(subjects.worker_abort(wid), AbortRequest, self.on_abort)
        await self.bus.subscribe(
            subjects.worker_kv_import(wid), KvTransfer, self.on_kv_import, concurrent=True
        )

    async def _kv_event_source(self) -> tuple[str, str | None, str] | None:
        """(endpoint, replay endpoint, topic) of the engine's KV events, or None when off.

        ``--kv-events`` wins; otherwise the engine's ``kv_events_config`` from ``/server_info``
        (SGLang reports its server args there), with a wildcard host replaced by the engine's.
        """
        info = await self.engine.get_json("/server_info")
        raw = info.get("kv_events_config")
        config = json.loads(raw) if isinstance(raw, str) and raw else (raw or {})
        endpoint = self.config.kv_events_endpoint
        if not endpoint:
            endpoint = config.get("endpoint", "tcp://*:5557")  # SGLang's defaults
            if config.get("publisher", "null") != "zmq":
                log.warning("engine publishes no KV events (its kv_events_config has publisher "
                            "%r; start SGLang with --kv-events-config '{\"publisher\": \"zmq\", "
                            "\"endpoint\": \"tcp://*:5557\"}'): this adapter announces what its "
                            "runs leave cached instead (evictions under memory pressure unseen)",
                            config.get("publisher", "null"))  # fmt: skip
                return None
            if not publisher_binds(endpoint, config.get("bind")):
                log.warning("engine's KV publisher connects to %s instead of binding it, so it "
                            "waits for a subscriber that binds there, which this adapter does "
                            "not: give SGLang a wildcard endpoint (tcp://*:PORT) or \"bind\": "
                            "true", endpoint)  # fmt: skip
        host = urlparse(self.engine.base_url).hostname or "127.0.0.1"
        replay = config.get("replay_endpoint")
        rank = self.config.dp_rank or 0  # rank r publishes on rank 0's ports + r (SGLang's rule)
        return (
            offset_endpoint_port(connectable(endpoint, host), rank) or endpoint,
            offset_endpoint_port(connectable(replay, host), rank) if replay else None,
            config.get("topic", ""),
        )

    async def _lease_loop(self, stop: asyncio.Event) -> None:
        """Renew the lease while the engine answers; leave the fleet at once when it stops
        answering (routers stop sending work here) and come back when it answers again."""
        registered = False
        renewal_failures = 0
        while not stop.is_set():
            healthy = self.engine_healthy.is_set()
            try:
                if healthy:
                    if self._lora:
                        await self._refresh_adapters()
                    if not await self.lease.renew():
                        log.error("%s", self.lease.taken)
                        stop.set()
                        return
                elif registered:
                    log.warning("%s: engine not answering: leaving the fleet", self.lease.key)
                    await self._hand_back_runs("the engine stopped answering")
                    await self.lease.withdraw()
                    if self.inferred is not None:
                        await self.inferred.forget()
                registered = healthy
            except Exception as err:  # NATS away: the traceback once, then one line
                renewal_failures += 1
                if _doubled(renewal_failures):
                    log.warning("lease renewal failed (%d in a row): %r", renewal_failures, err,
                                exc_info=renewal_failures == 1)  # fmt: skip
            else:
                renewal_failures = 0
            self._health_changed.clear()
            await wait_any(stop, self._health_changed, self.config.lease_s / 3)

    async def _load_loop(self, stop: asyncio.Event) -> None:
        subject = subjects.worker_load(self.config.worker_id)
        failures = 0
        while not stop.is_set():
            try:
                report = await self.read_load()
            # an answer that is not a load (ValueError, TypeError) is as unhealthy as none
            except (TimeoutError, OSError, EngineError, ValueError, TypeError) as err:
                failures += 1
                if _doubled(failures):
                    log.warning("load poll failed (%d in a row): %s", failures, err)
                if failures >= UNHEALTHY_AFTER:
                    self._set_healthy(False)
            else:
                if failures >= UNHEALTHY_AFTER:
                    log.warning("engine %s answers again after %d failed load polls",
                                self.engine.base_url, failures)  # fmt: skip
                failures = 0
                self._set_healthy(True)
                try:
                    await self.bus.publish(subject, report)
                except BusError as err:  # NATS away: the next poll reports again
                    log.warning("load report not published: %s", err)
            await sleep_or_stop(stop, self.config.load_interval_s)

    async def _held_loop(self, stop: asyncio.Event) -> None:
        """Tell the clients of quiet runs that their request is held here (``held_after_s``)."""
        after_s = self.config.held_after_s
        while not stop.is_set():
            await sleep_or_stop(stop, after_s / 4)
            now = time.monotonic()
            for generation in [g for g in self.running.values() if g.owes_held_reply(now, after_s)]:
                generation.held = True
                held = HeldReply(request_id=generation.request_id,
                                 service=f"worker/{self.config.worker_id}")  # fmt: skip
                try:
                    await self.bus.publish(generation.work.reply_subject, held)
                except BusError as err:  # NATS away: the client's resend still runs it once
                    log.warning("held reply for %s not published: %s", generation.request_id, err)

    async def _hand_back_runs(self, reason: str) -> None:
        """Every run on the dead engine goes back to the scheduler (before we leave the fleet,
        so it resumes them instead of failing them)."""
        runs = list(self.running.values())
        for generation in runs:
            generation.abandon(reason)
        tasks = [g.task for g in runs if g.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=5)

    def _set_healthy(self, healthy: bool) -> None:
        if healthy != self.engine_healthy.is_set():
            (self.engine_healthy.set if healthy else self.engine_healthy.clear)()
            self._health_changed.set()

    async def read_load(self) -> LoadReport:
        """The engine's load answer (``/v1/loads``) plus this adapter's own run counts (SGLang
        reports neither the runs it was handed nor the prefill they still queue)."""
        reg = self.registration
        block_size = reg.block_size if reg else 1
        figures = await self._engine_load(block_size)
        capacity = reg.kv_capacity_blocks if reg else 0
        return load_report(self.config.worker_id, time.time(), figures, self.runs, capacity)

    async def _engine_load(self, block_size: int) -> EngineLoadFigures:
        """SGLang 0.5's ``/v1/loads``; an engine without it (404: SGLang before 0.5) is read
        through ``/get_load`` from then on."""
        rank = self.config.dp_rank
        if not self._old_load_api:
            try:
                return parse_v1_loads(await self._shared_answer(LOADS_PATH), block_size, rank)
            except EngineError as err:
                if err.status != 404:
                    raise
                log.info("engine %s has no %s: reading %s", self.engine.base_url, LOADS_PATH,
                         OLD_LOAD_PATH)  # fmt: skip
                self._old_load_api = True
        return parse_get_load(await self._shared_answer(OLD_LOAD_PATH), block_size, rank)

    async def _shared_answer(self, path: str) -> object:
        """The engine's answer at ``path``; the ranks of one engine share one (it is the whole
        engine's: its load holds every rank's, its adapters are every rank's)."""
        if self.config.dp_rank is None:
            return await self.engine.get_json(path)
        return await self.engine.get_shared(path, self.config.load_interval_s / 2)

    async def on_generate(self, work: WorkerGenerate, delivery: Delivery) -> None:
        rid = work.request.request_id
        now = time.monotonic()
        taken, refusal = self.offer_screen.screen(work, self.running.get(rid), now)
        if not (taken or refusal):
            healthy = self.engine_healthy.is_set()
            refusal = pd_refusal(self.pd_mode, work) if healthy else "its engine is not answering"
        if taken or refusal:
            if delivery.reply:
                ack = Ack(accepted=bool(taken), reason=taken or refusal)
                await self.bus.publish(delivery.reply, ack)
            return
        generation = Generation(
            work, self.config.worker_id, self.bus, self.engine, self.runs,
            max_request_s=self.config.max_request_s,
            prepare=self.migration.before_run if self.migration is not None else None,
            inferred=self.inferred,
        )  # fmt: skip
        # booked before the ack's await: an abort handled meanwhile finds the run and stops it
        self.running[rid] = generation
        self.offer_screen.offers.ran(now, work.offer)
        context = len(work.request.token_ids or [])
        prefill = context - max(0, work.predicted_cached_tokens)
        if work.bootstrap is not None and self.pd_mode == "decode":
            prefill = 0  # SGLang's PD: the prefill engine computes it; the KV comes here
        self.runs.accept(generation.engine_rid, prefill)
        try:
            if delivery.reply:
                await self.bus.publish(delivery.reply, Ack(accepted=True))
            final = await generation.run()
        finally:
            self.runs.finished(generation.engine_rid)
            self.running.pop(rid, None)
        if final is not None:
            self._count(final, work.request.model)

    async def on_kv_import(self, transfer: KvTransfer, delivery: Delivery) -> None:
        """PD: the decode side takes over a prefilled prompt's KV before its continuation."""
        try:
            result = await self.engine.import_kv(
                transfer.token_ids, cache_salt=transfer.cache_salt, lora_name=transfer.lora_name
            )
            answer = Ack(accepted=True)
            imported = result.get("imported_blocks")
            log.debug("imported %s blocks for %s", imported, transfer.request_id)
        except (TimeoutError, EngineError, OSError) as err:
            answer = Ack(accepted=False, reason=f"KV import failed: {err}")
        if delivery.reply:
            await self.bus.publish(delivery.reply, answer)

    async def on_abort(self, abort: AbortRequest, delivery: Delivery) -> None:
        """Preemption or cancellation: stop the run without telling the client, hand back what
        it produced (a preempted request resumes from there). The offers it names are refused
        from now on, found or not."""
        self.offer_screen.offers.void(time.monotonic(), *abort.offers)
        generation = self.running.get(abort.request_id)
        if generation is None:
            answer = Preempted(request_id=abort.request_id, found=False)
        else:
            log.info("request %s stopped: %s", abort.request_id, abort.reason)
            await generation.stop()
            answer = Preempted(
                request_id=abort.request_id, found=True, output_token_ids=generation.all_output()
            )
        if delivery.reply:
            await self.bus.publish(delivery.reply, answer)

    def _count(self, final: FinalReply, model: str) -> None:
        attrs = {"model": model, "worker_id": self.config.worker_id}
        m = self.metrics
        m.completed.add(1, attrs)
        m.prompt_tokens.add(final.usage.prompt_tokens, attrs)
        m.cached_tokens.add(final.usage.cached_tokens, attrs)
        if final.usage.cached_tokens:
            m.hit_requests.add(1, attrs)


def _doubled(failures: int) -> bool:
    """Log the 1st, 2nd, 4th, 8th... failure in a row: an engine or NATS away for minutes is
    a few lines, not several a second."""
    return failures & (failures - 1) == 0
