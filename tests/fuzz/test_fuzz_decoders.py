"""The decoders of every subscribed message type (and of SGLang's KV-event wire format, which the
adapter reads from the engine) fail only with the errors the bus catches, whatever the bytes:
the bus turns exactly those into an ErrorReply and a dead letter, so any other exception type
(an OverflowError, a UnicodeError, a ValueError from ``__post_init__`` that escaped msgspec)
would escape its net. Found here: JSON nested 20,000 deep makes msgspec raise RecursionError,
which the bus did not catch (now it does: ``DECODE_ERRORS``)."""

from __future__ import annotations

import json
import random

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fuzz.payloads import Shaper
from thunderagent.bus.bus import decoder_for
from thunderagent.bus.errors import DECODE_ERRORS
from thunderagent.schemas import (
    AbortRequest,
    CancelRequest,
    CreditGrant,
    DirectDispatch,
    Dispatched,
    DrainNotice,
    Dropped,
    GenerateRequest,
    KvEventBatch,
    KvExportRequest,
    KvPullRequest,
    KvRelease,
    KvTransfer,
    LoadReport,
    MigrationOrder,
    ProgramRelease,
    ProgressBatch,
    ResyncRequest,
    RouteDecision,
    RouteDecisionBatch,
    RouterHello,
    RunFailed,
    ScheduleRequest,
    WorkerGenerate,
    WorkerRegistration,
    relayed,
)
from thunderagent.sglang import kv_wire

pytestmark = pytest.mark.fuzz

TYPES = [
    GenerateRequest, ScheduleRequest, CancelRequest, ProgramRelease, ProgressBatch, Dispatched,
    Dropped, WorkerGenerate, AbortRequest, KvTransfer, ResyncRequest, KvExportRequest,
    KvPullRequest, KvRelease, LoadReport, KvEventBatch, RouteDecision, RouteDecisionBatch,
    MigrationOrder, DrainNotice,
    WorkerRegistration, DirectDispatch, RouterHello, CreditGrant, RunFailed,
    relayed.ScheduleRequest, relayed.DirectDispatch,
]  # fmt: skip
WIRE = {relayed.ScheduleRequest: ScheduleRequest, relayed.DirectDispatch: DirectDispatch}
"""The wire type a relayed decoder reads (the shape its fuzzed messages take)."""
EXPECTED = DECODE_ERRORS
"""Exactly what the bus (and the JetStream consumer, and the fleet watcher) catch."""

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner, max_size=5),
    max_leaves=30,
)


def _type_id(message_type) -> str:
    relayed_form = message_type.__module__ == relayed.__name__
    return f"relayed.{message_type.__name__}" if relayed_form else message_type.__name__


def _field_names(message_type) -> list[str]:
    return [f.encode_name for f in msgspec.inspect.type_info(message_type).fields]


def _decode_or_refuse(message_type, data: bytes) -> None:
    try:
        decoder_for(message_type).decode(data)
    except EXPECTED:
        pass


@pytest.mark.parametrize("message_type", TYPES, ids=_type_id)
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=512))
def test_random_bytes(message_type, data):
    _decode_or_refuse(message_type, data)


@pytest.mark.parametrize("message_type", TYPES, ids=_type_id)
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_objects_with_the_fields_and_any_values(message_type, data):
    names = _field_names(message_type)
    fields = data.draw(st.dictionaries(st.sampled_from(names), json_values, max_size=len(names)))
    raw = json.dumps(fields, allow_nan=True).encode()  # Infinity / NaN tokens too
    _decode_or_refuse(message_type, raw)


@pytest.mark.parametrize("message_type", TYPES, ids=_type_id)
def test_schema_shaped_extremes(message_type):
    shaper = Shaper(random.Random(message_type.__name__), big=2_000)
    for _ in range(100):
        _decode_or_refuse(message_type, shaper.message(WIRE.get(message_type, message_type)))


@settings(max_examples=500, deadline=None)
@given(data=st.binary(max_size=512))
def test_sglang_kv_wire_bytes(data):
    try:
        kv_wire.decode_batch(data)
    except EXPECTED:
        pass


block_events = (
    st.builds(
        kv_wire.BlockStored,
        block_hashes=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=4),
        parent_block_hash=st.none() | st.integers(-(2**63), 2**63 - 1),
        token_ids=st.lists(st.integers(-(2**64), 2**65), max_size=40),
        block_size=st.sampled_from((0, 1, 4, 16)),
        lora_id=st.none(),
        medium=st.none() | st.sampled_from(("GPU", "CPU_PINNED", "DISK", "bogus")),
        cache_salt=st.none() | st.text(max_size=8),
    )
    | st.builds(
        kv_wire.BlockRemoved,
        block_hashes=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=4),
        medium=st.none() | st.sampled_from(("GPU", "CPU_PINNED", "bogus")),
    )
    | st.just(kv_wire.AllBlocksCleared())
)


@settings(max_examples=300, deadline=None)
@given(batches=st.lists(st.lists(block_events, max_size=6), max_size=6))
def test_the_adapter_mirror_survives_any_engine_events(batches):
    """Whatever an engine reports (token ids above uint32: SGLang hashes those wide; HiCache's
    DISK and EXTERNAL tiers, which the index does not track; blocks of the wrong size), the
    mirror skips what it cannot use and never raises: an exception there would end the
    adapter's KV relay, and the adapter with it. Both were found here, and fixed."""
    from thunderagent.sglang.mirror import KvMirror

    mirror = KvMirror(4)
    for events in batches:
        mirror.apply(events)
