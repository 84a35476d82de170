"""The hand-offs a worker must not run (pure, injected clock): an offer that ran is known as
run, one voided (by an abort or a later offer) is known as voided, each for ``keep_s`` and at
most ``limit`` of them; names from one sender never repeat, nor across its restarts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from thunderagent.fleet import HandledOffers, OfferIds


def test_an_offer_is_known_as_run_or_voided_until_it_is_forgotten() -> None:
    book = HandledOffers(keep_s=10.0)
    assert book.outcome("a", 0.0) is None
    book.ran(0.0, "a")
    book.void(1.0, "b", "c")
    assert (book.outcome("a", 5.0), book.outcome("b", 5.0), book.outcome("c", 5.0)) == (
        True, False, False,
    )  # fmt: skip
    assert book.outcome("a", 9.99) is True and book.outcome("a", 10.0) is None
    assert book.outcome("b", 10.99) is False and book.outcome("b", 11.0) is None


def test_voiding_an_offer_that_ran_keeps_it_known_as_run() -> None:
    """The scheduler voids offers left unanswered; one of them may have run here meanwhile,
    and a resend of it must still be answered as taken."""
    book = HandledOffers()
    book.ran(0.0, "a")
    book.void(1.0, "a")
    assert book.outcome("a", 2.0) is True


def test_unnamed_offers_are_never_tracked() -> None:
    book = HandledOffers()
    book.ran(0.0, "")
    book.void(0.0, "", "")
    assert len(book) == 0 and book.outcome("", 0.0) is None


def test_past_the_limit_the_oldest_are_forgotten_first() -> None:
    book = HandledOffers(keep_s=100.0, limit=3)
    for i, name in enumerate("abcd"):
        book.void(float(i), name)
    assert len(book) == 3
    assert book.outcome("a", 4.0) is None
    assert all(book.outcome(n, 4.0) is False for n in "bcd")
    book.ran(5.0, "b")  # put again: it is the youngest now, so "c" goes next
    book.void(6.0, "e")
    assert book.outcome("c", 6.0) is None and book.outcome("b", 6.0) is True


def test_expired_offers_are_dropped_as_new_ones_come() -> None:
    book = HandledOffers(keep_s=1.0)
    book.void(0.0, "a", "b")
    book.void(5.0, "c")
    assert len(book) == 1


@pytest.mark.parametrize(("keep_s", "limit"), [(0.0, 1), (-1.0, 1), (1.0, 0)])
def test_bad_settings_are_refused_by_name(keep_s: float, limit: int) -> None:
    with pytest.raises(ValueError, match="keep_s" if keep_s <= 0 else "limit"):
        HandledOffers(keep_s=keep_s, limit=limit)


def test_offer_names_do_not_repeat_within_a_sender_or_across_senders() -> None:
    one, other = OfferIds(), OfferIds()
    names = [one.next() for _ in range(1000)] + [other.next() for _ in range(1000)]
    assert len(set(names)) == 2000
    assert one.prefix != other.prefix  # a restarted sender starts from a new prefix
    assert OfferIds("r1").next() == "r1-0"
    assert all(len(n) <= 64 for n in names)  # the schema's bound on a name


_ops = st.lists(
    st.tuples(
        st.sampled_from(["ran", "void"]),
        st.sampled_from("abcdef"),
        st.floats(min_value=0.0, max_value=3.0, allow_nan=False),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(_ops, st.integers(min_value=1, max_value=6), st.floats(min_value=0.5, max_value=5.0))
def test_the_book_agrees_with_a_plain_model(ops, limit: int, keep_s: float) -> None:
    """Against the obvious model: the latest record of each name, the youngest ``limit`` of
    them, each forgotten ``keep_s`` after it was recorded."""
    book = HandledOffers(keep_s=keep_s, limit=limit)
    model: dict[str, tuple[float, bool]] = {}
    now = 0.0
    for op, name, step in ops:
        now += step
        known = model.get(name)
        alive = known is not None and now - known[0] < keep_s
        ran = op == "ran" or (alive and known[1])
        if op == "ran":
            book.ran(now, name)
        else:
            book.void(now, name)
        model.pop(name, None)
        model[name] = (now, ran)
        model = {n: v for n, v in model.items() if now - v[0] < keep_s}
        model = dict(list(model.items())[-limit:])
        for n in "abcdef":
            expect = model[n][1] if n in model else None
            assert book.outcome(n, now) is expect, (n, now, model)
        assert len(book) == len(model)
