"""nats-py's client with fewer event-loop turns per message: direct delivery for the
subscriptions on a request's way, and publishes written by a plain callback.

nats-py hands every message to its subscription through an ``asyncio.Queue`` read by a task of
that subscription's own, so a message reaches its callback one event-loop turn after the read
loop parsed it (two when the callback then starts a task of its own, as a concurrent handler
does). ``subscribe_direct`` skips that: its callback runs in the read loop, synchronously, as
the message is parsed. It must not block: it sets a future, appends to a buffer or starts a
task. Used where the work per message is exactly that: a reply to a pending request, a client's
reply inbox, and the concurrent handlers (one task per message anyway).

Everything else (ordered handlers, JetStream, nats-py's own request/reply) takes nats-py's
path unchanged; reconnects re-subscribe by the same subscription ids, so direct callbacks stay
bound across them.

Publishing: nats-py wakes its flusher task (a queue and a future per flush) to write what one
turn of the loop published; here a ``call_soon`` callback writes it, in the same place in the
loop's order, with one write for all of a turn's publishes as before. nats-py's flusher still
does it whenever the socket is backed up (it waits for the buffer to drain), while
(re)connecting, and for a forced flush. A PING (``flush()``) is queued behind what is pending,
never written ahead of it, so its PONG means the server has everything sent before.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from nats.aio.client import PING_PROTO
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

log = logging.getLogger(__name__)

OnMessage = Callable[[Msg], None]


class FastClient(NATS):
    def __init__(self) -> None:
        super().__init__()
        self._direct: dict[int, OnMessage] = {}
        self._write_scheduled = False

    async def _flush_pending(self, force_flush: bool = False) -> None:
        if force_flush or not self._may_write_directly():
            await super()._flush_pending(force_flush)
        elif not self._write_scheduled:
            self._write_scheduled = True
            asyncio.get_running_loop().call_soon(self._write_pending)

    async def _send_ping(self, future: asyncio.Future | None = None) -> None:
        # nats-py 2.16 writes PING straight to the socket, ahead of what is still pending (a SUB
        # made the same turn), so flush() could return before the server had that SUB: another
        # connection's publish then found no subscriber and was lost. Queued behind them, its
        # PONG proves everything before it arrived, as flush() promises.
        if not self.is_connected:  # reconnecting: nats-py's way (the PING goes nowhere)
            await super()._send_ping(future)
            return
        self._pongs.append(future if future is not None else asyncio.Future())
        await self._send_command(PING_PROTO)
        await self._flush_pending()

    def _may_write_directly(self) -> bool:
        flusher, transport = self._flusher_task, self._transport
        if not self.is_connected or flusher is None or flusher.done() or transport is None:
            return False
        writer = getattr(transport, "_io_writer", None)  # nats-py's TcpTransport
        return writer is not None and not writer.transport.get_write_buffer_size()

    def _write_pending(self) -> None:
        self._write_scheduled = False
        if not self._pending_data_size:
            return
        if not self._may_write_directly():  # backed up or reconnecting since: nats-py's way
            if self._flush_queue is not None and self._flush_queue.empty():
                self._flush_queue.put_nowait(asyncio.get_running_loop().create_future())
            return
        self._transport.writelines(self._pending[:])
        self._pending = []
        self._pending_data_size = 0

    async def subscribe_direct(
        self, subject: str, on_msg: OnMessage, *, queue: str = ""
    ) -> Subscription:
        """Subscribe with ``on_msg`` called from the read loop (see the module docstring).

        No message can come before ``on_msg`` is bound: ``subscribe`` returns without yielding
        to the event loop, before the SUB it queued has been written to the server."""
        sub = await self.subscribe(subject, queue=queue)  # no callback: nats-py starts no task
        self._direct[sub._id] = on_msg
        return sub

    async def _process_msg(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None
    ) -> None:
        on_msg = self._direct.get(sid)
        if on_msg is None:
            await super()._process_msg(sid, subject, reply, data, headers)
            return
        self.stats["in_msgs"] += 1
        self.stats["in_bytes"] += len(data)
        hdr = await self._process_headers(headers) if headers else None
        try:
            on_msg(self._build_message(sid, subject, reply, data, hdr))
        except Exception:  # never into the read loop: nats-py would stop reading for good
            log.exception("nats: direct delivery on %s failed", subject[:80])

    def _remove_sub(self, sid: int, max_msgs: int = 0) -> None:
        self._direct.pop(sid, None)
        super()._remove_sub(sid, max_msgs)


async def subscribe_fast(
    nc: NATS, subject: str, on_msg: OnMessage, *, queue: str = ""
) -> Subscription:
    """``subscribe_direct`` on a FastClient; on a plain nats-py client, the same callback
    behind nats-py's own queue and task."""
    if isinstance(nc, FastClient):
        return await nc.subscribe_direct(subject, on_msg, queue=queue)

    async def deliver(msg: Msg) -> None:
        on_msg(msg)

    return await nc.subscribe(subject, queue=queue, cb=deliver)
