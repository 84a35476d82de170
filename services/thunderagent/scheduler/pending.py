"""What the scheduler service keeps per request it owns, and progress that arrived before it."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from msgspec import structs
from opentelemetry import context as otel_context

from thunderagent.fleet import Run, sched_request
from thunderagent.scheduling import SchedRequest
from thunderagent.schemas import DirectDispatch, RequestProgress, ScheduleRequest

EARLY_PROGRESS_S = 5.0
"""A run's progress may beat the router's report of its direct dispatch; it is kept this long
for the report to arrive."""
MAX_EARLY = 10_000


@dataclass(slots=True)
class Pending:
    submit: ScheduleRequest
    context: otel_context.Context
    output: list[int] = field(default_factory=list)
    """Output tokens the client received before a preemption (a continuation carries them)."""
    worker_id: str = ""
    """Where the current run is (empty while it waits)."""
    decode_worker: str = ""
    """PD: the decode worker the current run was paired with. Under SGLang's PD that worker
    runs it from the start, so its end may come before the prefill worker's ``transferred``."""
    started: bool = False
    """The current run produced its first token (the client has output from it)."""
    excluded: set[str] = field(default_factory=set)
    """Workers that failed this request: it is not sent there again."""
    failure: str = ""
    """The latest of those failures, as its worker said it (told the client if none is left)."""
    resumes: int = 0
    """Times it was resumed after a worker or engine failure."""
    replaced: set[str] = field(default_factory=set)
    """Workers whose run of it was ended here and replaced by a continuation (the one that
    failed, and a PD run's other side): a failure one of them reports later is old news."""
    unanswered: dict[str, list[str]] = field(init=False)
    """worker id -> offers of it there that got no answer and no abort was answered since (the
    router's fast path's, then this scheduler's): the worker may still take one late."""

    def __post_init__(self) -> None:
        self.unanswered = {}
        for offer in self.submit.unanswered:
            self.unanswered.setdefault(offer.worker_id, []).append(offer.offer)

    @property
    def request_id(self) -> str:
        return self.submit.request.request_id

    def sched_request(self) -> SchedRequest:
        """What the scheduling core sees: the run so far, and only candidates that did not
        fail it."""
        submit = self.submit
        req = submit.request
        decision = submit.decision
        if self.excluded:
            kept = [c for c in decision.candidates if c.worker_id not in self.excluded]
            decision = structs.replace(decision, candidates=kept)
        return sched_request(
            request_id=req.request_id,
            arrival=submit.decision.decided_at,
            run=Run(req.prompt_len(), req.max_tokens, len(self.output)),
            expected_output_tokens=submit.expected_output_tokens or req.max_tokens,
            decision=decision,
            block_size=submit.block_size,
            block_hashes=submit.block_hashes,
            priority=req.priority,
            program_id=req.program_id,
            deadline=req.deadline_ms / 1e3 if req.deadline_ms is not None else None,
        )


class DirectRun(Enum):
    """What a router's report of a run it dispatched on credit is, against what the scheduler
    holds under the id."""

    NEW = "new"
    """Nothing here under the id: the scheduler books the run."""
    TOLD_TWICE = "told twice"
    """The run the scheduler already tracks, on the same worker."""
    OTHER_CLIENT = "other client"
    """Another client's request holds the id: this run is stopped and its client told why."""
    SECOND_RUN = "second run"
    """The client resent the request and the resend ran or runs: a router that read the first
    send late (a long inbox) ran it again. Stopped without a word to the client, whose answer
    comes from the first run."""
    TAKES_OVER = "takes over"
    """The client's resend waits in the queue with no output yet: the run on credit serves it,
    and the queued copy leaves without a run."""


def direct_run(direct: DirectDispatch, pending: Pending | None, ran_for: str | None) -> DirectRun:
    """Classify ``direct`` given the request held under its id (``pending``) and the reply
    subject of the request that last ended under it (``ran_for``). Only the scheduler sees every
    run of an id, so only it can tell a resend's second run from a new request."""
    client = direct.submit.reply_subject
    if pending is not None:
        if pending.submit.reply_subject != client:
            return DirectRun.OTHER_CLIENT
        if pending.worker_id == direct.worker_id:
            return DirectRun.TOLD_TWICE
        if pending.worker_id or pending.output:
            return DirectRun.SECOND_RUN
        return DirectRun.TAKES_OVER
    return DirectRun.SECOND_RUN if ran_for == client else DirectRun.NEW


def may_be_unreported(pending: Pending | None) -> bool:
    """Progress of this request may be of a run a router made on credit and has not reported
    yet: the id is unknown here, or its request waits with no output (a resend that such a run
    serves, ``DirectRun.TAKES_OVER``). It is kept for the report (``EarlyProgress``); else a
    run that ended before its report came would be booked and never end here."""
    return pending is None or (not pending.worker_id and not pending.output)


class EarlyProgress:
    """Progress of runs the service does not know yet: a router's report of a direct dispatch
    and the worker's progress travel separately, and the progress may come first."""

    def __init__(self) -> None:
        self._held: dict[str, list[RequestProgress]] = {}

    def hold(self, progress: RequestProgress, now: float) -> bool:
        """Keep ``progress`` for its report; False when it is too old to expect one."""
        if now - progress.ts >= EARLY_PROGRESS_S:
            return False
        self._held.setdefault(progress.request_id, []).append(progress)
        if len(self._held) > MAX_EARLY:
            self._held.pop(next(iter(self._held)))
        return True

    def take(self, request_id: str) -> list[RequestProgress]:
        return self._held.pop(request_id, [])

    def forget_old(self, now: float) -> None:
        """Progress whose direct dispatch never came (a request that ended otherwise)."""
        for rid in [r for r, ps in self._held.items() if now - ps[0].ts > EARLY_PROGRESS_S]:
            del self._held[rid]
