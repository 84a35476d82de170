"""The adapter's keep-alive HTTP/1.1 client for ``/generate``, against real sockets: a scripted
server (byte-exact answers, split anywhere, closed or reset on cue) and the simulated engine."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from thunderagent.worker.engine_client import EngineClient, EngineError
from thunderagent.worker.http1 import Http1Pool, HttpProtocolError

pytestmark = pytest.mark.integration

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[bool]]
"""Answers one request (the connection's n-th); False ends the connection."""


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


SSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    + chunked(b'data: {"a": 1}\n\n', b'data: {"b": 2}\n\ndata: [DO', b"NE]\n")
)


class Server:
    """A real TCP server that runs ``script`` for each request it reads."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> Server:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        n = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))  # fmt: skip
                self.requests.append(head + await reader.readexactly(length))
                n += 1
                if not await self.script(reader, writer, n):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


async def write_split(writer: asyncio.StreamWriter, data: bytes, step: int = 3) -> None:
    """Every few bytes its own write, so the client sees every boundary split somewhere."""
    for i in range(0, len(data), step):
        writer.write(data[i : i + step])
        await writer.drain()
        await asyncio.sleep(0)


async def lines_of(pool: Http1Pool) -> tuple[int, list[bytes]]:
    async with pool.stream("/generate", b'{"x": 1}', {"Content-Type": "application/json"}) as r:
        return r.status, [line async for batch in r.line_batches() for line in batch]


async def test_chunked_stream_split_anywhere_and_kept_alive():
    async def script(reader, writer, n):
        await write_split(writer, SSE)
        return True

    async with Server(script) as server:
        pool = Http1Pool(server.url)
        first = await lines_of(pool)
        second = await lines_of(pool)
        pool.close()
    want = [b'data: {"a": 1}', b"", b'data: {"b": 2}', b"", b"data: [DONE]"]
    assert first == second == (200, want)
    assert server.connections == 1  # the second request reused the first one's connection
    assert server.requests[0].startswith(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1:")
    assert server.requests[0].endswith(b'\r\n\r\n{"x": 1}')


async def test_sized_error_answer_then_reuse():
    async def script(reader, writer, n):
        body = b'{"error": "nope"}' if n == 1 else b"fine"
        status = b"400 Bad Request" if n == 1 else b"200 OK"
        writer.write(b"HTTP/1.1 %s\r\nContent-Length: %d\r\n\r\n%s" % (status, len(body), body))
        return True

    async with Server(script) as server:
        pool = Http1Pool(server.url)
        async with pool.stream("/generate", b"{}", {}) as bad:
            assert (bad.status, await bad.read()) == (400, b'{"error": "nope"}')
        async with pool.stream("/generate", b"{}", {}) as good:
            assert (good.status, await good.read()) == (200, b"fine")
        pool.close()
    assert server.connections == 1


async def test_body_to_the_end_of_the_connection_is_not_reused():
    async def script(reader, writer, n):
        writer.write(b"HTTP/1.0 200 OK\r\n\r\nall of it")
        return False

    async with Server(script) as server:
        pool = Http1Pool(server.url)
        for _ in range(2):
            async with pool.stream("/generate", b"{}", {}) as r:
                assert await r.read() == b"all of it"
        pool.close()
    assert server.connections == 2


async def test_idle_connection_closed_by_the_server_is_retried_once():
    async def script(reader, writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        return False  # keep-alive promised, but the server closes it once idle (uvicorn does)

    async with Server(script) as server:
        pool = Http1Pool(server.url)
        for _ in range(3):
            async with pool.stream("/generate", b"{}", {}) as r:
                assert await r.read() == b"ok"
        pool.close()
    assert server.connections == 3 and len(server.requests) == 3  # each request sent once


async def test_reset_mid_body_is_an_oserror_and_the_connection_is_dropped():
    async def script(reader, writer, n):
        writer.write(SSE[:120])
        await writer.drain()
        return False

    async with Server(script) as server:
        pool = Http1Pool(server.url)
        with pytest.raises(ConnectionResetError):
            await lines_of(pool)
        assert pool._idle == []
        pool.close()


async def test_malformed_answers_are_protocol_errors():
    answers = iter([b"SSH-2.0-OpenSSH\r\n\r\n", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: "
                    b"chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n"])  # fmt: skip

    async def script(reader, writer, n):
        writer.write(next(answers))
        return False

    async with Server(script) as server:
        pool = Http1Pool(server.url)
        with pytest.raises(HttpProtocolError):
            await lines_of(pool)
        with pytest.raises(HttpProtocolError):
            await lines_of(pool)
        pool.close()
    assert issubclass(HttpProtocolError, OSError)  # the adapter hands such a run back


async def test_leaving_early_closes_the_connection():
    seen_eof = asyncio.Event()

    async def script(reader, writer, n):
        writer.write(SSE[:100])
        await writer.drain()
        if await reader.read(1) == b"":
            seen_eof.set()
        return False

    async with Server(script) as server:
        pool = Http1Pool(server.url)
        async with pool.stream("/generate", b"{}", {}) as r:
            async for _ in r.line_batches():
                break
        await asyncio.wait_for(seen_eof.wait(), 5)
        assert pool._idle == []
        pool.close()


async def test_engine_client_streams_deltas_and_reports_engine_errors():
    body = (b'data: {"text": "a", "output_ids": [5], "meta_info": {"completion_tokens": 1}}\n\n'
            b'data: {"text": "ab", "output_ids": [5, 6], "meta_info": {"completion_tokens": 2, '
            b'"finish_reason": {"type": "length"}}}\n\ndata: [DONE]\n\n')  # fmt: skip
    answers = iter([
        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body),
        b'HTTP/1.1 200 OK\r\nContent-Length: 23\r\n\r\ndata: {"error": "oom"}\n',
        b"HTTP/1.1 503 Busy\r\nContent-Length: 4\r\n\r\nbusy",
    ])  # fmt: skip

    async def script(reader, writer, n):
        writer.write(next(answers))
        return True

    async with Server(script) as server:
        async with EngineClient(server.url) as engine:
            chunks = [c async for c in engine.generate("r", [1, 2], {"max_new_tokens": 2})]
            with pytest.raises(EngineError, match="oom"):
                [c async for c in engine.generate("r2", [1], {})]
            with pytest.raises(EngineError) as refused:
                [c async for c in engine.generate("r3", [1], {})]
    # both lines arrived in one write: the client gets them as one chunk
    assert [(c.new_token_ids, c.new_text, c.finished) for c in chunks] == [([5, 6], "ab", True)]
    assert refused.value.status == 503 and "busy" in str(refused.value)


async def test_stream_lines_that_arrive_apart_are_chunks_apart():
    lines = [b'data: {"text": "a", "output_ids": [5], "meta_info": {"completion_tokens": 1}}\n\n',
             b'data: {"text": "b", "output_ids": [6], "meta_info": {"completion_tokens": 2}}\n\n',
             b'data: {"text": "c", "output_ids": [7], "meta_info": {"completion_tokens": 3, '
             b'"finish_reason": {"type": "length"}}}\n\ndata: [DONE]\n\n']  # fmt: skip
    body = b"".join(lines)
    read: list[asyncio.Event] = []

    async def script(reader, writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
        for line in lines:  # the next line only once the client has read this one
            writer.write(line)
            await writer.drain()
            read.append(asyncio.Event())
            await asyncio.wait_for(read[-1].wait(), 5)
        return True

    async with Server(script) as server:
        async with EngineClient(server.url) as engine:
            chunks = []
            async for c in engine.generate("r", [1], {}):
                chunks.append(c)
                read[-1].set()
    assert [(c.new_token_ids, c.new_text, c.finished) for c in chunks] == [
        ([5], "a", False),
        ([6], "b", False),
        ([7], "c", True),
    ]


async def test_a_connection_dropped_mid_answer_is_an_oserror_on_every_engine_call():
    """aiohttp's own errors for a cut connection are not OSErrors; the adapter's loops handle
    OSError, so the client turns them into one rather than let them end the adapter."""

    async def script(reader, writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{")
        await writer.drain()
        return False

    class GetServer(Server):
        async def _serve(self, reader, writer):  # GET: no body to read
            await reader.readuntil(b"\r\n\r\n")
            await script(reader, writer, 1)
            writer.close()

    async with GetServer(script) as server, EngineClient(server.url) as engine:
        with pytest.raises(OSError):
            await engine.get_json("/get_load")


async def test_a_server_that_is_not_sglang_is_named_in_one_line() -> None:
    """An adapter pointed at some other web server logged its whole error page every 2 s."""
    from aiohttp import web

    async def page(request: web.Request) -> web.Response:
        html = "<html>\n<head><title>404</title></head>\n<body>\n" + "x" * 5000 + "</body></html>"
        return web.Response(status=404, text=html, content_type="text/html")

    app = web.Application()
    app.router.add_get("/{tail:.*}", page)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with EngineClient(f"http://127.0.0.1:{port}") as engine:
            with pytest.raises(EngineError) as err:
                await engine.get_json("/server_info")
    finally:
        await runner.cleanup()
    message = str(err.value)
    assert "\n" not in message and len(message) < 300
    assert message.startswith("engine HTTP 404: GET /server_info: <html> <head>")
    assert message.endswith("(is this an SGLang server?)")


async def test_body_that_arrives_with_its_end_while_the_reader_is_away_is_read():
    """The reader takes what has arrived as one piece; what arrives while it handles that
    piece, the response's end included, still reaches it (before the end is reported)."""
    from thunderagent.worker.http1 import Response, _Connection

    conn = _Connection()
    conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nabc")
    conn.data_received(b"def")  # both before the reader asks: one piece
    pieces = []
    async for piece in Response(conn).pieces():
        pieces.append(piece)
        if len(pieces) == 1:
            conn.data_received(b"ghi")  # the rest and the end, while the reader is away
    assert pieces == [b"abcdef", b"ghi"]
