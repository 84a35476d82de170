"""The message contract: round trips, validation, subject escaping, committed JSON Schemas."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from thunderagent.schemas import (
    REPLY_DECODER,
    AllCleared,
    BlocksRemoved,
    BlocksStored,
    Candidate,
    ChatMessage,
    ErrorCode,
    ErrorReply,
    FinalReply,
    GenerateRequest,
    KvEventBatch,
    KvExportOffer,
    KvTransfer,
    LoadReport,
    Preempted,
    RouteDecision,
    RunFailed,
    ScheduleRequest,
    TokenChunk,
    Usage,
    WorkerRegistration,
    is_valid_worker_id,
    subjects,
)
from thunderagent.schemas.catalog import JSON_DIR, MESSAGES, json_schema

EXAMPLES = [
    GenerateRequest(model="m", token_ids=[1, 2, 3], max_tokens=4, priority=2, program_id="p"),
    GenerateRequest(model="m", messages=[ChatMessage(role="user", content="hi")]),
    TokenChunk(request_id="r", index=3, token_ids=[9], text="x"),
    FinalReply(
        request_id="r",
        worker_id="w0",
        usage=Usage(prompt_tokens=10, cached_tokens=8, completion_tokens=2),
        ttft_ms=1.5,
        e2e_ms=3.0,
    ),
    ErrorReply(code=ErrorCode.UNKNOWN_MODEL, message="nope"),
    KvEventBatch(
        worker_id="w0",
        seq=7,
        ts=1.0,
        epoch=3,
        events=[
            BlocksStored(hashes=[1, 2], check_hashes=[3, 4], parent_hash=None),
            BlocksRemoved(hashes=[2]),
            AllCleared(),
        ],
    ),
    WorkerRegistration(
        worker_id="w0",
        model="m",
        engine_url="http://e",
        block_size=16,
        kv_capacity_blocks=100,
        lease_s=10,
        registered_at=1.0,
    ),
    LoadReport(worker_id="w0", ts=1.0, running=1, queued=2, kv_used_blocks=3, kv_total_blocks=4),
]


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(message):
    data = msgspec.json.encode(message)
    assert msgspec.json.decode(data, type=type(message)) == message


@pytest.mark.parametrize("message", EXAMPLES[2:5], ids=lambda m: type(m).__name__)
def test_replies_decode_through_the_tagged_union(message):
    assert REPLY_DECODER.decode(msgspec.json.encode(message)) == message


@pytest.mark.parametrize(
    ("payload", "fragment"),
    [
        ({"model": "m"}, "exactly one of"),
        ({"model": "m", "text": "a", "token_ids": [1]}, "exactly one of"),
        ({"model": "m", "token_ids": []}, "empty"),
        ({"model": "m", "text": "a", "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "token_ids": [-1]}, "token_ids"),
        ({"model": "m", "text": "a", "priority": 10}, "priority"),
        ({"model": "", "text": "a"}, "model"),
    ],
)
def test_invalid_requests_are_rejected_with_the_reason(payload, fragment):
    with pytest.raises(msgspec.ValidationError, match=fragment):
        msgspec.json.decode(msgspec.json.encode(payload), type=GenerateRequest)


@pytest.mark.parametrize(
    "event",
    [
        {"type": "stored", "hashes": [-1], "check_hashes": [1]},
        {"type": "stored", "hashes": [1], "check_hashes": [-3]},
        {"type": "stored", "hashes": [1], "check_hashes": [1], "parent_hash": -(2**63)},
        {"type": "removed", "hashes": [3, -5]},
    ],
)
def test_kv_events_take_unsigned_64_bit_hashes_only(event):
    """The index keeps hashes in uint64 arrays: a signed or wider one is refused at decode."""
    batch = {"worker_id": "w", "seq": 0, "ts": 0.0, "events": [event]}
    with pytest.raises(msgspec.ValidationError, match="unsigned 64-bit"):
        msgspec.msgpack.decode(msgspec.msgpack.encode(batch), type=KvEventBatch)


@pytest.mark.parametrize(("primary", "check"), [([], [1, 2]), ([1, 2], [1]), ([1], [])])
def test_a_stored_event_needs_one_check_hash_per_block(primary, check):
    """Found by the subject fuzz (seed 6): 0 hashes with 2 check hashes decoded, and every
    index fed from the stream raised on it; it is now refused at decode, with the counts."""
    event = {"type": "stored", "hashes": primary, "check_hashes": check}
    batch = {"worker_id": "w", "seq": 0, "ts": 0.0, "events": [event]}
    with pytest.raises(msgspec.ValidationError, match="one check hash per block"):
        msgspec.msgpack.decode(msgspec.msgpack.encode(batch), type=KvEventBatch)


@pytest.mark.parametrize(
    ("message", "payload"),
    [
        (KvTransfer, {"request_id": "r", "token_ids": [1, 2**32], "source_worker": "w"}),
        (RunFailed, {"request_id": "r", "worker_id": "w", "output_token_ids": [-1]}),
        (Preempted, {"request_id": "r", "found": True, "output_token_ids": [2**40]}),
        (KvExportOffer, {"migration_id": "m", "worker_id": "w", "blocks": 1, "token_ids": [-2]}),
    ],
    ids=lambda x: x.__name__ if isinstance(x, type) else "",
)
def test_token_ids_an_engine_will_see_fit_uint32(message, payload):
    """Token ids that reach an engine (a continuation, a KV import, a warm-up) are refused at
    decode when no vocabulary could hold them: a fuzzed one once crashed an adapter's tap."""
    with pytest.raises(msgspec.ValidationError, match="token_ids"):
        msgspec.json.decode(msgspec.json.encode(payload), type=message)


