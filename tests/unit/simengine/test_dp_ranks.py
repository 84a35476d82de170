"""The simulated engine's data-parallel ranks: a request goes to the rank it names (either of
SGLang's spellings) or to the next in turn; a rank the engine does not have is refused, as
SGLang refuses it."""

from __future__ import annotations

import pytest

from thunderagent.simengine.dp_ranks import DpRanks


def test_a_named_rank_is_taken_and_otherwise_the_next_in_turn() -> None:
    engines = [object(), object(), object()]
    ranks = DpRanks(engines)  # type: ignore[arg-type]
    assert ranks.pick({"routed_dp_rank": 2}) is engines[2]
    assert ranks.pick({"data_parallel_rank": 1}) is engines[1]  # the older spelling
    assert ranks.pick({"routed_dp_rank": None, "data_parallel_rank": 0}) is engines[0]
    # named ranks leave the turn where it was
    assert [ranks.pick({}) for _ in range(4)] == [engines[0], engines[1], engines[2], engines[0]]


@pytest.mark.parametrize("rank", [3, -1, True, "1", 1.0])
def test_a_rank_the_engine_does_not_have_is_refused(rank) -> None:
    ranks = DpRanks([object(), object(), object()])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rank"):
        ranks.pick({"routed_dp_rank": rank})


def test_an_engine_has_a_rank() -> None:
    with pytest.raises(ValueError):
        DpRanks([])
