"""Generated workloads through the replay: open-loop mixes and closed-loop agent programs.

``WorkRequest``s (``thunderagent.workloads``) become ``TraceRequest``s carrying their priority,
deadline, program id and the client's output estimate, so the scheduler sees what a client would
send. Open loop: every request arrives at its ``issue_at`` whatever happens to the others.
Closed loop: only each program's first step is known up front; when a step ends (completed or
rejected) the workload issues the next one ``pause`` seconds later, and after the last step the
driver sends ``release_program``.
"""

from __future__ import annotations

from collections.abc import Sequence

from thunderagent.replay.driver import Replay
from thunderagent.replay.records import ReplayConfig, ReplayResult
from thunderagent.replay.traces import TraceRequest
from thunderagent.workloads import AgentWorkload, WorkRequest


def to_trace(req: WorkRequest) -> TraceRequest:
    return TraceRequest(
        request_id=req.request_id,
        arrival=req.issue_at,
        prompt_len=req.prompt_tokens,
        output_len=req.output_tokens,
        block_ids=list(req.blocks),
        session=req.program_id,
        step=req.step,
        priority=req.priority,
        deadline=req.deadline,
        expected_output=req.expected_output_tokens,
    )


def run_open(config: ReplayConfig, requests: Sequence[WorkRequest]) -> ReplayResult:
    """Replay an open-loop request list (sorted by ``issue_at``)."""
    if not requests:
        raise ValueError("no requests")
    replay = Replay(config, requests[0].block_size)
    return replay.run([to_trace(r) for r in requests])


def run_programs(config: ReplayConfig, workload: AgentWorkload) -> ReplayResult:
    """Replay closed-loop agent programs until every program has run its last step."""
    first = workload.start()
    replay = Replay(config, workload.params.block_size)

    def follow_up(request_id: str, now: float) -> TraceRequest | None:
        nxt = workload.on_step_done(request_id, now)
        return None if nxt is None else to_trace(nxt)

    replay.follow_up = follow_up
    return replay.run([to_trace(r) for r in first])