@given(st.text(min_size=1, max_size=40))
def test_model_token_is_one_subject_token_and_round_trips(model):
    token = subjects.model_token(model)
    assert not set(token) & set(".*> \t\r\n")
    assert subjects.model_from_token(token) == model


def test_model_names_with_dots_stay_in_one_token():
    subject = subjects.requests("meta-llama/Llama-3.1-8B")
    assert subject == "thunderagent.requests.meta-llama/Llama-3%2E1-8B"
    assert len(subject.split(".")) == 3


@pytest.mark.parametrize(
    ("worker_id", "ok"),
    [("w0", True), ("gpu-node_3", True), ("a.b", False), ("a b", False), ("", False)],
)
def test_worker_ids_must_be_subject_safe(worker_id, ok):
    assert is_valid_worker_id(worker_id) is ok


@pytest.mark.parametrize("name", sorted(MESSAGES))
def test_committed_json_schema_is_current(name):
    path = JSON_DIR / f"{name}.json"
    assert path.exists(), f"{path} missing: run `thunderagent schemas`"
    assert path.read_text() == json_schema(name), f"{path} is stale: run `thunderagent schemas`"


def test_no_stray_schema_files():
    assert {p.stem for p in JSON_DIR.glob("*.json")} == set(MESSAGES)


def test_every_message_field_has_a_docstring():
    import ast
    import inspect

    missing = []
    for name, msg_type in MESSAGES.items():
        if not isinstance(msg_type, type):
            continue
        source = inspect.getsource(msg_type)
        body = ast.parse(source).body[0].body
        for i, node in enumerate(body):
            if isinstance(node, ast.AnnAssign):
                nxt = body[i + 1] if i + 1 < len(body) else None
                documented = isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                if not documented:
                    missing.append(f"{name}.{node.target.id}")
    assert not missing, f"fields without a docstring: {missing}"


def test_committed_message_reference_is_current():
    from thunderagent.schemas.reference import DOC_PATH, markdown_reference

    assert DOC_PATH.exists(), f"{DOC_PATH} missing: run `thunderagent schemas`"
    assert DOC_PATH.read_text() == markdown_reference(), "docs/messages.md is stale"


def test_a_scheduled_request_carries_token_ids():
    """Submissions and direct-dispatch notices are refused at decode when their request is text:
    the scheduler continues a preempted or failed run from its token ids (a fuzzed notice of text
    was once booked and its continuation raised)."""
    decision = RouteDecision(request_id="r", model="m", worker_id="w0", overlap_blocks=0,
                             prompt_blocks=0, candidates=[Candidate(worker_id="w0", score=1.0)],
                             policy="thunder", decided_at=0.0)  # fmt: skip
    ok = ScheduleRequest(request=GenerateRequest(request_id="r", model="m", token_ids=[1]),
                         reply_subject="_INBOX.r", decision=decision)  # fmt: skip
    payload = msgspec.to_builtins(ok)
    assert msgspec.json.decode(msgspec.json.encode(payload), type=ScheduleRequest) == ok
    del payload["request"]["token_ids"]
    payload["request"]["text"] = "hello"
    with pytest.raises(msgspec.ValidationError, match="carries token ids"):
        msgspec.json.decode(msgspec.json.encode(payload), type=ScheduleRequest)
