"""The engine's id for a run: SGLang's /abort_request stops every request whose rid starts with
the one named, so no run's id may begin another's."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from thunderagent.fleet import engine_request_id

ids = st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=12)
offsets = st.integers(0, 10_000)


@given(a=ids, b=ids, i=offsets, j=offsets)
def test_no_runs_id_begins_another(a: str, b: str, i: int, j: int) -> None:
    x, y = engine_request_id(a, i), engine_request_id(b, j)
    assert (x == y) == ((a, i) == (b, j))
    if x != y:
        assert not y.startswith(x) and not x.startswith(y)


def test_the_ids_that_collided_under_the_old_scheme() -> None:
    """``req-1`` began ``req-10``; a run at output 1 began the one at output 12."""
    assert not engine_request_id("req-10", 0).startswith(engine_request_id("req-1", 0))
    assert not engine_request_id("x", 12).startswith(engine_request_id("x", 1))
    assert engine_request_id("req-1", 0) == "5:req-1#0;"
