"""Route decisions and the hand-offs router -> scheduler -> worker adapter."""

from __future__ import annotations

from typing import Annotated, Final, Literal

from msgspec import Meta, Struct, field

from thunderagent.schemas.generate import ErrorCode, GenerateRequest, TokenId, Usage
from thunderagent.schemas.ids import (
    OfferName,
    OfferNames,
    PositiveInt,
    ReplySubject,
    RouterId,
    RouterIdOrNone,
)
from thunderagent.schemas.kv import check_block_hashes


class Candidate(Struct, frozen=True, kw_only=True):
    """One ranked worker for a request."""

    worker_id: str
    """Worker."""
    score: float
    """Policy score; higher is better."""
    overlap_blocks: int = 0
    """Leading prompt blocks the router believes this worker has cached."""


class RouteDecision(Struct, frozen=True, kw_only=True):
    """The router's choice for one request: in its ``ScheduleRequest``, and for observers in a
    ``RouteDecisionBatch``."""

    request_id: str
    """Routed request."""
    model: str
    """Its model."""
    worker_id: str
    """First choice."""
    overlap_blocks: int
    """Predicted cached leading blocks on the first choice."""
    prompt_blocks: int
    """Full blocks in the prompt."""
    candidates: list[Candidate]
    """Ranked candidates, best first (the scheduler may spill to later ones)."""
    policy: str
    """Routing policy that decided."""
    decided_at: float
    """Unix seconds."""
    decision_us: float = 0.0
    """Time spent hashing and scoring, microseconds."""
    prefix_hash: int | None = None
    """Hash of the deepest prompt block cached on the chosen worker (names the reused prefix;
    the index counts these to find hot prefixes). None without a hit."""
    lora_name: str | None = None
    """The LoRA adapter it names (None: the base model): its prefix is cached in the adapter's
    namespace, so a copy of it can go only to a worker with the adapter loaded."""

    def __post_init__(self) -> None:
        if self.prefix_hash is not None:
            check_block_hashes([self.prefix_hash])


class RouteDecisionBatch(Struct, frozen=True, kw_only=True):
    """Router -> observers (the migration service, dashboards, benchmarks) on
    ``subjects.ROUTE_DECISIONS``: the decisions of one router replica over a short window (its
    first waits at most 50 ms), oldest first. Read in aggregate, so one message per request
    would be pure overhead."""

    router_id: RouterId
    """The replica that decided."""
    decisions: list[RouteDecision]
    """Oldest first."""


class UnansweredOffer(Struct, frozen=True, kw_only=True):
    """A hand-off that got no answer in time: the worker may still take it late."""

    worker_id: str
    """Where it went."""
    offer: OfferName
    """Its name (``WorkerGenerate.offer``)."""


class ScheduleRequest(Struct, frozen=True, kw_only=True):
    """Router -> scheduler. The request is tokenized: ``request.token_ids`` is always set."""

    request: GenerateRequest
    """The request, token ids filled in, request id assigned."""
    reply_subject: ReplySubject
    """Client inbox that receives ``TokenChunk`` / ``FinalReply`` / ``ErrorReply``."""
    decision: RouteDecision
    """The router's ranking."""
    block_size: PositiveInt = 16
    """Block size the decision was computed with."""
    block_hashes: list[int] = field(default_factory=list)
    """Primary hashes of the prompt's full blocks (for prefix grouping)."""
    expected_output_tokens: int = 0
    """The router's estimate of the output length (0: use ``max_tokens``)."""
    router_id: RouterIdOrNone = ""
    """The router replica that routed it: the scheduler tells it where the request went."""
    unanswered: list[UnansweredOffer] = field(default_factory=list)
    """The router's own hand-offs of this request that got no answer (its fast path): the
    worker may still take one late, so the scheduler voids them where it does not run it."""

    def __post_init__(self) -> None:
        # a run of text could never be resumed: continuations extend the prompt's token ids
        if self.request.token_ids is None:
            raise ValueError("a scheduled request carries token ids (the router tokenizes)")


class Dispatched(Struct, frozen=True, kw_only=True):
    """Scheduler -> the routing replica: a run of the request was handed to ``worker_id``
    (first dispatch, a spill to another candidate, or a continuation after a preemption). The
    router books it there: in-flight prefix, pending load, lazy verification, policy state."""

    request_id: str
    """The request."""
    worker_id: str
    """The worker that accepted the run (the prefill worker under PD)."""


class Dropped(Struct, frozen=True, kw_only=True):
    """Scheduler -> the routing replica: the request leaves the scheduler with no run on a
    worker (refused at its deadline, cancelled while it waited, taken by no worker), or the
    replica routed a client's resend of a request that runs already, or that another replica
    routed. The router counts a request as load on its first candidate from the decision until
    a worker takes it; this lets that go at once."""

    request_id: str
    """The request."""


