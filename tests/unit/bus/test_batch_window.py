"""When a batch of fire-and-forget messages goes (``bus.batches.BatchWindow``): nothing lost or
reordered, no item waits longer than the window, a full batch goes at once."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from thunderagent.bus.batches import BatchWindow


def drive(window: BatchWindow[int], arrivals: list[tuple[float, int]]):
    """What ``BatchSender`` does: send at once when ``add`` says so (dropping the timer),
    else when the first item's timer fires. Returns [(sent_at, items)]."""
    sent: list[tuple[float, list[int]]] = []
    timer: float | None = None
    for now, item in arrivals:
        if timer is not None and timer <= now:
            sent.append((timer, window.take()))
            timer = None
        due = window.add(item, now)
        if due <= now:
            sent.append((now, window.take()))
            timer = None
        elif timer is None:
            timer = due
    if timer is not None:
        sent.append((timer, window.take()))
    return sent


def test_items_wait_one_window_from_the_first_a_full_batch_goes_at_once():
    w = BatchWindow[int](0.05, max_items=3)
    sent = drive(w, [(1.0, 1), (1.01, 2), (1.2, 3), (1.21, 4), (1.22, 5), (1.23, 6)])
    assert sent == [(1.05, [1, 2]), (1.22, [3, 4, 5]), (1.28, [6])]


@pytest.mark.parametrize("window", [-1.0, math.inf, math.nan])
def test_a_bad_window_is_refused(window):
    with pytest.raises(ValueError, match="window"):
        BatchWindow[int](window)


@given(
    window=st.sampled_from([0.0, 0.01, 0.05]),
    max_items=st.integers(1, 5),
    gaps=st.lists(st.floats(0.0, 0.1, allow_nan=False), max_size=50),
)
def test_nothing_lost_or_reordered_and_no_item_waits_past_the_window(window, max_items, gaps):
    w = BatchWindow[int](window, max_items)
    now, arrivals = 10.0, []
    for i, gap in enumerate(gaps):
        now += gap
        arrivals.append((now, i))
    sent = drive(w, arrivals)
    assert [i for _, items in sent for i in items] == list(range(len(gaps)))
    at = dict((i, t) for t, i in arrivals)
    for t, items in sent:
        assert 0 < len(items) <= max_items
        assert all(at[i] <= t <= at[i] + window + 1e-12 for i in items)
        if len(items) < max_items:  # not full: it waited its first item's whole window
            assert t == pytest.approx(at[items[0]] + window, abs=1e-12)


async def test_a_batch_over_the_payload_limit_goes_in_halves_and_a_lone_oversize_item_is_dropped():
    from thunderagent.bus.batches import BatchSender
    from thunderagent.bus.errors import PayloadTooLarge

    sent: list[list[str]] = []

    async def send(items: list[str]) -> None:
        size = sum(len(i) for i in items)
        if size > 3:  # the bus's check: the encoded batch over the server's max_payload
            raise PayloadTooLarge("subject", size, 3)
        sent.append(items)

    sender = BatchSender[str](send, window_s=10.0, max_items=100, what="items")
    for item in ["a", "b", "c", "d", "e", "fghij", "k"]:
        sender.add(item)
    await sender.close()
    assert [i for batch in sent for i in batch] == ["a", "b", "c", "d", "e", "k"]
    assert all(sum(len(i) for i in batch) <= 3 for batch in sent)
    assert sender.dropped == 1 and sender.sent == len(sent)
