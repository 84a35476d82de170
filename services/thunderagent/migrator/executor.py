"""Carry out one planner action through the workers' adapters, as one trace.

A move is export (source) -> pull (target) -> release (source, always, with ``drop`` only when
a migration's pull succeeded). Every way it can end (a refusal, a timeout, a dead worker, a bad
reply) becomes a ``MigrationReport`` with ``phase="failed"`` and the reason; the source's pin is
released on every path (and lapses by itself after ``hold_s`` if even that fails), the target
inserts nothing unless its copy was complete and verified.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import msgspec
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from thunderagent.bus import Bus, BusError
from thunderagent.migration import Action, Drop, Migrate
from thunderagent.schemas import (
    KvExportOffer,
    KvExportRequest,
    KvPullRequest,
    KvPullResult,
    KvRelease,
    KvReleaseResult,
    MigrationMode,
    MigrationReport,
    subjects,
)

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("thunderagent.migration")


class MoveFailed(Exception):
    """A step of a move was refused or could not be carried out."""


@dataclass(kw_only=True)
class Timeouts:
    export_s: float = 5.0
    pull_s: float = 60.0
    """A GiB at 1 GB/s plus the target's checks; a warm-up prefill of a long prefix."""
    release_s: float = 5.0
    hold_s: float = 90.0
    """How long the source keeps the prefix pinned without a release: beyond ``pull_s``."""


def mode_of(action: Action) -> MigrationMode:
    return MigrationMode.MIGRATE if isinstance(action, Migrate | Drop) else MigrationMode.REPLICATE


class Executor:
    def __init__(self, bus: Bus, timeouts: Timeouts) -> None:
        self.bus = bus
        self.timeouts = timeouts

    async def run(self, action: Action, on_report) -> MigrationReport:
        """Carry out ``action``; ``on_report(report)`` is awaited for "started" and the end.
        A new trace per move (not the trace of whatever request made the prefix hot)."""
        kind = "drop" if isinstance(action, Drop) else mode_of(action).value
        root = otel_context.Context()
        with _tracer.start_as_current_span(f"migration {kind}", context=root) as span:
            span.set_attribute("thunderagent.migration_id", action.action_id)
            span.set_attribute("thunderagent.prefix_hash", f"{action.prefix_hash:#x}")
            span.set_attribute("thunderagent.blocks", action.blocks)
            span.set_attribute("thunderagent.reason", action.reason)
            started = time.perf_counter()
            await on_report(self._report(action, "started"))
            try:
                if isinstance(action, Drop):
                    report = await self._drop(action)
                else:
                    span.set_attribute("thunderagent.source", action.source)
                    span.set_attribute("thunderagent.target", action.target)
                    report = await self._move(action)
            except MoveFailed as err:
                span.set_status(Status(StatusCode.ERROR, str(err)))
                report = self._report(action, "failed", reason=str(err))
            report = msgspec.structs.replace(report, total_s=time.perf_counter() - started)
            span.set_attribute("thunderagent.outcome", report.phase)
            span.set_attribute("thunderagent.bytes", report.bytes)
            await on_report(report)
            return report

    async def _move(self, action) -> MigrationReport:
        offer = await self._export(action)
        result: KvPullResult | None = None
        try:
            result = await self._pull(action, offer)
        finally:
            drop = isinstance(action, Migrate) and result is not None and result.ok
            await self._release(action, drop)
        gbps = result.bytes / result.transfer_s / 1e9 if result.transfer_s > 0 else 0.0
        return self._report(
            action,
            "done",
            transport=result.transport,
            moved_blocks=result.moved_blocks,
            bytes=result.bytes,
            transfer_s=result.transfer_s,
            gbps=gbps,
            verified=result.verified,
            blocks=offer.blocks,
        )

    async def _export(self, action) -> KvExportOffer:
        """The source's offer of the prefix's pages, held for the pull."""
        offer = await self._ask(
            "export",
            subjects.worker_kv_export(action.source),
            KvExportRequest(
                migration_id=action.action_id,
                prefix_hash=action.prefix_hash,
                blocks=action.blocks,
                hold_s=self.timeouts.hold_s,
            ),
            KvExportOffer,
            self.timeouts.export_s,
        )
        if offer.blocks <= 0:
            raise MoveFailed(f"source {action.source}: {offer.reason or 'nothing to export'}")
        return offer

    async def _pull(self, action, offer: KvExportOffer) -> KvPullResult:
        """The target pulls what the source offered; a failed pull raises ``MoveFailed``."""
        result = await self._ask(
            "pull",
            subjects.worker_kv_pull(action.target),
            KvPullRequest(
                migration_id=action.action_id,
                source_worker=action.source,
                offer=offer,
                timeout_s=max(0.5, self.timeouts.pull_s - 1.0),
            ),
            KvPullResult,
            self.timeouts.pull_s,
        )
        if not result.ok:
            raise MoveFailed(f"target {action.target}: {result.reason}")
        return result

    async def _release(self, action, drop: bool) -> None:
        """Unpin at the source; a failure here only costs the pin's ``hold_s`` lease."""
        try:
            answer = await self._ask(
                "release",
                subjects.worker_kv_release(action.source),
                KvRelease(migration_id=action.action_id, prefix_hash=action.prefix_hash, drop=drop),
                KvReleaseResult,
                self.timeouts.release_s,
            )
            if drop and not answer.dropped_blocks:
                log.info(
                    "%s: source %s kept its copy (%s)",
                    action.action_id,
                    action.source,
                    answer.reason or "blocks in use",
                )
        except MoveFailed as err:
            log.warning(
                "%s: release at %s failed (%s): its pin lapses by itself",
                action.action_id,
                action.source,
                err,
            )

    async def _drop(self, action: Drop) -> MigrationReport:
        answer = await self._ask(
            "drop",
            subjects.worker_kv_release(action.worker),
            KvRelease(migration_id="", prefix_hash=action.prefix_hash, drop=True),
            KvReleaseResult,
            self.timeouts.release_s,
        )
        if not answer.dropped_blocks:
            raise MoveFailed(f"{action.worker} dropped nothing: {answer.reason or 'in use'}")
        return self._report(action, "done", moved_blocks=answer.dropped_blocks)

    async def _ask(self, step: str, subject: str, message, reply_type, wait_s: float):
        with _tracer.start_as_current_span(f"migration {step}") as span:
            span.set_attribute("messaging.destination.name", subject)
            try:
                return await self.bus.request(subject, message, reply_type, timeout=wait_s)
            except BusError as err:
                span.set_status(Status(StatusCode.ERROR, str(err)))
                raise MoveFailed(f"{step}: {err}") from err
            except (msgspec.DecodeError, msgspec.ValidationError) as err:  # an ErrorReply
                span.set_status(Status(StatusCode.ERROR, str(err)))
                raise MoveFailed(f"{step}: unexpected reply ({err})") from err

    @staticmethod
    def _report(action: Action, phase: str, **fields) -> MigrationReport:
        if isinstance(action, Drop):
            source, target = action.worker, ""
        else:
            source, target = action.source, action.target
        values = {"blocks": action.blocks, "reason": action.reason, **fields}
        return MigrationReport(
            migration_id=action.action_id,
            mode=mode_of(action),
            phase=phase,
            prefix_hash=action.prefix_hash,
            source=source,
            target=target,
            **values,
        )
