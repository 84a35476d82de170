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
