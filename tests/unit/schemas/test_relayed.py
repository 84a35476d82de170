"""Relayed hand-offs: the prompt's ids kept as the JSON array they came in, the wire unchanged."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from thunderagent.fleet.runs import continuation
from thunderagent.schemas import (
    DirectDispatch,
    GenerateRequest,
    RouteDecision,
    ScheduleRequest,
    relayed,
)

ids_lists = st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=300)


def _request(ids: list[int], **fields: object) -> GenerateRequest:
    return GenerateRequest(model="m", request_id="r1", token_ids=ids, **fields)  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(ids=ids_lists, max_tokens=st.integers(1, 4096), salt=st.none() | st.text(max_size=8))
def test_a_relayed_request_reads_and_writes_the_same_bytes(
    ids: list[int], max_tokens: int, salt: str | None
) -> None:
    plain = _request(ids, max_tokens=max_tokens, cache_salt=salt)
    wire = msgspec.json.encode(plain)
    got = msgspec.json.decode(wire, type=relayed.GenerateRequest)
    assert got.prompt_len() == len(ids)
    assert msgspec.json.encode(got) == wire
    assert msgspec.json.decode(msgspec.json.encode(got), type=GenerateRequest) == plain
    assert msgspec.json.encode(relayed.GenerateRequest.of(plain)) == wire


@settings(max_examples=200, deadline=None)
@given(
    ids=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=2_000),
    output=st.lists(st.integers(0, 2**32 - 1), max_size=50),
    more=st.lists(st.integers(0, 2**32 - 1), max_size=20),
)
def test_a_continuation_of_a_relayed_request_is_the_plain_ones(
    ids: list[int], output: list[int], more: list[int]
) -> None:
    plain = _request(ids, max_tokens=100)
    got = continuation(relayed.GenerateRequest.of(plain), output)
    want = continuation(plain, output)
    assert isinstance(got, relayed.GenerateRequest)
    assert got.prompt_len() == len(ids) + len(output)
    assert msgspec.json.encode(got) == msgspec.json.encode(want)
    # continuations compose, and a spliced prompt decodes as the ids it holds
    again = continuation(got, more)
    assert msgspec.json.encode(again) == msgspec.json.encode(continuation(want, more))
    assert msgspec.json.decode(msgspec.json.encode(again), type=GenerateRequest).token_ids == [
        *ids, *output, *more
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("array", "count"),
    [
        (b"[7]", 1),
        (b"[1, 2,3 ]", 3),
        (b"[\n 10,\n 20\n]", 2),
        (b"[ 4294967295 ]", 1),
        (b"[" + b", ".join(b"%d" % (i * 7919) for i in range(5000)) + b"]", 5000),  # numpy's
    ],
)
def test_a_spaced_array_from_a_client_is_counted_by_its_items(array: bytes, count: int) -> None:
    body = b'{"model":"m","token_ids":' + array + b"}"
    got = msgspec.json.decode(body, type=relayed.GenerateRequest)
    assert got.prompt_len() == count
    spliced = msgspec.json.decode(msgspec.json.encode(got.extended([1, 2])), type=GenerateRequest)
    assert len(spliced.token_ids or []) == count + 2


odd_items = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 2**32 - 1, 2**32, -1, -0.0, 1.5, 1e3, 2.0]),
    st.text(max_size=3),
    st.booleans(),
    st.none(),
    st.lists(st.integers(0, 9), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=1),
)


@settings(max_examples=400, deadline=None)
@given(
    head=st.lists(st.integers(0, 2**32 - 1), max_size=5),
    odd=st.lists(odd_items, max_size=3),
    padding=st.sampled_from([0, 2_000]),  # 2,000 ids: past the short arrays' scan
    where=st.integers(0, 2_000),
)
def test_a_relayed_request_takes_exactly_arrays_of_non_negative_integers(
    head: list[int], odd: list[object], padding: int, where: int
) -> None:
    items: list[object] = [*head, *range(100_000, 100_000 + padding)]
    position = min(where, len(items))
    items[position:position] = odd
    body = msgspec.json.encode({"model": "m", "token_ids": items})
    values = json.loads(body)["token_ids"]
    integers = bool(values) and all(type(v) is int and v >= 0 for v in values)
    try:
        got = msgspec.json.decode(body, type=relayed.GenerateRequest)
    except msgspec.ValidationError:
        assert not integers
    else:
        assert integers
        assert got.prompt_len() == len(values)


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b'{"model":"m","text":"hi"}', "carries token ids"),
        (b'{"model":"m","messages":[{"role":"user","content":"hi"}]}', "carries token ids"),
        (b'{"model":"m","token_ids":[1],"text":"hi"}', "carries token ids"),
        (b'{"model":"m","token_ids":[]}', "the prompt is empty"),
        (b'{"model":"m","token_ids":[ ]}', "the prompt is empty"),
        (b'{"model":"m","token_ids":null}', "not an array"),
        (b'{"model":"m","token_ids":"1,2"}', "not an array"),
        (b'{"model":"m","token_ids":[1,-2]}', "not an array"),
        (b'{"model":"m","token_ids":[1,[2]]}', "not an array"),
        (b'{"model":"m","token_ids":[1e3]}', "not an array"),
    ],
)
def test_a_relayed_request_refuses_what_the_router_never_sends(body: bytes, reason: str) -> None:
    with pytest.raises(msgspec.ValidationError) as err:
        msgspec.json.decode(body, type=relayed.GenerateRequest)
    assert reason in str(err.value)


def test_broken_json_in_the_ids_is_refused_by_the_decoder() -> None:
    with pytest.raises(msgspec.DecodeError):
        msgspec.json.decode(b'{"model":"m","token_ids":[1,,2]}', type=relayed.GenerateRequest)


def test_the_schedulers_messages_decode_relayed_and_encode_byte_for_byte() -> None:
    request = _request([5, 6, 70000], max_tokens=9)
    decision = RouteDecision(
        request_id="r1", model="m", worker_id="w0", overlap_blocks=0, prompt_blocks=0,
        candidates=[], policy="thunder", decided_at=0.0,
    )  # fmt: skip
    submit = ScheduleRequest(request=request, reply_subject="_INBOX.a", decision=decision)
    direct = DirectDispatch(submit=submit, worker_id="w0")
    got_submit = msgspec.json.decode(msgspec.json.encode(submit), type=relayed.ScheduleRequest)
    got_direct = msgspec.json.decode(msgspec.json.encode(direct), type=relayed.DirectDispatch)
    assert msgspec.json.encode(got_submit) == msgspec.json.encode(submit)
    assert msgspec.json.encode(got_direct) == msgspec.json.encode(direct)
    assert isinstance(got_direct.submit.request, relayed.GenerateRequest)
    assert got_direct.submit.request.prompt_len() == 3
