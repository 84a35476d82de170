"""A small keep-alive HTTP/1.1 client for the adapter's one hot call: the engine's streamed
``/generate``. Responses are parsed by llhttp (Node.js's parser, through ``httptools``, the
binding uvicorn serves with); this module only pools connections and hands the body on.

Why not aiohttp here (the adapter's other calls to the engine stay on it): a streamed one-token
``/generate`` against the simulated engine cost the client ~300 µs of CPU per request through
aiohttp's session (timeouts, header multidicts, URL objects, its connector and response
machinery) and ~90 µs through a plain protocol on a pooled connection, on this 2-core VM; wall
p50 ~570 µs against ~330 µs.

One request at a time per connection, ``Content-Length`` request bodies; responses framed as
llhttp reads them (chunked, sized, or by the end of the connection). A connection goes back to
the pool only after its response was read to the end; a response left early (cancelled,
broken) closes it, which is also how SGLang notices a client that went away.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httptools


class HttpProtocolError(OSError):
    """The server's bytes are not HTTP/1.1 (an OSError: the connection is useless, like a reset
    one, and the adapter hands the run back the same way)."""


class _Connection(asyncio.Protocol):
    """A connection, its parser, and the response being read on it (the parser's callbacks
    fill it in; at most one reader waits for more)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.used = False
        """Has carried a request before (a server may close such a connection when idle)."""
        self.error: HttpProtocolError | None = None
        self._waiter: asyncio.Future | None = None
        self.begin()

    def begin(self) -> None:
        """A new request goes out: forget the previous response."""
        self.status = 0
        self.headers: dict[str, str] = {}
        self.head_done = False
        self.done = False
        self.keep_alive = False
        self.answered = False
        """Any byte of this response arrived."""
        self.body: deque[bytes] = deque()

    # ---- asyncio.Protocol ----------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.answered = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as err:
            self.error = HttpProtocolError(f"the engine's response is not HTTP/1.1: {err}")
            self.close()
        self._wake()

    def eof_received(self) -> bool:
        self.closed = True
        self._wake()
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._wake()

    # ---- llhttp callbacks ----------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if self.status >= 200:  # an interim 1xx answer (none is asked for): the real one follows
            self.keep_alive = self.parser.should_keep_alive()
            self.head_done = True

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.head_done:
            self.done = True
        else:
            self.headers = {}

    # ---- the reader's side ---------------------------------------------------------------
    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def more(self) -> None:
        """Wait for the parser to make progress; raises once the connection broke or ended."""
        if self.error is not None:
            raise self.error
        if self.closed:
            raise ConnectionResetError("the engine closed the connection mid-response")
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Response:
    """Status and headers of a response whose body has not been read yet."""

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self.status = conn.status
        self.headers = conn.headers
        """Names in lower case."""
        self.keep_alive = conn.keep_alive
        self.complete = False
        """The body was read to its end (the connection can carry another request)."""

    async def pieces(self) -> AsyncIterator[bytes]:
        """The body as it arrives, de-chunked: whatever has arrived by the time the reader asks,
        in one piece."""
        conn = self._conn
        while True:
            while conn.body:  # more may arrive, and the response end, while the reader is away
                piece = b"".join(conn.body)
                conn.body.clear()
                yield piece
            if conn.done:
                self.complete = True
                return
            if conn.closed and conn.error is None and self._to_eof():
                self.complete, self.keep_alive = True, False  # framed by the connection's end
                return
            await conn.more()

    def _to_eof(self) -> bool:
        h = self.headers
        return "content-length" not in h and "chunked" not in h.get("transfer-encoding", "")

    async def line_batches(self) -> AsyncIterator[list[bytes]]:
        """The body split at newlines (server-sent events), each line without its newline; the
        lines that arrived together come as one list."""
        rest = b""
        async for piece in self.pieces():
            *done, rest = (rest + piece).split(b"\n")
            if done:
                yield done
        if rest:
            yield [rest]

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self.pieces()])


class Http1Pool:
    """Keep-alive connections to one server (``base_url``: ``http(s)://host:port[/prefix]``)."""

    def __init__(self, base_url: str, *, connect_timeout_s: float = 5.0) -> None:
        parts = urlsplit(base_url)
        self.host = parts.hostname or "127.0.0.1"
        self.tls = parts.scheme == "https"
        self.port = parts.port or (443 if self.tls else 80)
        self.prefix = parts.path.rstrip("/")
        self.authority = parts.netloc.rpartition("@")[2]
        self.connect_timeout_s = connect_timeout_s
        self._idle: list[_Connection] = []

    def stream(self, path: str, body: bytes, headers: dict[str, str]) -> _Exchange:
        """``async with pool.stream(...) as response``: POST ``body``."""
        lines = [f"POST {self.prefix}{path} HTTP/1.1", f"Host: {self.authority}",
                 f"Content-Length: {len(body)}"]  # fmt: skip
        lines += [f"{k}: {v}" for k, v in headers.items()]
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        return _Exchange(self, head + body)

    async def connection(self) -> _Connection:
        """An idle connection still open, else a new one."""
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_timeout_s):
            _, conn = await loop.create_connection(
                _Connection, self.host, self.port, ssl=True if self.tls else None
            )
        return conn

    def release(self, conn: _Connection, response: Response | None) -> None:
        conn.used = True
        if response is not None and response.complete and response.keep_alive:
            if not conn.closed:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()


class _Exchange:
    """One request and its response on a pooled connection."""

    def __init__(self, pool: Http1Pool, request: bytes) -> None:
        self.pool = pool
        self.request = request
        self.conn: _Connection | None = None
        self.response: Response | None = None

    async def __aenter__(self) -> Response:
        for attempt in range(2):
            conn = self.conn = await self.pool.connection()
            conn.begin()
            try:
                conn.transport.write(self.request)
                while not conn.head_done:
                    await conn.more()
                self.response = Response(conn)
                return self.response
            except ConnectionResetError:
                # a kept-alive connection that ended before any byte of an answer: the server
                # closed it while idle (uvicorn does after its keep-alive timeout) as this
                # request went out, so it goes once more, on a new connection
                conn.close()
                if not (conn.used and attempt == 0 and not conn.answered):
                    raise
            except BaseException:
                conn.close()
                raise
        raise AssertionError("unreachable")

    async def __aexit__(self, *exc: object) -> None:
        if self.conn is not None:
            self.pool.release(self.conn, self.response)
