"""One valid message per fuzzed type, as plain JSON values: the shaper mutates a few of its
leaves, so a good share of the cases decode and reach the handler with extreme values in
otherwise sensible messages (a purely random object rarely passes validation)."""

from __future__ import annotations

import time
from typing import Any

import msgspec

from thunderagent import schemas as s

PROMPT = [5 + i % 200 for i in range(40)]


def _request(**kw) -> s.GenerateRequest:
    return s.GenerateRequest(model="sim/test-model.v1", token_ids=PROMPT, max_tokens=4, **kw)


def _decision() -> s.RouteDecision:
    return s.RouteDecision(
        request_id="fuzz-1",
        model="sim/test-model.v1",
        worker_id="w0",
        overlap_blocks=1,
        prompt_blocks=2,
        candidates=[
            s.Candidate(worker_id="w0", score=1.0, overlap_blocks=1),
            s.Candidate(worker_id="w1", score=0.5),
        ],
        policy="thunder",
        decided_at=time.time(),
        prefix_hash=12345,
    )


def _schedule() -> s.ScheduleRequest:
    return s.ScheduleRequest(
        request=_request(request_id="fuzz-1"),
        reply_subject="_INBOX.fz.1",
        decision=_decision(),
        block_hashes=[1, 2],
        router_id="r1",
    )


def _offer() -> s.KvExportOffer:
    return s.KvExportOffer(
        migration_id="m1",
        worker_id="w0",
        blocks=2,
        block_size=16,
        token_ids=PROMPT[:32],
        block_hashes=[1, 2],
    )


def _examples() -> dict[type, Any]:
    now = time.time()
    stored = s.BlocksStored(hashes=[11, 12], check_hashes=[21, 22], parent_hash=None)
    return {
        s.GenerateRequest: _request(cache_salt="tenant", program_id="p1", priority=3),
        s.ScheduleRequest: _schedule(),
        s.CancelRequest: s.CancelRequest(request_id="fuzz-1", reason="fuzz"),
        s.ProgramRelease: s.ProgramRelease(program_id="p1"),
        s.ProgressBatch: s.ProgressBatch(
            worker_id="w0",
            events=[
                s.RequestProgress(request_id="fuzz-1", worker_id="w0", phase="started", ts=now),
                s.RequestProgress(
                    request_id="fuzz-1",
                    worker_id="w0",
                    phase="finished",
                    ts=now,
                    usage=s.Usage(prompt_tokens=40, cached_tokens=16, completion_tokens=4),
                ),
            ],
        ),
        s.Dispatched: s.Dispatched(request_id="fuzz-1", worker_id="w0"),
        s.Dropped: s.Dropped(request_id="fuzz-1"),
        s.DirectDispatch: s.DirectDispatch(submit=_schedule(), worker_id="w0"),
        s.RouterHello: s.RouterHello(router_id="r-fuzz"),
        s.CreditGrant: s.CreditGrant(
            router_id="r1", credits={"w0": 2}, booked={"w0": 0}, issued_at=now
        ),
        s.WorkerGenerate: s.WorkerGenerate(
            request=_request(request_id="fuzz-2"), reply_subject="_INBOX.fz.2"
        ),
        s.AbortRequest: s.AbortRequest(request_id="fuzz-2", reason="fuzz"),
        s.RunFailed: s.RunFailed(
            request_id="fuzz-1", worker_id="w0", output_token_ids=[7, 8], reason="fuzz"
        ),
        s.KvTransfer: s.KvTransfer(request_id="fuzz-3", token_ids=PROMPT, source_worker="w0"),
        s.ResyncRequest: s.ResyncRequest(worker_id="w0", reason="fuzz"),
        s.KvExportRequest: s.KvExportRequest(migration_id="m1", prefix_hash=12345, blocks=2),
        s.KvPullRequest: s.KvPullRequest(migration_id="m1", source_worker="w0", offer=_offer()),
        s.KvRelease: s.KvRelease(migration_id="m1", prefix_hash=12345),
        s.LoadReport: s.LoadReport(
            worker_id="w0", ts=now, running=1, queued=0, kv_used_blocks=3, kv_total_blocks=32
        ),
        s.KvEventBatch: s.KvEventBatch(
            worker_id="w1",
            seq=10**6,
            ts=now,
            epoch=1,
            events=[s.AllCleared(), stored, s.BlocksRemoved(hashes=[12])],
        ),
        s.RouteDecision: _decision(),
        s.RouteDecisionBatch: s.RouteDecisionBatch(router_id="r1", decisions=[_decision()]),
        s.MigrationOrder: s.MigrationOrder(prefix_hash=12345, blocks=2, source="w0", target="w1"),
        s.DrainNotice: s.DrainNotice(worker_id="w1", draining=False, reason="fuzz"),
    }


def seed_for(message_type: Any) -> Any | None:
    """The valid example as JSON values (dicts, lists), or None when there is none."""
    example = _examples().get(message_type)
    return None if example is None else msgspec.to_builtins(example)
