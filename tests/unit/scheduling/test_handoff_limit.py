"""The router's bound on hand-offs waiting for an ack (``HandoffLimit``)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from thunderagent.scheduling.handoff_limit import HandoffLimit


def test_the_bound_refuses_past_it_and_a_release_makes_room() -> None:
    limit = HandoffLimit(initial=2, minimum=1)
    assert limit.acquire() and limit.acquire()
    assert not limit.acquire()
    assert (limit.in_flight, limit.shed) == (2, 1)
    limit.release(0.01, now=1.0)
    assert limit.acquire()


def test_fast_answers_grow_a_bound_in_use_and_only_then() -> None:
    limit = HandoffLimit(initial=4, minimum=1)
    for _ in range(4):
        assert limit.acquire()
    for i in range(4):  # each fast answer while the bound was half used adds one: 4+1 of 4, 3+1
        limit.release(0.005, now=float(i))  # of 5; then 2 of 6 and 1 of 6 are not half
    assert limit.limit == 6.0
    idle = HandoffLimit(initial=8, minimum=1)
    for i in range(50):  # one at a time: the bound is never half used, so it stays
        assert idle.acquire()
        idle.release(0.005, now=float(i))
    assert idle.limit == 8.0


def test_a_slow_answer_cuts_the_bound_to_a_share_of_what_is_in_flight_once_per_window() -> None:
    limit = HandoffLimit(initial=64, minimum=4, slow_s=0.25, backoff=0.5)
    for _ in range(20):
        assert limit.acquire()
    limit.release(1.0, now=10.0)  # 19 left in flight: cut to half of the 20 there were
    assert limit.limit == 10.0
    limit.release(1.0, now=10.1)  # the same backlog's next late answer: no second cut
    assert limit.limit == 10.0
    limit.release(1.0, now=10.3)  # a window later, still slow: half the bound (under the 18)
    assert limit.limit == 5.0
    assert limit.in_flight == 17
    assert not any(limit.acquire() for _ in range(3))  # 17 in flight over a bound of 5
    for i in range(20):
        limit.release(2.0, now=11.0 + i)
    assert limit.limit == 4.0  # never below the minimum
    assert limit.in_flight == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"minimum": 0},
        {"initial": 2, "minimum": 4},
        {"initial": 5000},
        {"slow_s": 0.0},
        {"slow_s": float("nan")},
        {"backoff": 1.0},
        {"backoff": 0.0},
    ],
)
def test_bad_settings_are_refused_with_their_name(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="HandoffLimit"):
        HandoffLimit(**kwargs)


def test_a_refused_request_is_told_when_to_come_back() -> None:
    assert HandoffLimit(slow_s=0.25).retry_after_s() == 1.0
    assert HandoffLimit(slow_s=2.5).retry_after_s() == 3.0


events = st.lists(
    st.one_of(st.just(("acquire", 0.0)), st.tuples(st.just("release"), st.floats(0.0, 3.0))),
    max_size=300,
)


@given(events)
def test_the_books_stay_sound_whatever_comes(steps: list[tuple[str, float]]) -> None:
    limit = HandoffLimit(initial=8, minimum=2, maximum=32)
    held = refused = 0
    now = 0.0
    for kind, answered_in in steps:
        now += 0.05
        if kind == "acquire":
            room = limit.in_flight < int(limit.limit)
            assert limit.acquire() is room
            held += room
            refused += not room
        elif held:
            before = limit.limit
            limit.release(answered_in, now)
            held -= 1
            if answered_in > limit.slow_s:
                assert limit.limit <= before
            else:
                assert limit.limit >= before
        assert limit.in_flight == held
        assert limit.shed == refused
        assert 2.0 <= limit.limit <= 32.0
