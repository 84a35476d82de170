"""The migration messages round-trip through JSON (bytes as base64) and reject bad input."""

from __future__ import annotations

import msgspec
import pytest

from thunderagent.schemas import (
    DrainNotice,
    KvExportOffer,
    KvExportRequest,
    KvPullRequest,
    KvPullResult,
    KvRelease,
    KvReleaseResult,
    MigrationMode,
    MigrationOrder,
    MigrationReport,
    subjects,
)

OFFER = KvExportOffer(
    migration_id="m-1",
    worker_id="w0",
    blocks=2,
    block_size=4,
    token_ids=list(range(8)),
    transport="nixl",
    nixl_agent="a",
    nixl_metadata=b"\x00\xffmeta",
    block_addrs=[4096, 8192],
    block_bytes=64,
    checksums=[2**64 - 1, 7],
)
EXAMPLES = [
    MigrationOrder(
        prefix_hash=2**63 + 5,
        blocks=4,
        source="w0",
        target="w1",
        mode=MigrationMode.MIGRATE,
        reason="ops",
    ),
    DrainNotice(worker_id="w3", reason="scale-in"),
    MigrationReport(
        migration_id="m-1",
        mode=MigrationMode.REPLICATE,
        phase="done",
        prefix_hash=1,
        blocks=2,
        source="w0",
        target="w1",
        transport="nixl",
        moved_blocks=2,
        bytes=128,
        transfer_s=0.5,
        total_s=0.6,
        gbps=2.5e-7,
        verified=True,
    ),
    KvExportRequest(migration_id="m-1", prefix_hash=1, blocks=2, hold_s=9.0),
    OFFER,
    KvPullRequest(migration_id="m-1", source_worker="w0", offer=OFFER, timeout_s=3.0),
    KvPullResult(migration_id="m-1", worker_id="w1", ok=False, reason="no room"),
    KvRelease(migration_id="", prefix_hash=1, drop=True),
    KvReleaseResult(migration_id="m-1", worker_id="w0", released=True, dropped_blocks=2),
]


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(message) -> None:
    wire = msgspec.json.encode(message)
    assert msgspec.json.decode(wire, type=type(message)) == message


def test_nixl_metadata_travels_as_base64() -> None:
    wire = msgspec.json.decode(msgspec.json.encode(OFFER))
    assert wire["nixl_metadata"] == "AP9tZXRh"


@pytest.mark.parametrize(
    ("payload", "fragment"),
    [
        (b'{"prefix_hash": 1, "mode": "teleport"}', "Invalid enum value 'teleport'"),
        (b'{"blocks": 3}', "missing required field `prefix_hash`"),
        (b'{"prefix_hash": "abc"}', "Expected `int`"),
    ],
)
def test_bad_orders_are_rejected_with_the_reason(payload: bytes, fragment: str) -> None:
    with pytest.raises(msgspec.ValidationError, match=fragment):
        msgspec.json.decode(payload, type=MigrationOrder)


def test_per_worker_subjects_are_one_token_per_worker() -> None:
    assert subjects.worker_kv_export("w0") == "thunderagent.worker.w0.kv_export"
    assert subjects.worker_kv_pull("w0") == "thunderagent.worker.w0.kv_pull"
    assert subjects.worker_kv_release("w0") == "thunderagent.worker.w0.kv_release"
    assert subjects.MIGRATION_REQUEST == "thunderagent.migration.request"
