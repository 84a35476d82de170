"""The simulated engine's stop strings: where its fixed output text meets one."""

from __future__ import annotations

import time

from hypothesis import given
from hypothesis import strategies as st

from thunderagent.simengine.driver import first_stop, output_token


def _naive(stops: list[str], max_new_tokens: int) -> tuple[int, str] | None:
    """The whole output, then the earliest end of any stop string in it."""
    text = bytes(output_token(i) - 4 for i in range(max_new_tokens)).decode("latin-1")
    hits = [(at, s) for s in stops if s and (at := text.find(s)) >= 0]
    return min(hits, key=lambda hit: hit[0] + len(hit[1])) if hits else None


_TEXT = bytes(output_token(i) - 4 for i in range(600)).decode("latin-1")
# pieces of the output (found, wherever they start) and arbitrary strings (mostly not)
_STOPS = st.one_of(
    st.tuples(st.integers(0, 400), st.integers(0, 150)).map(lambda p: _TEXT[p[0] : p[0] + p[1]]),
    st.text(max_size=8),
)


@given(st.lists(_STOPS, max_size=4), st.integers(1, 500))
def test_the_answer_is_the_one_the_whole_output_gives(stops: list[str], max_new: int) -> None:
    assert first_stop(stops, max_new) == _naive(stops, max_new)


def test_a_huge_max_new_tokens_costs_one_period_of_text() -> None:
    """A request asking for 10^12 tokens is refused later by the context-length check; before
    that, finding its stop string must not build 10^12 bytes of text."""
    started = time.perf_counter()
    assert first_stop([], 10**12) is None
    assert first_stop(["never in the output"], 10**12) is None
    at, s = first_stop(["KV cache", "worker"], 10**12)  # type: ignore[misc]
    assert s == "KV cache" and _TEXT[at : at + len(s)] == s
    # microseconds now; the old code would build the text for hours: no noisy-machine flake
    assert time.perf_counter() - started < 10.0
