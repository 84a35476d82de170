"""Closed-loop agent programs through the replay: every step runs, each after the one before,
and every program is released at its end."""

import itertools
from dataclasses import replace
from typing import ClassVar

import pytest

from thunderagent.engine import get_profile
from thunderagent.replay import SCHEDULERS, ReplayConfig
from thunderagent.replay.workload_driver import run_programs
from thunderagent.scheduling import ThunderScheduler
from thunderagent.scheduling.params import SchedParams
from thunderagent.workloads import AgentParams, AgentWorkload

PROFILE = get_profile("llama-3.1-8b-h100")
PARAMS = AgentParams(
    programs=6,
    steps_range=(2, 4),
    start_gap_s=0.1,
    system_blocks=8,
    task_blocks_range=(4, 8),
    output_tokens_range=(16, 64),
    observation_blocks_range=(2, 8),
    tool_pause_median_s=0.5,
)


class _Spy(ThunderScheduler):
    released: ClassVar[list[str]] = []

    def release_program(self, program_id: str, now: float = 0.0) -> None:
        _Spy.released.append(program_id)
        super().release_program(program_id, now)


@pytest.mark.parametrize("programs_on", [True, False])
def test_every_step_of_every_program_completes_in_order(monkeypatch, programs_on: bool) -> None:
    _Spy.released = []
    monkeypatch.setitem(
        SCHEDULERS._factories, "spy", lambda: _Spy(SchedParams(programs=programs_on), name="spy")
    )
    expected = AgentWorkload(PARAMS, seed=4)
    steps = {r.program_id: r for r in expected.start()}  # first steps; counts come from rng
    cfg = ReplayConfig(profile=PROFILE, policy="thunder", workers=2, scheduler="spy")
    result = run_programs(cfg, AgentWorkload(PARAMS, seed=4))
    recs = result.records
    assert all(r.status == "completed" for r in recs)
    by_prog: dict[str, list] = {}
    for r in recs:
        by_prog.setdefault(r.request_id.rsplit("-s", 1)[0], []).append(r)
    assert sorted(by_prog) == sorted(steps)
    for _prog, runs in by_prog.items():
        runs.sort(key=lambda r: int(r.request_id.rsplit("-s", 1)[1]))
        assert [int(r.request_id.rsplit("-s", 1)[1]) for r in runs] == list(range(len(runs)))
        assert PARAMS.steps_range[0] <= len(runs) <= PARAMS.steps_range[1]
        for prev, nxt in itertools.pairwise(runs):
            assert nxt.arrival > prev.finish  # closed loop: issued after a tool pause
            assert nxt.prompt_tokens > prev.prompt_tokens  # the context grows
            if programs_on:  # sticky placement: the previous prompt is a hit
                assert nxt.cached_tokens >= prev.prompt_tokens // 16 * 16 - 16
    assert sorted(_Spy.released) == sorted(steps)


def test_same_seed_same_program_run() -> None:
    cfg = ReplayConfig(profile=PROFILE, policy="thunder", workers=2, scheduler="programs")
    a = run_programs(cfg, AgentWorkload(PARAMS, seed=1)).records
    b = run_programs(replace(cfg), AgentWorkload(PARAMS, seed=1)).records
    assert [(r.request_id, r.finish) for r in a] == [(r.request_id, r.finish) for r in b]
