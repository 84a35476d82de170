"""One dispatch pass of the composed scheduler: the spill pool, then the per-worker queues.

``DispatchPass`` is mixed into ``ThunderScheduler`` (``thunder.py``), like ``ProgramSteps``: it
works on that scheduler's waiting entries, queues, spill pool, admission and running table.

* **Spilled requests first**, anywhere with room, in key order; the scan stops once every
  worker is full. A worker caching less of a request than its best candidate takes it only
  while no request homed there waits (``SchedParams.spill_past_queues``).
* **Per-worker queues**, merged by key; a worker whose head cannot go is done for the pass (no
  head-of-line bypass, so no starvation); with preemption on, a head may take a running
  request's place.
* **Room** is read once per worker per pass (``_has_room``): past capacity a pass tries every
  spilled request on every open worker, and only a commit or an ended run changes a worker's
  books meanwhile; both clear ``_rooms``.
* **A spilled request is not tried again where nothing changed**: when it found no room on a
  worker (or was passed over for the worker's own queue), the worker's headroom, grouping
  version and whether its queue holds a request are kept on the entry (``_books``), and while
  they are the same the try would have the same outcome. Only requests whose try
  has no other outcome are skipped so: no deadline (the clock can doom it), no step of a
  program paused now (the try parks or resumes it), no PD gate (its answer depends on other
  workers). Past capacity this was most of a replay's time (thunder at 3x on the conversation
  trace: 7.4 M tries).
* **A request settled everywhere is skipped in one comparison**: the open workers' books get a
  generation (``_books_gen``), and a request whose memo held every open worker it may go to
  under that generation is marked with it. Past capacity most of the pool is settled in most
  passes (agent trace at 8x: ~550 spilled requests and ~100 tries a pass), and comparing each one's
  memo worker by worker was what the pass spent its time on. A commit changes the committed
  worker's books (its grouping version at least), so the requests after it are looked at again.
"""

from __future__ import annotations

import heapq
from typing import Any

from thunderagent.scheduling.admission import Headroom, kv_need, output_blocks
from thunderagent.scheduling.api import Action, Dispatch, Preempt, SchedRequest
from thunderagent.scheduling.pd import pick_decode_worker
from thunderagent.scheduling.preemption import Running
from thunderagent.scheduling.programs import PAUSED

WINDOW, QUEUED, SPILL, HELD = "window", "queued", "spill", "held"
"""Entry states a pass reads and moves entries between (``thunder.py`` has the life cycle)."""

Entry = Any
"""``thunder._Entry`` (not imported: ``thunder`` imports this module)."""


