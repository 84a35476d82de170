"""The gateway's OpenAI body parser, fuzzed: whatever a client sends, ``parse_chat`` and
``parse_completion`` either build a request the rest of the stack accepts (it survives the
schema's own decoder, with every ``Meta`` bound checked, as the router will decode it) or refuse
with an ``HttpError`` that names a 4xx status and a message. Any other exception would be a 500
for a client mistake; a request built past a schema bound would be refused one hop later, as an
internal error instead of the client's 400."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from thunderagent.gateway.errors import HttpError
from thunderagent.gateway.protocol import ROLES, parse_chat, parse_completion, request_id_from
from thunderagent.schemas import GenerateRequest

pytestmark = pytest.mark.fuzz

_REQUEST = msgspec.json.Decoder(GenerateRequest)

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=300)
    | st.sampled_from(["", "text", "user", "system", "developer", "tool", "json_object", "m"])
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
ints = st.integers(min_value=-5, max_value=2**40) | st.sampled_from([0, 1, 9, 10, 2**32, 2**63])
floats = st.floats(allow_nan=True, allow_infinity=True)
strings = st.text(max_size=300) | st.sampled_from(["", "a", "x" * 256, "x" * 257])


def _body(required: dict, optional: dict, wild: bool) -> st.SearchStrategy:
    """Well-typed fields with edge values, or (``wild``) any JSON value in any field."""
    if wild:
        required = {k: v | values for k, v in required.items()}
        optional = {k: v | values for k, v in optional.items()}
    return st.fixed_dictionaries(required, optional=optional)


part = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", ""])}, optional={"text": st.text(max_size=20)}
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "developer", "assistant", "tool", "bot", ""])},
    optional={
        "content": st.none() | st.text(max_size=50) | st.lists(part, max_size=3),
        "tool_calls": st.none() | st.lists(values, max_size=1),
    },
)
COMMON = {
    "max_tokens": st.none() | ints,
    "temperature": st.none() | floats,
    "top_p": st.none() | floats,
    "n": st.none() | ints,
    "stream": st.none() | st.booleans(),
    "stream_options": st.none()
    | st.fixed_dictionaries({}, optional={"include_usage": st.none() | st.booleans()}),
    "stop": st.none() | st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=3),
    "ignore_eos": st.none() | st.booleans(),
    "priority": st.none() | ints,
    "program_id": st.none() | strings,
    "session_id": st.none() | strings,
    "session_params": st.none() | st.fixed_dictionaries({}, optional={"id": st.none() | strings}),
    "deadline_ms": st.none() | floats | ints,
    "cache_salt": st.none() | strings,
    "expected_output_tokens": st.none() | ints,
    "nvext": st.none()
    | st.fixed_dictionaries(
        {},
        optional={
            "cache_salt": st.none() | strings,
            "agent_hints": st.none()
            | st.fixed_dictionaries({}, optional={"osl": st.none() | ints}),
        },
    ),
    "unknown_field": values,
}
CHAT = {
    **COMMON,
    "max_completion_tokens": st.none() | ints,
    "logprobs": st.none() | st.booleans(),
    "tools": st.none() | st.lists(values, max_size=1),
    "response_format": st.none()
    | st.fixed_dictionaries({}, optional={"type": st.sampled_from(["text", "json_object"])}),
}
COMPLETION = {
    **COMMON,
    "echo": st.none() | st.booleans(),
    "best_of": st.none() | ints,
    "suffix": st.none() | st.text(max_size=3),
    "logprobs": st.none() | ints,
}
prompt = (
    st.text(max_size=50)
    | st.lists(st.integers(min_value=-2, max_value=2**33) | st.booleans(), max_size=5)
    | st.lists(
        st.lists(st.integers(min_value=0, max_value=9), max_size=3) | st.text(max_size=5),
        max_size=2,
    )
)


good_message = st.fixed_dictionaries(
    {"role": st.sampled_from(sorted(ROLES)), "content": st.text(min_size=1, max_size=50)}
)
REFUSED = {"n", "logprobs", "tools", "response_format", "echo", "best_of", "suffix"}
"""Fields whose mere presence (with most values) is refused: left out of the ``plain`` bodies,
so that those reach the request's construction with their edge values."""


def chat_bodies(mode: str) -> st.SearchStrategy:
    if mode == "plain":
        fields = {k: v for k, v in CHAT.items() if k not in REFUSED}
        return _body({"model": strings, "messages": st.lists(good_message, min_size=1, max_size=3)},
                     fields, False)  # fmt: skip
    return _body(
        {"model": strings, "messages": st.lists(message, max_size=3)}, CHAT, mode == "wild"
    )


def completion_bodies(mode: str) -> st.SearchStrategy:
    if mode == "plain":
        fields = {k: v for k, v in COMPLETION.items() if k not in REFUSED}
        return _body({"model": strings, "prompt": prompt}, fields, False)
    return _body({"model": strings, "prompt": prompt}, COMPLETION, mode == "wild")


headers = st.dictionaries(
    st.sampled_from(
        [
            "x-priority",
            "x-session-id",
            "x-dynamo-session-id",
            "x-deadline-ms",
            "x-timeout-ms",
            "x-tenant-id",
            "x-request-id",
            "content-type",
        ]
    ),
    st.text(max_size=300) | st.sampled_from(["1", "-1", "10", "nan", "inf", "1e400", "0", "5.5"]),
    max_size=4,
)


def _check(parse, body: object, hdrs: dict[str, str]) -> None:
    raw = json.dumps(body).encode()
    try:
        parsed = parse(raw, hdrs, request_id="r-1", now_ms=1.7e12)
    except HttpError as err:
        assert 400 <= err.status < 500, err
        assert err.message
        return
    request = _REQUEST.decode(msgspec.json.encode(parsed.request))  # every bound checked
    assert request.model and request.max_tokens > 0


@pytest.mark.parametrize("mode", ["plain", "typed", "wild"])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_chat_body_is_a_valid_request_or_a_4xx(mode, data) -> None:
    _check(parse_chat, data.draw(chat_bodies(mode)), data.draw(headers))


@pytest.mark.parametrize("mode", ["plain", "typed", "wild"])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_completion_body_is_a_valid_request_or_a_4xx(mode, data) -> None:
    _check(parse_completion, data.draw(completion_bodies(mode)), data.draw(headers))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_are_a_request_or_a_4xx(raw) -> None:
    for parse in (parse_chat, parse_completion):
        try:
            parsed = parse(raw, {}, request_id="r-1", now_ms=1.7e12)
        except HttpError as err:
            assert 400 <= err.status < 500, err
            continue
        _REQUEST.decode(msgspec.json.encode(parsed.request))


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300) | st.sampled_from(["", " ", "a b", "x" * 256, "x" * 257, "é"]))
def test_any_request_id_header_is_kept_or_a_4xx(given_id) -> None:
    try:
        rid = request_id_from({"x-request-id": given_id})
    except HttpError as err:
        assert err.status == 400 and "x-request-id" in err.message
        return
    assert rid == given_id or (given_id == "" and len(rid) == 32)
    assert 1 <= len(rid) <= 256 and rid.isascii() and " " not in rid
