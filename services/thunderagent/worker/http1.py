"""A small keep-alive HTTP/1.1 client for the adapter's one hot call: the engine's streamed
``/generate``.

Why not aiohttp here (the adapter's other calls to the engine stay on it): a streamed one-token
``/generate`` against the simulated engine cost the client ~300 µs of CPU per request through
aiohttp's session (timeouts, header multidicts, URL objects, its connector and response
machinery) and ~90 µs through a plain protocol on a pooled connection, on this 2-core VM; wall
p50 ~570 µs against ~330 µs.

What it speaks: one request at a time per connection, ``Content-Length`` request bodies, and
responses framed by ``Transfer-Encoding: chunked`` (SGLang's and aiohttp's streams),
``Content-Length`` (their error answers) or the end of the connection. A connection goes back
to the pool only after its response was read to the end; a response left early (cancelled,
broken) closes it, which is also how SGLang notices a client that went away.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

MAX_HEAD = 64 * 1024
"""Longest status line plus headers, or chunk-size line, accepted from the server."""


class HttpProtocolError(OSError):
    """The server's bytes are not HTTP/1.1 as expected (an OSError: the connection is useless,
    like a reset one)."""


class _Connection(asyncio.Protocol):
    """Bytes from the server in a buffer, and at most one reader waiting for more."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.used = False
        """Has carried a request before (a server may close such a connection when idle)."""
        self._waiter: asyncio.Future | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self._wake()

    def eof_received(self) -> bool:
        self.closed = True
        self._wake()
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def more(self) -> None:
        """Wait for bytes beyond what the buffer holds; ConnectionResetError once it ended."""
        if self.closed:
            raise ConnectionResetError("the engine closed the connection mid-response")
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def line(self) -> bytes:
        """The next CRLF-terminated line, without its CRLF."""
        while (end := self.buf.find(b"\r\n")) < 0:
            if len(self.buf) > MAX_HEAD:
                raise HttpProtocolError("line too long in the engine's response")
            await self.more()
        line = bytes(self.buf[:end])
        del self.buf[: end + 2]
        return line

    async def take(self, n: int) -> bytes:
        """Up to ``n`` bytes, at least one (waiting for them when the buffer is empty)."""
        while not self.buf:
            await self.more()
        piece = bytes(self.buf[:n])
        del self.buf[:n]
        return piece

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Response:
    """Status and headers of a response whose body has not been read yet."""

    def __init__(self, conn: _Connection, status: int, headers: dict[str, str], version: str):
        self.status = status
        self.headers = headers
        self._conn = conn
        self.complete = False
        """The body was read to its end (the connection can carry another request)."""
        self.keep_alive = version == "HTTP/1.1" and headers.get("connection") != "close"

    async def pieces(self) -> AsyncIterator[bytes]:
        """The body as it arrives, de-chunked."""
        if "chunked" in self.headers.get("transfer-encoding", ""):
            gen = self._chunked()
        elif "content-length" in self.headers:
            gen = self._sized(_int(self.headers["content-length"], 10))
        else:
            self.keep_alive = False  # framed by the end of the connection
            gen = self._to_eof()
        async for piece in gen:
            yield piece
        self.complete = True

    async def lines(self) -> AsyncIterator[bytes]:
        """The body split at newlines (server-sent events), each without its newline."""
        rest = b""
        async for piece in self.pieces():
            *done, rest = (rest + piece).split(b"\n")
            for line in done:
                yield line
        if rest:
            yield rest

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self.pieces()])

    async def _chunked(self) -> AsyncIterator[bytes]:
        conn = self._conn
        while size := _int((await conn.line()).split(b";", 1)[0], 16):
            left = size
            while left:
                piece = await conn.take(left)
                left -= len(piece)
                yield piece
            if await conn.line():
                raise HttpProtocolError("chunk not followed by CRLF")
        while await conn.line():  # trailers, up to the empty line
            pass

    async def _sized(self, length: int) -> AsyncIterator[bytes]:
        while length:
            piece = await self._conn.take(length)
            length -= len(piece)
            yield piece

    async def _to_eof(self) -> AsyncIterator[bytes]:
        conn = self._conn
        while True:
            try:
                yield await conn.take(MAX_HEAD)
            except ConnectionResetError:
                return


def _int(text: bytes | str, base: int) -> int:
    try:
        value = int(text.strip(), base)
    except ValueError:
        raise HttpProtocolError(f"bad number {text[:40]!r} in the engine's response") from None
    if value < 0:
        raise HttpProtocolError(f"negative length {value} in the engine's response")
    return value


async def _read_head(conn: _Connection) -> Response:
    while (end := conn.buf.find(b"\r\n\r\n")) < 0:
        if len(conn.buf) > MAX_HEAD:
            raise HttpProtocolError("response headers too long")
        await conn.more()
    lines = bytes(conn.buf[:end]).decode("latin-1").split("\r\n")
    del conn.buf[: end + 4]
    version, _, rest = lines[0].partition(" ")
    if not version.startswith("HTTP/1."):
        raise HttpProtocolError(f"not an HTTP/1.x response: {lines[0][:60]!r}")
    status = _int(rest[:3], 10)
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip().lower()
    if 100 <= status < 200:  # an interim answer (none is asked for): the real one follows
        return await _read_head(conn)
    return Response(conn, status, headers, version)


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
            if not conn.closed and not conn.buf:
                return conn
            conn.close()
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_timeout_s):
            _, conn = await loop.create_connection(
                _Connection, self.host, self.port, ssl=True if self.tls else None
            )
        return conn

    def release(self, conn: _Connection, response: Response | None) -> None:
        conn.used = True
        if response is not None and response.complete and response.keep_alive:
            if not conn.closed and not conn.buf:
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
            try:
                conn.transport.write(self.request)
                self.response = await _read_head(conn)
                return self.response
            except ConnectionResetError:
                # a kept-alive connection the server closed while idle: it never read this
                # request (nothing came back), so sending it once more on a new one is safe
                conn.close()
                if not (conn.used and attempt == 0 and not conn.buf):
                    raise
            except BaseException:
                conn.close()
                raise
        raise AssertionError("unreachable")

    async def __aexit__(self, *exc: object) -> None:
        if self.conn is not None:
            self.pool.release(self.conn, self.response)
