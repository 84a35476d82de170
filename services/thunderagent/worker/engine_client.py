"""HTTP client for SGLang's (and the simulated engine's) API."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec

from thunderagent.telemetry import inject_headers

_encode = msgspec.json.encode


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
        self._session: aiohttp.ClientSession | None = None
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=5)

    async def __aenter__(self) -> EngineClient:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        self._session = aiohttp.ClientSession(timeout=self._timeout, connector=connector)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("EngineClient used outside `async with`")
        return self._session

    async def get_json(self, path: str) -> Any:
        async with self.session.get(self.base_url + path) as resp:
            if resp.status != 200:
                raise EngineError(resp.status, await resp.text())
            return await resp.json(content_type=None)

    async def import_kv(self, token_ids: list[int]) -> dict:
        """PD: import a prompt's KV (the simulated engine's ``/import_kv``)."""
        body = _encode({"input_ids": token_ids})
        headers = {"Content-Type": "application/json"}
        async with self.session.post(
            self.base_url + "/import_kv", data=body, headers=headers
        ) as resp:
            if resp.status != 200:
                raise EngineError(resp.status, (await resp.text())[:300])
            return await resp.json()

    async def abort(self, rid: str) -> bool:
        """Best effort ``/abort_request``; False when the engine refused or is unreachable."""
        try:
            async with self.session.post(self.base_url + "/abort_request", json={"rid": rid}) as r:
                return r.status == 200
        except (aiohttp.ClientError, OSError):
            return False

    async def generate(
        self,
        rid: str,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        *,
        cache_salt: str | None = None,
    ) -> AsyncIterator[EngineChunk]:
        """Stream ``/generate``. SGLang sends cumulative ``text``/``output_ids`` by default and
        incremental ones with ``--incremental-streaming-output``; both are turned into deltas.

        ``cache_salt``: the tenant's KV namespace (SGLang's ``GenerateReqInput.cache_salt``): the
        engine reuses cached prefixes only between requests with the same salt."""
        body: dict[str, Any] = {
            "rid": rid,
            "input_ids": input_ids,
            "sampling_params": sampling_params,
            "stream": True,
        }
        if cache_salt:
            body["cache_salt"] = cache_salt
        headers = inject_headers({"Content-Type": "application/json"})
        # msgspec, not aiohttp's json.dumps: prompts are thousands of ints, on every request
        async with self.session.post(
            self.base_url + "/generate", data=_encode(body), headers=headers
        ) as resp:
            if resp.status != 200:
                raise EngineError(resp.status, (await resp.text())[:500])
            seen_ids = 0
            seen_text = 0
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    raise EngineError(500, str(chunk["error"]))
                ids = chunk.get("output_ids") or []
                text = chunk.get("text") or ""
                meta = chunk.get("meta_info") or {}
                cumulative = len(ids) == meta.get("completion_tokens", -1) and len(ids) >= seen_ids
                new_ids = ids[seen_ids:] if cumulative else ids
                seen_ids = len(ids) if cumulative else seen_ids + len(ids)
                new_text = text[seen_text:] if cumulative else text
                seen_text = len(text) if cumulative else seen_text + len(text)
                yield EngineChunk(new_token_ids=new_ids, new_text=new_text, meta=meta)
