"""SGLang's PD, the pages of one paired request on a simulated engine (``pd_bootstrap.py`` has
the protocol between the two engines).

* The decode engine reserves pages for the prompt's KV before it bootstraps the room
  (``reserve_kv``: SGLang's prealloc queue, the rule ``EngineCore.reserve_for_decode``), fills
  them once the prefill engine's KV has crossed the modelled link (``fill_kv``), or gives them
  back if it never does (``release_kv``), each exactly once.
* The prefill engine keeps the prompt's pages pinned while they are the source of that copy
  (``hold_prompt``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from thunderagent.simengine.driver import EngineDriver
from thunderagent.simengine.salts import CacheNamespace


class KvNotReserved(Exception):
    """A decode engine found no room for a prompt's KV in time."""


@dataclass(slots=True)
class KvReservation:
    """Pages a decode engine reserved for a prompt's KV (``reserve_kv``)."""

    keys: list[int]
    present: int
    """Leading blocks already cached here (pinned, not sent)."""
    token_ids: list[int]
    space: CacheNamespace | None
    open: bool = True
    """Reserved, and neither filled nor given back yet (each happens once)."""


async def reserve_kv(
    engine: EngineDriver,
    token_ids: list[int],
    space: CacheNamespace | None,
    reserved_decode_tokens: int,
    timeout_s: float,
) -> KvReservation:
    """Reserve pages for the full blocks of ``token_ids``, whose KV a prefill engine will send,
    once they fit with ``reserved_decode_tokens`` per request held kept free
    (``EngineCore.reserve_for_decode``); waits for room up to ``timeout_s``."""
    keys, full = engine.full_block_keys(token_ids, space)
    deadline = time.monotonic() + timeout_s
    made: list[int] = []

    def attempt() -> int | None:
        present = engine.core.reserve_for_decode(keys, reserved_decode_tokens)
        if present is not None:
            made.append(present)
        return present

    while True:
        changed = engine.next_change()
        try:
            present = await engine.between_steps(attempt)
        except asyncio.CancelledError:
            if made:  # reserved just before the cancel reached us: give it back
                engine.give_back_import(keys, made[0])
            raise
        if present is not None:
            return KvReservation(keys, present, token_ids[:full], space)
        left = deadline - time.monotonic()
        if left <= 0:
            raise KvNotReserved(
                f"no room for {len(keys)} KV blocks in {timeout_s:g} s (the decode engine "
                f"keeps {reserved_decode_tokens} tokens per request it holds)"
            )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(changed), left)


async def fill_kv(engine: EngineDriver, reservation: KvReservation) -> float:
    """The prefill engine's KV arrives in the reserved pages: after the modelled transfer time
    the blocks are cached here (Stored events name the request's namespace). Returns the
    modelled seconds."""
    seconds = engine.copy_s(len(reservation.keys) - reservation.present)
    await asyncio.sleep(seconds / engine.speedup)
    keys, space = reservation.keys, reservation.space

    def commit() -> None:
        if not reservation.open:  # given back while the bytes crossed
            return
        reservation.open = False
        if space:
            engine.salts.hold(keys, space)
        engine.core.commit_import(keys, reservation.present, reservation.token_ids)

    await engine.between_steps(commit)
    if space:
        engine.salts.release(keys, engine.core.cache.__contains__)
    return seconds


def release_kv(engine: EngineDriver, reservation: KvReservation) -> None:
    """Give reserved pages back (the prefill failed, or the request was dropped): at once, as
    nothing was inserted there is no event to order."""
    if reservation.open:
        reservation.open = False
        engine.give_back_import(reservation.keys, reservation.present)


def hold_prompt(
    engine: EngineDriver, token_ids: list[int], space: CacheNamespace | None
) -> Callable[[], None]:
    """The prefill side: pin the prompt's cached full blocks, the source of a copy, so they
    stay while it lasts; returns the release (once; later calls do nothing)."""
    keys, _ = engine.full_block_keys(token_ids, space)
    pinned, _ = engine.core.pin_prefix(keys, need_tokens=False)  # no event: no step order
    held = [pinned]

    def release() -> None:
        if held:
            engine.unpin(held.pop())

    return release
