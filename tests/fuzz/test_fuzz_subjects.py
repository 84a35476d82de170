"""Every subscribed subject of a running stack, fuzzed: random bytes and schema-shaped messages
with extreme values, against real NATS + JetStream + Redis with every service in-process
(router, scheduler, index, migration, the HTTP gateway, two worker adapters in front of
simulated engines).

What must hold afterwards:
- no service task died, no connection was dropped (a protocol error or a slow consumer would
  show as a reconnect), and no handler raised: ``handler_errors`` is zero everywhere. The only
  expected rejections are messages that fail to decode or validate, or that a handler refuses on
  purpose with ``Bus.reject``; an exception escaping a handler is a finding;
- every message of a request/reply subject that carried a reply subject was answered (the
  normal reply or an ``ErrorReply``); a rejected message with a reply subject got an
  ``ErrorReply``;
- every message its subscribers cannot decode is on ``thunderagent.deadletter.<service>`` with a
  reason, once per subscribing service;
- the stack still serves a normal request, and every service answers its health probe.

Cases per subject: 1,000 (``THUNDERAGENT_FUZZ_CASES``), 10,000 with ``THUNDERAGENT_FUZZ_LONG=1``.
A failing case is reproduced by ``THUNDERAGENT_FUZZ_SEED`` (printed); ``THUNDERAGENT_FUZZ_ONLY``
narrows the run to the subjects containing a text.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import logging
import os
import random
import re
import time
from collections import Counter

import pytest

from tests.fuzz.harness import Observer, Target, cases, fuzz_target, wait_subscribed
from tests.integration.inproc import MODEL, inproc_stack, start_full_stack
from thunderagent.bus import connect
from thunderagent.client import ThunderClient
from thunderagent.schemas import (
    AbortRequest,
    CancelRequest,
    CreditGrant,
    DirectDispatch,
    Dispatched,
    DrainNotice,
    Dropped,
    GenerateRequest,
    HoldersQuery,
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
    RouteDecisionBatch,
    RouterHello,
    RunFailed,
    ScheduleRequest,
    WorkerGenerate,
    relayed,
    subjects,
)
from thunderagent.shell.runner import _answer_health

pytestmark = [pytest.mark.fuzz, pytest.mark.integration, pytest.mark.slow]

LONG = os.environ.get("THUNDERAGENT_FUZZ_LONG") == "1"
CASES = int(os.environ.get("THUNDERAGENT_FUZZ_CASES") or (10_000 if LONG else 1_000))
_SEED = os.environ.get("THUNDERAGENT_FUZZ_SEED") or ("random" if LONG else "1")
SEED = time.time_ns() % 1_000_000 if _SEED == "random" else int(_SEED)
"""Fixed in CI (the same corpus every run, so a red run is a change in the code); a new one per
run in the long mode or with THUNDERAGENT_FUZZ_SEED=random (exploration); always printed."""
BIG = int(os.environ.get("THUNDERAGENT_FUZZ_BIG") or 20_000)
"""Length of a 'huge' list or string (tokens, hashes, characters)."""
VERBOSE = os.environ.get("THUNDERAGENT_FUZZ_VERBOSE") == "1"
ONLY = os.environ.get("THUNDERAGENT_FUZZ_ONLY", "")
"""Fuzz only the subjects containing this text (reproducing one finding)."""

STRICT = os.environ.get("THUNDERAGENT_FUZZ_STRICT") == "1"
"""Fail on the known findings below too (they are reported, and fixed outside this suite)."""

KNOWN: dict[str, str] = {}
"""Findings reported and not fixed yet (regex -> cause): printed, and failing only with
THUNDERAGENT_FUZZ_STRICT=1. A finding not listed here fails the test. The 16 found so far are
fixed (docs/reliability.md lists them)."""

SERVICES = ("router", "scheduler", "index", "migration", "gateway", "worker-w0", "worker-w1")
FOLLOWERS = ("router", "scheduler", "index")
"""Services that follow the KV-event stream."""
FLEET = (*FOLLOWERS, "gateway")
"""Services that watch load reports."""

# Subjects (functions and constants of subjects.py) and the targets that cover them; a new
# subject fails test_every_subject_is_covered until it is fuzzed here or listed as not subscribed.
NOT_SUBSCRIBED = {
    "MIGRATION_EVENTS": "observers only (benchmarks, dashboards): no service subscribes",
    "DEAD_LETTER_WILDCARD": "observers only; dead_letter(): where services publish rejections",
    "dead_letter": "observers only",
    "worker_key": "a bucket key, not a subject",
    "model_token": "helper",
    "model_from_token": "helper",
    "scheduler_inbound": "helper: sched_submit, sched_direct and sched_run_failed, fuzzed",
    "REDIS_INDEX_SNAPSHOT": "a Redis key",
}


def targets(router_id: str) -> list[Target]:
    s = subjects
    return [
        Target(s.requests(MODEL), GenerateRequest, "request", ("router",)),
        Target(
            s.sched_submit(MODEL),
            ScheduleRequest,
            "request",
            ("scheduler",),
            decoded_as=relayed.ScheduleRequest,
        ),
        Target(s.SCHED_CANCEL, CancelRequest, "event", ("scheduler",)),
        Target(
            s.sched_direct(MODEL),
            DirectDispatch,
            "event",
            ("scheduler",),
            decoded_as=relayed.DirectDispatch,
        ),
        Target(s.sched_run_failed(MODEL), RunFailed, "request", ("scheduler",)),
        Target(s.ROUTER_PRESENCE, RouterHello, "event", ("scheduler",)),
        Target(s.router_credits(router_id), CreditGrant, "event", ("router",)),
        Target(s.PROGRAM_RELEASE, ProgramRelease, "event", ("scheduler",)),
        Target(s.progress("w0", ended=True), ProgressBatch, "event", ("router", "scheduler")),
        Target(s.progress("ghost", ended=True), ProgressBatch, "event", ("router", "scheduler")),
        Target(s.progress("w0", ended=False), ProgressBatch, "event", ("scheduler",)),
        Target(s.router_dispatched(router_id), Dispatched, "event", ("router",)),
        Target(s.router_dropped(router_id), Dropped, "event", ("router",)),
        Target(s.worker_generate("w0"), WorkerGenerate, "request", ("worker-w0",)),
        Target(s.worker_abort("w0"), AbortRequest, "request", ("worker-w0",)),
        Target(s.worker_kv_import("w1"), KvTransfer, "request", ("worker-w1",)),
        Target(s.worker_resync("w0"), ResyncRequest, "request", ("worker-w0",)),
        Target(s.worker_kv_export("w0"), KvExportRequest, "request", ("worker-w0",)),
        Target(s.worker_kv_pull("w1"), KvPullRequest, "request", ("worker-w1",)),
        Target(s.worker_kv_release("w0"), KvRelease, "request", ("worker-w0",)),
        Target(s.worker_load("w0"), LoadReport, "event", FLEET),
        Target(s.worker_load("ghost"), LoadReport, "event", FLEET),
        Target(s.kv_events("w1"), KvEventBatch, "stream", FOLLOWERS),
        Target(s.kv_events("ghost"), KvEventBatch, "stream", FOLLOWERS),
        Target(s.ROUTE_DECISIONS, RouteDecisionBatch, "event", ("migration",)),
        Target(s.MIGRATION_REQUEST, MigrationOrder, "request", ("migration",)),
        Target(s.MIGRATION_DRAIN, DrainNotice, "request", ("migration",)),
        Target(s.INDEX_HOLDERS, HoldersQuery, "request", ("index",)),
        *[Target(s.health(name), None, "raw", ()) for name in SERVICES],
    ]


# names in subjects.py -> the target subject prefix that covers them
COVERED = {
    "REQUESTS_WILDCARD": "thunderagent.requests.", "requests": "thunderagent.requests.",
    "SCHED_SUBMIT_WILDCARD": "thunderagent.sched.submit.",
    "sched_submit": "thunderagent.sched.submit.",
    "SCHED_CANCEL": "thunderagent.sched.cancel",
    "SCHED_DIRECT_WILDCARD": "thunderagent.sched.direct.",
    "sched_direct": "thunderagent.sched.direct.",
    "ROUTER_PRESENCE": "thunderagent.router.presence",
    "router_credits": "thunderagent.router.",
    "SCHED_RUN_FAILED_WILDCARD": "thunderagent.sched.run_failed.",
    "sched_run_failed": "thunderagent.sched.run_failed.",
    "PROGRAM_RELEASE": "thunderagent.programs.release",
    "PROGRESS_WILDCARD": "thunderagent.progress.", "progress": "thunderagent.progress.",
    "worker_progress": "thunderagent.progress.",
    "router_dispatched": "thunderagent.router.", "router_dropped": "thunderagent.router.",
    "worker_generate": "thunderagent.worker.w0.gen",
    "worker_abort": "thunderagent.worker.w0.abort",
    "worker_kv_import": "thunderagent.worker.w1.kv_import",
    "worker_resync": "thunderagent.worker.w0.resync", "worker_load": "thunderagent.worker.w0.load",
    "WORKER_LOAD_WILDCARD": "thunderagent.worker.ghost.load",
    "worker_kv_export": "thunderagent.worker.w0.kv_export",
    "worker_kv_pull": "thunderagent.worker.w1.kv_pull",
    "worker_kv_release": "thunderagent.worker.w0.kv_release",
    "kv_events": "thunderagent.kv.events.", "KV_EVENTS_WILDCARD": "thunderagent.kv.events.",
    "ROUTE_DECISIONS": "thunderagent.route.decisions",
    "MIGRATION_REQUEST": "thunderagent.migration.request",
    "MIGRATION_DRAIN": "thunderagent.migration.drain",
    "INDEX_HOLDERS": "thunderagent.index.holders",
    "health": "thunderagent.health.", "HEALTH_WILDCARD": "thunderagent.health.",
}  # fmt: skip
NOT_SUBJECTS = {"PREFIX", "ROUTER_QUEUE", "SCHEDULER_QUEUE", "KV_EVENTS_STREAM", "INDEX_DURABLE",
                "WORKERS_BUCKET", "MIGRATION_QUEUE", "INDEX_QUEUE"}  # fmt: skip


def test_every_subject_is_covered():
    """A subject added to subjects.py must be fuzzed here, or said to have no subscriber."""
    names = {
        n for n, v in vars(subjects).items()
        if not n.startswith("_") and (isinstance(v, str) or inspect.isfunction(v))
        and getattr(v, "__module__", subjects.__name__) == subjects.__name__
    }  # fmt: skip
    fuzzed = {t.subject for t in targets("r")}
    uncovered = []
    for name in sorted(names - NOT_SUBJECTS - set(NOT_SUBSCRIBED)):
        prefix = COVERED.get(name)
        if prefix is None or not any(subject.startswith(prefix) for subject in fuzzed):
            uncovered.append(name)
    assert not uncovered, f"subjects.py names no fuzz target covers: {uncovered}"


async def _start(stack, redis_url: str) -> str:
    from thunderagent.gateway.service import Gateway, GatewayConfig
    from thunderagent.migrator.service import MigrationConfig, MigrationService

    await start_full_stack(stack, workers=2, policy="thunder", redis_url=redis_url, speedup=200)
    config = MigrationConfig(interval_s=0.2)
    await stack.start_service("migration", lambda ctx, svc: svc.run(ctx),
                              build=lambda ctx: MigrationService(ctx.bus, config))  # fmt: skip
    gateway = GatewayConfig(port=0)  # the OpenAI HTTP gateway: watches the fleet's load reports
    await stack.start_service("gateway", lambda ctx, gw: gw.run(ctx.stop),
                              build=lambda ctx: Gateway(ctx.bus, gateway))  # fmt: skip
    for name, svc in stack.services.items():
        await _answer_health(svc.bus, name)
    return stack.services["router"].runtime.router.config.router_id


async def _serves(nats_url: str) -> None:
    client = await ThunderClient.connect(nats_url, idle_timeout_s=20)
    try:
        for i in range(100):  # the index may still be replaying the fuzzed stream
            request = GenerateRequest(model=MODEL, token_ids=[5, 6, 7, i], max_tokens=4)
            try:
                done = await client.generate(request)
                assert done.final is not None and done.final.usage.completion_tokens == 4
                return
            except Exception:
                if i == 99:
                    raise
    finally:
        await client.close()


class ErrorLog(logging.Handler):
    """Every error a service logs (a handler that raised, the engine's HTTP server failing a
    request): the exception is the finding's cause."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.seen: Counter = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        err = record.exc_info[1] if record.exc_info else None
        where = ""
        if err is not None and err.__traceback__ is not None:
            frame = err.__traceback__
            while frame.tb_next is not None:
                frame = frame.tb_next
            where = f" at {frame.tb_frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.tb_lineno}"
        self.seen[f"{record.name}: {record.getMessage()[:90]}: {err!r}"[:300] + where] += 1