class DispatchPass:
    """The dispatch pass; a mixin of ``ThunderScheduler``, whose ``entries``, ``queues``,
    ``spill``, ``admission``, ``running``, ``runs_on``, ``groups``, ``gate``, ``preemptor`` and
    ``programs`` it uses."""

    def _head(self, worker_id: str) -> Entry | None:
        q = self.queues.get(worker_id)
        while q:
            entry = self.entries.get(q[0][2])
            if entry is not None and entry.state == QUEUED and entry.home == worker_id:
                return entry
            heapq.heappop(q)
        return None

    def _dispatch_spilled(self, now: float, out: list[Action]) -> None:
        """Spilled requests waited past the bound: they go first, anywhere with room. The scan
        stops once every worker is full (a long spill pool costs nothing while nothing fits)."""
        spill = self.spill
        if not spill:  # the usual poll: no worker's room is read for nothing
            return
        gone = self.gone
        books = _OpenBooks(
            self, {w for w in self.admission.workers if w not in gone and self._has_room(w, 0)}
        )
        keep = []
        entries = self.entries
        pd, programs = self.params.pd_mode == "disaggregated", self.params.programs
        i, n = 0, len(spill)
        while i < n and books.open and not (pd and self.gate.full()):
            item = spill[i]
            i += 1
            entry = entries.get(item[2])
            if entry is None or entry.state != SPILL:
                continue
            memo = entry.no_room  # once set, only a program's pause or the clock can void it
            clocked = now < entry.all_open_at or (programs and entry.req.program_id is not None)
            if memo is None or clocked:
                memo = self._no_room_memo(entry, now)
            if memo is not None and books.settle(entry, memo):
                keep.append(item)  # every try would be skipped
                continue
            gone, changed = self._try_spilled(entry, memo, books.open, now, out)
            if changed:
                books.now = None
            if not gone:
                keep.append(item)
                if memo is not None:
                    books.mark(entry)
        # ``spill`` is kept sorted (a sorted list is a heap too): what was kept, then the rest
        keep.extend(spill[i:])
        self.spill = keep

    def _try_spilled(
        self, entry: Entry, memo: dict | None, open_: set[str], now: float, out: list[Action]
    ) -> tuple[bool, bool]:
        """Try a spilled request on its candidates, skipping those its memo says would fail
        again: (it left the pool, some worker's books or ``open_`` changed meanwhile). A
        candidate caching less of it than the best one is passed over while requests homed
        there wait (``SchedParams.spill_past_queues``): that worker is short of room too, and
        the re-prefill would only add to the work both queues wait behind."""
        known = self.admission.workers
        changed = False
        opens = entry.opens or {}
        cands = self._eligible(entry.req)
        best = max((c for _, c in cands), default=0)
        past_queues = self.params.spill_past_queues
        for w, cached in cands:
            if (w not in open_ and w in known) or opens.get(w, now) > now:
                continue
            books = None
            if memo is not None and w in known:
                books = self._books(w)
                if memo.get(w) == books:
                    if not books[0].fits(0):
                        open_.discard(w)
                        changed = True
                    continue
            poorer = cached < best and not past_queues
            if poorer and (books[2] if books is not None else self._head(w) is not None):
                if books is not None:
                    memo[w] = books  # type: ignore[index]
                continue
            if self._try_dispatch(entry, w, now, out):
                self.counters["spilled_off_cache"] += cached < best
                return True, True
            if entry.state != SPILL:
                return True, True
            if books is not None:
                memo[w] = books  # type: ignore[index]
            if not self._has_room(w, 0):
                open_.discard(w)
                changed = True
        return False, changed

    def _books(self, w: str) -> tuple:
        """What a spilled request's try on ``w`` depends on besides the request: its headroom,
        its grouping version, whether requests homed there wait."""
        return self._room(w), self.groups.versions.get(w, 0), self._head(w) is not None

    def _books_now(self, open_: set[str]) -> tuple[dict[str, tuple], list[str], int]:
        """The open workers' books (``_books``), those of them now full, and the books'
        generation (``_books_gen``)."""
        books = {w: self._books(w) for w in open_}
        closed = [w for w, (room, *_) in books.items() if not room.fits(0)]
        return books, closed, self._books_gen(books)

    def _dispatch_queued(self, now: float, out: list[Action]) -> None:
        """Per-worker queues, merged by key; a worker whose head cannot go is done this poll
        (nothing behind it may take its room: no head-of-line bypass, so no starvation)."""
        blocked: set[str] = set()
        while not self._gate_full():
            heads = [
                (h.key, h.seq, w, h)
                for w in self.queues
                if w not in blocked and (h := self._head(w)) is not None
            ]
            if not heads:
                return
            _, _, w, entry = min(heads)
            heapq.heappop(self.queues[w])
            entry.state = SPILL  # off the queue while it is decided
            if self._try_dispatch(entry, w, now, out) or entry.state != SPILL:
                continue
            if self._try_preempt(entry, w, now, out) and self._try_dispatch(entry, w, now, out):
                continue
            entry.state = QUEUED
            heapq.heappush(self.queues[w], (entry.key, entry.seq, entry.req.request_id))
            blocked.add(w)

    def _cold_held(self, req: SchedRequest, w: str) -> bool:
        """``req`` has nothing cached on ``w`` (nor being prefilled there by a leader), whose
        queue of prompts not started is at the bound (``cold_prefill_queue_tokens``): it
        waits here. ``_try_dispatch`` asks the same of the hit it has computed already."""
        room = self._room(w)
        if not room.prefill_full:  # the usual case: no hit to look up
            return False
        hit = self.groups.first_uncached(w, req.block_hashes, self._cached(req, w))
        return _cold(room, req, hit, self.params.cold_shared_hits)

    def _has_room(self, w: str, need: int) -> bool:
        """``admission.has_room`` with each worker's state read once per dispatch pass: past
        capacity a pass tries every spilled request on every open worker, and only a commit
        or an ended run changes a worker's books meanwhile (both clear ``_rooms``)."""
        return self._room(w).fits(need)

    def _room(self, w: str) -> Headroom:
        room = self._rooms.get(w)
        if room is None:
            room = self._rooms[w] = self.admission.headroom(w)
        return room

    def _books_gen(self, books: dict[str, tuple]) -> int:
        """A number for these open workers' books: the same while they stay the same, across
        passes; a new one for anything else. An entry marked with it (``settled``) has every
        open worker it may go to in its memo as now."""
        if books != self._gen_books:
            self._gen += 1
            self._gen_books = books
        return self._gen

    def _no_room_memo(self, entry: Entry, now: float) -> dict[str, tuple] | None:
        """Where ``entry`` last found no room (see the module docstring); None when its try
        can end otherwise, so it is always tried: a deadline (the clock can doom it), a
        candidate not open to it yet (the clock opens it), the PD gate (its answer depends on
        other workers), a step of a program paused now (the try parks or resumes it). A step
        of a running program tries exactly as a plain request."""
        req, p = entry.req, self.params
        if (req.deadline is not None and p.deadlines) or p.pd_mode == "disaggregated":
            return None
        if now < entry.all_open_at:
            return None
        if p.programs and req.program_id is not None:
            prog = self.programs.programs.get(req.program_id)
            if prog is not None and prog.phase == PAUSED:
                return None
        if entry.no_room is None:
            entry.no_room = {}
        return entry.no_room

    def _gate_full(self) -> bool:
        return self.params.pd_mode == "disaggregated" and self.gate.full()

    def _try_dispatch(self, entry: Entry, w: str, now: float, out: list[Action]) -> bool:
        """Dispatch ``entry`` to ``w`` if it may go now. False: it stays; its state says why
        (``held``/``paused``/gone: it left the queue; unchanged: no room)."""
        req, p = entry.req, self.params
        cached = self._cached(req, w)
        if self._doomed(req, now, cached, out):
            return False
        if p.programs and req.program_id is not None and self._pause_step(entry, now):
            return False
        cached = self.groups.first_uncached(w, req.block_hashes, cached)
        if p.grouping and not entry.regrouped:
            if self.groups.try_hold(req, w, cached, now):
                entry.state = HELD
                return False
        need = kv_need(req, cached)
        room = self._room(w)
        if not room.fits(need) or _cold(room, req, cached, p.cold_shared_hits):
            return False  # no room; or cold, and it waits in this queue, not the engine's
        decode = None
        if p.pd_mode == "disaggregated":
            decode = self._decode_worker(req, w, need)
            if decode == "":
                return False
        self._commit(entry, w, decode, cached, need, now)
        out.append(Dispatch(req.request_id, w, decode))
        return True

    def _commit(  # all plain values from _try_dispatch
        self, entry: Entry, w: str, decode: str | None, cached: int, need: int, now: float
    ) -> None:
        req = entry.req
        rid = req.request_id
        del self.entries[rid]
        self._rooms.clear()
        out = output_blocks(req)
        run = Running(req, w, cached, need, now, decode_worker=decode)
        self.admission.charge(w, need, out, run.prefill_tokens)
        self._note_need(need)
        if decode is not None:
            self.admission.charge(decode, need, out)
            self.gate.start(rid, decode)
        self._add_run(run)
        self.groups.lead(rid, w, req.block_hashes, cached)
        if self.params.programs and req.program_id is not None:
            self.programs.on_dispatch(req, w, now)
            self._dirty.add(w)
        self.counters["dispatched"] += 1

    def _decode_worker(self, req: SchedRequest, prefill: str, need: int) -> str | None:
        """The decode worker, among the request's candidates (the workers that serve its model
        and its LoRA adapter); None: decode where it prefilled; "": none has room (wait)."""
        serving = {w for w, _ in req.candidates}
        workers = [
            (w, self._role(w))
            for w in self.admission.workers
            if w not in self.gone and w in serving
        ]
        if not any(r != "prefill" and w != prefill for w, r in workers):
            return None if self._role(prefill) == "both" else ""

        def share(w: str) -> tuple[float, float]:
            load = self.admission.workers[w]
            total = load.room.kv_total_blocks if load.room is not None else 0
            kv = self.admission.kv_blocks(w) / total if total else 0.0
            return self.admission.running(w) / self.admission.cap(w), kv

        picked = pick_decode_worker(
            workers, prefill, share, lambda w: self.admission.has_room(w, need)
        )
        return "" if picked is None else picked

    def _cached(self, req: SchedRequest, w: str) -> int:
        for cw, c in req.candidates:
            if cw == w:
                return c
        return 0

    def _try_preempt(self, entry: Entry, w: str, now: float, out: list[Action]) -> bool:
        if not self.params.preemption:
            return False
        on_w = self.runs_on.get(w)
        if not on_w or self._cold_held(entry.req, w):
            return False  # ending a run does not shorten the queue of prompts not started
        allowed = self.preemptor.allowed_at(w)
        if allowed > now:  # rate-limited (``pick``'s first test): retry once it is not
            self._retry_at = min(self._retry_at or allowed, allowed)
            return False
        cached = self._cached(entry.req, w)
        victim = self.preemptor.pick(entry.req, cached, list(on_w.values()), now)
        if victim is None:
            return False
        self.preemptor.record(victim, now)
        rid = victim.req.request_id
        self._end_run(rid, now)
        self.counters["preempted"] += 1
        out.append(Preempt(rid, w, reason=f"for {entry.req.request_id}"))
        return True


