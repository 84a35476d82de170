"""The composed scheduler's side of agent programs: where a step goes, pause, park, resume.

``ProgramSteps`` is mixed into ``ThunderScheduler`` (``thunder.py``); it works on that
scheduler's waiting entries, running table and ``ProgramTracker`` (``programs.py``, which keeps
the bookkeeping of residency). What it adds to the tracker is what needs the scheduler's view:

* **stickiness that yields**: a step goes back to the worker holding its program's KV unless
  the router ranked another worker first, the holder's queued prefill is longer than that
  worker's by more than the prompt the step would re-prefill there, and the program fits there
  without pausing anyone (``program_yield_ratio``);
* **rescue**: a step of a paused program whose previous prompt the engine has not evicted yet
  resumes the program where it is cached at once instead of parking
  (``program_rescue_share``);
* resume where room appears, forced resume after ``program_park_max_s``, idle release;
* a program no candidate could hold even with nothing else on it resumes at once: no
  release can make room for it, so parking its step would only delay it by the bound.
"""

from __future__ import annotations

import math

from thunderagent.scheduling.api import SchedRequest
from thunderagent.scheduling.ordering import uncached_prompt_tokens
from thunderagent.scheduling.programs import PAUSED, Program

PAUSED_STEP = "paused"
IDLE_CHECK_S = 1.0
"""Idle programs are looked for at most once a second (a scan over all programs)."""


