"""The scheduler service's per-request books: what the core sees of a request that failed on
some workers, and progress that arrives before the router's report of a direct dispatch."""

from __future__ import annotations

import time

import msgspec
from opentelemetry import context as otel_context

from thunderagent import schemas as s
from thunderagent.scheduler.drain import DRAIN_WINDOW_S, DrainRate
from thunderagent.scheduler.pending import (
    EARLY_PROGRESS_S,
    DirectRun,
    EarlyProgress,
    Pending,
    direct_run,
    may_be_unreported,
)


def _pending() -> Pending:
    request = s.GenerateRequest(request_id="r1", model="m", token_ids=list(range(40)),
                                max_tokens=8)  # fmt: skip
    decision = s.RouteDecision(
        request_id="r1",
        model="m",
        worker_id="w0",
        overlap_blocks=2,
        prompt_blocks=2,
        candidates=[
            s.Candidate(worker_id="w0", score=1.0, overlap_blocks=2),
            s.Candidate(worker_id="w1", score=0.5),
        ],
        policy="thunder",
        decided_at=100.0,
    )
    submit = s.ScheduleRequest(request=request, reply_subject="_INBOX.x", decision=decision)
    return Pending(submit, otel_context.get_current())


def test_a_request_resumed_elsewhere_keeps_its_output_and_loses_the_failed_candidate() -> None:
    pending = _pending()
    first = pending.sched_request()
    assert [c for c, _ in first.candidates] == ["w0", "w1"]
    assert first.generated_tokens == 0 and first.arrival == 100.0
    pending.excluded.add("w0")
    pending.output = [7, 7, 7]
    again = pending.sched_request()
    assert [c for c, _ in again.candidates] == ["w1"]
    assert again.generated_tokens == 3


def test_a_run_on_credit_is_classified_against_every_run_of_its_id() -> None:
    """Only the scheduler sees every run of an id: a router's run on credit is new, the one it
    tracks, another client's, a second run of a resent request, or the run that serves a
    resend still waiting in the queue."""
    pending = _pending()
    mine = s.DirectDispatch(submit=pending.submit, worker_id="w1")
    submit = pending.submit
    other_client = msgspec.structs.replace(submit, reply_subject="_INBOX.y")
    other = s.DirectDispatch(submit=other_client, worker_id="w1")
    assert direct_run(mine, None, None) is DirectRun.NEW
    assert direct_run(mine, None, "_INBOX.y") is DirectRun.NEW, "another client may reuse an id"
    assert direct_run(mine, None, "_INBOX.x") is DirectRun.SECOND_RUN, "its resend ran"
    assert direct_run(other, pending, None) is DirectRun.OTHER_CLIENT
    assert direct_run(mine, pending, None) is DirectRun.TAKES_OVER, "its resend waits"
    pending.output = [7]
    assert direct_run(mine, pending, None) is DirectRun.SECOND_RUN, "a continuation waits"
    pending.output, pending.worker_id = [], "w0"
    assert direct_run(mine, pending, None) is DirectRun.SECOND_RUN, "its resend runs on w0"
    pending.worker_id = "w1"
    assert direct_run(mine, pending, None) is DirectRun.TOLD_TWICE


def _progress(rid: str, ts: float) -> s.RequestProgress:
    return s.RequestProgress(request_id=rid, worker_id="w0", phase="started", ts=ts)


def test_early_progress_waits_for_its_report_but_not_forever() -> None:
    now = time.time()
    early = EarlyProgress()
    assert early.hold(_progress("a", now), now)
    assert not early.hold(_progress("b", now - EARLY_PROGRESS_S - 1), now), "too old to wait"
    assert [p.request_id for p in early.take("a")] == ["a"]
    assert early.take("a") == [] and early.take("b") == []
    early.hold(_progress("c", now), now)
    early.forget_old(now + EARLY_PROGRESS_S + 1)
    assert early.take("c") == []


class _Ends:
    """A core that records how each run ended."""

    def __init__(self) -> None:
        self.ends: list[tuple[str, str]] = []

    def on_finished(self, rid: str, worker_id: str, now: float) -> None:
        self.ends.append(("finished", rid))

    def on_failed(self, rid: str, worker_id: str, now: float) -> None:
        self.ends.append(("failed", rid))


def test_a_run_the_engine_failed_for_good_reaches_the_core_as_failed() -> None:
    """A ``failed`` end (the request's error went to its client) is not a served step: the
    core hears ``on_failed``, so a program's books do not count the prompt as held there."""
    from thunderagent.scheduler.service import SchedulerConfig, SchedulerService

    svc = SchedulerService(SchedulerConfig(), bus=None, clock=lambda: 5.0)  # type: ignore[arg-type]
    ends = _Ends()
    svc.core = ends  # type: ignore[assignment]
    for rid, phase in (("r1", "failed"), ("r2", "finished"), ("r3", "aborted")):
        pending = _pending()
        pending.worker_id = "w0"
        svc.pending[rid] = pending
        svc._on_run_event(s.RequestProgress(request_id=rid, worker_id="w0", phase=phase, ts=5.0))
    assert ends.ends == [("failed", "r1"), ("finished", "r2"), ("finished", "r3")]


def test_progress_is_kept_for_a_report_only_where_a_run_on_credit_may_be_booked() -> None:
    pending = _pending()
    assert may_be_unreported(None), "an unknown id: its report may be on its way"
    assert may_be_unreported(pending), "a waiting resend a run on credit would serve"
    pending.output = [7]
    assert not may_be_unreported(pending), "a continuation waits: its old run's end is stale"
    pending.output, pending.worker_id = [], "w0"
    assert not may_be_unreported(pending), "it runs: progress is of its run or stale"


def test_the_retry_hint_is_the_queue_over_the_recent_dispatch_rate() -> None:
    drain = DrainRate()
    assert drain.seconds(5, 100.0) == DRAIN_WINDOW_S, "nothing went out: the whole window"
    for i in range(20):  # 2 per second over the window
        drain.dispatched(90.5 + i * 0.5)
    assert drain.seconds(10, 100.0) == 5.0
    assert drain.seconds(1, 100.0) == 1.0, "never below a second"
    assert drain.seconds(10, 200.0) == DRAIN_WINDOW_S, "old dispatches do not count"
