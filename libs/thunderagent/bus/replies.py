"""Request/reply over one shared reply subscription per connection.

nats-py's own ``request`` also shares one inbox subscription, but names each request with a new
random token (NUID) and waits with ``asyncio.wait_for``, which wraps every wait in a task of its
own; here a request is a counter token, one future and one timer handle. What the server answers
is kept: a reply, or its 503 status (nobody subscribes: at once, not at the timeout).
"""

from __future__ import annotations

import asyncio
import itertools

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from thunderagent.bus.errors import NoResponders, RequestTimeout
from thunderagent.bus.fastpath import subscribe_fast

NO_RESPONDERS = "503"


def _expire(future: asyncio.Future) -> None:
    if not future.done():
        future.set_exception(TimeoutError())


class Replies:
    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self.prefix = nc.new_inbox()
        self._waiting: dict[str, asyncio.Future] = {}
        self._ids = itertools.count()
        self._sub = None
        self._starting: asyncio.Lock | None = None

    async def start(self) -> None:
        """Subscribe once (concurrent first requests wait for the same subscription)."""
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._sub is None:
                self._sub = await subscribe_fast(self.nc, f"{self.prefix}.*", self._on_msg)

    def _on_msg(self, msg: Msg) -> None:
        future = self._waiting.pop(msg.subject[len(self.prefix) + 1 :], None)
        if future is not None and not future.done():  # else: it timed out already
            future.set_result(msg)

    def __len__(self) -> int:
        return len(self._waiting)

    async def request(
        self,
        subject: str,
        payload: bytes,
        *,
        timeout: float,  # noqa: ASYNC109 - a timer handle, not a task per wait
        headers: dict[str, str] | None = None,
    ) -> Msg:
        """The reply; raises :class:`NoResponders` or :class:`RequestTimeout`."""
        if self._sub is None:
            await self.start()
        token = str(next(self._ids))
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._waiting[token] = future
        timer = loop.call_later(timeout, _expire, future)
        try:
            await self.nc.publish(subject, payload, reply=f"{self.prefix}.{token}", headers=headers)
            msg = await future
        except TimeoutError as err:
            raise RequestTimeout(subject, timeout) from err
        finally:
            timer.cancel()
            self._waiting.pop(token, None)
        if msg.headers and msg.headers.get("Status") == NO_RESPONDERS and not msg.data:
            raise NoResponders(subject)
        return msg
