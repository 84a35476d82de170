"""HTTP client for SGLang's (and the simulated engine's) API: the streamed ``/generate`` over
``http1.Http1Pool`` (the hot path, see there for why), everything else over aiohttp."""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import msgspec

from thunderagent.schemas import PdBootstrap
from thunderagent.telemetry import inject_headers
from thunderagent.worker.http1 import Http1Pool

_encode = msgspec.json.encode
_decode_chunk = msgspec.json.Decoder(dict).decode


def _broken(path: str, err: aiohttp.ClientError) -> OSError:
    """aiohttp's transport failures as the OSError every caller handles (a dropped connection
    or a cut body is not an OSError in aiohttp: uncaught, it would end the adapter's loops)."""
    if isinstance(err, OSError):
        return err
    return ConnectionError(f"engine {path}: {type(err).__name__}: {err}")


class EngineError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"engine HTTP {status}: {message}")
        self.status = status


@dataclass(slots=True)
class EngineChunk:
    """One streamed update, normalised: only the *new* output ids, plus SGLang's meta_info."""

    new_token_ids: list[int]
    new_text: str
    meta: dict[str, Any]

    @property
    def finished(self) -> bool:
        """The engine named a finish reason: this is the run's last token."""
        return bool(self.meta.get("finish_reason"))


