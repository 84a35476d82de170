"""``thunderagent gateway``: the OpenAI-compatible HTTP front door (aiohttp on uvloop).

One event loop per process: the HTTP server, the NATS connection and the fleet view share it,
with no thread hop on a request's path. Run several processes (``--reuse-port`` on one host,
or replicas behind a load balancer) for more cores; they share nothing but NATS. A client that
disconnects cancels its handler (aiohttp's ``handler_cancellation``), which publishes a
``CancelRequest`` and stops reading the reply inbox. Why aiohttp: README.md in this folder.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from thunderagent.bus import Bus
from thunderagent.client import Call, ReplyMux, Route
from thunderagent.fleet import WorkerRegistry
from thunderagent.gateway.admission import Admission, default_limit
from thunderagent.gateway.errors import CLIENT_CLOSED, HttpError, from_code, from_reply
from thunderagent.gateway.metrics import GatewayMetrics
from thunderagent.gateway.protocol import (
    Defaults,
    Parsed,
    parse_chat,
    parse_completion,
    request_id_from,
)
from thunderagent.gateway.responses import StreamEncoder, completion_body, sse_error
from thunderagent.gateway.routes import ModelRoutes
from thunderagent.schemas import ErrorCode, ErrorReply, FinalReply, TokenChunk
from thunderagent.shell import FleetWatcher, ServiceContext, TaskSet
from thunderagent.telemetry import extract_context

log = logging.getLogger(__name__)


class _ClientFaults(logging.Filter):
    """A request aiohttp cannot parse is the client's fault: one warning line, where aiohttp
    logs an error with a traceback (a client sending bad HTTP could fill the log)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, BadHttpMessage):
            record.msg, record.args = "bad HTTP from a client: %s", (exc.message,)
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


HTTP_LOG = logging.getLogger("thunderagent.gateway.http")
HTTP_LOG.addFilter(_ClientFaults())
_tracer = trace.get_tracer("thunderagent.gateway")

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
STARTED = web.RequestKey("started", float)
REQUEST_ID = web.RequestKey("request_id", str)
STATUS = web.RequestKey("status", int)
"""Per-request values the route wrapper reads: ``STATUS`` overrides the response's status in
the request counter (a stream that failed or lost its client after it began)."""