def _findings(stack, results, observer, errors: ErrorLog) -> list[str]:
    out = list(observer.bad_dead_letters)
    out += [f"{n} x logged: {line}" for line, n in errors.seen.items()]
    for name, svc in stack.services.items():
        if svc.task.done():
            out.append(f"{name}: service task ended: {svc.task!r}")
        if not svc.bus.nc.is_connected or svc.bus.nc.stats.get("reconnects"):
            out.append(f"{name}: NATS connection dropped ({svc.bus.nc.stats})")
        for subject, st in svc.bus.stats.items():
            if st.handler_errors and not errors.seen:  # else the log says which and why
                out.append(f"{name}: {st.handler_errors} handler errors on {subject}")
    for (service, subject), records in observer.dead.items():
        failed = [r for r in records if r.reason.startswith("handler failed")]
        for r in failed[:3]:  # the exception, and the message that raised it
            out.append(f"{service} on {subject}: {r.reason[:300]}\n    payload {r.raw[:300]!r}")
    for r in results:
        where = r.target.subject
        if r.unanswered:
            out.append(f"{where}: {len(r.unanswered)} unanswered, e.g. {r.unanswered[:3]}")
        if r.missing_dead_letters:
            out.append(f"{where}: dead letters missing {r.missing_dead_letters}")
        if r.unanswered_rejections:
            out.append(f"{where}: rejections without an ErrorReply, e.g. "
                       f"{r.unanswered_rejections[:3]}")  # fmt: skip
    return out