def _cold(room: Headroom, req: SchedRequest, hit_blocks: int, shared_only: bool) -> bool:
    """``req``, with ``hit_blocks`` cached on a worker in state ``room``, is held by the cold
    prefill queue bound: the bound is reached and nothing of it is cached there, or (with
    ``shared_only``) no more than every other candidate caches too (a shared system prompt)."""
    if not room.prefill_full:
        return False
    if shared_only and len(req.candidates) > 1:
        return hit_blocks <= min(c for _, c in req.candidates)
    return not hit_blocks


class _OpenBooks:
    """The open workers of one spill pass and their books (``DispatchPass._books_now``), read
    when a memo is first compared with them and again after a try changed them."""

    __slots__ = ("_pass", "closed", "gen", "now", "open")

    def __init__(self, dispatch: DispatchPass, open_: set[str]) -> None:
        self._pass, self.open = dispatch, open_
        self.now: dict[str, tuple] | None = None
        self.closed: list[str] = []
        self.gen = 0

    def settle(self, entry: Entry, memo: dict) -> bool:
        """True: ``entry`` would find no room on any open worker it may go to, as its memo
        says; marked settled under these books (``_books_gen``), a full worker leaves ``open``."""
        if self.now is None:
            self.now, self.closed, self.gen = self._pass._books_now(self.open)
        if entry.settled == self.gen and not self.closed:
            return True  # settled under these very books
        if self.now.items() <= memo.items():
            entry.settled = self.gen
            if self.closed:
                self.open.difference_update(self.closed)
                self.now = None
            return True
        return False

    def mark(self, entry: Entry) -> None:
        """``entry``'s try left every eligible open worker in its memo as the books are now."""
        if self.now is not None:
            entry.settled = self.gen
