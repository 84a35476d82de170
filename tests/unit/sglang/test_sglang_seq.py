"""Gap and restart classification of SGLang publisher sequence numbers (no I/O)."""

from __future__ import annotations

import pytest

from thunderagent.sglang.seq import ReplayPlan, SeqTracker, SeqVerdict, plan_replay


@pytest.mark.parametrize(
    ("expected", "seq", "verdict", "missing"),
    [
        (0, 0, SeqVerdict.IN_ORDER, None),
        (5, 5, SeqVerdict.IN_ORDER, None),
        (None, 42, SeqVerdict.IN_ORDER, None),  # no assumption: the first frame is taken
        (0, 3, SeqVerdict.GAP, (0, 3)),  # late subscriber: 0..2 happened before it joined
        (5, 9, SeqVerdict.GAP, (5, 9)),
        (9, 0, SeqVerdict.RESTART, None),  # new publisher counting from 0
        (9, 4, SeqVerdict.RESTART, None),  # ... whose first frames were lost on reconnect
    ],
)
def test_classify(
    expected: int | None, seq: int, verdict: SeqVerdict, missing: tuple[int, int] | None
) -> None:
    tracker = SeqTracker(expected=expected)
    assert tracker.classify(seq) is verdict
    if verdict is not SeqVerdict.RESTART:
        assert tracker.missing_before(seq) == missing


def test_restart_then_gap_from_zero() -> None:
    tracker = SeqTracker(expected=0)
    for seq in range(10):
        assert tracker.classify(seq) is SeqVerdict.IN_ORDER
        tracker.delivered(seq)
    assert tracker.classify(3) is SeqVerdict.RESTART
    tracker.restarted()
    assert tracker.missing_before(3) == (0, 3)
    tracker.delivered(3)
    assert tracker.classify(4) is SeqVerdict.IN_ORDER


@pytest.mark.parametrize(
    ("start", "stop", "replayed", "plan"),
    [
        (0, 3, [0, 1, 2, 3, 4], ReplayPlan(deliver=[0, 1, 2], lost=[])),
        (0, 3, [], ReplayPlan(deliver=[], lost=[(0, 3)])),
        (5, 10, [7, 8, 9, 10], ReplayPlan(deliver=[7, 8, 9], lost=[(5, 7)])),  # buffer rolled
        (5, 10, [5, 9, 5], ReplayPlan(deliver=[5, 9], lost=[(6, 9)])),
        (5, 10, [6, 7], ReplayPlan(deliver=[6, 7], lost=[(5, 6), (8, 10)])),
    ],
)
def test_plan_replay(start: int, stop: int, replayed: list[int], plan: ReplayPlan) -> None:
    assert plan_replay(start, stop, replayed) == plan