def _line(r) -> str:
    return (f"  {r.target.subject:45s} {r.sent:6d} sent {r.with_reply:6d} with reply "
            f"{r.invalid:6d} invalid {r.seconds:6.2f} s")  # fmt: skip


@pytest.mark.timeout(1800 if LONG else 300)
async def test_fuzz_every_subscribed_subject(nats_server, redis_server, capsys):
    # every rejection logs a warning: tens of thousands of records would cost more than the
    # fuzzing; errors (a handler that raised) still log
    quiet = logging.getLogger("thunderagent")
    level, quiet.level = quiet.level, logging.ERROR
    campaign = Campaign(nats_server.url, capsys)
    try:
        async with inproc_stack(nats_server.url) as stack:
            await campaign.run(stack, redis_server.url)
    except AssertionError as err:  # inproc_stack: a service task ended with an exception
        campaign.findings.append(str(err))
    finally:
        quiet.setLevel(level)
    new, known = _triage(campaign.findings)
    with capsys.disabled():
        print(campaign.summary())
        for pattern in known:
            print(f"  known finding (reported): {KNOWN[pattern]}")
    assert not new, f"seed {SEED}:\n" + "\n".join(new)
    assert not (STRICT and known), f"seed {SEED}: known findings: {sorted(known)}"
    assert campaign.results and all(r.sent == CASES for r in campaign.results)


