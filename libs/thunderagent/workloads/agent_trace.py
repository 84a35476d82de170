"""Agent programs as an open-loop Mooncake trace (rows with ``program_id`` and ``step``).

Programs start as a Poisson process. Each picks one of ``tool_prompts`` shared tool/system
prompts, adds its own task, and runs a log-normal number of steps. Step k+1's prompt is step k's
prompt followed by step k's output and a tool observation, so it extends step k's prompt (its
full blocks keep their ids; see ``thunderagent.workloads.mooncake``). A program stops early when
its next prompt plus output would pass ``max_context_tokens``.

Arrival times: a trace cannot react to the system replaying it, so a later step's arrival is
the closed-loop schedule *under no queueing*: the previous step's arrival, plus an estimated
service time (its uncached prompt tokens at ``est_prefill_tokens_per_s`` plus its output at
``est_s_per_output_token``), plus the tool pause (log-normal). A replay whose engines are slower
than that estimate sees steps arrive sooner after their predecessor finished than a real agent
would send them (a step may even arrive before its predecessor finished); the closed-loop
``AgentWorkload`` is the exact alternative when that matters.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

from thunderagent.workloads.mooncake import (
    BlockIds,
    GeneratedTrace,
    Prompt,
    TraceRow,
    est_service,
    in_order,
    lognormal,
    make_row,
    start_prompt,
)


@dataclass(slots=True, frozen=True, kw_only=True)
class AgentTraceParams:
    programs: int = 400
    program_rate_per_s: float = 0.6
    """Poisson rate of program starts (400 programs: about 11 minutes of starts)."""
    steps_median: float = 8.6
    steps_sigma: float = 0.5
    steps_min: int = 2
    steps_max: int = 40
    tool_prompts: int = 1
    """Distinct shared tool/system prompts; each program picks one uniformly."""
    tool_prompt_tokens: int = 8000
    task_tokens_median: float = 800.0
    task_tokens_sigma: float = 0.8
    output_tokens_median: float = 160.0
    output_tokens_sigma: float = 0.8
    output_tokens_max: int = 4096
    observation_tokens_median: float = 800.0
    observation_tokens_sigma: float = 1.0
    observation_tokens_max: int = 32768
    pause_median_s: float = 6.0
    pause_sigma: float = 1.0
    """Log-normal sigma of the tool pause (1.0: p90 is ~3.6x the median)."""
    max_context_tokens: int = 131072
    est_prefill_tokens_per_s: float = 20000.0
    """Service-time estimate: uncached prompt tokens per second (8B on one H100, loaded)."""
    est_s_per_output_token: float = 0.025
    """Service-time estimate: seconds per output token (decode in a busy batch)."""
    block_size: int = 512

    def scaled(self, scale: float) -> AgentTraceParams:
        """``scale`` times the programs at the same start rate (same load, longer trace)."""
        return replace(self, programs=max(1, round(self.programs * scale)))


def agent_trace(p: AgentTraceParams, seed: int) -> GeneratedTrace:
    """Every step of every program, in arrival order (the first program starts at 0)."""
    rng, ids = random.Random(seed), BlockIds()
    tools = [start_prompt(p.tool_prompt_tokens, ids, p.block_size) for _ in range(p.tool_prompts)]
    rows: list[TraceRow] = []
    start = 0.0
    for i in range(p.programs):
        rows.extend(_program(p, rng, ids, f"prog-{i}", start, rng.choice(tools)))
        start += rng.expovariate(p.program_rate_per_s)
    in_order(rows)
    per_program = round(len(rows) / p.programs, 3)
    return GeneratedTrace(rows, {"programs": p.programs, "steps_per_program": per_program})


def _program(
    p: AgentTraceParams, rng: random.Random, ids: BlockIds, pid: str, at: float, tool: Prompt
) -> list[TraceRow]:
    bs = p.block_size
    steps = lognormal(rng, p.steps_median, p.steps_sigma, p.steps_min, p.steps_max)
    task = lognormal(rng, p.task_tokens_median, p.task_tokens_sigma, 1, p.max_context_tokens // 4)
    prompt = tool.extend(task, ids, bs)
    cached = len(tool.full) * bs
    out: list[TraceRow] = []
    for k in range(steps):
        output = lognormal(
            rng, p.output_tokens_median, p.output_tokens_sigma, 1, p.output_tokens_max
        )
        if prompt.tokens + output > p.max_context_tokens:
            break
        out.append(make_row(at, prompt, output, ids, bs, program_id=pid, step=k))
        observation = lognormal(
            rng,
            p.observation_tokens_median,
            p.observation_tokens_sigma,
            1,
            p.observation_tokens_max,
        )
        pause = p.pause_median_s * math.exp(p.pause_sigma * rng.gauss(0.0, 1.0))
        new = prompt.tokens - cached
        at += est_service(new, output, p.est_prefill_tokens_per_s, p.est_s_per_output_token)
        at += pause
        cached = len(prompt.full) * bs
        prompt = prompt.extend(output + observation, ids, bs)
    return out
