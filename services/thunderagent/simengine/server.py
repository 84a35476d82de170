"""SGLang's HTTP surface over the simulated engine.

Endpoints and JSON shapes follow SGLang's server (``/generate`` with ``input_ids`` or ``text``,
SSE streaming as ``data: {...}`` lines ending with ``data: [DONE]``, ``meta_info`` with
``prompt_tokens`` / ``cached_tokens`` / ``completion_tokens``), so the worker adapter and SGLang's
own router talk to it exactly as they talk to SGLang.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from thunderagent.sglang.zmq_publisher import KvEventsConfig
from thunderagent.simengine import instant
from thunderagent.simengine.dp_ranks import DpRanks
from thunderagent.simengine.driver import (
    EngineDriver,
    EngineRejected,
    GenerateInput,
    TokenEvent,
    first_stop,
    stop_strings,
)
from thunderagent.simengine.kv_moves import KvMover
from thunderagent.simengine.openai_api import OpenAIRoutes
from thunderagent.simengine.pd_bootstrap import (
    RESERVED_DECODE_TOKENS,
    WAIT_S,
    KvNotReceived,
    Offered,
    Pairing,
    PairingError,
    PrefillRooms,
    pairing_of,
    take_kv,
)
from thunderagent.simengine.pd_pages import (
    KvNotReserved,
    fill_kv,
    hold_prompt,
    release_kv,
    reserve_kv,
)
from thunderagent.simengine.salts import cache_namespace
from thunderagent.telemetry import extract_context, start_span_if_sampled
from thunderagent.tokenizer import ByteTokenizer

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("thunderagent.simengine")


@dataclass
class EngineInfo:
    model: str
    block_size: int
    kv_events_config: str | None = None
    kv_pull_gbps: float = 0.0
    """Pace KV pulls (migration) to this link speed in GB/s; 0: as fast as NIXL copies."""
    instant: bool = False
    """``--engine instant``: answer ``/generate`` at once with one token (``instant.py``)."""
    lora_adapters: list[str] = field(default_factory=list)
    """LoRA adapters loaded, by name (SGLang's ``--lora-paths``): a request may name one."""
    disaggregation_mode: str = "null"
    """SGLang's PD role (``--disaggregation-mode``): ``prefill``, ``decode`` or ``null``
    (``pd_bootstrap.py``)."""
    bootstrap_port: int = 0
    """A prefill engine's bootstrap port: its API port, where it serves the registry."""
    reserved_decode_tokens: int = RESERVED_DECODE_TOKENS
    """A decode engine keeps this many tokens free per request it holds before it reserves
    pages for another prompt (``SGLANG_NUM_RESERVED_DECODE_TOKENS``)."""


KEEPALIVE_S = 5.0
"""Seconds an idle HTTP connection stays open: SGLang's server runs uvicorn with
``timeout_keep_alive=5`` (``entrypoints/http_server.py``). aiohttp's default is 75 s, which
kept a burst's extra client connections open that long."""


def http_runner(app: web.Application) -> web.AppRunner:
    """The runner that serves a simulated engine's ``app`` as SGLang's server would."""
    return web.AppRunner(app, access_log=None, keepalive_timeout=KEEPALIVE_S)


def _bad(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


class SimEngineApp:
    def __init__(self, engine: EngineDriver | Sequence[EngineDriver], info: EngineInfo) -> None:
        """``engine``: one driver, or one per data-parallel rank (``--dp-size``)."""
        self.ranks = DpRanks([engine] if isinstance(engine, EngineDriver) else engine)
        self.engine = self.ranks.engines[0]
        """Rank 0: what every rank shares (profile, block size, capacity) is read here."""
        self.info = info
        self.tokenizer = ByteTokenizer()
        self.app = web.Application()
        r = self.app.router
        r.add_post("/generate", self.generate)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        r.add_get("/v1/loads", self.loads)  # SGLang 0.5
        r.add_get("/get_load", self.get_load)  # before it (sglang-router 0.3 polls it)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/import_kv", self.import_kv)
        r.add_get("/v1/models", self.models)
        self.rooms = PrefillRooms() if info.disaggregation_mode == "prefill" else None
        if self.rooms is not None:
            r.add_get("/pd/{room}", self.rooms.take)
        self._pd_session: aiohttp.ClientSession | None = None
        self._bootstrapping: dict[str, asyncio.Future] = {}
        """SGLang's PD: runs waiting for their other side, by request id (an abort ends it)."""
        self._aborted: set[str] = set()
        self.app.on_cleanup.append(self._close_pd_session)
        self.mover: KvMover | None = None
        if self.engine.kv_pool is not None:  # KV export/import over NIXL (not an SGLang API)
            pace = info.kv_pull_gbps * 1e9 or None
            self.mover = KvMover(
                self.engine, self.engine.kv_pool, pace_bytes_per_s=pace,
                lora_adapters=info.lora_adapters,
            )  # fmt: skip
            self.mover.add_routes(self.app)
            self.app.on_cleanup.append(self._close_mover)
        OpenAIRoutes(self.ranks, info.model).add_to(self.app)

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(text="")

    async def server_info(self, _: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.info.model,
                "served_model_name": self.info.model,
                "page_size": self.info.block_size,
                "dp_size": len(self.ranks),
                "max_running_requests": self.engine.max_running,
                "max_total_num_tokens": self.engine.capacity_blocks * self.info.block_size,
                # as SGLang: the server argument (None unless overridden), and the longest
                # prompt, which the KV pool bounds as well as the model's context
                "context_length": None,
                "max_req_input_len": min(
                    self.engine.context_length, self.engine.capacity_blocks * self.info.block_size
                )
                - 1,
                # not an SGLang field: the simulated model's vocabulary, so the adapter can
                # check token ids (with SGLang it reads it from the model's tokenizer)
                "vocab_size": self.engine.profile.model.vocab_size,
                "kv_events_config": self.info.kv_events_config,
                "kv_events": self._kv_events(),
                "enable_lora": bool(self.info.lora_adapters),
                "lora_paths": list(self.info.lora_adapters) or None,
                "disaggregation_mode": self.info.disaggregation_mode,
                "disaggregation_bootstrap_port": self.info.bootstrap_port or None,
                "version": "thunderagent-simengine",
                "kv_transfer": self.mover.info() if self.mover else None,
            }
        )

    def _kv_events(self) -> dict | None:
        """SGLang 0.5's description of its publisher (``kv_events``), from the events config
        the engine reports."""
        raw = self.info.kv_events_config
        if not raw:
            return None
        config = KvEventsConfig.from_cli(raw)
        return config.descriptor(self.info.block_size, len(self.ranks))

    async def _close_mover(self, _: web.Application) -> None:
        if self.mover is not None:
            await self.mover.close()

    async def model_info(self, _: web.Request) -> web.Response:
        return web.json_response(
            {"model_path": self.info.model, "tokenizer_path": None, "is_generation": True}
        )

    async def get_load(self, _: web.Request) -> web.Response:
        return web.json_response([e.load(r) for r, e in enumerate(self.ranks.engines)])

    async def loads(self, _: web.Request) -> web.Response:
        ranks = [e.load_snapshot(r) for r, e in enumerate(self.ranks.engines)]
        return web.json_response({"timestamp": time.time(), "version": "simulated", "loads": ranks})

    async def flush_cache(self, _: web.Request) -> web.Response:
        if not all([e.flush() for e in self.ranks.engines]):  # every rank asked, as SGLang does
            return web.Response(status=400, text="Cache not flushed: requests are running.\n")
        return web.Response(text="Cache flushed.\n")

    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            return _bad(f"body is not JSON: {err}")
        rid = body.get("rid") if isinstance(body, dict) else None
        if not isinstance(rid, str):
            return _bad("rid must be a string")
        for waiting_rid in [r for r in self._bootstrapping if r.startswith(rid)]:
            self._aborted.add(waiting_rid)
            self._bootstrapping[waiting_rid].cancel()
        for engine in self.ranks.engines:  # SGLang hands an abort to every rank
            engine.abort(rid)
        return web.Response(text="")

    async def import_kv(self, request: web.Request) -> web.Response:
        """Not an SGLang endpoint: PD disaggregation for the simulated engine. SGLang moves KV
        engine to engine (its PD bootstrap / NIXL); here the decode side imports the blocks and
        answers after the modelled transfer time."""
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            return _bad(f"body is not JSON: {err}")
        ids = body.get("input_ids") if isinstance(body, dict) else None
        if not isinstance(ids, list) or not all(isinstance(t, int) and 0 <= t < 2**63 for t in ids):
            return _bad("input_ids must be a list of integers in [0, 2**63)")  # SGLang's range
        salt, lora = body.get("cache_salt"), body.get("lora_path")
        if not all(x is None or isinstance(x, str) for x in (salt, lora)):
            return _bad("cache_salt and lora_path must be strings")
        try:
            engine = self.ranks.pick(body)
        except ValueError as err:
            return _bad(str(err))
        blocks, seconds = engine.import_kv(ids, cache_namespace(salt, lora))
        await asyncio.sleep(seconds / engine.speedup)
        return web.json_response({"imported_blocks": blocks, "transfer_s": seconds})

    async def models(self, _: web.Request) -> web.Response:
        """SGLang's list: the base model, then each loaded adapter with the base as parent."""
        base = {"id": self.info.model, "object": "model", "root": self.info.model, "parent": None}
        adapters = [{"id": name, "object": "model", "root": name, "parent": self.info.model}
                    for name in self.info.lora_adapters]  # fmt: skip
        return web.json_response({"object": "list", "data": [base, *adapters]})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        received = time.monotonic()
        if self.info.instant:
            return await self._instant(request, received)
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            return _bad(f"body is not JSON: {err}")
        parsed = self._parse_generate(body)
        if isinstance(parsed, web.Response):
            return parsed
        try:
            engine = self.ranks.pick(body)
            pairing = self._paired(body, parsed, self.ranks.engines.index(engine))
            if pairing is not None:
                await self._bootstrap(engine, pairing, parsed)
        except KvNotReceived as err:
            return _bad(str(err), 502)
        except KvNotReserved as err:
            return _bad(str(err), 503)
        except ValueError as err:  # a rank it lacks, a pairing without its fields
            return _bad(str(err))
        ctx = extract_context(request.headers)
        with _tracer.start_as_current_span("engine generate", context=ctx, kind=SpanKind.SERVER):
            events = engine.generate(parsed)
            first = None
            try:
                first = await anext(events)
            except (EngineRejected, ValueError) as err:
                return _bad(str(err))
            finally:
                if pairing is not None and self.rooms is not None:
                    self._hand_over(engine, pairing.room, parsed, first)
            if body.get("stream"):
                return await self._stream(request, parsed, first, events, received)
            return await self._whole(parsed, first, events, received)

    def _hand_over(
        self, engine: EngineDriver, room: int, req: GenerateInput, first: TokenEvent | None
    ) -> None:
        """The prefill side: a run's first token means the prompt's KV is ready for the decode
        side, whose copy reads it from pages this engine keeps until the copy is done; a run
        that ended without one (aborted, refused) has none, and the decode side hears so at
        once instead of waiting for it."""
        assert self.rooms is not None
        if first is None or not first.token_ids:
            self.rooms.offer(room, None)
            return
        space = cache_namespace(req.cache_salt, req.lora_name)
        release = hold_prompt(engine, req.input_ids, space)
        loop = asyncio.get_running_loop()
        untaken = loop.call_later(WAIT_S, release)
        copy_s = engine.copy_s(len(req.input_ids) // engine.block_size) / engine.speedup

        def taken() -> None:
            untaken.cancel()
            loop.call_later(copy_s, release)

        self.rooms.offer(room, Offered(req.input_ids, req.cache_salt, req.lora_name, taken))

    def _paired(self, body: dict, parsed: GenerateInput, rank: int) -> Pairing | None:
        """SGLang's PD: a request's pairing (None outside PD); a prefill engine computes only
        the prompt and its first token. A prefill engine of several ranks balances by room, as
        SGLang's ``follow_bootstrap_room``: a run routed to another rank must name its rank
        (``disagg_prefill_dp_rank``), or the decode side would ask the wrong one."""
        mode = self.info.disaggregation_mode
        if mode == "null":
            return None
        pairing = pairing_of(body, mode)
        if mode == "prefill":
            parsed.max_new_tokens = 1
            ranks = len(self.ranks)
            named = body.get("disagg_prefill_dp_rank")
            if ranks > 1 and named is None and rank != pairing.room % ranks:
                raise PairingError(f"follow_bootstrap_room conflict: dispatched to dp_rank "
                                   f"{rank} but bootstrap_room {pairing.room} implies dp_rank "
                                   f"{pairing.room % ranks}")  # fmt: skip
        return pairing

    async def _bootstrap(self, engine: EngineDriver, pairing: Pairing, req: GenerateInput) -> None:
        """SGLang's PD before a run: the decode side reserves pages and takes the KV, the
        prefill side waits until the decode side has reserved. An abort for the request ends
        the wait (SGLang aborts requests in its bootstrap and prealloc queues too)."""
        if self.info.disaggregation_mode == "decode":
            waiting = asyncio.ensure_future(self._take_kv(engine, pairing, req))
        else:
            waiting = asyncio.ensure_future(self.rooms.bootstrapped(pairing.room))
        self._bootstrapping[req.rid] = waiting
        try:
            await waiting
        except BaseException as err:
            if self.rooms is not None:  # this prefill will not run: a decode side asking later
                self.rooms.offer(pairing.room, None)  # hears so at once
            if not isinstance(err, asyncio.CancelledError):
                raise
            if req.rid not in self._aborted:  # this handler itself was cancelled
                waiting.cancel()
                raise
            raise KvNotReceived(f"request {req.rid} aborted during its PD bootstrap") from None
        finally:
            self._bootstrapping.pop(req.rid, None)
            self._aborted.discard(req.rid)

    async def _take_kv(self, engine: EngineDriver, pairing: Pairing, req: GenerateInput) -> None:
        """The decode side: pages reserved for the prompt's KV, then the KV from the paired
        prefill engine into them (in the request's namespace, after the modelled transfer
        time); the reservation is given back if the KV does not come."""
        space = cache_namespace(req.cache_salt, req.lora_name)
        reservation = await reserve_kv(
            engine, req.input_ids, space, self.info.reserved_decode_tokens, WAIT_S
        )
        try:
            if self._pd_session is None:
                self._pd_session = aiohttp.ClientSession()
            offered = await take_kv(self._pd_session, pairing)
            if offered.token_ids != req.input_ids:
                raise KvNotReceived(f"room {pairing.room} holds another prompt")
            await fill_kv(engine, reservation)
        finally:
            release_kv(engine, reservation)  # a no-op once filled

    async def _close_pd_session(self, _: web.Application) -> None:
        if self._pd_session is not None:
            await self._pd_session.close()

    async def _instant(self, request: web.Request, received: float) -> web.Response:
        try:
            body = msgspec.json.decode(await request.read())
        except msgspec.DecodeError as err:
            return _bad(f"body is not JSON: {err}")
        parsed = self._parse_generate(body)
        if isinstance(parsed, web.Response):
            return parsed
        try:
            engine = self.ranks.pick(body)
        except ValueError as err:
            return _bad(str(err))
        stream = bool(body.get("stream"))
        with start_span_if_sampled(_tracer, "engine generate", request.headers, SpanKind.SERVER):
            payload = await instant.answer(engine, parsed, received, stream=stream)
        kind = "text/event-stream" if stream else "application/json"
        return web.Response(body=payload, content_type=kind)

    def _parse_generate(self, body: Any) -> GenerateInput | web.Response:
        if not isinstance(body, dict):
            return _bad("body must be a JSON object")
        ids = self._prompt_ids(body)
        if isinstance(ids, web.Response):
            return ids
        params = body.get("sampling_params") or {}
        max_new = params.get("max_new_tokens", 128)
        if not isinstance(max_new, int) or max_new <= 0:
            return _bad("sampling_params.max_new_tokens must be a positive integer")
        salt = body.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            return _bad("cache_salt must be a string (batches are not supported)")
        lora = body.get("lora_path")
        if lora is not None and not isinstance(lora, str):
            return _bad("lora_path must be an adapter's name (batches are not supported)")
        if lora and lora not in self.info.lora_adapters:  # SGLang's registry refuses it so
            return _bad(f"The following requested LoRA adapters are not loaded: {lora}")
        stop = stop_strings(params.get("stop"))
        if stop is None:
            return _bad("sampling_params.stop must be a string or a list of strings")
        # the output is fixed text: it ends before the first stop string it meets, and the
        # run reports that string, as SGLang does (which also generates the string's tokens)
        hit = first_stop(stop, max_new)
        if hit is not None:
            max_new = max(hit[0], 1)
        rid = body.get("rid") or uuid.uuid4().hex
        return GenerateInput(
            rid=str(rid), input_ids=ids, max_new_tokens=max_new, cache_salt=salt or None,
            lora_name=lora or None,
            stop_matched=hit[1] if hit is not None else None,
        )  # fmt: skip

    def _prompt_ids(self, body: dict) -> list[int] | web.Response:
        """The prompt's token ids: ``input_ids`` as given, else ``text`` tokenized."""
        ids, text = body.get("input_ids"), body.get("text")
        if ids is None and text is None:
            return _bad("one of input_ids or text is required")
        if ids is None:
            if not isinstance(text, str):
                return _bad("text must be a string (batches are not supported)")
            ids = self.tokenizer.encode(text)
        if not isinstance(ids, list) or not all(isinstance(t, int) and t >= 0 for t in ids):
            return _bad("input_ids must be a list of non-negative integers")
        if not ids:
            return _bad("the prompt is empty")
        return ids

    def _chunk(
        self, req: GenerateInput, out_ids: list[int], ev, started: float, first_at: float | None
    ) -> dict:
        meta: dict[str, Any] = {
            "id": req.rid,
            "prompt_tokens": ev.prompt_tokens,
            "cached_tokens": ev.cached_tokens,
            "completion_tokens": ev.completion_tokens,
            "finish_reason": None,
            "e2e_latency": time.monotonic() - started,
        }
        if first_at is not None:
            # Not an SGLang field: the simulated engine's own receipt-to-first-token time, so
            # benchmarks can subtract the engine from what a client saw.
            meta["engine_ttft_s"] = first_at - started
        if ev.finished:
            meta["finish_reason"] = {"type": ev.finish_reason, "length": ev.completion_tokens}
            if ev.finish_reason == "length" and req.stop_matched is not None:
                meta["finish_reason"] = {"type": "stop", "matched": req.stop_matched}
        return {
            "text": self.tokenizer.decode(out_ids),
            "output_ids": list(out_ids),
            "meta_info": meta,
        }

    async def _stream(
        self, request: web.Request, req: GenerateInput, first, events, started: float
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        out_ids: list[int] = []
        first_at = None
        ev = first
        try:  # aclosing: a client gone mid-stream aborts the run now, as SGLang does
            async with contextlib.aclosing(events):
                await resp.prepare(request)
                while ev is not None:
                    out_ids.extend(ev.token_ids)
                    if first_at is None and ev.token_ids:
                        first_at = time.monotonic()
                    payload = json.dumps(self._chunk(req, out_ids, ev, started, first_at))
                    await resp.write(f"data: {payload}\n\n".encode())
                    ev = await anext(events, None)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            log.info("request %s: the client went away mid-stream; aborted", req.rid)
        return resp

    async def _whole(self, req: GenerateInput, first, events, started: float) -> web.Response:
        first_at = time.monotonic() if first.token_ids else None
        out_ids: list[int] = list(first.token_ids)
        last = first
        async for ev in events:
            out_ids.extend(ev.token_ids)
            if first_at is None and ev.token_ids:
                first_at = time.monotonic()
            last = ev
        return web.json_response(self._chunk(req, out_ids, last, started, first_at))
