"""The simulated engine's KV bytes: a host-memory pool registered with NIXL.

The engine core models KV by block counts only; this pool gives every cached GPU block a slot of
real bytes, so moving a prefix between engines moves real memory through NIXL, the way SGLang's
PD disaggregation moves it between GPUs. Without a GPU the slots live in host memory (DRAM) and
NIXL's UCX backend copies them between processes (``UCX_NET_DEVICES=lo`` unless set).

Invariants
----------
* A slot per cached GPU block, assigned by following the core's cache events (the only record of
  what is cached): ``Stored`` on the GPU takes a slot and fills it, ``Removed`` from the GPU frees
  it, ``AllCleared`` frees every slot that is not staged. Host-tier blocks hold no slot.
* A block's bytes are a function of its cache key (``fill``), so any copy can be checked: a
  checksum per block (xxh3-64) at the source must equal the one computed on arrival.
* An import stages slots first (``stage``): the transfer writes there, and only a verified copy is
  adopted as the blocks' slots (``adopt``); a failed one is unstaged, leaving nothing behind.
* Slots = the core's KV capacity, and staging never exceeds the blocks an import reserved in the
  core, so cached + staged <= capacity: a slot is always free when the core stores a block.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import time
import uuid
from dataclasses import dataclass

import numpy as np
import xxhash

from thunderagent.engine import AllCleared, CacheEvent, Medium, Profile, Removed, Stored

log = logging.getLogger(__name__)

_MIX = np.uint64(0x9E3779B97F4A7C15)
"""Golden-ratio constant: consecutive words of a block differ in every byte."""

POLL_S = 0.0001
"""How often a running NIXL transfer is polled. The copy progresses in NIXL's own thread, but
polling every 0.5 ms measured up to ~30 % slower than every 50 us for 1 GiB here; a transfer is
short, so the extra wake-ups cost little."""


PROGRESS_DELAY_US = 1000
"""How long NIXL's progress thread waits between its rounds. NIXL's Python wrapper starts it
with no wait: a thread that spins a whole core even with nothing to move, one per engine (eight
pooled engines asked this 2-core machine for eight cores and starved everything else)."""


class NixlUnavailable(RuntimeError):
    """nixl cannot be imported here (``pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1``)."""


class TransferFailed(RuntimeError):
    """A NIXL transfer ended in error or did not finish in time."""


def load_nixl():
    """Import NIXL (UCX on loopback unless ``UCX_NET_DEVICES`` says otherwise)."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as err:  # the pool is optional; say how to get it
        raise NixlUnavailable(
            f"nixl is not importable ({err}); install it with "
            "`pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1 numpy`"
        ) from err
    return nixl_agent, nixl_agent_config


def _patient_agent(name: str, nixl_agent, nixl_agent_config):
    """A UCX NIXL agent whose progress thread waits ``PROGRESS_DELAY_US`` between rounds.
    ``nixl_agent`` builds its C++ config and sets the wait to 0 inside its constructor, with
    no parameter for it, so the binding's constructor is wrapped for that one call."""
    import nixl._api as api  # nixl_cu12._api at run time

    bind = api.nixlBind
    real = bind.nixlAgent

    def patient(agent_name: str, config):
        config.pthrDelay = PROGRESS_DELAY_US
        return real(agent_name, config)

    bind.nixlAgent = patient
    try:
        return nixl_agent(name, nixl_agent_config(backends=["UCX"]))
    finally:
        bind.nixlAgent = real


