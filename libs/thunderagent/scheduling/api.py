"""The contract between a scheduling policy and whoever drives it (service or replay).

The driver tells the scheduler what happens (``submit``, ``update_worker``, ``on_prefix_cached``,
``on_started``, ``on_finished``) and asks it what to do (``poll``), at every event and at the time
``next_wakeup`` names. The scheduler never reads a clock and does no I/O: it returns actions and
the driver carries them out (send to a worker, abort at an engine and re-submit, answer with an
error).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(slots=True)
class SchedRequest:
    """A routed request waiting for a worker."""

    request_id: str
    arrival: float
    """When the scheduler first saw it (driver's clock)."""
    prompt_tokens: int
    expected_output_tokens: int
    candidates: Sequence[tuple[str, int]]
    """(worker id, predicted cached blocks), ranked by the router, best first."""
    block_size: int = 16
    block_hashes: Sequence[int] = ()
    """Primary hashes of the prompt's full blocks (prefix grouping)."""
    priority: int = 0
    """0 is the most urgent class."""
    program_id: str | None = None
    deadline: float | None = None
    """Absolute time (driver's clock) after which the answer is useless."""
    generated_tokens: int = 0
    """Tokens already produced before a preemption (a continuation resumes after them)."""


@dataclass(slots=True, frozen=True)
class WorkerRoom:
    """A worker's capacity as last reported (admission decides against it)."""

    worker_id: str
    running: int
    queued: int
    kv_used_blocks: int
    kv_total_blocks: int
    max_running: int = 0
    """Engine's running-request cap (0: unknown)."""
    role: str = "both"
    """"prefill", "decode" or "both" (PD disaggregation)."""
    active_blocks: int | None = None
    """KV blocks held by running requests, evictable cache excluded (None: not reported; the
    scheduler then counts only what it dispatched itself)."""


@dataclass(slots=True, frozen=True)
class Dispatch:
    """Send ``request_id`` to ``worker_id``.

    With ``decode_worker`` set (PD disaggregation): ``worker_id`` only prefills; the driver
    calls ``on_started(request_id, worker_id)`` when the prefill ends, moves the KV to
    ``decode_worker`` (KV bytes / link bandwidth), calls ``on_transfer_done(request_id,
    decode_worker)`` when it has landed, decodes there and reports ``on_finished(request_id,
    decode_worker)``.
    """

    request_id: str
    worker_id: str
    decode_worker: str | None = None


@dataclass(slots=True, frozen=True)
class Preempt:
    """Abort ``request_id`` on ``worker_id`` and re-submit it as a continuation."""

    request_id: str
    worker_id: str
    reason: str = ""


@dataclass(slots=True, frozen=True)
class Reject:
    """Answer the client with an error now: its deadline passed or cannot be met, or
    (``unavailable``) no worker can take it at all."""

    request_id: str
    reason: str
    unavailable: bool = False


Action = Dispatch | Preempt | Reject


class Scheduler(Protocol):
    name: str

    def submit(self, request: SchedRequest, now: float) -> None: ...

    def update_worker(self, room: WorkerRoom, now: float) -> None: ...

    def remove_worker(self, worker_id: str, now: float) -> None: ...

    def on_prefix_cached(self, worker_id: str, block_hashes: Sequence[int], now: float) -> None:
        """KV events: these blocks are now cached on the worker (releases grouped requests)."""
        ...

    def on_started(self, request_id: str, worker_id: str, now: float) -> None:
        """First token produced (the request left the prefill phase)."""
        ...

    def on_finished(self, request_id: str, worker_id: str, now: float) -> None: ...

    def on_failed(self, request_id: str, worker_id: str, now: float) -> None:
        """The run ended on ``worker_id`` without serving its step (the worker refused it, or
        its engine failed it for good): what it held is freed, as at ``on_finished``, and
        nothing is known to be cached there for it."""
        ...

    def on_transfer_done(self, request_id: str, worker_id: str, now: float) -> None:
        """PD only: the request's KV has landed on its decode worker ``worker_id``."""
        ...

    def rooms(self) -> dict[str, int]:
        """Requests each worker can take now without waiting here: the room lent to routers
        as credits (``credits.py``). Empty while anything waits here."""
        ...

    def admitted(self, request: SchedRequest, worker_id: str, now: float) -> None:
        """A router dispatched ``request`` to ``worker_id`` on credit: book it as if this
        scheduler had dispatched it (it runs, holds room, may lead a prefix group)."""
        ...

    def cancel(self, request_id: str, now: float) -> bool:
        """The client gave up: a waiting request leaves without an action (True); a running
        one is forgotten like a finished one (the driver aborts it at the engine; False)."""
        ...

    def poll(self, now: float) -> list[Action]:
        """Decisions to carry out now."""
        ...

    def next_wakeup(self, now: float) -> float | None:
        """When ``poll`` should be called again even if nothing happens (None: on events only)."""
        ...

    def waiting(self) -> int: ...


@dataclass
class _Base:
    """Bookkeeping shared by simple schedulers: known workers and in-flight requests."""

    worker_rooms: dict[str, WorkerRoom] = field(default_factory=dict)
    inflight: dict[str, str] = field(default_factory=dict)
    """request id -> worker id."""

    def update_worker(self, room: WorkerRoom, now: float) -> None:
        self.worker_rooms[room.worker_id] = room

    def remove_worker(self, worker_id: str, now: float) -> None:
        self.worker_rooms.pop(worker_id, None)

    def on_prefix_cached(self, worker_id: str, block_hashes: Sequence[int], now: float) -> None:
        pass

    def on_started(self, request_id: str, worker_id: str, now: float) -> None:
        pass

    def on_finished(self, request_id: str, worker_id: str, now: float) -> None:
        self.inflight.pop(request_id, None)

    def on_failed(self, request_id: str, worker_id: str, now: float) -> None:
        self.on_finished(request_id, worker_id, now)

    def on_transfer_done(self, request_id: str, worker_id: str, now: float) -> None:
        pass

    def rooms(self) -> dict[str, int]:
        return {}  # lend nothing: every request comes through the queue

    def admitted(self, request: SchedRequest, worker_id: str, now: float) -> None:
        self.inflight[request.request_id] = worker_id

    def cancel(self, request_id: str, now: float) -> bool:
        self.inflight.pop(request_id, None)
        return False

    def next_wakeup(self, now: float) -> float | None:
        return None
