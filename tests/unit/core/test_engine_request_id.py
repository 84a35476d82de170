"""The engine's id for a run: SGLang's /abort_request stops every request whose rid starts with
the one named, so no run's id may begin another's."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from thunderagent.fleet import engine_request_id

ids = st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=12)
offsets = st.integers(0, 10_000)


@given(a=ids, b=ids, i=offsets, j=offsets, m=offsets, n=offsets)
def test_no_runs_id_begins_another(a: str, b: str, i: int, j: int, m: int, n: int) -> None:
    x, y = engine_request_id(a, i, m), engine_request_id(b, j, n)
    assert (x == y) == ((a, i, m) == (b, j, n))
    if x != y:
        assert not y.startswith(x) and not x.startswith(y)


def test_the_ids_that_collided_under_the_old_scheme() -> None:
    """``req-1`` began ``req-10``; a run at output 1 began the one at output 12."""
    assert not engine_request_id("req-10", 0).startswith(engine_request_id("req-1", 0))
    assert not engine_request_id("x", 12).startswith(engine_request_id("x", 1))
    assert not engine_request_id("x", 0, 12).startswith(engine_request_id("x", 0, 1))
    assert engine_request_id("req-1", 0, 3) == "5:req-1#0.3;"


def test_two_runs_of_one_request_at_one_offset_get_two_ids() -> None:
    """A run resumed before it produced anything (same offset) must not reuse the aborted
    run's id: SGLang may still hold it and would refuse the duplicate."""
    from thunderagent.schemas import GenerateRequest, WorkerGenerate
    from thunderagent.worker.generation import Generation

    work = WorkerGenerate(request=GenerateRequest(model="m", request_id="r", token_ids=[1]),
                          reply_subject="_INBOX.x")  # fmt: skip
    first, again = (Generation(work, "w0", None, None, None) for _ in range(2))  # type: ignore[arg-type]
    assert first.engine_rid != again.engine_rid
    assert first.engine_rid.startswith("1:r#0.")
