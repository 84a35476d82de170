"""Closed-loop agent programs.

``programs`` programs start ``start_gap_s`` apart. Each runs ``steps`` steps (uniform in
``steps_range``). Step k's prompt is the shared system prompt, then the program's own task,
then everything earlier steps produced (each step's output plus its tool observation), so the
context grows step by step and step k's prompt is a prefix-extension of step k-1's. After step
k finishes at ``now``, step k+1 is issued at ``now + pause`` (tool call, pause drawn
log-normally with median ``tool_pause_median_s``).

Driver contract: ``start()`` gives every first step; after each step finishes call
``on_step_done(request_id, now)``: it returns the next step (issue it at its ``issue_at``) or
None when that was the program's last step (then send ``release_program``). Output and
observation content are fresh block ids: an engine caches generated tokens under its own ids,
so only the part of the next prompt that was in an earlier prompt is a guaranteed hit.

Each program draws its sizes and pauses from its own stream, seeded by the workload's seed and
the program's index. A shared stream would be consumed in completion order, so two schedulers
would be compared on different programs (other outputs, observations and tool pauses).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from thunderagent.workloads.common import WorkRequest, noisy

SYSTEM_BASE = 1 << 40
"""System-prompt block ids live above this; program content below (never collide)."""
PROGRAM_BLOCKS = 1 << 24
"""Program i's own block ids start at i * PROGRAM_BLOCKS, so a program's ids do not depend on
the order other programs' steps finish in."""


@dataclass(slots=True, frozen=True, kw_only=True)
class AgentParams:
    programs: int = 64
    steps_range: tuple[int, int] = (4, 12)
    start_gap_s: float = 0.5
    block_size: int = 16
    system_blocks: int = 64
    task_blocks_range: tuple[int, int] = (16, 64)
    output_tokens_range: tuple[int, int] = (64, 512)
    observation_blocks_range: tuple[int, int] = (8, 128)
    tool_pause_median_s: float = 2.0
    tool_pause_sigma: float = 1.0
    """Log-normal sigma of the pause (1.0: p90 is ~3.6x the median)."""
    estimate_noise: float = 0.0
    priority: int = 0


@dataclass(slots=True)
class _Program:
    program_id: str
    steps: int
    context: list[int]
    rng: random.Random
    next_block: int
    step: int = 0

    def fresh(self, n: int) -> list[int]:
        ids = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return ids


@dataclass(slots=True)
class AgentWorkload:
    params: AgentParams = field(default_factory=AgentParams)
    seed: int = 0
    _programs: dict[str, _Program] = field(default_factory=dict)
    _last: dict[str, WorkRequest] = field(default_factory=dict)
    """request id -> the step it is (until it is done)."""

    def start(self) -> list[WorkRequest]:
        p, out = self.params, []
        if p.programs > SYSTEM_BASE // PROGRAM_BLOCKS:
            raise ValueError(f"at most {SYSTEM_BASE // PROGRAM_BLOCKS} programs, got {p.programs}")
        system = [SYSTEM_BASE + i for i in range(p.system_blocks)]
        for i in range(p.programs):
            pid = f"prog-{i}"
            rng = random.Random(f"{self.seed}/{i}")
            prog = _Program(pid, rng.randint(*p.steps_range), [*system], rng, i * PROGRAM_BLOCKS)
            prog.context.extend(prog.fresh(rng.randint(*p.task_blocks_range)))
            self._programs[pid] = prog
            out.append(self._step(prog, i * p.start_gap_s))
        return out

    def _step(self, prog: _Program, at: float) -> WorkRequest:
        p = self.params
        out_tokens = prog.rng.randint(*p.output_tokens_range)
        req = WorkRequest(
            request_id=f"{prog.program_id}-s{prog.step}",
            issue_at=at,
            blocks=tuple(prog.context),
            block_size=p.block_size,
            output_tokens=out_tokens,
            expected_output_tokens=noisy(prog.rng, out_tokens, p.estimate_noise),
            priority=p.priority,
            program_id=prog.program_id,
            step=prog.step,
            last_step=prog.step == prog.steps - 1,
        )
        self._last[req.request_id] = req
        return req

    def on_step_done(self, request_id: str, now: float) -> WorkRequest | None:
        """The step finished at ``now``: the program's next step, or None if it was the last."""
        done = self._last.pop(request_id)
        prog = self._programs[done.program_id or ""]
        if done.last_step:
            del self._programs[prog.program_id]
            return None
        p = self.params
        grown = math.ceil(done.output_tokens / p.block_size)
        grown += prog.rng.randint(*p.observation_blocks_range)
        prog.context.extend(prog.fresh(grown))
        prog.step += 1
        pause = p.tool_pause_median_s * math.exp(p.tool_pause_sigma * prog.rng.gauss(0, 1))
        return self._step(prog, now + pause)

    def active(self) -> int:
        return len(self._programs)
