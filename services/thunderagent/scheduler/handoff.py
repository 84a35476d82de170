"""The scheduler's side of the wire to workers and clients: a dispatch is a request/ack with the
next candidate when a worker refuses or does not answer, an abort returns what the run streamed,
and a request that cannot run gets an error its client can act on. No queue state lives here:
the service applies what comes back to its books and the scheduling core."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from opentelemetry import trace

from thunderagent.bus import Bus, BusError
from thunderagent.fleet import OfferIds, continuation
from thunderagent.migration.pull import PullPlanner
from thunderagent.scheduler.pending import Pending
from thunderagent.schemas import (
    AbortRequest,
    Ack,
    DirectDispatch,
    Dispatched,
    Dropped,
    ErrorCode,
    ErrorReply,
    Preempted,
    PullHint,
    ScheduleRequest,
    WorkerGenerate,
    subjects,
)
from thunderagent.shell.tasks import TaskSet
from thunderagent.telemetry.propagation import child_span

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("thunderagent.scheduler")


def in_use(rid: str) -> str:
    """Why a second request under ``rid`` does not run."""
    return (f"request id {rid} is in use by another request that has not finished: "
            "give each request its own id")  # fmt: skip


class Handoff:
    """Bound to one bus; the ack timeout applies to every hand-off and abort."""

    def __init__(
        self,
        bus: Bus,
        timeout_s: float,
        pulls: PullPlanner | None = None,
        spawn: Callable[[Awaitable[None]], object] | None = None,
    ) -> None:
        self.bus = bus
        self.timeout_s = timeout_s
        self.pulls = pulls
        """Copies of a prompt's prefix ordered with its first run (None: none)."""
        self.offer_ids = OfferIds()
        self._spawn = spawn or TaskSet("scheduler hand-offs").spawn
        """Runs what no caller waits for (the aborts that void late offers)."""

    async def dispatch(
        self, pending: Pending, worker_id: str, decode_worker: str = ""
    ) -> tuple[str | None, list[str]]:
        """Hand ``pending`` to ``worker_id``, then to its other candidates in the router's
        order while they refuse; (the worker that took it or None, why the others did not).
        ``pending.worker_id`` follows each try, ``pending.output`` what a stray run streamed."""
        submit = pending.submit
        order = [worker_id] + [
            c.worker_id
            for c in submit.decision.candidates
            if c.worker_id != worker_id and c.worker_id not in pending.excluded
        ]
        reasons: list[str] = []
        with child_span(_tracer, "scheduler dispatch") as span:
            span.set_attribute("thunderagent.request_id", submit.request.request_id)
            took = None
            for attempt, wid in enumerate(order):
                pending.worker_id = wid
                await self._tell_router(submit, wid)
                why = await self._offer(pending, wid, attempt, decode_worker, worker_id)
                if why is None:
                    span.set_attribute("thunderagent.worker_id", wid)
                    took = wid
                    break
                reasons.append(why)
        self._void_unanswered(pending, took)
        return took, reasons

    def _void_unanswered(self, pending: Pending, took: str | None) -> None:
        """Abort, in the background, the offers left unanswered at workers that did not take
        the run: a late one would start a second run there. One that did start is stopped
        (the client drops what it streams at positions it already has)."""
        rid = pending.request_id
        why = "a hand-off that got no answer: " + (
            f"the request runs on {took}" if took else "no worker took the request"
        )
        for wid, offers in pending.unanswered.items():
            self._spawn(self.abort(wid, rid, why, offers))
        pending.unanswered = {}

    async def _offer(
        self, pending: Pending, wid: str, attempt: int, decode_worker: str, chosen: str
    ) -> str | None:
        """Offer the run (what the client has not had yet) to ``wid``: None when it took it,
        else why not. Only the policy's ``chosen`` worker gets the PD decode worker."""
        submit = pending.submit
        rid = submit.request.request_id
        overlap = next((c.overlap_blocks for c in submit.decision.candidates
                        if c.worker_id == wid), 0)  # fmt: skip
        decode = decode_worker if wid == chosen else ""
        earlier = pending.unanswered.get(wid, [])
        work = WorkerGenerate(
            request=continuation(submit.request, pending.output),
            reply_subject=submit.reply_subject,
            predicted_cached_tokens=overlap * submit.block_size,
            attempt=attempt,
            output_offset=len(pending.output),
            decode_worker=decode,
            pull=self._pull(submit, wid) if not pending.output and not decode else None,
            offer=self.offer_ids.next(),
            supersedes=list(earlier),
        )
        try:
            ack = await self.bus.request(
                subjects.worker_generate(wid), work, Ack, timeout=self.timeout_s
            )
        except BusError as err:
            # no ack is not "no": the worker may be running it. Stop it there before the next
            # worker starts it; what it streamed already, the next continues.
            offers = pending.unanswered[wid] = [*earlier, work.offer]
            stray = await self.abort(wid, rid, "hand-off timed out: another worker", offers)
            if stray is not None:  # answered: none of those offers can start a run there now
                del pending.unanswered[wid]
                if stray.found and stray.output_token_ids:
                    pending.output = list(stray.output_token_ids)
            return f"{wid}: {err}"
        pending.unanswered.pop(wid, None)  # answered: it refuses the earlier ones from now on
        if not ack.accepted:
            return f"{wid}: refused ({ack.reason})"
        self.book_pull(work.pull, wid)  # only now: a refused offer copies nothing
        return None

    def book_pull(self, hint: PullHint | None, worker_id: str) -> None:
        """``worker_id`` took a run carrying ``hint`` (this scheduler's, or a router's on the
        fast path): its copy holds both links in this scheduler's pull decisions."""
        if hint is not None and self.pulls is not None:
            self.pulls.book(hint, worker_id, time.monotonic())

    def _pull(self, submit: ScheduleRequest, worker_id: str) -> PullHint | None:
        if self.pulls is None:
            return None
        prompt = submit.request.prompt_len()
        return self.pulls.hint(submit.decision.candidates, worker_id, submit.block_hashes,
                               prompt, submit.block_size, time.monotonic())  # fmt: skip

    async def _tell_router(self, submit: ScheduleRequest, worker_id: str) -> None:
        if submit.router_id:
            notice = Dispatched(request_id=submit.request.request_id, worker_id=worker_id)
            await self.bus.publish(subjects.router_dispatched(submit.router_id), notice)

    async def abort(
        self, worker_id: str, rid: str, reason: str, offers: list[str] | None = None
    ) -> Preempted | None:
        """Stop ``rid`` on ``worker_id`` and void ``offers`` there; None when the adapter did
        not answer (it runs on)."""
        try:
            return await self.bus.request(
                subjects.worker_abort(worker_id),
                AbortRequest(request_id=rid, reason=reason, offers=offers or []),
                Preempted,
                timeout=self.timeout_s,
            )
        except BusError as err:
            log.warning("aborting %s on %s failed (%s): it keeps running", rid, worker_id, err)
            return None

    async def stop_direct_run(self, direct: DirectDispatch, other_client: bool) -> None:
        """Stop a run a router made on credit under an id whose request holds another run
        (``pending.DirectRun``); the other runs on. ``other_client``: another client's request
        holds the id (neither router could know), and this run's client is told why. Else the
        client resent it and a router read the first send late: its answer comes from the
        other run, and what this one streamed sits at output positions the client has had (its
        stream keeps one copy, ``client.mux``), so it hears nothing from here."""
        rid = direct.submit.request.request_id
        why = "its request id is in use" if other_client else "the request runs elsewhere"
        stopped = await self.abort(direct.worker_id, rid, why)
        if stopped is None or not stopped.found:
            return
        log.warning("request %s: a second run of it stopped on %s (%s)", rid, direct.worker_id, why)
        if other_client:
            error = ErrorReply(code=ErrorCode.BAD_REQUEST, message=in_use(rid), request_id=rid,
                               service="scheduler")  # fmt: skip
            await self.bus.publish(direct.submit.reply_subject, error)

    async def fail(self, pending: Pending, code: ErrorCode, message: str) -> None:
        """Tell the client its request ended here with an error, and its router that no
        worker will run it."""
        rid = pending.submit.request.request_id
        log.info("request %s: %s: %s", rid, code.value, message)
        error = ErrorReply(code=code, message=message, request_id=rid, service="scheduler")
        await self.bus.publish(pending.submit.reply_subject, error)
        await self.dropped(pending)

    async def dropped(self, pending: Pending) -> None:
        """The request leaves here with no run: its router lets go of what it booked for it
        (it would otherwise count as load on its first candidate until the booking lapses)."""
        await self._drop_booking(pending.submit)

    async def resent(self, pending: Pending, resend: ScheduleRequest) -> None:
        """The client resent a request held here: the router that routed the resend booked it
        as new load, but the request runs once, as ``pending``. That router lets the booking go,
        unless it routed the request before and it still waits: it then hears of its dispatch
        (its booking moved to the resend's first candidate when it routed it again)."""
        if pending.worker_id or resend.router_id != pending.submit.router_id:
            await self._drop_booking(resend)

    async def _drop_booking(self, submit: ScheduleRequest) -> None:
        if submit.router_id:
            notice = Dropped(request_id=submit.request.request_id)
            await self.bus.publish(subjects.router_dropped(submit.router_id), notice)
