"""OpenAI-compatible ``/v1/completions`` and ``/v1/chat/completions`` over the same engine.

SGLang serves both next to ``/generate``; usage carries ``prompt_tokens_details.cached_tokens``
as SGLang reports it. Streaming sends ``data: {chunk}`` lines and ``data: [DONE]``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from thunderagent.simengine.dp_ranks import DpRanks
from thunderagent.simengine.driver import (
    EngineRejected,
    GenerateInput,
    first_stop,
    stop_strings,
)
from thunderagent.tokenizer import ByteTokenizer, render_chat

log = logging.getLogger(__name__)

_ROLES = {"system", "user", "assistant", "tool"}


@dataclass(slots=True, frozen=True)
class _Turn:
    role: str
    content: str


def _bad(message: str, status: int = 400) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": "invalid_request_error", "code": status}},
        status=status,
    )


class OpenAIRoutes:
    def __init__(self, ranks: DpRanks, model: str) -> None:
        self.ranks = ranks
        self.model = model
        self.tokenizer = ByteTokenizer()

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await _json(request)
        if isinstance(body, web.Response):
            return body
        prompt = body.get("prompt")
        if isinstance(prompt, list) and all(isinstance(t, int) and t >= 0 for t in prompt):
            ids = prompt
        elif isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            return _bad("prompt must be a string or a list of token ids")
        return await self._run(request, body, ids, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await _json(request)
        if isinstance(body, web.Response):
            return body
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return _bad("messages must be a non-empty list")
        try:
            turns = [_Turn(m["role"], m["content"]) for m in messages]
        except (KeyError, TypeError):
            return _bad("each message needs a role and a content")
        if any(t.role not in _ROLES or not isinstance(t.content, str) for t in turns):
            return _bad(f"message roles must be one of {sorted(_ROLES)} with string content")
        ids = self.tokenizer.encode(render_chat(turns))
        return await self._run(request, body, ids, chat=True)

    async def _run(self, request: web.Request, body: dict, ids: list[int], *, chat: bool):
        if not ids:
            return _bad("the prompt is empty")
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens", 16))
        if not isinstance(max_tokens, int) or max_tokens <= 0:
            return _bad("max_tokens must be a positive integer")
        stops = stop_strings(body.get("stop"))
        if stops is None:
            return _bad("stop must be a string or a list of strings")
        # the output is fixed text: it ends before the first stop string it meets (which
        # OpenAI leaves out of the answer), finish_reason "stop"
        hit = first_stop(stops, max_tokens)
        finish = "length" if hit is None else "stop"
        try:
            engine = self.ranks.pick(body)
        except ValueError as err:
            return _bad(str(err))
        rid = uuid.uuid4().hex
        events = engine.generate(
            GenerateInput(
                rid=rid,
                input_ids=ids,
                max_new_tokens=max_tokens if hit is None else max(hit[0], 1),
                stop_matched=None if hit is None else hit[1],
            )
        )
        try:
            first = await anext(events)
        except (EngineRejected, ValueError) as err:
            return _bad(str(err))
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        if body.get("stream"):
            kind += ".chunk" if chat else ""
            return await self._stream(request, events, first, kind, rid, created, chat, finish)
        return await self._whole(events, first, kind, rid, created, chat, finish)

    async def _whole(
        self, events, first, kind: str, rid: str, created: int, chat: bool, finish: str
    ) -> web.Response:
        """The answer in one reply (no ``stream``): every event's tokens, then the usage."""
        out: list[int] = list(first.token_ids)
        last = first
        async for ev in events:
            out.extend(ev.token_ids)
            last = ev
        reason = finish if last.finish_reason == "length" else last.finish_reason
        result = self._choice(kind, rid, created, self.tokenizer.decode(out), reason, chat)
        result["usage"] = _usage(last)
        return web.json_response(result)

    async def _stream(
        self,
        request: web.Request,
        events,
        first,
        kind: str,
        rid: str,
        created: int,
        chat: bool,
        finish: str,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        try:  # aclosing: a client gone mid-stream aborts the run now, as SGLang does
            async with contextlib.aclosing(events):
                await resp.prepare(request)
                ev = last = first
                while ev is not None:
                    if ev.token_ids:
                        text = self.tokenizer.decode(ev.token_ids)
                        chunk = self._choice(kind, rid, created, text, None, chat, delta=True)
                        await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    last = ev
                    ev = await anext(events, None)
            reason = finish if last.finish_reason == "length" else last.finish_reason
            final = self._choice(kind, rid, created, "", reason, chat, delta=True)
            final["usage"] = _usage(last)
            await resp.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())
            await resp.write_eof()
        except ConnectionResetError:
            log.info("request %s: the client went away mid-stream; aborted", rid)
        return resp

    def _choice(
        self, kind: str, rid: str, created: int, text: str, finish, chat: bool, *, delta=False
    ) -> dict[str, Any]:
        if chat:
            key = "delta" if delta else "message"
            choice = {
                "index": 0,
                key: {"role": "assistant", "content": text},
                "finish_reason": finish,
            }
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish}
        return {
            "id": rid,
            "object": kind,
            "created": created,
            "model": self.model,
            "choices": [choice],
        }


def _usage(ev) -> dict[str, Any]:
    return {
        "prompt_tokens": ev.prompt_tokens,
        "completion_tokens": ev.completion_tokens,
        "total_tokens": ev.prompt_tokens + ev.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": ev.cached_tokens},
    }


async def _json(request: web.Request) -> dict | web.Response:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        return _bad(f"body is not JSON: {err}")
    if not isinstance(body, dict):
        return _bad("body must be a JSON object")
    return body
