"""SGLang's PD disaggregation as the simulated engine plays it (``--disaggregation-mode``).

What a router sees is SGLang's protocol: it sends one request to a prefill engine and to a decode
engine at once, both carrying ``bootstrap_host`` and ``bootstrap_port`` (the prefill engine's
bootstrap server) and ``bootstrap_room`` (a random 63-bit id naming the request on both); the
decode engine streams the answer, the prefill engine's own answer is only its first token.

* ``decode``: the engine first reserves pages for the prompt's KV (SGLang's prealloc queue:
  only while ``SGLANG_NUM_RESERVED_DECODE_TOKENS``, 512 by default, per request it holds stay
  free for their decode; it waits for room up to ``WAIT_S``), then asks the prefill engine for
  the room (``GET /pd/{room}``, the bootstrap), receives the prompt once it is prefilled, fills
  the reserved pages after the modelled transfer time, and runs the request: the prompt's
  blocks are cached, so it computes only the partial last block, and streams every output
  token.
* ``prefill``: the engine starts a request's prefill only once the decode side has asked for
  its room, i.e. has reserved the pages (SGLang's bootstrap queue; a decode side that never
  comes fails the request after ``WAIT_S``), computes the prompt and its first token, then
  hands the prompt over under the room, keeping its pages (pinned) for the modelled copy of the
  whole prompt once the decode side has taken it (``WAIT_S`` if it never does). It serves the
  registry on its API port, as SGLang's Rust server does, and reports that port as
  ``disaggregation_bootstrap_port``.

SGLang's transfer engine pushes the KV from the prefill side into the pages the decode side
reserved; here the decode side receives the tokens over HTTP and the copy is modelled, not
made. A request without the three fields is refused by either kind of engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import aiohttp
from aiohttp import web

MODES = ("null", "prefill", "decode")
WAIT_S = 30.0
"""How long either side waits for the other (a decode engine for room and for the prefill, a
prefill engine for the decode side's bootstrap): SGLang gives a request up after its bootstrap
timeout too."""
RESERVED_DECODE_TOKENS_ENV = "SGLANG_NUM_RESERVED_DECODE_TOKENS"
RESERVED_DECODE_TOKENS = 512
"""SGLang's default: tokens a decode engine keeps free per request it holds."""


def reserved_decode_tokens(environ: Mapping[str, str]) -> int:
    """Read as SGLang reads it: the environment variable, else 512."""
    raw = environ.get(RESERVED_DECODE_TOKENS_ENV, "")
    try:
        value = int(raw) if raw.strip() else RESERVED_DECODE_TOKENS
    except ValueError:
        raise ValueError(f"{RESERVED_DECODE_TOKENS_ENV} must be an integer, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{RESERVED_DECODE_TOKENS_ENV} must be >= 0, got {value}")
    return value


CHECK_GONE_S = 0.5
"""How often a decode side's wait for its room looks whether that decode side is still there."""
ROOMS_KEPT = 4096
"""Offered rooms no decode engine has taken yet, kept at most (the oldest go first)."""


class PairingError(ValueError):
    """A PD request without its bootstrap fields, or with malformed ones."""


class KvNotReceived(Exception):
    """The decode side got no KV for the room (the prefill engine failed, or never had it)."""


@dataclass(frozen=True, slots=True)
class Pairing:
    host: str
    port: int
    room: int


@dataclass(frozen=True, slots=True)
class Offered:
    """A prefilled prompt, as the decode side imports it."""

    token_ids: list[int]
    cache_salt: str | None
    lora_name: str | None
    taken: Callable[[], None] | None = None
    """Called when the decode side takes it (the prefill side's pages are being copied)."""


def pairing_of(body: dict, mode: str) -> Pairing:
    """The request's bootstrap fields; a PD engine serves no request without them."""
    host, port, room = (body.get(k) for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room"))
    if not isinstance(host, str) or not host:
        raise PairingError(f"a {mode} engine (SGLang's PD) needs bootstrap_host, bootstrap_port "
                           "and bootstrap_room on every request")  # fmt: skip
    if not isinstance(port, int) or not 0 < port < 65536:
        raise PairingError("bootstrap_port must be a TCP port")
    if not isinstance(room, int) or not 0 <= room < 2**63:
        raise PairingError("bootstrap_room must be an integer in [0, 2**63)")
    return Pairing(host, port, room)


class PrefillRooms:
    """The prefill side's registry: per room, whether the decode side has bootstrapped it and
    the prompt prefilled for it, until the decode side has taken it."""

    def __init__(self) -> None:
        self._rooms: dict[int, asyncio.Future[Offered | None]] = {}
        self._bootstrapped: dict[int, asyncio.Future[None]] = {}

    @staticmethod
    def _slot(table: dict[int, asyncio.Future], room: int) -> asyncio.Future:
        slot = table.get(room)
        if slot is None:
            slot = table[room] = asyncio.get_running_loop().create_future()
            while len(table) > ROOMS_KEPT:
                table.pop(next(iter(table))).cancel()
        return slot

    async def bootstrapped(self, room: int) -> None:
        """The prefill side: wait until the decode side has asked for ``room`` (it has reserved
        the pages); raises ``KvNotReceived`` after ``WAIT_S``."""
        slot = self._slot(self._bootstrapped, room)
        gone = f"no decode engine bootstrapped room {room} in {WAIT_S:g} s"
        try:
            await asyncio.wait_for(asyncio.shield(slot), WAIT_S)
        except TimeoutError:
            raise KvNotReceived(gone) from None
        except asyncio.CancelledError:
            if slot.cancelled():  # dropped from a full registry, not our caller going away
                raise KvNotReceived(gone) from None
            raise
        finally:
            self._bootstrapped.pop(room, None)

    def offer(self, room: int, offered: Offered | None) -> None:
        """The prefill for ``room`` is done (None: it ended without computing the prompt)."""
        slot = self._slot(self._rooms, room)
        if not slot.done():
            slot.set_result(offered)

    async def take(self, request: web.Request) -> web.Response:
        """``GET /pd/{room}``: the prompt prefilled for this room, once it is (404 after
        ``WAIT_S``)."""
        try:
            room = int(request.match_info["room"])
        except ValueError:
            return web.json_response({"error": {"message": "room must be an integer"}}, status=400)
        ready = self._slot(self._bootstrapped, room)
        if not ready.done():
            ready.set_result(None)  # the decode side is here: the prefill may start
        slot = self._slot(self._rooms, room)
        offered = await _until_offered(slot, request)
        self._rooms.pop(room, None)
        if offered is None:
            return web.json_response(
                {"error": {"message": f"no prefill for room {room}"}}, status=404
            )
        if offered.taken is not None:
            offered.taken()
        return web.json_response({"token_ids": offered.token_ids, "cache_salt": offered.cache_salt,
                                  "lora_name": offered.lora_name})  # fmt: skip


async def _until_offered(
    slot: asyncio.Future[Offered | None], request: web.Request
) -> Offered | None:
    """The room's prompt once prefilled; None after ``WAIT_S``, or as soon as the decode side
    has gone (its request aborted: its connection closed), which the server would otherwise
    not notice until the wait ran out."""
    give_up_at = asyncio.get_running_loop().time() + WAIT_S
    while True:
        left = give_up_at - asyncio.get_running_loop().time()
        try:
            return await asyncio.wait_for(asyncio.shield(slot), min(CHECK_GONE_S, max(left, 0)))
        except TimeoutError:
            transport = request.transport
            if left <= CHECK_GONE_S or transport is None or transport.is_closing():
                return None
        except asyncio.CancelledError:
            return None


async def take_kv(session: aiohttp.ClientSession, pairing: Pairing) -> Offered:
    """The decode side: the prompt the paired prefill engine computed for this room."""
    host = pairing.host
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    url = f"http://{host}:{pairing.port}/pd/{pairing.room}"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=WAIT_S + 5)) as resp:
            got = await resp.json(content_type=None)
            status = resp.status
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as err:
        raise KvNotReceived(f"KV bootstrap at {host}:{pairing.port} failed: {err!r}") from err
    if status != 200 or not isinstance(got, dict) or not isinstance(got.get("token_ids"), list):
        raise KvNotReceived(f"KV bootstrap at {host}:{pairing.port}: {str(got)[:200]}")
    return Offered(got["token_ids"], got.get("cache_salt"), got.get("lora_name"))
