"""The composed scheduler: global waiting queue, window, grouping, SRPT, preemption, PD, programs.

Requests wait here, not in engine queues. Life of a request (``_Entry.state``):

``window`` (collected until its class's window closes) -> ``queued`` on its *home* worker (the
router's first eligible candidate; a program's KV holder goes first) -> ``spill`` once it has
waited ``spill_after_s`` (then any candidate with room may take it, in router order; one
caching less of the prompt than the best only after a further wait of its extra prefill) ->
dispatched, or ``held`` behind a prefix leader (back to ``queued`` when the prefix is cached),
or ``paused`` with its program (back when memory frees), or rejected (deadline).

Each waiting request is in exactly one of these states and leaves exactly once, by ``Dispatch``
or ``Reject``; heaps are cleaned lazily (an item whose entry moved on is skipped). Actions come
out of ``poll`` in the order the driver must carry them out (a ``Preempt`` precedes the
``Dispatch`` that takes the freed room).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from thunderagent.scheduling.admission import Admission, Headroom, kv_need, output_blocks
from thunderagent.scheduling.api import Action, Reject, SchedRequest, WorkerRoom
from thunderagent.scheduling.dispatch import HELD, QUEUED, SPILL, WINDOW, DispatchPass
from thunderagent.scheduling.grouping import PrefixGroups
from thunderagent.scheduling.ordering import (
    order_key,
    prefill_s,
    remaining_output_tokens,
    service_s,
)
from thunderagent.scheduling.params import SchedParams
from thunderagent.scheduling.pd import PREFILL_ROLES, TransferGate
from thunderagent.scheduling.preemption import Preemptor, Running
from thunderagent.scheduling.program_steps import PAUSED_STEP, ProgramSteps
from thunderagent.scheduling.programs import ProgramTracker
from thunderagent.scheduling.window import Window

COUNTERS = (
    "submitted", "direct", "dispatched", "rejected", "preempted", "cancelled", "spilled",
    "spilled_off_cache",
)  # fmt: skip
"""What ``stats()`` counts besides the books it reads. ``spilled_off_cache``: spilled requests
sent where less of their prompt is cached than on their best candidate, the re-prefills
spilling buys (``SchedParams.spill_past_queues`` bounds them)."""
NEED_ALPHA = 0.05
"""EMA weight of dispatched requests' KV needs (the size credits are counted in): ~20 requests."""


@dataclass(slots=True)
class _Entry:
    req: SchedRequest
    seq: int
    state: str = WINDOW
    home: str = ""
    key: float = 0.0
    regrouped: bool = False
    """Released from a hold without its prefix: never held again (no endless waiting)."""
    no_room: dict[str, tuple] | None = None
    """Spilled: worker -> its books (``DispatchPass._books``) when this request last found no
    room there; the same books again mean the same answer (``DispatchPass._dispatch_spilled``)."""
    settled: int = -1
    """The books generation (``DispatchPass._books_gen``) under which its memo covered every
    open worker it may go to: while it lasts, a pass skips this request at once."""
    opens: dict[str, float] | None = None
    """Spilled: when each candidate caching less than its best opens to it
    (``spill_pays_for_hits``); absent: open since the spill."""
    all_open_at: float = 0.0
    """When the last of ``opens`` opens (until then its tries depend on the clock)."""


@dataclass(slots=True)
class _Heap:
    """(time or key, seq, request id) items, smallest first."""

    items: list[tuple[float, int, str]] = field(default_factory=list)

    def push(self, t: float, seq: int, rid: str) -> None:
        heapq.heappush(self.items, (t, seq, rid))

    def due(self, now: float) -> list[str]:
        out = []
        while self.items and self.items[0][0] <= now:
            out.append(heapq.heappop(self.items)[2])
        return out


