"""Agent programs: multi-step sessions whose KV is kept or released on purpose.

A program (``SchedRequest.program_id``) alternates between *reasoning* (a step runs) and
*acting* (a tool call between steps; its KV sits on the worker waiting for the next step). Per
worker the tracker sums the context of the programs living there (reasoning or acting). When
that passes ``program_watermark`` of the worker's KV pool, acting programs there are *paused*
smallest context first until it is back under (never one resumed for a step still queued: that
step would park twice): a paused program's blocks are left to the engine's eviction, and its
next step waits here instead of thrashing the cache. A paused step resumes (fewest steps run
first: ``resume_order``) on the first router candidate where the program fits under
``program_resume_watermark``, or at once where the engine still holds its previous prompt
(``cached_on``: a pause only leaves blocks to eviction, and a program back within seconds
usually finds them). While not paused, a step is *sticky*: the worker holding the program's KV
goes first among its candidates (the scheduler may keep the router's order instead:
``program_steps.py``). ``release`` ends a program; an acting program silent for
``program_idle_s`` is released too.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from thunderagent.scheduling.api import SchedRequest

REASONING, ACTING, PAUSED = "reasoning", "acting", "paused"
TOOL_PAUSES_KEPT = 256
"""Recent tool-call pauses (acting -> next step) the tracker learns "silent too long" from."""
MIN_TOOL_PAUSES = 16
"""Fewer observed pauses than this: no program counts as stale yet."""
STALE_QUANTILE = 0.99
"""A program silent past this quantile of the tool pauses seen is most likely over (0.9 paused
live programs too often: 1.21x the steps/min of program-unaware scheduling against 1.45x)."""


@dataclass(slots=True)
class Program:
    program_id: str
    context_tokens: int = 0
    block_size: int = 16
    phase: str = ACTING
    worker_id: str | None = None
    last_seen: float = 0.0
    steps: int = 0
    waking: bool = False
    """Resumed with parked steps that have not been dispatched yet: it is not paused again
    before they run, or a step could wait past ``program_park_max_s`` (forced back in, then
    paused while still queued, then parked again)."""
    hashes: Sequence[int] = ()
    """Its latest prompt's full blocks: blocks programs share (a system or tool prompt) are
    counted once per worker."""

    @property
    def blocks(self) -> int:
        return math.ceil(self.context_tokens / self.block_size)

    @property
    def tail(self) -> int:
        """Its blocks no other program can share: past its prompt's full blocks."""
        return max(0, self.blocks - len(self.hashes))


@dataclass(slots=True)
class Residency:
    """KV blocks the programs living on one worker hold, a shared prefix counted once."""

    shared: Counter[int] = field(default_factory=Counter)
    tails: int = 0

    @property
    def blocks(self) -> int:
        return len(self.shared) + self.tails

    def add(self, prog: Program) -> None:
        self.shared.update(prog.hashes)
        self.tails += prog.tail

    def remove(self, prog: Program) -> None:
        self.shared.subtract(prog.hashes)
        for h in prog.hashes:
            if self.shared[h] <= 0:
                del self.shared[h]
        self.tails -= prog.tail


