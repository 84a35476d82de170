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

Pure bookkeeping: phases per request id, the link clock per prefill worker, and each transfer's
duration (link queueing included) for the report.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PREFILL, TRANSFER, DECODE = "prefill", "transfer", "decode"


def transfer_s(context_tokens: int, kv_bytes_per_token: int, link_bytes_per_s: float) -> float:
    """Seconds to move ``context_tokens`` tokens of KV over an idle link."""
    return context_tokens * kv_bytes_per_token / link_bytes_per_s


@dataclass(slots=True)
class TransferLinks:
    """Phases of PD runs and one FIFO link per prefill worker."""

    kv_bytes_per_token: int
    link_bytes_per_s: float
    durations: list[float] = field(default_factory=list)
    _phase: dict[str, str] = field(default_factory=dict)
    _decode: dict[str, str] = field(default_factory=dict)
    _free_at: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.link_bytes_per_s > 0:
            raise ValueError(f"link_bytes_per_s must be > 0, got {self.link_bytes_per_s!r}")

    def start(self, rid: str, decode_worker: str) -> None:
        self._phase[rid] = PREFILL
        self._decode[rid] = decode_worker

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

    def forget(self, rid: str) -> None:
        self._phase.pop(rid, None)
        self._decode.pop(rid, None)
