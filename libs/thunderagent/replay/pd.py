"""PD disaggregation in the replay: the life of a run with a separate decode worker.

A ``Dispatch(rid, p, decode_worker=d)`` is modelled in three phases:

1. **prefill** on ``p``: the engine core runs the request with ``max_new_tokens=1``, so its
   prefill (chunked, batched with others, cache hits included) ends with the first token, as a
   prefill-only SGLang worker does. The finish inserts the prompt's full blocks into ``p``'s
   cache (the prefill pool keeps its prefix cache). The driver calls ``on_started(rid, p)``.
2. **transfer**: ``context_tokens * kv_bytes_per_token / link_bytes_per_s`` seconds on ``p``'s
   outgoing link. Each prefill worker has one link (its NIC); transfers out of it go one after
   another, first come first served, so a burst of prefills queues on the link (a decode
   worker's inbound side is not modelled as a bottleneck). ``on_transfer_done(rid, d)`` fires
   when the last byte lands.
3. **decode** on ``d``: the transferred blocks are imported into ``d``'s cache
   (``EngineCore.import_blocks``, which emits Stored events, so prefill and decode share one
   index), then a request for prompt + first token is added there; its admission hits every
   imported block, so ``d`` only computes the partial last block and the first token's KV (a
   step the size of a decode step) before decoding the rest. If ``d``'s pool is so full that
   blocks were evicted before admission, the miss is re-prefilled on ``d`` (the cost of an
   oversubscribed decode pool, visible in the results).

That is the workers' hand-off (``pd_via="workers"``, ``thunderagent up --pd-via workers``): the
client's first token is the prefill's. Under SGLang's own PD (``pd_via="sglang"``, read in SGLang
0.5.23's ``disaggregation/decode.py`` and ``prefill.py``) the router sends the request to both
engines at once and three things change:

0. **bootstrap** first: the decode engine reserves pages for the prompt's KV when the request
   arrives (its prealloc queue, first come first served: one that does not fit waits, and so do
   those behind it), and the prefill engine starts the prefill only once that reservation is
   made (its bootstrap queue). A full decode pool therefore holds prefills back, which is
   SGLang's own back-pressure. The reservation is ``EngineCore.reserve_for_decode`` on the decode
   worker (blocks it already holds are pinned, not reserved again); the landing commits it.
2. the prefill engine keeps the prompt's KV until the transfer has landed (its pages are the
   transfer's source), so a slow link fills the prefill pool and holds later prefills back.
3. the client's first token is the decode engine's: it reaches the client after the transfer
   (here: the decode run's first token, one decode step after the landing; SGLang's decode
   engine streams the prefill's token in a step of its own, so this reads up to one decode step
   late).

Pure bookkeeping: phases per request id, the link clock per prefill worker, each transfer's
duration (link queueing included) for the report, and under SGLang's PD each decode worker's
prealloc queue and the reservations made.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

BOOTSTRAP, PREFILL, TRANSFER, DECODE = "bootstrap", "prefill", "transfer", "decode"
PD_VIA = ("workers", "sglang")
"""How a PD run moves its KV: the workers' hand-off, or SGLang's own PD (the decode engine
reserves the pages first)."""


def transfer_s(context_tokens: int, kv_bytes_per_token: int, link_bytes_per_s: float) -> float:
    """Seconds to move ``context_tokens`` tokens of KV over an idle link."""
    return context_tokens * kv_bytes_per_token / link_bytes_per_s


@dataclass(slots=True)
class TransferLinks:
    """Phases of PD runs and one FIFO link per prefill worker."""

    kv_bytes_per_token: int
    link_bytes_per_s: float
    via: str = "workers"
    durations: list[float] = field(default_factory=list)
    _phase: dict[str, str] = field(default_factory=dict)
    _decode: dict[str, str] = field(default_factory=dict)
    _free_at: dict[str, float] = field(default_factory=dict)
    _prealloc: dict[str, deque[str]] = field(default_factory=dict)
    _reserved: dict[str, tuple[list[int], int]] = field(default_factory=dict)
    _queued_at: dict[str, float] = field(default_factory=dict)
    _sources: dict[str, tuple[str, list[int]]] = field(default_factory=dict)
    """SGLang's PD: per run in transfer, its prefill worker and the blocks pinned there."""
    bootstrap_waits: list[float] = field(default_factory=list)
    """SGLang's PD: each run's time in its decode worker's prealloc queue."""

    def __post_init__(self) -> None:
        if not self.link_bytes_per_s > 0:
            raise ValueError(f"link_bytes_per_s must be > 0, got {self.link_bytes_per_s!r}")
        if self.via not in PD_VIA:
            raise ValueError(f"pd_via must be one of {PD_VIA}, got {self.via!r}")

    @property
    def decode_streams_first_token(self) -> bool:
        """SGLang's PD: the client's first token comes from the decode engine."""
        return self.via == "sglang"

    def start(self, rid: str, decode_worker: str, now: float) -> None:
        """A PD run was dispatched; under SGLang's PD it waits in its decode worker's prealloc
        queue (``bootstrapped`` takes it out)."""
        self._decode[rid] = decode_worker
        if self.via == "sglang":
            self._phase[rid] = BOOTSTRAP
            self._prealloc.setdefault(decode_worker, deque()).append(rid)
            self._queued_at[rid] = now
        else:
            self._phase[rid] = PREFILL

    def prealloc_queue(self, decode_worker: str) -> deque[str]:
        """Runs waiting for ``decode_worker`` to reserve their prompt's pages, oldest first."""
        return self._prealloc.setdefault(decode_worker, deque())

    def awaiting_room(self, decode_worker: str) -> bool:
        """Some run waits in ``decode_worker``'s prealloc queue (checked after every step)."""
        return bool(self._prealloc.get(decode_worker))

    def bootstrapped(self, rid: str, keys: list[int], present: int, now: float) -> None:
        """The decode worker reserved ``keys`` (``present`` of them it already held, pinned):
        the run leaves the prealloc queue and its prefill may start."""
        self.bootstrap_waits.append(now - self._queued_at.pop(rid))
        self._prealloc[self._decode[rid]].remove(rid)
        self._reserved[rid] = (keys, present)
        self._phase[rid] = PREFILL

    def hold_source(self, rid: str, source: str, keys: list[int]) -> None:
        """SGLang's PD: the prefill worker keeps a run's KV (``keys`` pinned) until it lands."""
        self._sources[rid] = (source, keys)

    def release_source(self, rid: str) -> tuple[str, list[int]] | None:
        """The run's KV landed: the prefill worker and the blocks it may unpin now."""
        return self._sources.pop(rid, None)

    def sending(self, worker: str) -> bool:
        """``worker`` keeps some run's KV pinned until its transfer lands (asked only when an
        engine finds nothing it can run)."""
        return any(source == worker for source, _ in self._sources.values())

    def take_reservation(self, rid: str) -> tuple[list[int], int] | None:
        """The pages reserved for ``rid`` on its decode worker (SGLang's PD), now to be filled
        (the KV landed) or given back; None outside SGLang's PD."""
        return self._reserved.pop(rid, None)

    def phase(self, rid: str) -> str | None:
        """None: not a PD run (or it ended)."""
        return self._phase.get(rid)

    def decode_worker(self, rid: str) -> str:
        return self._decode[rid]

    def send(self, rid: str, source: str, context_tokens: int, now: float) -> float:
        """The prefill ended at ``now``: queue the KV on ``source``'s link; when it lands."""
        begin = max(now, self._free_at.get(source, 0.0))
        done = begin + transfer_s(context_tokens, self.kv_bytes_per_token, self.link_bytes_per_s)
        self._free_at[source] = done
        self._phase[rid] = TRANSFER
        self.durations.append(done - now)
        return done

    def occupy(self, workers: tuple[str, ...], seconds: float, now: float) -> float:
        """A KV move between workers (migration, ``migration.py``) on the same links: it starts
        when every named worker's link is free, holds them all for ``seconds``, and PD sends
        queue behind it (and it behind them). Returns when it ends."""
        begin = self.begins(workers, now)
        for w in workers:
            self._free_at[w] = begin + seconds
        return begin + seconds

    def begins(self, workers: tuple[str, ...], now: float) -> float:
        """When a move between ``workers`` booked now would start (both links free)."""
        return max([now, *(self._free_at.get(w, 0.0) for w in workers)])

    def landed(self, rid: str) -> str:
        """The KV is on the decode worker (returned); the run decodes there now."""
        self._phase[rid] = DECODE
        return self._decode[rid]

    def forget(self, rid: str) -> tuple[list[int], int] | None:
        """The run ended or failed; returns a reservation it still held (to give back)."""
        if self._phase.pop(rid, None) == BOOTSTRAP:
            self._prealloc[self._decode[rid]].remove(rid)
            self._queued_at.pop(rid, None)
        self._decode.pop(rid, None)
        return self._reserved.pop(rid, None)