class ThunderScheduler(DispatchPass, ProgramSteps):
    """The scheduler of docs/features.md, points 5-7; every behaviour is switched by
    ``SchedParams``. The dispatch pass is in ``dispatch.py``; agent programs' placement, pausing
    and resuming in ``program_steps.py``."""

    def __init__(self, params: SchedParams | None = None, *, name: str = "thunder", **kw):
        p = (params or SchedParams(**kw)).validate()
        self.name = name
        self.params = p
        self.admission = Admission(p)
        self.window = Window(p)
        self.groups = PrefixGroups(min_blocks=max(p.group_min_blocks, 1))
        self.preemptor = Preemptor(p)
        self.gate = TransferGate(cap=p.pd_max_inflight)
        self.programs = ProgramTracker(p.program_watermark, p.program_resume_watermark)
        self.entries: dict[str, _Entry] = {}
        self.running: dict[str, Running] = {}
        self.runs_on: dict[str, dict[str, Running]] = {}
        """worker -> its runs that also decode there (the ones preemption may stop), by id."""
        self.queues: dict[str, list[tuple[float, int, str]]] = {}
        self.spill: list[tuple[float, int, str]] = []
        self.buffer, self.spill_timers, self.deadlines = _Heap(), _Heap(), _Heap()
        self.open_timers = _Heap()
        """When a spilled request's next candidate opens to it (``_open_later``)."""
        self.gone: set[str] = set()
        self._out: list[Action] = []
        self._seq = 0
        self._retry_at: float | None = None
        self._next_idle_check = 0.0
        self._dirty: set[str] = set()
        self._typical_need = 64.0
        self._rooms: dict[str, Headroom] = {}
        """Each worker's admission state during one dispatch pass (see ``_has_room``)."""
        self._gen, self._gen_books = 0, {}
        """The spill pass's books generation and what it stands for (``_books_gen``)."""
        self.counters = dict.fromkeys(COUNTERS, 0)

    # ---- driver events --------------------------------------------------------------------

    def submit(self, request: SchedRequest, now: float) -> None:
        rid = request.request_id
        if rid in self.entries:
            raise ValueError(f"request {rid} is already waiting")
        if rid in self.running:  # re-submitted without our Preempt: forget the old run
            self._end_run(rid, now)
        self.counters["submitted"] += 1
        self._seq += 1
        entry = _Entry(request, self._seq)
        self.entries[rid] = entry
        if self.params.programs and request.program_id is not None:
            self._place_step(request, now)
        if self._doomed(request, now):
            return
        if request.deadline is not None and self.params.deadlines:
            self.deadlines.push(request.deadline, entry.seq, rid)
        release = self.window.release_at(request.priority, len(self.entries) - 1, now)
        if release <= now:
            self._enqueue(entry, now)
        else:
            self.buffer.push(release, entry.seq, rid)

    def update_worker(self, room: WorkerRoom, now: float) -> None:
        self.gone.discard(room.worker_id)
        self.admission.report(room)
        self._dirty.add(room.worker_id)

    def remove_worker(self, worker_id: str, now: float) -> None:
        self.gone.add(worker_id)
        self.admission.remove(worker_id)
        for rid in [r for r, run in self.running.items() if worker_id in _workers_of(run)]:
            self._end_run(rid, now)
        for _, _, rid in self.queues.pop(worker_id, []):
            entry = self.entries.get(rid)
            if entry is not None and entry.state == QUEUED and entry.home == worker_id:
                self._enqueue(entry, now)

    def on_prefix_cached(self, worker_id: str, block_hashes: Sequence[int], now: float) -> None:
        for rid in self.groups.on_cached(worker_id, block_hashes):
            self._enqueue(self.entries[rid], now)

    def on_started(self, request_id: str, worker_id: str, now: float) -> None:
        run = self.running.get(request_id)
        if run is None or run.started_at is not None:
            return
        run.started_at = now
        for rid in self.groups.on_leader_prefilled(request_id):
            self._enqueue(self.entries[rid], now)
        prefill = run.prefill_tokens
        if run.decode_worker is not None:  # the prefill worker is done with it
            self.admission.discharge(run.worker_id, run.kv_blocks, prefill_tokens=prefill)
        else:
            out = remaining_output_tokens(run.req)
            self.admission.started(
                run.worker_id, run.kv_blocks, out, now, run.req.block_size, prefill
            )

    def on_transfer_done(self, request_id: str, worker_id: str, now: float) -> None:
        self.gate.done(request_id)

    def on_finished(self, request_id: str, worker_id: str, now: float) -> None:
        run = self.running.get(request_id)
        if run is not None and self.params.programs and run.req.program_id is not None:
            self.programs.on_finished(run.req, now)
            self._dirty.add(run.worker_id)
        self._end_run(request_id, now)

    def on_failed(self, request_id: str, worker_id: str, now: float) -> None:
        run = self.running.get(request_id)
        if run is not None and self.params.programs and run.req.program_id is not None:
            # the step never ran: what the program holds, and where, is not known any more
            self.release_program(run.req.program_id, now)
        self._end_run(request_id, now)

    def rooms(self) -> dict[str, int]:
        """Room to lend as credits: none while anything waits here (a direct dispatch must
        never pass a waiting request) and none under PD (transfers are capped here); else
        what admission takes now, in requests of the recent typical size."""
        if self.entries or self.params.pd_mode == "disaggregated":
            return {}
        need = max(1, round(self._typical_need))
        return self.admission.rooms(need, skip=self.gone)

    def admitted(self, request: SchedRequest, worker_id: str, now: float) -> None:
        rid = request.request_id
        if rid in self.entries or rid in self.running:
            return  # told twice
        self.counters["submitted"] += 1
        self.counters["direct"] += 1
        cached = self._cached(request, worker_id)
        need, out = kv_need(request, cached), output_blocks(request)
        run = Running(request, worker_id, cached, need, now)
        self.admission.charge(worker_id, need, out, run.prefill_tokens)
        self._add_run(run)
        self.groups.lead(rid, worker_id, request.block_hashes, cached)
        self._note_need(need)
        self.counters["dispatched"] += 1

    def _note_need(self, need: int) -> None:
        self._typical_need += NEED_ALPHA * (need - self._typical_need)

    def cancel(self, request_id: str, now: float) -> bool:
        entry = self.entries.pop(request_id, None)
        if entry is None:
            self._end_run(request_id, now)
            return False
        self.programs.unpark(entry.req.program_id or "", request_id)
        self.groups.drop(request_id)
        entry.state = "cancelled"
        self.counters["cancelled"] += 1
        return True

    # ---- decisions ------------------------------------------------------------------------

    def poll(self, now: float) -> list[Action]:
        self.admission.now = now
        out, self._out = self._out, []
        for rid in self.buffer.due(now):
            entry = self.entries.get(rid)
            if entry is not None and entry.state == WINDOW:
                self._enqueue(entry, now)
        for rid in self.groups.expire(now, self.params.group_timeout_s):
            self.entries[rid].regrouped = True
            self._enqueue(self.entries[rid], now)
        self._expire_deadlines(now, out)
        self._spill_due(now)
        self.open_timers.due(now)  # opened: the pass below tries them; only later ones wake us
        if self.params.programs:
            self._programs_tick(now)
        self._retry_at = None
        self._rooms.clear()
        self._dispatch_spilled(now, out)
        self._dispatch_queued(now, out)
        self._rooms.clear()
        if self.entries and self._gate_full():
            self.gate.held_polls += 1
        return out

    def next_wakeup(self, now: float) -> float | None:
        if not self.entries:
            return None
        times = [
            self._first_live(self.buffer, (WINDOW,)),
            self._first_live(self.spill_timers, (QUEUED,)),
            self._first_live(self.open_timers, (SPILL,)),
            self._first_live(self.deadlines, (WINDOW, QUEUED, SPILL, HELD, PAUSED_STEP)),
            self.groups.next_timeout(self.params.group_timeout_s),
            self._retry_at,
            self.programs.next_park_deadline(self.params.program_park_max_s),
        ]
        live = [t for t in times if t is not None]
        return max(min(live), now) if live else None

    def waiting(self) -> int:
        return len(self.entries)

    def stats(self) -> dict[str, int]:
        g = self.groups
        return {
            **self.counters,
            "waiting": len(self.entries),
            "running": len(self.running),
            "grouped_requests": g.grouped_requests,
            "group_released_cached": g.released_cached,
            "group_released_timeout": g.released_timeout + g.released_leader_gone,
            "prefill_tokens_saved": g.prefill_tokens_saved,
            "pd_transfers": self.gate.transfers,
            "pd_inflight": len(self.gate.inflight),
            "pd_held_polls": self.gate.held_polls,
            "program_pauses": self.programs.pauses,
            "program_resumes": self.programs.resumes,
            "program_rescues": self.programs.rescues,
        }

    # ---- internals: queues -----------------------------------------------------------------

    def _eligible(self, req: SchedRequest) -> Sequence[tuple[str, int]]:
        pd = self.params.pd_mode == "disaggregated"
        if not pd and not self.gone:
            return req.candidates  # the common case, on every try of every waiting request
        return [
            (w, c)
            for w, c in req.candidates
            if w not in self.gone and (not pd or self._role(w) in PREFILL_ROLES)
        ]

    def _role(self, worker_id: str) -> str:
        load = self.admission.workers.get(worker_id)
        return load.room.role if load is not None and load.room is not None else "both"

    def _enqueue(self, entry: _Entry, now: float) -> None:
        req = entry.req
        cands = self._eligible(req)
        if not cands:
            self._reject(entry, "no eligible worker", self._out, unavailable=True)
            return
        entry.home, cached = cands[0]
        entry.key = order_key(req, cached, self.params)
        entry.state = QUEUED
        entry.opens = None
        queue = self.queues.setdefault(entry.home, [])
        heapq.heappush(queue, (entry.key, entry.seq, req.request_id))
        if len(cands) > 1:
            self.spill_timers.push(now + self.params.spill_after_s, entry.seq, req.request_id)

    def _spill_due(self, now: float) -> None:
        for rid in self.spill_timers.due(now):
            entry = self.entries.get(rid)
            if entry is not None and entry.state == QUEUED:
                entry.state = SPILL
                self.counters["spilled"] += 1
                bisect.insort(self.spill, (entry.key, entry.seq, rid))  # sorted: see dispatch
                if self.params.spill_pays_for_hits:
                    self._open_later(entry, now)

    def _open_later(self, entry: _Entry, now: float) -> None:
        """Candidates caching less than the best one open once the request has waited, past
        the spill, as long as they would take to prefill what they lack (``SchedParams.
        spill_pays_for_hits``)."""
        cands = self._eligible(entry.req)
        best = max((c for _, c in cands), default=0)
        req, p = entry.req, self.params
        floor = prefill_s(req, best, p)
        entry.opens = {w: now + prefill_s(req, c, p) - floor for w, c in cands if c < best}
        entry.all_open_at = max(entry.opens.values(), default=now)
        for t in sorted(set(entry.opens.values())):
            self.open_timers.push(t, entry.seq, entry.req.request_id)

    def _first_live(self, heap: _Heap, states: tuple[str, ...]) -> float | None:
        while heap.items:
            t, _, rid = heap.items[0]
            entry = self.entries.get(rid)
            if entry is not None and entry.state in states:
                return t
            heapq.heappop(heap.items)
        return None

    def _add_run(self, run: Running) -> None:
        rid = run.req.request_id
        self.running[rid] = run
        if run.decode_worker is None:
            self.runs_on.setdefault(run.worker_id, {})[rid] = run

    def _end_run(self, rid: str, now: float) -> None:
        """A run is over (finished, preempted, worker gone): free what it held."""
        run = self.running.pop(rid, None)
        if run is None:
            return
        self._rooms.clear()
        if run.decode_worker is None:
            on_w = self.runs_on[run.worker_id]
            del on_w[rid]
            if not on_w:
                del self.runs_on[run.worker_id]
            out = remaining_output_tokens(run.req)
            self.admission.discharge(
                run.worker_id,
                run.kv_blocks,
                started_at=run.started_at,
                output_tokens=out,
                prefill_tokens=run.prefill_tokens,
            )
        else:  # the decode side is charged as pending until the end (no start is reported there)
            if run.started_at is None:
                prefill = run.prefill_tokens
                self.admission.discharge(run.worker_id, run.kv_blocks, prefill_tokens=prefill)
            self.admission.discharge(run.decode_worker, run.kv_blocks)
        self.gate.done(rid)
        for held in self.groups.on_leader_done(rid):
            self.entries[held].regrouped = True
            self._enqueue(self.entries[held], now)

    # ---- internals: deadlines and programs ---------------------------------------------------

    def _doomed(
        self, req: SchedRequest, now: float, cached: int = -1, out: list[Action] | None = None
    ) -> bool:
        """Reject now if the deadline has passed or the predicted finish is past it."""
        if req.deadline is None or not self.params.deadlines:
            return False
        if cached < 0:
            cached = self._eligible(req)[0][1] if self._eligible(req) else 0
        if now >= req.deadline:
            reason = "deadline passed"
        elif now + service_s(req, cached, self.params) > req.deadline:
            reason = "deadline cannot be met"
        else:
            return False
        self._reject(self.entries[req.request_id], reason, self._out if out is None else out)
        return True

    def _reject(
        self, entry: _Entry, reason: str, out: list[Action], *, unavailable: bool = False
    ) -> None:
        rid = entry.req.request_id
        self.entries.pop(rid, None)
        self.programs.unpark(entry.req.program_id or "", rid)
        self.groups.drop(rid)
        entry.state = "rejected"
        self.counters["rejected"] += 1
        out.append(Reject(rid, reason, unavailable))

    def _expire_deadlines(self, now: float, out: list[Action]) -> None:
        for rid in self.deadlines.due(now):
            entry = self.entries.get(rid)
            if entry is not None:
                self._reject(entry, "deadline passed", out)


def _workers_of(run: Running) -> tuple[str, ...]:
    return (run.worker_id,) if run.decode_worker is None else (run.worker_id, run.decode_worker)