def _triage(findings: list[str]) -> tuple[list[str], set[str]]:
    """(findings no known cause explains, the known causes that showed up)."""
    new, known = [], set()
    for finding in findings:
        hits = [p for p in KNOWN if re.search(p, finding, re.S)]
        if hits:
            known.update(hits)
        else:
            new.append(finding)
    return new, known


class Campaign:
    """One fuzz run over every target; collects findings instead of stopping at the first."""

    def __init__(self, nats_url: str, capsys) -> None:
        self.nats_url = nats_url
        self.capsys = capsys
        self.results: list = []
        self.findings: list[str] = []
        self.observer: Observer | None = None
        self.seconds = 0.0
        self.loop_errors: list[str] = []
        self.errors = ErrorLog()

    def _on_loop_error(self, loop, context: dict) -> None:
        """Exceptions no one awaited (a task a service spawned and forgot) are findings too."""
        err = context.get("exception")
        self.loop_errors.append(f"{context.get('message')}: {err!r}"[:120])  # grouped by cause

    async def run(self, stack, redis_url: str) -> None:
        loop = asyncio.get_running_loop()
        previous = loop.get_exception_handler()
        loop.set_exception_handler(self._on_loop_error)
        logging.getLogger().addHandler(self.errors)
        try:
            await self._run(stack, redis_url)
        finally:
            logging.getLogger().removeHandler(self.errors)
            gc.collect()  # unretrieved task exceptions are reported when the task is freed
            loop.set_exception_handler(previous)
            seen = Counter(self.loop_errors)
            self.findings += [f"{n} x unhandled in a task: {e}" for e, n in seen.items()]

    async def _run(self, stack, redis_url: str) -> None:
        rng = random.Random(SEED)
        router_id = await _start(stack, redis_url)
        await wait_subscribed(stack, targets(router_id))
        await asyncio.sleep(0.5)  # the stream consumers start with the subscriptions
        nc = await connect(self.nats_url, name="fuzz", deadline_s=10)
        self.observer = Observer(nc)
        await self.observer.start()
        started = time.monotonic()
        try:
            for n, target in enumerate(targets(router_id)):
                payloads = cases(rng, target.message_type, CASES, BIG)
                if ONLY not in target.subject:
                    continue
                alive = lambda s: not stack.services[s].task.done()  # noqa: E731
                result = await fuzz_target(
                    nc, self.observer, target, payloads, tag=str(n), alive=alive
                )
                self.results.append(result)
                if VERBOSE:
                    with self.capsys.disabled():
                        print(_line(result), flush=True)
            self.seconds = time.monotonic() - started
            await self._still_serves(nc)
            self.findings += _findings(stack, self.results, self.observer, self.errors)
        finally:
            await nc.close()

    async def _still_serves(self, nc) -> None:
        try:
            await _serves(self.nats_url)
        except Exception as err:
            self.findings.append(f"no normal request served after fuzzing: {err!r}")
        for name in SERVICES:
            try:
                await nc.request(subjects.health(name), b"", timeout=5)
            except Exception as err:
                self.findings.append(f"{name} does not answer its health probe: {err!r}")

    def summary(self) -> str:
        dead = sum(len(v) for v in self.observer.dead.values()) if self.observer else 0
        lines = [f"\nfuzz seed {SEED}: {len(self.results)} subjects x {CASES} cases in "
                 f"{self.seconds:.1f} s, {sum(r.invalid for r in self.results)} undecodable, "
                 f"{dead} dead letters"]  # fmt: skip
        return "\n".join(lines + [_line(r) for r in self.results])
