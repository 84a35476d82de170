"""Worker registry: registrations with leases, renewed by registration puts and load reports.

A worker whose lease lapses (no renewal for ``lease_s``) disappears from routing; its adapter
re-registers when it comes back. The registry never reads a clock: every call takes ``now``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from thunderagent.schemas import LoadReport, WorkerRegistration

if TYPE_CHECKING:
    from thunderagent.routing import WorkerView

CARRIED_LIMIT = 4096
"""Requests carried over reports per worker at most: a start this process never hears of (a
lost message, a run that ended on another worker) would otherwise stay carried while the
worker keeps a backlog; past the limit the carry starts afresh, which only makes the queue look
longer."""


@dataclass(slots=True)
class WorkerState:
    registration: WorkerRegistration
    renewed_at: float
    load: LoadReport | None = None
    assigned_since_report: int = 0
    """Requests this process sent the worker since its last load report: the report lags, and
    without this a burst would all go to the worker that looked idle."""
    assigned_prefill_since_report: int = 0
    """Their prompt tokens this process expects the worker to prefill (predicted hits off)."""
    assigned_kv_since_report: int = 0
    """Their prompt tokens, cached or not: the KV they will hold there."""
    assigned: dict[str, tuple[int, int]] = field(default_factory=dict)
    """request id -> (prefill, KV tokens) of each of them, so one that starts or ends before the
    next report stops counting as queued work."""
    carried: dict[str, tuple[int, int]] = field(default_factory=dict)
    """request id -> (prefill, KV tokens) of requests this process sent before the last report
    that had no first token when it came: the report's backlog counts them."""
    started_since_report: int = 0
    """Prefill tokens of carried requests that have started since: the report's backlog
    overstates the queue by this much until the next report. Reports come a fraction of a
    second apart, while a prompt can be prefilled in a few ms; without this a cache holder
    looks busy with work it has done."""
    carried_running: dict[str, int] = field(default_factory=dict)
    """request id -> KV tokens of those started since the report and still running."""
    booked: dict[str, tuple[int, int]] = field(default_factory=dict)
    """request id -> (prefill, KV tokens) of requests this process routed here that no worker
    has taken yet (their hand-off awaits its ack, or they wait in the scheduler's queue). A
    burst is routed before the first of its hand-offs is answered: without these it would all
    go to the worker that looked idle. Reports do not clear them (nothing was sent yet)."""
    booked_prefill: int = 0
    booked_kv: int = 0
    taken_at: float | None = None
    """When ``load`` was taken (a poller's registry takes fewer reports than it gets)."""
    view: WorkerView | None = field(default=None, repr=False)
    """What routing saw of the worker at its last decision (``fleet.views.worker_view``),
    kept until any of the figures above changes: a decision reads every worker, and between
    two decisions most of a large fleet's workers have not changed."""

    @property
    def worker_id(self) -> str:
        return self.registration.worker_id

    @property
    def started_kv_since_report(self) -> int:
        """Context tokens of carried requests running now: KV they hold, which the report
        (taken while they waited) does not count. Few run at once: summed when asked."""
        return sum(self.carried_running.values()) if self.carried_running else 0

    def assign(self, request_id: str, prefill_tokens: int, kv_tokens: int) -> None:
        self.view = None
        self.assigned[request_id] = (prefill_tokens, kv_tokens)
        self.assigned_since_report += 1
        self.assigned_prefill_since_report += prefill_tokens
        self.assigned_kv_since_report += kv_tokens

    def book(self, request_id: str, prefill_tokens: int, kv_tokens: int) -> None:
        """Routed here, not taken yet (``assign`` once a worker takes it, here or elsewhere)."""
        self.view = None
        self.unbook(request_id)
        self.booked[request_id] = (prefill_tokens, kv_tokens)
        self.booked_prefill += prefill_tokens
        self.booked_kv += kv_tokens

    def unbook(self, request_id: str) -> None:
        got = self.booked.pop(request_id, None)
        if got is not None:
            self.view = None
            self.booked_prefill -= got[0]
            self.booked_kv -= got[1]

    def started(self, request_id: str) -> None:
        """The request's first token is out: the engine has prefilled its prompt, so it is no
        longer queued prefill here, though its KV stays until the next report covers it."""
        self.view = None
        got = self.assigned.get(request_id)
        if got is not None:
            if got[0]:
                self.assigned[request_id] = (0, got[1])
                self.assigned_prefill_since_report -= got[0]
            return
        got = self.carried.pop(request_id, None)
        if got is not None:  # sent before the report: in its backlog, now running
            self.started_since_report += got[0]
            self.carried_running[request_id] = got[1]

    def unassign(self, request_id: str) -> None:
        """The request's run ended before a report covered it: sent since the report (a short
        one, a fast engine), or carried over it."""
        self.view = None
        got = self.assigned.pop(request_id, None)
        if got is not None:
            self.assigned_since_report -= 1
            self.assigned_prefill_since_report -= got[0]
            self.assigned_kv_since_report -= got[1]
        got = self.carried.pop(request_id, None)
        if got is not None:  # its start went unseen: its prefill is done all the same
            self.started_since_report += got[0]
        self.carried_running.pop(request_id, None)

    def take_report(self, load: LoadReport, now: float) -> None:
        """A report covers everything sent before it; what had not started is in its backlog."""
        self.view = None
        self.load = load
        self.renewed_at = now
        self.taken_at = now
        if load.prefill_backlog_tokens <= 0:  # nothing queued: all carried has started, seen or not
            self.carried.clear()
        elif len(self.carried) >= CARRIED_LIMIT:  # starts never heard of: begin afresh
            self.carried.clear()
        else:
            self.carried.update((rid, got) for rid, got in self.assigned.items() if got[0])
        self.started_since_report = 0
        self.carried_running.clear()
        self.assigned_since_report = 0
        self.assigned_prefill_since_report = 0
        self.assigned_kv_since_report = 0
        self.assigned.clear()


