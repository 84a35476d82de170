"""The engines' load answers: SGLang 0.5's ``/v1/loads`` and the older ``/get_load`` give the
adapter (and the replay) the same figures for the same engine state; ranks are summed; an
answer that is not a load is refused."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from thunderagent.engine import EngineLoad
from thunderagent.sglang.load import (
    get_load_payload,
    parse_get_load,
    parse_v1_loads,
    v1_load_snapshot,
    v1_loads_max_running,
    v1_loads_payload,
)

counts = st.integers(0, 10**6)
loads = st.builds(EngineLoad, counts, counts, counts, counts, counts, counts, counts)


@given(load=loads, block_size=st.integers(1, 1024))
def test_both_answers_of_one_engine_read_the_same(load: EngineLoad, block_size: int) -> None:
    new = parse_v1_loads(v1_loads_payload(load, block_size), block_size)
    assert new == parse_get_load(get_load_payload(load), block_size)
    assert (new.running, new.queued, new.num_tokens) == (
        load.num_running, load.num_waiting, load.num_tokens,
    )  # fmt: skip


def test_sglang_ranks_are_summed_and_its_token_counts_become_blocks() -> None:
    """What SGLang 0.5.23 answers (its ``LoadSnapshot`` core fields; no block counts)."""
    answer = {
        "timestamp": "2026-12-06T00:00:00+00:00", "version": "0.5.23", "accelerator": "H100",
        "num_accelerators": 1,
        "loads": [
            {"dp_rank": 0, "num_running_reqs": 3, "num_waiting_reqs": 1, "num_used_tokens": 640,
             "max_total_num_tokens": 16_000, "token_usage": 0.04},
            {"dp_rank": 1, "num_running_reqs": 2, "num_waiting_reqs": 0, "num_used_tokens": 320,
             "max_total_num_tokens": 16_000, "token_usage": 0.02},
        ],
    }  # fmt: skip
    figures = parse_v1_loads(answer, block_size=16)
    assert (figures.running, figures.queued, figures.num_tokens) == (5, 1, 960)
    assert (figures.kv_used_blocks, figures.kv_total_blocks) == (60, 2_000)


@pytest.mark.parametrize("answer", [[], {"loads": 3}, {"data": []}, "busy", None])
def test_an_answer_that_is_not_v1_loads_is_refused(answer: object) -> None:
    with pytest.raises(ValueError, match="not a /v1/loads answer"):
        parse_v1_loads(answer, 16)


def test_a_rank_with_a_count_that_is_not_a_number_is_refused() -> None:
    with pytest.raises(ValueError):
        parse_v1_loads({"loads": [{"num_running_reqs": "lots"}]}, 16)


@given(ranks=st.lists(loads, min_size=1, max_size=4), block_size=st.integers(1, 1024))
def test_one_rank_of_an_answer_reads_as_that_rank_alone(ranks: list, block_size: int) -> None:
    """An adapter standing for one data-parallel rank reads its own entry of either answer,
    the same figures as an engine of that one rank; the ranks' figures add up to the whole."""
    v1 = {"loads": [v1_load_snapshot(load, block_size, r) for r, load in enumerate(ranks)]}
    old = [get_load_payload(load, r) for r, load in enumerate(ranks)]
    mine = [parse_v1_loads(v1, block_size, r) for r in range(len(ranks))]
    for rank, load in enumerate(ranks):
        alone = parse_v1_loads(v1_loads_payload(load, block_size), block_size)
        assert mine[rank] == alone == parse_get_load(old, block_size, rank)
    whole = parse_v1_loads(v1, block_size)
    assert whole.running == sum(m.running for m in mine)
    assert whole.num_tokens == sum(m.num_tokens for m in mine)


def test_a_rank_the_answer_does_not_name_is_refused() -> None:
    answer = {"loads": [{"dp_rank": 0, "num_running_reqs": 1, "max_running_requests": 48}]}
    assert v1_loads_max_running(answer, 0) == 48
    with pytest.raises(ValueError, match="DP rank 1"):
        parse_v1_loads(answer, 16, 1)
    with pytest.raises(ValueError, match="DP rank 1"):
        v1_loads_max_running(answer, 1)
    # an entry naming no rank is rank 0's (SGLang's default), as for an older engine
    assert parse_get_load({"num_reqs": 2}, 16, 0).running == 2