@dataclass(slots=True)
class ProgramTracker:
    watermark: float = 0.95
    resume_watermark: float = 0.85
    programs: dict[str, Program] = field(default_factory=dict)
    residency: dict[str, Residency] = field(default_factory=dict)
    """worker -> KV of the programs living there (not paused)."""
    pending: dict[str, list[str]] = field(default_factory=dict)
    """paused program id -> request ids of its steps waiting for it to resume, oldest first
    (insertion order: the oldest pause first). An open-loop client may send several."""
    parked_at: dict[str, float] = field(default_factory=dict)
    """paused program id -> when its oldest parked step was parked."""
    pauses: int = 0
    resumes: int = 0
    rescues: int = 0
    """Resumes of a paused program where its previous prompt was still cached."""
    tool_pauses: deque[float] = field(default_factory=lambda: deque(maxlen=TOOL_PAUSES_KEPT))

    def stale_after_s(self) -> float:
        """Silence after which an acting program is unlikely to come back soon: the
        ``STALE_QUANTILE`` of the tool-call pauses seen lately (inf until enough were seen).
        Such a program (often one that ended without a release) gives up its place at once to
        a paused one whose step arrived."""
        if len(self.tool_pauses) < MIN_TOOL_PAUSES:
            return math.inf
        ordered = sorted(self.tool_pauses)
        return ordered[min(len(ordered) - 1, int(STALE_QUANTILE * len(ordered)))]

    def get(self, req: SchedRequest, now: float) -> Program:
        pid = req.program_id or ""
        prog = self.programs.get(pid)
        if prog is None:
            prog = self.programs[pid] = Program(pid, block_size=req.block_size, last_seen=now)
        return prog

    def sticky(self, req: SchedRequest) -> None:
        """Put the worker holding the program's KV first among the candidates."""
        prog = self.programs.get(req.program_id or "")
        if prog is None or prog.phase == PAUSED or prog.worker_id is None:
            return
        cands = list(req.candidates)
        for i, (w, _) in enumerate(cands):
            if w == prog.worker_id and i > 0:
                req.candidates = [cands[i], *cands[:i], *cands[i + 1 :]]
                return

    def resident(self, worker_id: str) -> int:
        """Blocks the programs living on ``worker_id`` hold (a shared prefix once)."""
        r = self.residency.get(worker_id)
        return r.blocks if r is not None else 0

    def _at(self, worker_id: str) -> Residency:
        r = self.residency.get(worker_id)
        if r is None:
            r = self.residency[worker_id] = Residency()
        return r

    def _move(self, prog: Program, worker_id: str | None) -> None:
        if prog.worker_id is not None and prog.phase != PAUSED:
            self._at(prog.worker_id).remove(prog)
        prog.worker_id = worker_id
        if worker_id is not None:
            self._at(worker_id).add(prog)

    def on_dispatch(self, req: SchedRequest, worker_id: str, now: float) -> None:
        prog = self.get(req, now)
        if prog.phase == ACTING and prog.steps:  # a tool call just ended (not a paused one)
            self.tool_pauses.append(now - prog.last_seen)
        self._move(prog, None)
        prog.context_tokens = max(prog.context_tokens, req.prompt_tokens)
        prog.hashes = tuple(req.block_hashes)
        prog.phase = REASONING
        prog.waking = False
        prog.steps += 1
        prog.last_seen = now
        self._move(prog, worker_id)

    def on_finished(self, req: SchedRequest, now: float) -> None:
        prog = self.programs.get(req.program_id or "")
        if prog is None or prog.phase != REASONING:
            return
        worker = prog.worker_id
        self._move(prog, None)
        prog.context_tokens = req.prompt_tokens + req.expected_output_tokens
        prog.phase = ACTING
        prog.last_seen = now
        self._move(prog, worker)

    def over_capacity(self, worker_id: str, kv_total: int) -> list[str]:
        """Pause acting programs on ``worker_id``, smallest first, until under the watermark."""
        limit = self.watermark * kv_total
        if kv_total <= 0 or self.resident(worker_id) <= limit:
            return []
        acting = sorted(
            (
                p
                for p in self.programs.values()
                if p.worker_id == worker_id and p.phase == ACTING and not p.waking
            ),
            key=lambda p: (p.context_tokens, p.program_id),
        )
        paused: list[str] = []
        for prog in acting:
            if self.resident(worker_id) <= limit:
                break
            self._at(worker_id).remove(prog)
            prog.phase = PAUSED
            paused.append(prog.program_id)
        self.pauses += len(paused)
        return paused

    def fits(self, prog: Program, worker_id: str, kv_total: int) -> bool:
        if kv_total <= 0:
            return True
        room = self.resume_watermark * kv_total - self.resident(worker_id)
        if prog.tail + len(prog.hashes) <= room:  # fits even if it shares nothing
            return True
        if prog.tail > room:  # does not fit even if it shares all its prompt
            return False
        shared = self._at(worker_id).shared
        return prog.tail + sum(h not in shared for h in prog.hashes) <= room

    def could_fit(self, prog: Program, kv_total: int) -> bool:
        """Whether ``prog`` fits under the resume mark of a worker holding nothing else: if
        not, no pause or release there can ever make room for it."""
        return kv_total <= 0 or prog.tail + len(prog.hashes) <= self.resume_watermark * kv_total

    def make_room(
        self, prog: Program, worker_id: str, kv_total: int, now: float, silent_for: float = 0.0
    ) -> list[str]:
        """Pause acting programs on ``worker_id`` silent at least ``silent_for``, longest
        silent first, until ``prog`` fits there: a step displaces the program least likely to
        come back soon (a finished agent that never sent a release goes first) instead of
        pushing the worker over its KV and thrashing everyone's cache."""
        acting = sorted(
            (
                p
                for p in self.programs.values()
                if p.worker_id == worker_id
                and p.phase == ACTING
                and not p.waking
                and p is not prog
                and now - p.last_seen >= silent_for
            ),
            key=lambda p: (p.last_seen, p.program_id),
        )
        paused: list[str] = []
        for victim in acting:
            if self.fits(prog, worker_id, kv_total):
                break
            self._at(worker_id).remove(victim)
            victim.phase = PAUSED
            paused.append(victim.program_id)
        self.pauses += len(paused)
        return paused

    def cached_on(
        self, prog: Program, candidates: Sequence[tuple[str, int]], share: float
    ) -> str | None:
        """The first candidate (router order) still caching at least ``share`` of the blocks
        of the program's previous prompt, or None."""
        need = share * len(prog.hashes)
        if need <= 0:
            return None
        return next((w for w, cached in candidates if cached >= need), None)

    def place(
        self, prog: Program, candidates: Sequence[tuple[str, int]], totals: dict[str, int]
    ) -> str | None:
        """The first candidate a paused program fits on (router order), or None."""
        for w, _ in candidates:
            if self.fits(prog, w, totals.get(w, 0)):
                return w
        return None

    def park(self, program_id: str, request_id: str, now: float) -> None:
        """A step of a paused program waits for it to resume."""
        if program_id not in self.pending:
            self.parked_at[program_id] = now
        self.pending.setdefault(program_id, []).append(request_id)

    def resume_order(self) -> list[str]:
        """Paused programs with parked steps, in the order room is offered to them: fewest
        steps run first, then the oldest pause. A program that has run fewer steps most likely
        has more left (its length is unknown here), and a batch of agents is done when its last
        program is: the one that lost time to long tool calls or to an early pause would
        otherwise set the end. Against the oldest pause first (``bench sched``'s programs, stop
        66): steps per minute +2.3 % on the mean of twelve workload seeds (9 up, 3 down by at
        most 5 %: one program's chain sets each end), +10.6 % at the default seed. The price is
        fairness: under a long overload a program deep into its steps may wait longer than
        one paused after it; ``program_park_max_s`` still bounds every parked step's wait."""
        progs, parked_at = self.programs, self.parked_at
        return sorted(
            self.pending,
            key=lambda pid: (p.steps if (p := progs.get(pid)) else 0, parked_at.get(pid, 0.0)),
        )

    def next_park_deadline(self, park_max_s: float) -> float | None:
        """When the oldest parked step will have waited ``park_max_s`` (None: nothing parked)."""
        return min(self.parked_at.values()) + park_max_s if self.parked_at else None

    def parked_since(self, before: float) -> list[str]:
        """Programs whose oldest parked step was parked at or before ``before``."""
        return [pid for pid in self.pending if self.parked_at.get(pid, before) <= before]

    def unpark(self, program_id: str, request_id: str) -> None:
        """A step left without running (deadline, cancellation), parked or queued: a program
        woken for it may be paused again."""
        prog = self.programs.get(program_id)
        if prog is not None:
            prog.waking = False
        steps = self.pending.get(program_id)
        if steps and request_id in steps:
            steps.remove(request_id)
            if not steps:
                del self.pending[program_id]
                self.parked_at.pop(program_id, None)

    def resume(self, prog: Program, worker_id: str, now: float) -> list[str]:
        """The program lives on ``worker_id`` again; returns its parked steps."""
        prog.phase = ACTING
        prog.worker_id = None
        prog.last_seen = now
        self._move(prog, worker_id)
        self.resumes += 1
        self.parked_at.pop(prog.program_id, None)
        steps = self.pending.pop(prog.program_id, [])
        prog.waking = bool(steps)
        return steps

    def release(self, program_id: str) -> list[str]:
        """End a program; returns the request ids of steps still parked on it."""
        prog = self.programs.pop(program_id, None)
        self.parked_at.pop(program_id, None)
        if prog is None:
            return self.pending.pop(program_id, [])
        if prog.phase != PAUSED and prog.worker_id is not None:
            self._at(prog.worker_id).remove(prog)
        return self.pending.pop(program_id, [])

    def idle(self, now: float, idle_s: float) -> list[str]:
        return [
            p.program_id
            for p in self.programs.values()
            if p.phase in (ACTING, PAUSED)
            and p.program_id not in self.pending
            and now - p.last_seen >= idle_s
        ]
