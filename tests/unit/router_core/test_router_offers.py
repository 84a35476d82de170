"""A decision does not depend on how soon the worker answers its hand-off: a prompt offered on
the credit path counts as in flight on its worker from the offer, as it does once taken (the
replay hands over at once; live, a burst is decided while the first ack travels)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.router_core.test_router_bookings import BS, core, route

DOC = list(range(10_000, 10_000 + 64 * BS))  # a 64-block document many requests start with


def asking(doc: int, question: int) -> list[int]:
    """A prompt: one of a few documents, then its own question (two blocks)."""
    return DOC[: (16 + 16 * doc) * BS] + [doc * 100 + question] * (2 * BS) + [7]


def decide(burst: list[tuple[int, int]], *, answered_at_once: bool) -> list[str]:
    c = core()
    places = []
    for k, (doc, question) in enumerate(burst):
        rid = f"r{k}"
        first = route(c, rid, asking(doc, question)).decision.worker_id
        c.on_offered(rid, first)
        if answered_at_once:
            c.on_dispatched(rid, first, 1.0)
        places.append(first)
    return places


def test_the_next_decision_sees_a_prompt_offered_a_moment_ago() -> None:
    """Questions on one new document decided before the first ack comes back: each sees the
    document on its way to the worker it was offered to, as it would had the ack come back at
    once (before offers were counted it saw nothing there and the policy priced a full
    prefill everywhere)."""
    c = core()
    first = route(c, "a", asking(3, 0)).decision.worker_id
    c.on_offered("a", first)
    second = route(c, "b", asking(3, 1))
    assert second.expected == {first: 64}
    assert second.query.overlaps == {first: 64}  # what thunder prices


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5)), min_size=1, max_size=12))
def test_decisions_are_the_same_whether_acks_come_at_once_or_after_the_burst(burst) -> None:
    assert decide(burst, answered_at_once=False) == decide(burst, answered_at_once=True)


def test_a_refused_offer_no_longer_counts_as_in_flight() -> None:
    c = core()
    first = route(c, "a", asking(3, 0)).decision.worker_id
    c.on_offered("a", first)
    assert route(c, "b", asking(3, 1)).expected.get(first) == 64
    c.forget("b")
    c.on_offer_refused("a")  # the scheduler will place it; it waits there with no run
    assert route(c, "c", asking(3, 2)).expected == {}
    c.on_offered("c", first)
    c.forget("c")  # dropped, or resent elsewhere: its offer goes with its booking
    assert route(c, "d", asking(3, 3)).expected == {}