class DirectDispatch(Struct, frozen=True, kw_only=True):
    """Router -> scheduler: the router dispatched this request itself, on credit, and the
    worker accepted it. The scheduler books it as one of its own runs (room, prefix leader,
    preemption, cancellation, lifecycle), or stops it when the id's request holds another run:
    another client's, or this client's resend that ran or runs (a router read the first send
    late). A resend still waiting in the queue is served by this run instead."""

    submit: ScheduleRequest
    """What the router would otherwise have submitted."""
    worker_id: str
    """The worker that accepted it."""
    pull: PullHint | None = None
    """The prefix copy the router ordered with it: the scheduler books its link time too, so
    its own pull decisions see the links the fast path is using."""


class RouterHello(Struct, frozen=True, kw_only=True):
    """Router -> scheduler, every second: this replica is alive and wants its credit share."""

    router_id: RouterId
    """The replica."""


class CreditGrant(Struct, frozen=True, kw_only=True):
    """Scheduler -> one router replica: the room it may fill by dispatching itself."""

    router_id: RouterId
    """The replica this grant is for."""
    credits: dict[str, int]
    """worker id -> requests the router may send there without asking (absent: none)."""
    booked: dict[str, int]
    """worker id -> the router's direct dispatches the scheduler had booked when it granted:
    the router may send ``credits - (its direct dispatches - booked)`` more."""
    issued_at: float
    """Scheduler clock, Unix seconds."""
    scheduler_id: str = ""
    """The scheduler that granted it: schedulers partitioned by model each grant their own
    workers, and a router adds their grants up."""


class PullHint(Struct, frozen=True, kw_only=True):
    """With a run (``WorkerGenerate.pull``): another worker holds more of the prompt's prefix
    than this one, and copying it is cheaper than computing it. An adapter whose engine can
    import KV (NIXL) copies the prompt's leading ``blocks`` from ``source_worker`` before the
    run starts (export there, pull here, release there); any other adapter, or a copy that
    fails, leaves the run to compute them."""

    source_worker: RouterId
    """The worker holding the blocks (a worker id)."""
    prefix_hash: int
    """Our primary hash of the prompt's block ``blocks - 1``: names the prefix to the source."""
    blocks: PositiveInt
    """Leading prompt blocks to hold once the copy lands."""
    budget_s: Annotated[float, Meta(ge=0.0)] = 0.0
    """Give the copy up after this long and let the run prefill: the prefill time it saves, so
    a copy that stalls costs the run at most that (0: the adapter's own bound)."""


class PdBootstrap(Struct, frozen=True, kw_only=True):
    """SGLang's PD pairing of one request: the decode engine takes its KV from the prefill
    engine's bootstrap server at ``host``:``port``, ``room`` naming the request on both
    (SGLang's ``bootstrap_host``, ``bootstrap_port`` and ``bootstrap_room``)."""

    host: str
    """The prefill engine's host, as the decode engine reaches it."""
    port: Annotated[int, Meta(gt=0, lt=65536)]
    """Its bootstrap port (``disaggregation_bootstrap_port``)."""
    room: Annotated[int, Meta(ge=0, le=2**63 - 1)]
    """A random 63-bit id, the same on both engines' requests."""
    prefill_dp_rank: int | None = None
    """The prefill engine's data-parallel rank that computes the KV (SGLang's
    ``disagg_prefill_dp_rank``, on both requests: without it a prefill engine balancing by room
    fails a run routed to another rank); None: the engine's only rank."""


class WorkerGenerate(Struct, frozen=True, kw_only=True):
    """Scheduler -> adapter (request/reply: the adapter acks, then streams to ``reply_subject``)."""

    request: GenerateRequest
    """Tokenized request."""
    reply_subject: ReplySubject
    """Client inbox."""
    predicted_cached_tokens: int = -1
    """Router's prediction, echoed in the final reply for lazy verification."""
    attempt: int = 0
    """How many workers were tried before this one."""
    output_offset: int = 0
    """Output tokens the client already received before a preemption: ``request.token_ids``
    ends with them, and this run's token chunks continue numbering from here."""
    decode_worker: str = ""
    """PD disaggregation: prefill here up to the first token, move the KV to this worker and
    hand it the rest of the request. Empty: run the whole request here."""
    pull: PullHint | None = None
    """Copy the prompt's prefix from another worker first (first runs only; None: no copy)."""
    bootstrap: PdBootstrap | None = None
    """SGLang's PD: this decode engine runs the whole request, its KV coming from the paired
    prefill engine, which gets the same request with the same pairing (None: not paired)."""
    offer: OfferName = ""
    """This hand-off's name, the same when its sender asks again: the worker runs an offer
    once and refuses one it has handled (``fleet.offers``). Empty: not named, not tracked."""
    supersedes: OfferNames = field(default_factory=list)
    """Earlier offers of this run to this worker that got no answer: taking this one, the
    worker refuses them should they arrive later."""


class Ack(Struct, frozen=True, kw_only=True):
    """Acknowledgement of a hand-off; ``accepted=False`` carries the reason."""

    accepted: bool
    """Whether the receiver took responsibility for the request."""
    reason: str = ""
    """Why not."""
    code: ErrorCode | None = None
    """The error class to tell the client when not accepted (None: ``unavailable``)."""
    retry_after_s: float | None = None
    """With ``overloaded``: when a retry is likely to be admitted (seconds from now)."""