class EngineClient:
    def __init__(self, base_url: str, *, timeout_s: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.dp_rank: int | None = None
        """The data-parallel rank this client's runs go to (``for_rank``); None: the engine's
        own choice."""
        self.bootstrap_port = 0
        """A prefill engine in SGLang's PD mode: its KV bootstrap port (0: not one)."""
        self._session: aiohttp.ClientSession | None = None
        self._shared: dict[str, tuple[float, asyncio.Future]] = {}
        """``get_shared``'s latest GET per path, with when it was sent (the rank views share
        this dict: ``for_rank`` copies the reference)."""
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=5)
        self._streams = Http1Pool(self.base_url, connect_timeout_s=5)
        """``/generate``'s connections (its runs are bounded by the adapter's own limit)."""

    async def __aenter__(self) -> EngineClient:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        self._session = aiohttp.ClientSession(timeout=self._timeout, connector=connector)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._streams.close()
        if self._session is not None:
            await self._session.close()

    def for_rank(self, dp_rank: int) -> EngineClient:
        """A client whose runs and imports go to ``dp_rank``, sharing this one's connections
        (it is opened and closed with this one). The rank travels as ``data_parallel_rank``,
        the spelling sgl-model-gateway's DP-aware mode sends and releases before SGLang's
        rename know; 0.5.23 still takes it, as ``routed_dp_rank``."""
        ranked = copy.copy(self)
        ranked.dp_rank = dp_rank
        return ranked

    def _ranked(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.dp_rank is not None:
            body["data_parallel_rank"] = self.dp_rank
        return body

    @property
    def host(self) -> str:
        """The engine's host, as another engine reaches it (a PD pairing names it; an IPv6
        address in brackets, as SGLang's router sends it)."""
        host = urlsplit(self.base_url).hostname or "127.0.0.1"
        return f"[{host}]" if ":" in host else host

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("EngineClient used outside `async with`")
        return self._session

    async def get_json(self, path: str) -> Any:
        try:
            async with self.session.get(self.base_url + path) as resp:
                if resp.status != 200:  # one line: a web server's error page is a whole page
                    text = " ".join((await resp.text()).split())
                    hint = " (is this an SGLang server?)" if resp.status == 404 else ""
                    raise EngineError(resp.status, f"GET {path}: {text[:200]}{hint}")
                return await resp.json(content_type=None)
        except aiohttp.ClientError as err:
            raise _broken(path, err) from err

    async def get_shared(self, path: str, fresh_s: float) -> Any:
        """``get_json(path)``, one GET for every rank view that asks within ``fresh_s`` of the
        first: each rank's adapter polls the load, and one answer holds every rank's (an engine
        of 8 ranks is asked once per poll, not 8 times). A failure is shared the same way."""
        now = time.monotonic()
        sent = self._shared.get(path)
        if sent is None or now - sent[0] > fresh_s:
            sent = (now, asyncio.ensure_future(self.get_json(path)))
            self._shared[path] = sent
        return await asyncio.shield(sent[1])  # one rank's cancellation stops not the others'

    async def import_kv(
        self, token_ids: list[int], *, cache_salt: str | None = None, lora_name: str | None = None
    ) -> dict:
        """PD: import a prompt's KV (the simulated engine's ``/import_kv``), in the namespace of
        its tenant's salt and LoRA adapter."""
        fields: dict[str, Any] = {"input_ids": token_ids}
        if cache_salt:
            fields["cache_salt"] = cache_salt
        if lora_name:
            fields["lora_path"] = lora_name
        body = _encode(self._ranked(fields))
        headers = {"Content-Type": "application/json"}
        try:
            async with self.session.post(
                self.base_url + "/import_kv", data=body, headers=headers
            ) as resp:
                if resp.status != 200:
                    raise EngineError(resp.status, (await resp.text())[:300])
                return await resp.json()
        except aiohttp.ClientError as err:
            raise _broken("/import_kv", err) from err

    async def abort(self, rid: str) -> bool:
        """Best effort ``/abort_request``; False when the engine refused or is unreachable."""
        try:
            async with self.session.post(self.base_url + "/abort_request", json={"rid": rid}) as r:
                return r.status == 200
        except (aiohttp.ClientError, OSError):
            return False

    def generate_body(
        self,
        rid: str,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        bootstrap: PdBootstrap | None = None,
    ) -> dict[str, Any]:
        """``/generate``'s body, in SGLang's ``GenerateReqInput`` fields. ``cache_salt``: the
        tenant's KV namespace: the engine reuses cached prefixes only between requests with the
        same salt. ``lora_name``: the LoRA adapter, by its loaded name (SGLang's ``lora_path``).
        ``bootstrap``: SGLang's PD pairing, sent alike to the prefill and the decode engine."""
        body: dict[str, Any] = {
            "rid": rid,
            "input_ids": input_ids,
            "sampling_params": sampling_params,
            "stream": True,
        }
        if cache_salt:
            body["cache_salt"] = cache_salt
        if lora_name:
            body["lora_path"] = lora_name
        if bootstrap is not None:
            body["bootstrap_host"] = bootstrap.host
            body["bootstrap_port"] = bootstrap.port
            body["bootstrap_room"] = bootstrap.room
            if bootstrap.prefill_dp_rank is not None:
                body["disagg_prefill_dp_rank"] = bootstrap.prefill_dp_rank
        return self._ranked(body)

    async def generate(
        self, rid: str, input_ids: list[int], sampling_params: dict[str, Any], **fields: Any
    ) -> AsyncIterator[EngineChunk]:
        """Stream ``/generate`` (``fields``: ``generate_body``'s). SGLang sends cumulative
        ``text``/``output_ids`` by default and incremental ones with
        ``--incremental-streaming-output``; both are turned into deltas. The body is read to
        its end (past ``[DONE]``), so the connection can carry the next request."""
        body = self.generate_body(rid, input_ids, sampling_params, **fields)
        headers = inject_headers({"Content-Type": "application/json"})
        # msgspec, not json.dumps: prompts are thousands of ints, on every request
        async with self._streams.stream("/generate", _encode(body), headers) as resp:
            if resp.status != 200:
                raise EngineError(resp.status, (await resp.read()).decode(errors="replace")[:500])
            deltas = _Deltas()
            async for lines in resp.line_batches():
                chunk = deltas.merged(lines)
                if chunk is not None:
                    yield chunk


class _Deltas:
    """SGLang's stream lines -> EngineChunks of new tokens only."""

    __slots__ = ("done", "seen_ids", "seen_text")

    def __init__(self) -> None:
        self.seen_ids = 0
        self.seen_text = 0
        self.done = False

    def merged(self, lines: list[bytes]) -> EngineChunk | None:
        """One chunk for the stream lines that arrived together: when the adapter falls behind
        its engine, the tokens it owes a client leave as one message, not one each (every
        message costs the bus and the client as much as the adapter). A line arriving alone, as
        each does while the adapter keeps up, goes on alone: nothing waits for company."""
        out: EngineChunk | None = None
        for raw in lines:
            line = raw.strip()
            if not line.startswith(b"data:") or self.done:
                continue
            chunk = self.next(line[5:].strip())
            if chunk is None:
                continue
            if out is None:
                out = chunk
            else:
                out.new_token_ids = out.new_token_ids + chunk.new_token_ids
                out.new_text += chunk.new_text
                out.meta = chunk.meta
        return out

    def next(self, data: bytes) -> EngineChunk | None:
        if data == b"[DONE]":
            self.done = True
            return None
        try:
            chunk = _decode_chunk(data)
        except msgspec.DecodeError as err:
            raise EngineError(502, f"unreadable stream line: {err}") from None
        if "error" in chunk:
            raise EngineError(500, str(chunk["error"]))
        ids = chunk.get("output_ids") or []
        text = chunk.get("text") or ""
        meta = chunk.get("meta_info") or {}
        if not (isinstance(ids, list) and isinstance(text, str) and isinstance(meta, dict)):
            raise EngineError(502, f"stream line is not a generate chunk: {data[:200]!r}")
        cumulative = len(ids) == meta.get("completion_tokens", -1) and len(ids) >= self.seen_ids
        new_ids = ids[self.seen_ids :] if cumulative else ids
        self.seen_ids = len(ids) if cumulative else self.seen_ids + len(ids)
        new_text = text[self.seen_text :] if cumulative else text
        self.seen_text = len(text) if cumulative else self.seen_text + len(text)
        return EngineChunk(new_token_ids=new_ids, new_text=new_text, meta=meta)