def _populated_buffer(nbytes: int) -> np.ndarray:
    """Anonymous memory faulted in up front (MAP_POPULATE, ~0.65 s/GiB here): a transfer into
    never-touched pages would otherwise pay the page faults and look slower than NIXL is."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return np.frombuffer(mmap.mmap(-1, nbytes, flags=flags), dtype=np.uint8)


@dataclass(slots=True)
class PoolStats:
    filled_blocks: int = 0
    pulled_blocks: int = 0
    pulled_bytes: int = 0
    failed_pulls: int = 0


class KvPool:
    """``slots`` blocks of ``slot_bytes`` each, one NIXL registration for the whole buffer."""

    def __init__(self, slots: int, slot_bytes: int, *, name: str | None = None) -> None:
        if slots <= 0 or slot_bytes <= 0 or slot_bytes % 8:
            raise ValueError(f"bad pool: {slots} slots of {slot_bytes} bytes (a multiple of 8)")
        nixl_agent, nixl_agent_config = load_nixl()
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.buf = _populated_buffer(slots * slot_bytes)
        self.base = self.buf.ctypes.data
        self._ramp = np.arange(slot_bytes // 8, dtype=np.uint64) * _MIX
        self._free = list(range(slots - 1, -1, -1))
        self._staged: set[int] = set()
        self.slot_of: dict[int, int] = {}
        self.stats = PoolStats()
        self.name = name or f"simengine-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.agent = _patient_agent(self.name, nixl_agent, nixl_agent_config)
        self.agent.register_memory([(self.base, self.buf.nbytes, 0, "")], "DRAM")
        self.metadata: bytes = self.agent.get_agent_metadata()
        self._remotes: set[str] = set()

    # ---- bytes ---------------------------------------------------------------------------
    def view(self, slot: int) -> np.ndarray:
        start = slot * self.slot_bytes
        return self.buf[start : start + self.slot_bytes]

    def addr(self, slot: int) -> int:
        return self.base + slot * self.slot_bytes

    def fill(self, slot: int, key: int) -> None:
        """Word ``i`` of block ``key`` is ``(i * MIX) ^ key``: cheap (memory speed) and
        different for every block and every position inside it."""
        words = self.view(slot).view(np.uint64)
        np.bitwise_xor(self._ramp, np.uint64(key & 0xFFFFFFFFFFFFFFFF), out=words)
        self.stats.filled_blocks += 1

    def checksum(self, slot: int) -> int:
        return xxhash.xxh3_64_intdigest(self.view(slot))

    def expected_checksum(self, key: int) -> int:
        """Checksum block ``key`` has wherever it is cached (tests compare engines with it)."""
        words = self._ramp ^ np.uint64(key & 0xFFFFFFFFFFFFFFFF)
        return xxhash.xxh3_64_intdigest(words.view(np.uint8))

    # ---- slots follow the cache ----------------------------------------------------------
    @property
    def used(self) -> int:
        return self.slots - len(self._free)

    def follow(self, events: list[CacheEvent]) -> None:
        for ev in events:
            if isinstance(ev, AllCleared):
                for slot in self.slot_of.values():
                    self._free.append(slot)
                self.slot_of.clear()
            elif ev.medium is not Medium.GPU:
                continue
            elif isinstance(ev, Stored):
                for key in ev.block_hashes:
                    if key not in self.slot_of:
                        self._take(key)
            elif isinstance(ev, Removed):
                for key in ev.block_hashes:
                    slot = self.slot_of.pop(key, None)
                    if slot is not None:
                        self._free.append(slot)

    def _take(self, key: int) -> None:
        if not self._free:  # cannot happen while the invariant holds; never crash the engine
            log.error("KV pool exhausted: block %x cached without bytes", key)
            return
        slot = self._free.pop()
        self.slot_of[key] = slot
        self.fill(slot, key)

    def stage(self, n: int) -> list[int] | None:
        """Slots for an import's blocks, not yet owned by any key."""
        if n > len(self._free):
            return None
        slots = [self._free.pop() for _ in range(n)]
        self._staged.update(slots)
        return slots

    def unstage(self, slots: list[int]) -> None:
        for slot in slots:
            self._staged.discard(slot)
            self._free.append(slot)

    def adopt(self, keys: list[int], slots: list[int]) -> None:
        """A verified import's staged slots become its blocks' slots. A block someone else
        cached meanwhile keeps its own slot (same bytes: they depend on the key only)."""
        for key, slot in zip(keys, slots, strict=True):
            self._staged.discard(slot)
            if key in self.slot_of:
                self._free.append(slot)
            else:
                self.slot_of[key] = slot

    # ---- NIXL ----------------------------------------------------------------------------
    def _remote(self, metadata: bytes) -> str:
        name = self.agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name not in self._remotes:
            # connect now rather than inside the first read, which would be timed with it
            self.agent.make_connection(name)
            self._remotes.add(name)
        return name

    async def read(
        self,
        metadata: bytes,
        remote_addrs: list[int],
        slots: list[int],
        *,
        timeout_s: float = 60.0,
        pace_bytes_per_s: float | None = None,
    ) -> float:
        """Copy remote blocks into ``slots`` with NIXL READs; returns the seconds it took.

        ``pace_bytes_per_s`` models a slower link: the blocks go in chunks, each started no
        earlier than the link would allow (None: as fast as NIXL goes)."""
        try:
            remote = self._remote(metadata)
        except Exception as err:  # nixl raises its own error types for bad metadata
            self.stats.failed_pulls += 1
            raise TransferFailed(f"cannot load the source's NIXL metadata: {err}") from err
        started = time.perf_counter()
        chunk = max(1, len(slots) // 16) if pace_bytes_per_s else max(1, len(slots))
        deadline = started + timeout_s
        for i in range(0, len(slots), chunk):
            if pace_bytes_per_s:
                due = started + i * self.slot_bytes / pace_bytes_per_s
                if due > deadline:  # the paced link cannot finish in time: give up at the deadline
                    await asyncio.sleep(max(0.0, deadline - time.perf_counter()))
                    self.stats.failed_pulls += 1
                    raise TransferFailed(f"NIXL read from {remote} timed out (paced link)")
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
            await self._read_chunk(remote, remote_addrs[i : i + chunk], slots[i : i + chunk],
                                   deadline)  # fmt: skip
        seconds = time.perf_counter() - started
        self.stats.pulled_blocks += len(slots)
        self.stats.pulled_bytes += len(slots) * self.slot_bytes
        return seconds

    async def _read_chunk(
        self, remote: str, remote_addrs: list[int], slots: list[int], deadline: float
    ) -> None:
        size = self.slot_bytes
        try:
            local = self.agent.get_xfer_descs([(self.addr(s), size, 0) for s in slots], "DRAM")
            far = self.agent.get_xfer_descs([(a, size, 0) for a in remote_addrs], "DRAM")
            handle = self.agent.initialize_xfer("READ", local, far, remote, b"")
        except Exception as err:  # e.g. addresses outside the source's registered memory
            self.stats.failed_pulls += 1
            raise TransferFailed(f"NIXL read from {remote} refused: {err}") from err
        try:
            state = self.agent.transfer(handle)
            while state == "PROC":
                if time.perf_counter() > deadline:
                    raise TransferFailed(f"NIXL read from {remote} timed out")
                await asyncio.sleep(POLL_S)
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferFailed(f"NIXL read from {remote} failed ({state})")
        except TransferFailed:
            self.stats.failed_pulls += 1
            raise
        except Exception as err:  # nixl's own errors (e.g. the remote agent disconnected)
            self.stats.failed_pulls += 1
            raise TransferFailed(f"NIXL read from {remote} failed: {err!r}") from err
        finally:
            try:
                self.agent.release_xfer_handle(handle)
            except Exception:  # an unfinished transfer may refuse release; the agent cleans up
                log.debug("NIXL handle release failed", exc_info=True)

    def close(self) -> None:
        for name in self._remotes:
            try:
                self.agent.remove_remote_agent(name)
            except Exception:
                log.debug("remove_remote_agent(%s) failed", name, exc_info=True)
        self._remotes.clear()


def pool_for(profile: Profile, *, scale: int = 1, name: str | None = None) -> KvPool:
    """A pool with a slot per KV block of ``profile``, each ``kv_bytes_per_block / scale`` bytes
    (``scale`` keeps test pools small); refuses more than half of this machine's memory."""
    if scale < 1:
        raise ValueError(f"--kv-pool-scale must be >= 1, got {scale}")
    slot_bytes = max(64, profile.kv_bytes_per_block // scale // 64 * 64)
    total = slot_bytes * profile.capacity_blocks
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if total > physical // 2:
        raise ValueError(
            f"a KV pool of {profile.capacity_blocks} blocks x {slot_bytes} bytes "
            f"({total / 2**30:.1f} GiB) exceeds half of this machine's memory: "
            "lower the block count (--kv-blocks) or raise --kv-pool-scale"
        )
    return KvPool(profile.capacity_blocks, slot_bytes, name=name)
