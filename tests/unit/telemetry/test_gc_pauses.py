"""GC pause accounting with a fake clock (exported metrics: integration/test_service_gc.py)."""

from __future__ import annotations

from thunderagent.telemetry.gcpause import GcPauses


def test_pauses_add_up_per_generation_and_the_longest_is_taken_once() -> None:
    now = [0.0]
    pauses = GcPauses(clock=lambda: now[0])
    for generation, start, end in ((0, 1.0, 1.001), (2, 2.0, 2.2), (0, 3.0, 3.004), (2, 4.0, 4.1)):
        now[0] = start
        pauses.on_gc("start", {"generation": generation})
        now[0] = end
        pauses.on_gc("stop", {"generation": generation, "collected": 0, "uncollectable": 0})
    assert [round(s, 6) for s in pauses.total_s] == [0.005, 0.0, 0.3]
    assert [round(s, 6) for s in pauses.take_longest()] == [0.004, 0.0, 0.2]
    assert pauses.take_longest() == [0.0, 0.0, 0.0]
    assert [round(s, 6) for s in pauses.total_s] == [0.005, 0.0, 0.3]
