"""Agent programs: multi-step sessions whose KV is kept or released on purpose.

A program (``SchedRequest.program_id``) alternates between *reasoning* (a step runs) and
*acting* (a tool call between steps; its KV sits on the worker waiting for the next step). Per
worker the tracker sums the context of the programs living there (reasoning or acting). When
that passes ``program_watermark`` of the worker's KV pool, acting programs there are *paused*
smallest context first until it is back under: a paused program's blocks are left to the
engine's eviction, and its next step waits here instead of thrashing the cache. A paused step
resumes (oldest pause first) on the first router candidate where the program fits under
``program_resume_watermark``. While not paused, a step is *sticky*: the worker holding the
program's KV goes first among its candidates. ``release`` ends a program; an acting program
silent for ``program_idle_s`` is released too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from thunderagent.scheduling.api import SchedRequest

REASONING, ACTING, PAUSED = "reasoning", "acting", "paused"


@dataclass(slots=True)
class Program:
    program_id: str
    context_tokens: int = 0
    block_size: int = 16
    phase: str = ACTING
    worker_id: str | None = None
    last_seen: float = 0.0
    paused_at: float = 0.0
    steps: int = 0

    @property
    def blocks(self) -> int:
        return math.ceil(self.context_tokens / self.block_size)


@dataclass(slots=True)
class ProgramTracker:
    watermark: float = 0.95
    resume_watermark: float = 0.85
    programs: dict[str, Program] = field(default_factory=dict)
    resident: dict[str, int] = field(default_factory=dict)
    """worker -> blocks of the programs living there (not paused)."""
    pending: dict[str, list[str]] = field(default_factory=dict)
    """paused program id -> request ids of its steps waiting for it to resume, oldest first
    (insertion order: the oldest pause first). An open-loop client may send several."""
    parked_at: dict[str, float] = field(default_factory=dict)
    """paused program id -> when its oldest parked step was parked."""
    pauses: int = 0
    resumes: int = 0

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

    def _move(self, prog: Program, worker_id: str | None) -> None:
        if prog.worker_id is not None and prog.phase != PAUSED:
            self.resident[prog.worker_id] = self.resident.get(prog.worker_id, 0) - prog.blocks
        prog.worker_id = worker_id
        if worker_id is not None:
            self.resident[worker_id] = self.resident.get(worker_id, 0) + prog.blocks

    def on_dispatch(self, req: SchedRequest, worker_id: str, now: float) -> None:
        prog = self.get(req, now)
        self._move(prog, None)
        prog.context_tokens = max(prog.context_tokens, req.prompt_tokens)
        prog.phase = REASONING
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

    def over_capacity(self, worker_id: str, kv_total: int, now: float) -> list[str]:
        """Pause acting programs on ``worker_id``, smallest first, until under the watermark."""
        limit = self.watermark * kv_total
        if kv_total <= 0 or self.resident.get(worker_id, 0) <= limit:
            return []
        acting = sorted(
            (p for p in self.programs.values() if p.worker_id == worker_id and p.phase == ACTING),
            key=lambda p: (p.context_tokens, p.program_id),
        )
        paused: list[str] = []
        for prog in acting:
            if self.resident.get(worker_id, 0) <= limit:
                break
            self.resident[worker_id] -= prog.blocks
            prog.phase, prog.paused_at = PAUSED, now
            paused.append(prog.program_id)
        self.pauses += len(paused)
        return paused

    def fits(self, prog: Program, worker_id: str, kv_total: int) -> bool:
        room = self.resume_watermark * kv_total - self.resident.get(worker_id, 0)
        return kv_total <= 0 or prog.blocks <= room

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

    def next_park_deadline(self, park_max_s: float) -> float | None:
        """When the oldest parked step will have waited ``park_max_s`` (None: nothing parked)."""
        return min(self.parked_at.values()) + park_max_s if self.parked_at else None

    def parked_since(self, before: float) -> list[str]:
        """Programs whose oldest parked step was parked at or before ``before``."""
        return [pid for pid in self.pending if self.parked_at.get(pid, before) <= before]

    def unpark(self, program_id: str, request_id: str) -> None:
        """A parked step left (deadline, cancellation)."""
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
        return self.pending.pop(prog.program_id, [])

    def release(self, program_id: str) -> list[str]:
        """End a program; returns the request ids of steps still parked on it."""
        prog = self.programs.pop(program_id, None)
        self.parked_at.pop(program_id, None)
        if prog is None:
            return self.pending.pop(program_id, [])
        if prog.phase != PAUSED and prog.worker_id is not None:
            self.resident[prog.worker_id] -= prog.blocks
        return self.pending.pop(program_id, [])

    def idle(self, now: float, idle_s: float) -> list[str]:
        return [
            p.program_id
            for p in self.programs.values()
            if p.phase in (ACTING, PAUSED)
            and p.program_id not in self.pending
            and now - p.last_seen >= idle_s
        ]