@dataclass(kw_only=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    """0: any free port (tests); the bound one is ``Gateway.url``."""
    reuse_port: bool = False
    """SO_REUSEPORT: several gateway processes on one host share the port (one core each)."""
    idle_timeout_s: float = 120.0
    """No reply for this long: the request is cancelled and answered 504."""
    retries: int = 3
    retry_after_s: float = 5.0
    """A request with no first reply after ``retry_after_s`` (a router replica went away
    holding it), or refused as unavailable by a restarting router or scheduler, is sent again
    with the same id, up to ``retries`` times (it still runs once): the ThunderClient's
    defaults."""
    backlog: int = 2048
    """Connections the kernel queues for ``accept``: uvicorn's default, which SGLang's own HTTP
    server runs with (aiohttp's 128 overflowed under a burst of new connections: clients were
    reset, 37 of 8,000 at 800 req/s of ``bench live --via gateway``). The kernel caps it at
    ``net.core.somaxconn``."""
    max_body_bytes: int = 8 * 2**20
    """Larger bodies are answered 413 (NATS's own limit is the server's ``max_payload``)."""
    shutdown_grace_s: float = 10.0
    """On SIGTERM, requests in flight get this long to finish."""
    max_concurrent_requests: int = -1
    """Generate requests held at once (``gateway.admission``; -1: SMG 1.13's default, 1,024
    per core and at least 4,096; 0: no bound)."""
    queue_size: int = 100
    """Requests that may wait for one of them to end (0: past the bound, 429 at once)."""
    queue_timeout_s: float = 60.0
    """How long one may wait before it is answered 429."""
    defaults: Defaults = field(default_factory=Defaults)


Parser = Callable[..., Parsed]


class Gateway:
    def __init__(self, bus: Bus, config: GatewayConfig, route: Route | None = None) -> None:
        """``route``: a router replica in this process (``thunderagent gateway --embed-router``)
        instead of one reached over NATS."""
        self.bus = bus
        self.config = config
        self.in_process_route = route
        self.registry = WorkerRegistry()
        self.fleet = FleetWatcher(bus, self.registry)
        self.mux = ReplyMux.on(bus)
        self.metrics = GatewayMetrics.get()
        limit = config.max_concurrent_requests
        self.admission = Admission(
            default_limit() if limit < 0 else limit, config.queue_size, config.queue_timeout_s
        )
        self.url = ""
        self.started = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self._tasks = TaskSet("gateway")

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes)
        models = ModelRoutes(self.registry, self.bus)
        route = self._route
        app.router.add_post(CHAT, route(CHAT, lambda r: self._generate(r, parse_chat)))
        app.router.add_post(
            COMPLETIONS, route(COMPLETIONS, lambda r: self._generate(r, parse_completion))
        )
        app.router.add_get("/v1/models", route("/v1/models", models.list))
        app.router.add_get("/v1/models/{model:.+}", route("/v1/models/{model}", models.get))
        app.router.add_get("/workers", route("/workers", models.workers))
        app.router.add_get("/health", route("/health", models.health))
        app.router.add_get("/ready", route("/ready", models.ready))
        app.router.add_get("/metrics", self._metrics)
        app.router.add_route("*", "/{tail:.*}", route("other", models.no_route))
        return app

    async def start(self) -> None:
        await self.mux.start()
        self._runner = web.AppRunner(
            self.app(),
            access_log=None,
            handler_cancellation=True,
            shutdown_timeout=self.config.shutdown_grace_s,
            logger=HTTP_LOG,
        )
        await self._runner.setup()
        site = web.TCPSite(
            self._runner, self.config.host, self.config.port,
            reuse_port=self.config.reuse_port, backlog=self.config.backlog,
        )  # fmt: skip
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        log.info("gateway serving the OpenAI API on %s", self.url)

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set, then let requests in flight finish (bounded)."""
        await self.start()
        self.started.set()
        try:
            await self.fleet.run(stop)
        finally:
            await self.close()

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        await self._tasks.wait(2)

    def spawn(self, coro: Awaitable[None]) -> None:
        self._tasks.spawn(coro)

    # --- request plumbing --------------------------------------------------------------------

    def _route(self, route: str, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        """Count, time and turn errors into OpenAI-shaped answers, for every route."""
        in_flight = self.metrics.in_flight.labels(route)
        duration = self.metrics.duration.labels(route)
        requests = self.metrics.requests

        async def counted(request: web.Request) -> web.StreamResponse:
            started = time.perf_counter()
            request[STARTED] = started
            in_flight.inc()
            status = 500
            try:
                response = await handler(request)
                status = request.get(STATUS, response.status)
                return response
            except HttpError as err:
                status = err.status
                return _error_response(request, err)
            except asyncio.CancelledError:
                status = CLIENT_CLOSED
                raise
            except ConnectionResetError:  # the client left before the answer could be written
                status = CLIENT_CLOSED
                return web.Response(status=CLIENT_CLOSED)  # aiohttp drops it quietly
            except Exception as err:
                log.exception("%s %s failed", request.method, request.path)
                error = from_code(ErrorCode.INTERNAL, f"{type(err).__name__}: {err}")
                return _error_response(request, error)
            finally:
                in_flight.dec()
                requests.labels(route, str(status)).inc()
                duration.observe(time.perf_counter() - started)

        return counted

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(REGISTRY)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _generate(self, request: web.Request, parse: Parser) -> web.StreamResponse:
        refused = await self.admission.enter()
        if refused is not None:
            raise from_code(ErrorCode.OVERLOADED, refused, retry_after_s=1.0)
        try:
            return await self._admitted(request, parse)
        finally:
            self.admission.leave()

    async def _admitted(self, request: web.Request, parse: Parser) -> web.StreamResponse:
        headers = request.headers
        request_id = request[REQUEST_ID] = request_id_from(headers)
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge as err:
            message = f"request body over {self.config.max_body_bytes} bytes ({err.text})"
            raise from_code(ErrorCode.PAYLOAD_TOO_LARGE, message) from None
        parsed = parse(raw, headers, request_id=request_id, now_ms=time.time() * 1e3,
                       defaults=self.config.defaults, served=self.registry.models())  # fmt: skip
        with _tracer.start_as_current_span(
            f"gateway POST {request.path}", context=extract_context(headers), kind=SpanKind.SERVER
        ) as span:
            span.set_attribute("thunderagent.request_id", request_id)
            span.set_attribute("http.request.method", "POST")
            span.set_attribute("url.path", request.path)
            call = Call(self.mux, parsed.request, idle_timeout_s=self.config.idle_timeout_s,
                        spawn=self.spawn, service="gateway", retries=self.config.retries,
                        retry_after_s=self.config.retry_after_s,
                        route=self.in_process_route)  # fmt: skip
            try:
                first = await call.start()
                if isinstance(first, ErrorReply):
                    span.set_status(Status(StatusCode.ERROR, first.message))
                    raise from_reply(first)
                if parsed.stream:
                    return await self._stream(request, parsed, call, first)
                return await self._collect(parsed, call, first)
            finally:
                call.close()

    async def _collect(self, parsed: Parsed, call: Call, reply) -> web.Response:
        """Non-streamed: the stack sends only the final reply (``stream=False``)."""
        texts: list[str] = []
        while not isinstance(reply, FinalReply):
            if isinstance(reply, ErrorReply):
                raise from_reply(reply)
            texts.append(reply.text)
            reply = await call.next()
        body = completion_body(
            reply, reply.text or "".join(texts), chat=parsed.chat,
            model=parsed.model, created=int(time.time()),
        )  # fmt: skip
        headers = {"x-request-id": reply.request_id, "x-thunderagent-worker": reply.worker_id}
        return web.Response(body=body, content_type="application/json", headers=headers)

    async def _stream(
        self, request: web.Request, parsed: Parsed, call: Call, reply
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={**_SSE_HEADERS, "x-request-id": parsed.request.request_id}
        )
        encoder = StreamEncoder(
            chat=parsed.chat, request_id=parsed.request.request_id, model=parsed.model,
            created=int(time.time()), include_usage=parsed.include_usage,
        )  # fmt: skip
        timing = _TokenTiming(self.metrics, request)
        try:
            await response.prepare(request)
            while True:
                frames, done = self._frames(call, reply, encoder, timing, request)
                await response.write(frames)
                if done:
                    break
                reply = await call.next()
            await response.write_eof()
        except ConnectionResetError:  # the client went away mid-stream
            request[STATUS] = CLIENT_CLOSED
        return response

    def _frames(self, call: Call, reply, encoder: StreamEncoder, timing, request):
        """SSE frames for ``reply`` and every reply already waiting (one write for a burst),
        and whether the stream is over."""
        frames = b""
        while reply is not None:
            if isinstance(reply, TokenChunk):
                timing.tokens(len(reply.token_ids))
                frames += encoder.tokens(reply.text)
            elif isinstance(reply, FinalReply):
                return frames + encoder.finish(reply), True
            else:
                error = from_reply(reply)
                request[STATUS] = error.status
                return frames + sse_error(error), True
            reply = call.next_nowait()
        return frames, False


class _TokenTiming:
    """TTFT and inter-token latency of one stream, as the client sees them (write time)."""

    __slots__ = ("_itl", "_last", "_started", "_ttft")

    def __init__(self, metrics: GatewayMetrics, request: web.Request) -> None:
        route = request.path
        self._ttft = metrics.ttft.labels(route)
        self._itl = metrics.itl.labels(route)
        self._started = request[STARTED]
        self._last: float | None = None

    def tokens(self, count: int) -> None:
        now = time.perf_counter()
        if self._last is None:
            self._ttft.observe(now - self._started)
        elif count:
            self._itl.observe((now - self._last) / count)
        self._last = now


def _error_response(request: web.Request, err: HttpError) -> web.Response:
    headers = dict(err.headers)
    if REQUEST_ID in request:
        headers["x-request-id"] = request[REQUEST_ID]
    return web.Response(
        status=err.status, body=err.body(), content_type="application/json", headers=headers
    )


async def main(ctx: ServiceContext, config: GatewayConfig) -> None:
    await Gateway(ctx.bus, config).run(ctx.stop)
