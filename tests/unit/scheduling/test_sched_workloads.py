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
