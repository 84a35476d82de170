"""The list of every message that crosses NATS, and the JSON Schema export of each.

``thunderagent schemas`` writes ``schemas/json/<Message>.json``; a test fails when the committed
files differ from what the Structs produce, so the documented contract cannot drift from the code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final

import msgspec

from thunderagent.schemas.deadletter import DeadLetter
from thunderagent.schemas.generate import (
    ErrorReply,
    FinalReply,
    GenerateRequest,
    HeldReply,
    ReplyMessage,
    TokenChunk,
)
from thunderagent.schemas.health import Health
from thunderagent.schemas.kv import HoldersQuery, HoldersReply, KvEventBatch, ResyncRequest
from thunderagent.schemas.migration import (
    DrainNotice,
    KvExportOffer,
    KvExportRequest,
    KvPullRequest,
    KvPullResult,
    KvRelease,
    KvReleaseResult,
    MigrationOrder,
    MigrationReport,
)
from thunderagent.schemas.routing import (
    AbortRequest,
    Ack,
    CancelRequest,
    CreditGrant,
    DirectDispatch,
    Dispatched,
    Dropped,
    KvTransfer,
    Preempted,
    ProgramRelease,
    ProgressBatch,
    RequestProgress,
    RouteDecision,
    RouteDecisionBatch,
    RouterHello,
    RunFailed,
    ScheduleRequest,
    WorkerGenerate,
)
from thunderagent.schemas.workers import LoadReport, WorkerRegistration

MESSAGES: Final[dict[str, Any]] = {
    "GenerateRequest": GenerateRequest,
    "TokenChunk": TokenChunk,
    "FinalReply": FinalReply,
    "ErrorReply": ErrorReply,
    "HeldReply": HeldReply,
    "ReplyMessage": ReplyMessage,
    "KvEventBatch": KvEventBatch,
    "ResyncRequest": ResyncRequest,
    "HoldersQuery": HoldersQuery,
    "HoldersReply": HoldersReply,
    "WorkerRegistration": WorkerRegistration,
    "LoadReport": LoadReport,
    "RouteDecision": RouteDecision,
    "RouteDecisionBatch": RouteDecisionBatch,
    "ScheduleRequest": ScheduleRequest,
    "WorkerGenerate": WorkerGenerate,
    "Ack": Ack,
    "AbortRequest": AbortRequest,
    "CancelRequest": CancelRequest,
    "CreditGrant": CreditGrant,
    "DirectDispatch": DirectDispatch,
    "RouterHello": RouterHello,
    "RunFailed": RunFailed,
    "Dispatched": Dispatched,
    "Dropped": Dropped,
    "KvTransfer": KvTransfer,
    "Preempted": Preempted,
    "ProgramRelease": ProgramRelease,
    "ProgressBatch": ProgressBatch,
    "RequestProgress": RequestProgress,
    "DeadLetter": DeadLetter,
    "Health": Health,
    "MigrationOrder": MigrationOrder,
    "MigrationReport": MigrationReport,
    "DrainNotice": DrainNotice,
    "KvExportRequest": KvExportRequest,
    "KvExportOffer": KvExportOffer,
    "KvPullRequest": KvPullRequest,
    "KvPullResult": KvPullResult,
    "KvRelease": KvRelease,
    "KvReleaseResult": KvReleaseResult,
}

JSON_DIR: Final = Path(__file__).resolve().parents[2] / "json"
"""``schemas/json`` in a source checkout."""


def json_schema(name: str) -> str:
    """Pretty, stable JSON Schema text of one message."""
    schema = msgspec.json.schema(MESSAGES[name])
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def write_json_schemas(out_dir: Path = JSON_DIR) -> list[Path]:
    """Write every message's schema; returns the files written. Stale extra files are removed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name in MESSAGES:
        path = out_dir / f"{name}.json"
        path.write_text(json_schema(name))
        written.append(path)
    for path in out_dir.glob("*.json"):
        if path not in written:
            path.unlink()
    return written
