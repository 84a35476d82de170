"""Admission: does a worker have room for one more request?

Room = running requests under the cap and KV held by running requests under
``kv_watermark`` of the pool; for a request with nothing cached on the worker, also the
uncached prompts sent there and not started under ``cold_prefill_queue_tokens``. Load reports
lag behind dispatches, so the estimate adds what this scheduler sent (and saw finish) since the
last report; KV adds the expected output of its running requests and the prompts the engine has
not started; the running count never goes below what it knows it has running there itself. A
worker with nothing running always admits one request, however large, so a big prompt cannot
wait forever.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Container
from dataclasses import dataclass, field
from typing import NamedTuple

from thunderagent.scheduling.api import SchedRequest, WorkerRoom
from thunderagent.scheduling.ordering import remaining_output_tokens
from thunderagent.scheduling.params import SchedParams


@dataclass(slots=True)
class WorkerLoad:
    """What the scheduler believes about one worker; plain counters, updated in O(1)."""

    room: WorkerRoom | None = None
    sent_since_report: int = 0
    done_since_report: int = 0
    own_running: int = 0
    own_blocks: int = 0
    """KV blocks (prompt + expected output) of requests this scheduler has running there."""
    pending_blocks: int = 0
    """Blocks (prompt + expected output) of requests the engine has not started yet."""
    prompt_since_report: int = 0
    pending_prefill: int = 0
    """Uncached prompt tokens of requests sent here that the engine has not started."""
    decode_ends: Counter[float] = field(default_factory=Counter)
    """When each run started here will have generated its expected output at
    ``decode_tokens_per_s`` (runs with that time past are dropped): the output still to come
    (the report shows the rest)."""
    block_size: int = 0


class Headroom(NamedTuple):
    """One worker's admission state: no slot left (``full``), any request fits (``open``:
    nothing running, or no KV total reported), else KV in use against the watermark; and
    whether its prompts not started have reached ``cold_prefill_queue_tokens`` (a request with
    nothing cached there then waits: the dispatch pass decides, since it knows the hit)."""

    full: bool
    open: bool
    kv_blocks: int
    kv_limit: float
    prefill_full: bool = False

    def fits(self, need_blocks: int) -> bool:
        if self.full:
            return False
        return self.open or self.kv_blocks + need_blocks <= self.kv_limit


@dataclass(slots=True)
class Admission:
    params: SchedParams
    workers: dict[str, WorkerLoad] = field(default_factory=dict)
    now: float = 0.0
    """The scheduler's clock, set on every poll (pure: no clock of its own)."""

    def load(self, worker_id: str) -> WorkerLoad:
        load = self.workers.get(worker_id)
        if load is None:
            load = self.workers[worker_id] = WorkerLoad()
        return load

    def report(self, room: WorkerRoom) -> None:
        load = self.load(room.worker_id)
        load.room = room
        load.sent_since_report = load.done_since_report = load.prompt_since_report = 0

    def remove(self, worker_id: str) -> None:
        self.workers.pop(worker_id, None)

    def cap(self, worker_id: str) -> int:
        load = self.workers.get(worker_id)
        return self._cap(load.room if load is not None else None)

    def _cap(self, room: WorkerRoom | None) -> int:
        if self.params.max_running:
            return self.params.max_running
        if room is not None and room.max_running > 0:
            return room.max_running
        return self.params.fallback_max_running

    def running(self, worker_id: str) -> int:
        return _running(self.load(worker_id))

    def kv_blocks(self, worker_id: str) -> int:
        """KV held by running requests once they have generated their expected output: the
        engine's report (prompts deduplicated, output so far), plus prompts it cannot show yet
        (sent since, or not started), plus output still to come (whole for runs not started;
        for each started one, expected minus ``decode_tokens_per_s`` x time since its start,
        at least zero).
        Prompts are not summed per request: requests sent together each count a shared
        uncached prefix that the engine holds once (on a hot prefix such a sum held the queue
        at a fraction of the real use)."""
        return self._kv_blocks(self.load(worker_id))

    def _kv_blocks(self, load: WorkerLoad) -> int:
        room = load.room
        if room is None or room.active_blocks is None:
            return load.own_blocks
        unseen = max(load.prompt_since_report, load.pending_blocks)
        return room.active_blocks + unseen + self._output_to_come(load)

    def _output_to_come(self, load: WorkerLoad) -> int:
        """Output the started runs still have to generate, each counted down to zero on its
        own: a sum over all of them let the runs past their expected length cancel the output
        of those just started, and the engines retracted what admission let in (the generated
        agent trace at 5x, copies 0-7: 257 retractions, 35 counted per run; docs/benchmarks.md
        "Stop 74")."""
        ends, now = load.decode_ends, self.now
        if not ends or load.block_size <= 0:
            return 0
        past = [t for t in ends if t <= now]
        for t in past:
            del ends[t]  # nothing more to come from them; their discharge finds nothing
        seconds = sum((t - now) * n for t, n in ends.items())
        return math.ceil(seconds * self.params.decode_tokens_per_s / load.block_size)

    def has_room(self, worker_id: str, need_blocks: int) -> bool:
        return self.headroom(worker_id).fits(need_blocks)

    def headroom(self, worker_id: str) -> Headroom:
        """What ``has_room`` decides from, for any ``need_blocks``: valid until the next
        change to this worker's books (a charge, a discharge, a report, the clock)."""
        load = self.load(worker_id)
        running, room = _running(load), load.room
        pf = self._prefill_full(load)
        if running >= self._cap(room):
            return Headroom(True, False, 0, 0.0, pf)
        total = room.kv_total_blocks if room is not None else 0
        if running == 0 or total <= 0:
            return Headroom(False, True, 0, 0.0, pf)
        limit = self.params.kv_watermark * total
        return Headroom(False, False, self._kv_blocks(load), limit, pf)

    def room(self, worker_id: str, need_blocks: int) -> int:
        """How many more requests of ``need_blocks`` each ``has_room`` would admit now; none
        once the cold prefill queue bound is reached (this counts credit for routers, which
        would spend it whatever a request's hit)."""
        return self._room(self.load(worker_id), need_blocks)

    def rooms(self, need_blocks: int, skip: Container[str] = ()) -> dict[str, int]:
        """``room`` of every worker not in ``skip``, in one pass over the books (the
        scheduler lends it after every dispatch pass)."""
        return {w: self._room(ld, need_blocks) for w, ld in self.workers.items() if w not in skip}

    def _room(self, load: WorkerLoad, need_blocks: int) -> int:
        running = _running(load)
        room = load.room
        slots = self._cap(room) - running
        if slots <= 0 or self._prefill_full(load):
            return 0
        total = room.kv_total_blocks if room is not None else 0
        if total <= 0 or need_blocks <= 0:
            return slots
        fit = int((self.params.kv_watermark * total - self._kv_blocks(load)) // need_blocks)
        if running == 0:
            fit = max(fit, 1)  # an idle worker always takes one, however large
        return max(0, min(slots, fit))

    def _prefill_full(self, load: WorkerLoad) -> bool:
        bound = self.params.cold_prefill_queue_tokens
        return bound > 0 and load.pending_prefill >= bound

    def charge(
        self, worker_id: str, blocks: int, output_blocks: int = 0, prefill_tokens: int = 0
    ) -> None:
        """A request of ``blocks`` new KV blocks (``output_blocks`` of them its expected
        output) and ``prefill_tokens`` uncached prompt tokens was sent to ``worker_id``."""
        load = self.load(worker_id)
        load.pending_prefill += prefill_tokens
        load.sent_since_report += 1
        load.prompt_since_report += blocks - output_blocks
        load.own_running += 1
        load.own_blocks += blocks
        load.pending_blocks += blocks

    def started(
        self,
        worker_id: str,
        blocks: int,
        output_tokens: int,
        now: float,
        block_size: int,
        prefill_tokens: int = 0,
    ) -> None:
        """The engine started a request charged here: its report shows the prompt from now,
        and its output as it is generated."""
        load = self.workers.get(worker_id)
        if load is None:
            return
        load.pending_prefill = max(load.pending_prefill - prefill_tokens, 0)
        load.pending_blocks = max(load.pending_blocks - blocks, 0)
        load.decode_ends[self._decode_end(now, output_tokens)] += 1
        load.block_size = block_size

    def discharge(
        self,
        worker_id: str,
        blocks: int,
        *,
        started_at: float | None = None,
        output_tokens: int = 0,
        prefill_tokens: int = 0,
    ) -> None:
        """A run charged here ended (``started_at``: when the engine started it, if it did)."""
        load = self.workers.get(worker_id)
        if load is None:
            return
        if started_at is None:
            load.pending_prefill = max(load.pending_prefill - prefill_tokens, 0)
        load.done_since_report += 1
        load.own_running = max(load.own_running - 1, 0)
        load.own_blocks = max(load.own_blocks - blocks, 0)
        if started_at is None:
            load.pending_blocks = max(load.pending_blocks - blocks, 0)
        else:
            end = self._decode_end(started_at, output_tokens)
            left = load.decode_ends.get(end, 0) - 1
            if left > 0:
                load.decode_ends[end] = left
            elif left == 0:
                del load.decode_ends[end]

    def _decode_end(self, started_at: float, output_tokens: int) -> float:
        """The key a run's start and its end both compute alike (the same floats)."""
        return started_at + output_tokens / self.params.decode_tokens_per_s


def _running(load: WorkerLoad) -> int:
    """Requests running or queued on the worker: its report plus what was sent (less what
    ended) since, never below what this scheduler knows it has running there."""
    r = load.room
    if r is None:
        return load.own_running
    reported = r.running + r.queued + load.sent_since_report - load.done_since_report
    return max(reported, load.own_running, 0)


def output_blocks(req: SchedRequest) -> int:
    """KV blocks the request's expected output will fill."""
    return math.ceil(remaining_output_tokens(req) / req.block_size)


def kv_need(req: SchedRequest, cached: int) -> int:
    """New KV blocks the request will hold: its uncached prompt plus its expected output (a
    cached prefix is shared, so counting it per request would overcount). Integer ceilings,
    inline: past capacity this runs for every waiting request on every open worker, each poll."""
    bs = req.block_size
    prompt = max(-(-req.prompt_tokens // bs) - cached, 0)
    return prompt - (-max(req.expected_output_tokens - req.generated_tokens, 1) // bs)