class AbortRequest(Struct, frozen=True, kw_only=True):
    """Scheduler -> adapter (request/reply, answered with ``Preempted``): stop a running request.

    The adapter closes its engine stream (SGLang aborts a request whose client disconnects) and
    sends the client nothing: the scheduler resumes the request as a continuation."""

    request_id: str
    """Request to abort."""
    reason: str = ""
    """Why."""
    offers: OfferNames = field(default_factory=list)
    """Offers of the request to this worker that got no answer: whether or not a run is found,
    the worker refuses any of them that arrives after this abort (it may be queued there
    still, behind the abort)."""


class Preempted(Struct, frozen=True, kw_only=True):
    """Adapter -> scheduler: what a request had produced when it was aborted."""

    request_id: str
    """The aborted request."""
    found: bool
    """False when the request was no longer running (it finished or failed first)."""
    output_token_ids: list[TokenId] = field(default_factory=list)
    """Every output token the client has received, including earlier runs."""


class CancelRequest(Struct, frozen=True, kw_only=True):
    """Client (or gateway) -> scheduler: stop a request; the client no longer wants it.

    A waiting request leaves the queue; a running one is aborted at its engine, freeing the slot.
    Nothing more is sent to the client's reply subject. Unknown ids are ignored (it ended)."""

    request_id: str
    """The request to stop."""
    reason: str = ""
    """Why (client disconnected, timeout)."""


class RunFailed(Struct, frozen=True, kw_only=True):
    """Adapter -> scheduler (request/reply, answered with an ``Ack``): the engine failed a run
    (connection lost, engine error). ``Ack(accepted=True)``: the scheduler resumes the request
    on another worker as a continuation (the client's stream goes on); otherwise, or with no
    answer, the adapter tells the client."""

    request_id: str
    """The request."""
    worker_id: str
    """The worker whose engine failed it."""
    output_token_ids: list[TokenId] = field(default_factory=list)
    """Every output token the client has received (earlier runs included)."""
    reason: str = ""
    """What the engine said."""


class ProgramRelease(Struct, frozen=True, kw_only=True):
    """Client -> scheduler: an agent program (session) is over; its KV need not be kept."""

    program_id: str
    """The program that ended."""


class KvTransfer(Struct, frozen=True, kw_only=True):
    """Prefill adapter -> decode adapter (request/reply, answered with an ``Ack`` once the blocks
    are in the decode engine's cache): the prompt whose KV moves over."""

    request_id: str
    """The request being disaggregated."""
    token_ids: list[TokenId]
    """The prompt (and first token) whose full blocks the decode engine imports."""
    source_worker: str
    """Prefill worker the KV comes from."""
    cache_salt: str | None = None
    """The request's tenant salt: the blocks are imported in its namespace, as they were cached."""
    lora_name: str | None = None
    """The request's LoRA adapter: likewise."""


class RequestProgress(Struct, frozen=True, kw_only=True):
    """One event of a run's life on a worker (admission accounting, verification); adapters
    send them in ``ProgressBatch``es."""

    request_id: str
    """The request."""
    worker_id: str
    """Where it runs."""
    phase: Literal["started", "transferred", "finished", "failed", "aborted"]
    """``started``: first token out (prefill done); ``transferred`` (PD): the KV reached the
    decode worker ``worker_id`` from ``from_worker``, which hands the rest of the request to it;
    ``finished``, ``failed`` and ``aborted`` (cancelled or preempted) end the run."""
    ts: float
    """Adapter wall clock, Unix seconds."""
    from_worker: str = ""
    """``transferred``: the prefill worker the KV came from."""
    usage: Usage | None = None
    """``finished``: the engine's token accounting (cached tokens verify the router's hit)."""


RUN_END_PHASES: Final = frozenset({"finished", "failed", "aborted"})
"""The phases after which a run holds nothing on its worker."""


class ProgressBatch(Struct, frozen=True, kw_only=True):
    """Adapter -> scheduler and routers, on ``subjects.progress(worker_id, ended=...)``: run events
    of one adapter, in the order they happened (a run whose first token is also its last
    sends its start and its end together). A batch holding a run's end goes on the ``ended``
    subject, starts and PD hand-offs alone on ``running``; the scheduler and routers read
    both (a router drops a prompt from its queued-prefill estimate at the start). Every
    event names ``worker_id`` (a PD ``transferred`` event names the decode worker and has
    ``from_worker`` = ``worker_id``); a batch that speaks for another worker, or for none,
    or arrives on the wrong subject, is dead-lettered."""

    worker_id: str
    """The adapter that sent it (the subject's worker)."""
    events: list[RequestProgress]
    """Oldest first; at least one."""

    @property
    def ends_runs(self) -> bool:
        """Some event ends a run (the batch goes on the ``ended`` subject)."""
        return any(event.phase in RUN_END_PHASES for event in self.events)