class WorkerRegistry:
    def __init__(self, load_poll_s: float = 0.0) -> None:
        """``load_poll_s`` > 0: the reader polls the fleet's loads every ``load_poll_s``
        seconds, every worker at once on the boundaries of its clock (SMG's load monitor), so a
        report is taken only when it is the worker's first since the last boundary; the others
        renew the lease and nothing else. 0: every report is taken."""
        self._workers: dict[str, WorkerState] = {}
        self.load_poll_s = load_poll_s

    def __len__(self) -> int:
        return len(self._workers)

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self._workers

    def get(self, worker_id: str) -> WorkerState | None:
        return self._workers.get(worker_id)

    def register(self, registration: WorkerRegistration, now: float) -> bool:
        """Add or renew; returns True when the worker is new or re-registered with a new epoch."""
        old = self._workers.get(registration.worker_id)
        if old is not None and old.registration.registered_at == registration.registered_at:
            old.renewed_at = now
            old.registration, old.view = registration, None
            return False
        self._workers[registration.worker_id] = WorkerState(registration, renewed_at=now)
        return True

    def report(self, load: LoadReport, now: float) -> bool:
        """Record a load report (or only renew the lease between polls, see ``__init__``);
        False when the worker is not registered."""
        state = self._workers.get(load.worker_id)
        if state is None:
            return False
        poll = self.load_poll_s
        if poll > 0 and state.taken_at is not None and state.taken_at >= now // poll * poll:
            state.renewed_at = now
            return True
        state.take_report(load, now)
        return True

    def remove(self, worker_id: str) -> bool:
        return self._workers.pop(worker_id, None) is not None

    def expire(self, now: float) -> list[str]:
        """Drop workers whose lease lapsed; returns their ids."""
        gone = [
            wid for wid, s in self._workers.items() if now - s.renewed_at > s.registration.lease_s
        ]
        for wid in gone:
            del self._workers[wid]
        return gone

    def for_model(self, model: str, lora_name: str | None = None) -> list[WorkerState]:
        """The workers serving ``model``, with LoRA adapter ``lora_name`` loaded if one is named."""
        states = [s for s in self._workers.values() if s.registration.model == model]
        if lora_name:
            states = [s for s in states if lora_name in s.registration.lora_adapters]
        return states

    def models(self) -> set[str]:
        return {s.registration.model for s in self._workers.values()}

    def all(self) -> list[WorkerState]:
        return list(self._workers.values())
