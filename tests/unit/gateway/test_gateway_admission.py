"""The gateway's permits (``gateway.admission``): at most ``limit`` requests at once, a bounded
and timed wait for more, every permit given back exactly once, also when a waiter goes away."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from thunderagent.gateway.admission import MIN_PERMITS, Admission, default_limit


async def test_past_the_limit_requests_wait_their_turn_and_past_the_queue_are_refused():
    gate = Admission(limit=2, queue_size=1, queue_timeout_s=5.0)
    assert await gate.enter() is None and await gate.enter() is None
    third = asyncio.create_task(gate.enter())
    await asyncio.sleep(0)
    assert gate.waiting == 1 and not third.done()
    refused = await gate.enter()
    assert refused is not None and "limit" in refused
    gate.leave()  # the permit passes to the third
    assert await third is None and gate.held == 2 and gate.waiting == 0
    gate.leave()
    gate.leave()
    assert gate.held == 0


async def test_a_wait_that_runs_out_is_refused_and_frees_its_place():
    gate = Admission(limit=1, queue_size=1, queue_timeout_s=0.05)
    assert await gate.enter() is None
    why = await gate.enter()
    assert why is not None and "within 0.05 s" in why
    for _ in range(3):  # with the permit never given back, gave-up waits do not pile up
        assert await gate.enter() is not None
    assert gate.waiting == 0 and len(gate._waiting) == 0
    gate.leave()
    assert gate.held == 0 and await gate.enter() is None


async def test_a_waiter_that_goes_away_takes_no_permit_with_it():
    gate = Admission(limit=1, queue_size=2, queue_timeout_s=5.0)
    assert await gate.enter() is None
    gone = asyncio.create_task(gate.enter())
    stays = asyncio.create_task(gate.enter())
    await asyncio.sleep(0)
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    gate.leave()  # passes over the cancelled waiter to the one still waiting
    assert await stays is None and gate.held == 1
    gate.leave()
    assert gate.held == 0


def test_no_limit_admits_everyone_and_bad_settings_are_refused():
    gate = Admission(limit=0, queue_size=0, queue_timeout_s=1.0)

    async def enter_many() -> list[object]:  # one loop: a loop per call took 8 s of the suite
        return [await gate.enter() for _ in range(10_000)]

    assert asyncio.run(enter_many()) == [None] * 10_000
    with pytest.raises(ValueError, match="queue_timeout_s"):
        Admission(limit=1, queue_size=0, queue_timeout_s=0.0)
    with pytest.raises(ValueError, match="limit"):
        Admission(limit=-1, queue_size=0, queue_timeout_s=1.0)
    assert default_limit() >= MIN_PERMITS


@settings(max_examples=150, deadline=None)
@given(
    limit=st.integers(1, 3),
    queue=st.integers(0, 3),
    steps=st.lists(st.sampled_from(["enter", "leave", "cancel", "tick"]), max_size=40),
)
def test_permits_never_exceed_the_limit_and_all_come_back(limit, queue, steps):
    """Any sequence of arrivals, ends, departures of waiters and loop turns: never more than
    ``limit`` permits held, never more than ``queue_size`` waiting, and once every holder has
    left, every permit is back."""

    async def drive() -> None:
        gate = Admission(limit, queue, queue_timeout_s=60.0)
        admitted = 0  # requests holding a permit (they leave when told to)
        waiters: list[asyncio.Task] = []
        for step in steps:
            if step == "enter":
                waiters.append(asyncio.create_task(gate.enter()))
            elif step == "leave" and admitted:
                admitted -= 1
                gate.leave()
            elif step == "cancel" and waiters:
                waiters.pop(0).cancel()
            for _ in range(5):  # let a handed permit reach its waiter
                await asyncio.sleep(0)
            for task in [t for t in waiters if t.done()]:
                waiters.remove(task)
                if not task.cancelled() and task.result() is None:
                    admitted += 1
            assert gate.held <= limit and gate.waiting <= queue
            assert gate.held == admitted + sum(
                1 for t in waiters if t.done() and not t.cancelled() and t.result() is None
            )
        for task in waiters:
            task.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        for _ in range(admitted):
            gate.leave()
        assert gate.held == 0

    asyncio.run(drive())