class ProgramSteps:
    """Program placement, pausing and resuming; a mixin of ``ThunderScheduler``, whose
    ``programs``, ``entries``, ``running``, ``params``, ``admission`` and queue methods it uses."""

    def release_program(self, program_id: str, now: float = 0.0) -> None:
        """The client ended the program: forget it; steps still parked go to the queue."""
        prog = self.programs.programs.get(program_id)
        if prog is not None and prog.worker_id is not None:
            self._dirty.add(prog.worker_id)  # its room is free: paused programs may fit
        for rid in self.programs.release(program_id):
            if rid in self.entries:
                self._enqueue(self.entries[rid], now)

    # ---- where a step goes -----------------------------------------------------------------

    def _place_step(self, req: SchedRequest, now: float) -> None:
        """A program's step arrived: its holder goes first unless it yields (module doc)."""
        self.programs.get(req, now)
        if not self._holder_yields(req, now):
            self.programs.sticky(req)

    def _holder_yields(self, req: SchedRequest, now: float) -> bool:
        """Keep the router's order for this step: its first candidate has room for the program
        and starts the step sooner although it re-prefills what the holder has cached."""
        prog = self.programs.programs.get(req.program_id or "")
        cands = self._eligible(req)
        ratio = self.params.program_yield_ratio
        if prog is None or prog.phase == PAUSED or prog.worker_id is None or not cands:
            return False
        if math.isinf(ratio):
            return False
        first, first_cached = cands[0]
        holder = prog.worker_id
        held = dict(cands).get(holder)
        if first == holder or held is None:
            return False
        extra = max(0, held - first_cached) * req.block_size
        backlog = self._prefill_backlogs((holder, first), now)
        if backlog[holder] - backlog[first] <= ratio * extra:
            return False
        return self.programs.fits(prog, first, self._kv_totals().get(first, 0))

    def _prefill_backlogs(self, workers: tuple[str, ...], now: float) -> dict[str, float]:
        """Per worker: prompt tokens sent there that have not produced a first token yet, less
        what it prefilled (at ``prefill_tokens_per_s``) since the oldest of them was sent: how
        long a new prompt would queue there behind prefill. One pass over the running table."""
        tokens = dict.fromkeys(workers, 0)
        since = dict.fromkeys(workers, now)
        for run in self.running.values():
            if run.started_at is None and run.worker_id in tokens:
                tokens[run.worker_id] += uncached_prompt_tokens(run.req, run.cached_blocks)
                since[run.worker_id] = min(since[run.worker_id], run.dispatched_at)
        rate = self.params.prefill_tokens_per_s
        return {w: max(0.0, tokens[w] - (now - since[w]) * rate) for w in workers}

    # ---- paused programs -------------------------------------------------------------------

    def _pause_step(self, entry, now: float) -> bool:
        """A step of a paused program: resume it where its KV still is or where it fits now
        (re-queued there), else park it until memory frees. True: it left the queue it was on."""
        prog = self.programs.programs.get(entry.req.program_id or "")
        if prog is None or prog.phase != PAUSED:
            return False
        entry.state = PAUSED_STEP
        self.programs.park(prog.program_id, entry.req.request_id, now)
        share = self.params.program_rescue_share
        w = self.programs.cached_on(prog, self._eligible(entry.req), share) if share else None
        if w is not None:
            self.programs.rescues += 1
            self._dirty.add(w)  # it counts there again: others there may have to pause
            self._resume_on(prog, w, now)
        else:
            self._try_resume(prog.program_id, self._kv_totals(), now)
        return True

    def _resume_on(self, prog: Program, w: str, now: float) -> None:
        """The program lives on ``w`` again; its parked steps go to ``w`` first."""
        for rid in self.programs.resume(prog, w, now):
            entry = self.entries[rid]
            entry.req.candidates = sorted(entry.req.candidates, key=lambda c: c[0] != w)
            self._enqueue(entry, now)

    def _try_resume(
        self, pid: str, totals: dict[str, int], now: float, changed: set[str] | None = None
    ) -> None:
        """Resume a paused program where it fits, or where programs gone stale make room for
        it; its parked steps follow it there. A program released meanwhile (idle) just lets
        its steps go to the queue. ``changed``: only workers whose room changed can newly fit
        it (and staleness, which only time changes, is left to the periodic pass)."""
        parked = self.programs.pending.get(pid)
        prog = self.programs.programs.get(pid)
        if not parked:
            return
        if prog is None:
            self.release_program(pid, now)
            return
        cands = self._eligible(self.entries[parked[0]].req)
        if cands and not any(self.programs.could_fit(prog, totals.get(w, 0)) for w, _ in cands):
            self._resume_on(prog, cands[0][0], now)  # waiting cannot make room for it
            return
        looked = cands if changed is None else [c for c in cands if c[0] in changed]
        w = self.programs.place(prog, looked, totals)
        if w is None and cands and changed is None:
            first = cands[0][0]
            stale = self.programs.stale_after_s()
            if self.programs.make_room(prog, first, totals.get(first, 0), now, stale):
                w = first if self.programs.fits(prog, first, totals.get(first, 0)) else None
        if w is not None:
            self._resume_on(prog, w, now)

    def _force_resume(self, pid: str, now: float) -> None:
        """A parked step waited its turn: resume the program on the step's first candidate,
        pausing the programs silent longest there to make room."""
        prog = self.programs.programs.get(pid)
        parked = self.programs.pending.get(pid)
        if not parked:
            return
        cands = self._eligible(self.entries[parked[0]].req)
        if prog is None or not cands:
            self.release_program(pid, now)
            return
        w = cands[0][0]
        self.programs.make_room(prog, w, self._kv_totals().get(w, 0), now)
        for rid in self.programs.resume(prog, w, now):
            self._enqueue(self.entries[rid], now)

    def _programs_tick(self, now: float) -> None:
        """Pause where programs overflow, resume where room appeared (every paused program
        is looked at only against workers whose room changed, and against all of them once a
        second), force parked steps that waited too long, release idle programs."""
        totals = self._kv_totals()
        changed, self._dirty = self._dirty, set()
        for w in sorted(changed):
            self.programs.over_capacity(w, totals.get(w, 0))
        periodic = now >= self._next_idle_check
        if changed or periodic:
            for pid in self.programs.resume_order():
                self._try_resume(pid, totals, now, None if periodic else changed)
        for pid in self.programs.parked_since(now - self.params.program_park_max_s):
            self._force_resume(pid, now)
        if periodic:
            self._next_idle_check = now + IDLE_CHECK_S
            for pid in self.programs.idle(now, self.params.program_idle_s):
                self.release_program(pid, now)

    def _kv_totals(self) -> dict[str, int]:
        return {
            w: load.room.kv_total_blocks
            for w, load in self.admission.workers.items()
            if load.room is not None
        }
