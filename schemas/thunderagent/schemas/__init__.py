"""ThunderAgent's message contract: msgspec Structs for every NATS message, and subject names.

Encoding on the wire is JSON (msgspec), so the ``nats`` CLI can publish and read every message.
"""

from thunderagent.schemas import subjects
from thunderagent.schemas.deadletter import DeadLetter
from thunderagent.schemas.generate import (
    REPLY_DECODER,
    ChatMessage,
    ErrorCode,
    ErrorReply,
    FinalReply,
    FinishReason,
    GenerateRequest,
    ReplyMessage,
    SamplingParams,
    TokenChunk,
    Usage,
)
from thunderagent.schemas.health import Health
from thunderagent.schemas.ids import WORKER_ID_PATTERN, is_valid_worker_id
from thunderagent.schemas.kv import (
    AllCleared,
    BlocksRemoved,
    BlocksStored,
    KvEvent,
    KvEventBatch,
    Medium,
    OverlapQuery,
    OverlapReply,
    ResyncRequest,
)
from thunderagent.schemas.routing import (
    AbortRequest,
    Ack,
    CancelRequest,
    Candidate,
    KvTransfer,
    Preempted,
    ProgramRelease,
    RequestProgress,
    RouteDecision,
    ScheduleRequest,
    WorkerGenerate,
)
from thunderagent.schemas.workers import LoadReport, WorkerRegistration, WorkerRole

__all__ = [
    "REPLY_DECODER",
    "WORKER_ID_PATTERN",
    "AbortRequest",
    "Ack",
    "AllCleared",
    "BlocksRemoved",
    "BlocksStored",
    "CancelRequest",
    "Candidate",
    "ChatMessage",
    "DeadLetter",
    "ErrorCode",
    "ErrorReply",
    "FinalReply",
    "FinishReason",
    "GenerateRequest",
    "Health",
    "KvEvent",
    "KvEventBatch",
    "KvTransfer",
    "LoadReport",
    "Medium",
    "OverlapQuery",
    "OverlapReply",
    "Preempted",
    "ProgramRelease",
    "ReplyMessage",
    "RequestProgress",
    "ResyncRequest",
    "RouteDecision",
    "SamplingParams",
    "ScheduleRequest",
    "TokenChunk",
    "Usage",
    "WorkerGenerate",
    "WorkerRegistration",
    "WorkerRole",
    "is_valid_worker_id",
    "subjects",
]
