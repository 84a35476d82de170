"""Dynamo 1.6.1's KV router in front of SGLang engines over HTTP: the ``dynamo`` baseline of
``bench live``.

    python -m thunderagent.bench.dynamo_router --port P --worker-urls URL [URL ...]

Dynamo ships its router's selection core without its runtime (``SelectionService`` in the
``ai-dynamo-runtime`` wheel, the core behind ``python -m dynamo.select_service``), for runtimes
that contact the chosen worker themselves: it indexes each worker's KV events from the engine's
own ZMQ publisher, picks a worker per prompt by KV overlap and load, and books the request's load
until told its prefill is done and its run has ended. This is that runtime, as thin as one can
be: each engine registered from its ``/server_info`` (its page size, its pool, its KV event
endpoint), each ``/generate`` sent where ``select_and_reserve`` says, its prefill marked done at
its first streamed chunk and its booking freed at its end. Every routing setting is Dynamo's
default (``KvRouterConfig``'s, which the selection core applies). Where requests go is Dynamo's
code; the per-request overhead of this aiohttp proxy is ours, so compare where prompts went and
how the engines served them, not the router's added latency.
"""

from __future__ import annotations

import argparse
import os
import sys

import aiohttp
from aiohttp import web

MODEL = "default"
SERVICE = web.AppKey("service", object)
"""The app's Dynamo selection core (its books: ``service.loads()``)."""


async def register(service, session: aiohttp.ClientSession, urls: list[str]) -> None:
    """Each engine as a Dynamo worker, from what it says of itself; an engine that publishes no
    KV events cannot be one (Dynamo's selection core routes on them)."""
    for worker_id, url in enumerate(urls):
        async with session.get(url + "/server_info") as r:
            info = await r.json()
        events = info.get("kv_events") or {}  # SGLang 0.5's description of its publisher
        if not events.get("endpoint_port_base"):
            raise SystemExit(f"{url} publishes no KV events: Dynamo's router needs them")
        if int(info.get("dp_size") or 1) != 1:  # rank r publishes on base + r: not wired here
            raise SystemExit(f"{url} has {info['dp_size']} data-parallel ranks; one is supported")
        host = events["endpoint_host"]
        endpoint = f"tcp://{host}:{events['endpoint_port_base']}"
        replay = events.get("replay_endpoint_port_base")
        page = int(info["page_size"])
        record = await service.upsert_worker(
            {
                "worker_id": worker_id,
                "model_name": MODEL,
                "endpoint": url,
                "kv_events_endpoint": endpoint,
                "replay_endpoint": f"tcp://{host}:{replay}" if replay else None,
                "block_size": page,
                "total_kv_blocks": int(info["max_total_num_tokens"]) // page,
                "max_num_batched_tokens": info.get("chunked_prefill_size"),
            }
        )
        if record.get("lifecycle") != "schedulable":
            raise SystemExit(f"Dynamo refused {url}: {record.get('not_schedulable_reasons')}")


class DynamoProxy:
    """``/generate`` through Dynamo's selection: choose, book, forward, mark, free."""

    def __init__(self, service, session: aiohttp.ClientSession) -> None:
        self.service = service
        self.session = session

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"error": "the body is not JSON"}, status=400)
        tokens = body.get("input_ids") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not tokens:
            return web.json_response({"error": "input_ids: a non-empty token list"}, status=400)
        try:
            chosen = await self.service.select_and_reserve(
                {"model_name": MODEL, "token_ids": tokens}
            )
        except Exception as err:  # no schedulable worker, or a prompt it refuses: say which
            return web.json_response({"error": f"Dynamo's selection: {err}"}, status=503)
        sid = chosen["selection_id"]
        try:
            async with self.session.post(chosen["endpoint"] + "/generate", json=body) as up:
                if not body.get("stream"):
                    await self.service.prefill_complete(sid)
                    return web.Response(
                        body=await up.read(), status=up.status, content_type=up.content_type
                    )
                return await self._stream(request, up, sid)
        finally:
            await self.service.free_reservation(sid)

    async def _stream(self, request: web.Request, up, sid: str) -> web.StreamResponse:
        out = web.StreamResponse(status=up.status, headers={"Content-Type": up.content_type})
        await out.prepare(request)
        first = True
        async for line in up.content:
            if first and line.startswith(b"data:"):
                first = False
                await self.service.prefill_complete(sid)  # the first token: prefill done
            await out.write(line)
        await out.write_eof()
        return out


async def app(urls: list[str]) -> web.Application:
    os.environ.setdefault("DYN_LOG", "error")  # its selector logs every decision at INFO
    from dynamo._core import SelectionService

    service = SelectionService()
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    try:
        await register(service, session, urls)
    except BaseException:
        await session.close()
        service.shutdown()
        raise
    proxy = DynamoProxy(service, session)
    application = web.Application()
    application[SERVICE] = service
    application.router.add_post("/generate", proxy.generate)

    async def close(_: web.Application) -> None:
        await session.close()
        service.shutdown()

    application.on_cleanup.append(close)
    return application


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="thunderagent.bench.dynamo_router", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--worker-urls", nargs="+", required=True)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    web.run_app(app(args.worker_urls), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
