"""The bus refuses a subject NATS would close the connection over, before sending it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from thunderagent.bus.errors import MAX_SUBJECT_BYTES, BadSubject, check_subject


@pytest.mark.parametrize(
    "subject",
    [
        "thunderagent.worker.w0.generate",
        "_INBOX.Vx1rZJ8uGmS3k2Dm5zGh2Q.17",
        "a" * MAX_SUBJECT_BYTES,
    ],
)
def test_a_subject_nats_takes_passes(subject: str) -> None:
    check_subject(subject)


@pytest.mark.parametrize(
    "subject",
    [
        "",
        "thunderagent.worker.w 0.generate",
        "thunderagent.requests.m\t",
        "_INBOX.x\r\nPUB evil 0",  # a second protocol line smuggled into the first
        "thunderagent.worker.w\u00a00",  # no-break space
        "thunderagent.worker.w\u20280",  # line separator
        "a" * (MAX_SUBJECT_BYTES + 1),
        "é" * (MAX_SUBJECT_BYTES // 2 + 1),  # two bytes each in UTF-8
    ],
)
def test_a_subject_nats_would_refuse_is_refused(subject: str) -> None:
    with pytest.raises(BadSubject):
        check_subject(subject)


@given(st.text(min_size=1, max_size=40))
def test_white_space_is_what_python_calls_white_space(subject: str) -> None:
    refused = any(ch.isspace() for ch in subject)
    try:
        check_subject(subject)
    except BadSubject:
        assert refused
    else:
        assert not refused


def test_every_white_space_character_is_refused() -> None:
    spaces = [chr(c) for c in range(0x110000) if chr(c).isspace()]
    assert len(spaces) > 20  # ASCII and Unicode spaces, line and paragraph separators
    for ch in spaces:
        with pytest.raises(BadSubject):
            check_subject(f"a{ch}b")
