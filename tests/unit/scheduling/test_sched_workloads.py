"""Workload generators: seeded, closed loop grows context, mixed has the asked mix."""

from __future__ import annotations

from thunderagent.workloads import (
    AgentParams,
    AgentWorkload,
    MixedParams,
    MixedWorkload,
    block_tokens,
    request_tokens,
)


def test_agent_closed_loop_extends_the_prompt_and_ends() -> None:
    w = AgentWorkload(AgentParams(programs=3, steps_range=(2, 2), system_blocks=4), seed=7)
    first = w.start()
    assert [r.issue_at for r in first] == [0.0, 0.5, 1.0]
    assert all(r.blocks[:4] == first[0].blocks[:4] for r in first)  # shared system prompt
    nxt = w.on_step_done(first[0].request_id, 10.0)
    assert nxt is not None and nxt.issue_at > 10.0 and nxt.last_step
    assert nxt.blocks[: len(first[0].blocks)] == first[0].blocks
    assert len(nxt.blocks) > len(first[0].blocks)
    assert w.on_step_done(nxt.request_id, 20.0) is None
    assert w.active() == 2


def _drain(w: AgentWorkload, order: list[int]) -> dict[str, list[tuple]]:
    """Finish every step, picking which pending step ends next by ``order``; each program's
    steps as (blocks, output tokens, tool pause)."""
    seen: dict[str, list[tuple]] = {}
    pending, now, k = w.start(), 0.0, 0
    while pending:
        req = pending.pop(order[k % len(order)] % len(pending))
        k += 1
        now = max(now, req.issue_at) + 1.0
        nxt = w.on_step_done(req.request_id, now)
        pause = None if nxt is None else round(nxt.issue_at - now, 9)
        seen.setdefault(req.program_id or "", []).append((req.blocks, req.output_tokens, pause))
        if nxt is not None:
            pending.append(nxt)
    return seen


def test_agent_programs_do_not_depend_on_completion_order() -> None:
    """Two schedules that finish steps in different orders must see the same programs: a
    scheduler comparison on different outputs, observations or pauses would not be one."""
    p = AgentParams(programs=5, steps_range=(3, 6), system_blocks=4)
    first = _drain(AgentWorkload(p, seed=11), [0])
    last = _drain(AgentWorkload(p, seed=11), [-1])
    mixed = _drain(AgentWorkload(p, seed=11), [3, 1, 4, 1, 5, 9, 2, 6])
    assert first == last == mixed
    assert first != _drain(AgentWorkload(p, seed=12), [0])


def test_generators_are_seeded() -> None:
    a = AgentWorkload(seed=3).start()
    b = AgentWorkload(seed=3).start()
    assert a == b
    p = MixedParams(requests=50)
    assert MixedWorkload(p, 1).requests() == MixedWorkload(p, 1).requests()
    assert MixedWorkload(p, 1).requests() != MixedWorkload(p, 2).requests()


def test_mixed_open_loop_shape() -> None:
    reqs = MixedWorkload(
        MixedParams(requests=400, long_fraction=0.25, shared_prefix_fraction=0.5)
    ).requests()
    longs = [r for r in reqs if r.request_id.startswith("long")]
    assert 60 < len(longs) < 140
    assert all(r.priority == 1 and r.deadline is None for r in longs)
    assert [r.issue_at for r in reqs] == sorted(r.issue_at for r in reqs)
    shared = [r for r in reqs if r.blocks[0] >= 1 << 41]
    assert 150 < len(shared) < 250


def test_block_tokens_are_deterministic() -> None:
    assert block_tokens(5, 16) == block_tokens(5, 16) != block_tokens(6, 16)
    r = AgentWorkload(AgentParams(programs=1)).start()[0]
    assert len(request_tokens(r)) == r.prompt_tokens
