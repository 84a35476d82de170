"""The router's decision, written once: the router service and the virtual-time replay both run it.

One ``RouterCore`` holds everything a router replica knows and learns:

* the fleet (registrations with leases, latest load reports, runs sent since each report);
* the prefix index fed by KV-event batches (``feeder``: every tier, and a GPU-only view once a
  host tier shows up) plus the in-flight overlay of prompts just dispatched, which covers the
  time until the engine's events arrive;
* for workers whose engines publish no KV events, when the policy keeps one (Dynamo's), an
  approximate index of the prompts this replica sent them, each entered when its run gives its
  first token and kept ``approximate_ttl_s`` (ThunderAgent's adapters announce such a cache on
  the KV stream instead: ``thunderagent.sglang.shadow``);
* the routing policy and its rng, the lazy verifier, the running mean of output lengths and the
  feedback window the online tuner learns from.

Life of a request: ``route`` (hash, overlaps, rank; the request is booked as load on its first
candidate, so the next decisions see it before any worker takes it; ``bookings.py``) ->
``on_offered`` when the caller hands it to that worker itself, on credit (its prompt counts as
in flight there until the answer; ``on_offer_refused`` if none takes it) -> ``on_dispatched`` with
the worker that actually took the run (the scheduler's choice, which may not be the first
candidate; the booking moves there) -> ``on_finished`` when the run ends (verification, policy
bookings, output mean).
``tick`` expires TTLs and, once per ``feedback_interval_s``, gives the policy its feedback.
Every method takes the caller's clock; nothing here does I/O.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from thunderagent.fleet import WorkerRegistry, WorkerState, worker_view
from thunderagent.hashing import BlockHasher, BlockHashes, kv_namespace
from thunderagent.prefix_index import DEFAULT_TTL_S, PrefixIndex
from thunderagent.prefix_index.feed import FeedOutcome, IndexFeeder
from thunderagent.prefix_index.inflight import INFLIGHT_TTL_S, InflightPrefixes, longer_matches
from thunderagent.prefix_index.prefilled import APPROXIMATE_TTL_S, PrefilledPrefixes
from thunderagent.router_core.bookings import Bookings
from thunderagent.router_core.verification import Dispatch, Verdict, Verifier
from thunderagent.routing import POLICIES, RouteQuery, RoutingFeedback, WorkerView
from thunderagent.routing.cost import RunningMean
from thunderagent.scheduling.credits import may_dispatch_directly
from thunderagent.schemas import (
    Candidate,
    KvEventBatch,
    LoadReport,
    RouteDecision,
    WorkerRegistration,
)


@dataclass(kw_only=True)
class RouterParams:
    """Everything that shapes a router's decisions; the same object configures the service and
    the replay."""

    policy: str = "thunder"
    policy_params: dict[str, Any] = field(default_factory=dict)
    """Overrides of the policy's documented defaults (``--param FIELD=VALUE``)."""
    seed: int | None = None
    """Seed of the tie-breaking rng (None: random)."""
    index_ttl_s: float | None = DEFAULT_TTL_S
    """Prefix-index TTL (None: entries live until removed)."""
    inflight_ttl_s: float = INFLIGHT_TTL_S
    approximate_ttl_s: float = APPROXIMATE_TTL_S
    """How long a prompt sent to a worker without KV events counts as cached there."""
    feedback_interval_s: float = 1.0
    """How often the policy's ``observe`` gets the window's measurements."""
    prior_output_tokens: int = 128
    """Output length assumed before any request has finished."""
    output_alpha: float = 0.02
    """EMA weight of finished output lengths (~50 requests of memory)."""
    verify_capacity: int = 50_000
    """Dispatched runs remembered for verification (and routed ones awaiting dispatch)."""
    booking_ttl_s: float = 30.0
    """How long a routed request no worker has taken counts as load on its first candidate at
    most: the scheduler tells the router of one it drops (``Dropped``), but a message can be
    lost."""


@dataclass(slots=True)
class Routed:
    """The core's answer for one request; ``decision`` is what goes on the wire."""

    decision: RouteDecision
    query: RouteQuery
    hashes: BlockHashes
    model: str
    confirmed: dict[str, int]
    """Per worker, the prefix its engine has reported holding."""
    expected: dict[str, int]
    """Per worker, the prefix the router expects its engine to find: ``confirmed`` plus the
    in-flight overlay (prompts dispatched moments ago). What the run's predicted hit and the
    worker's pending prefill are booked from, whatever the policy was shown (``query``)."""

    def may_dispatch_directly(self, deadline: float | None, program_id: str | None) -> bool:
        """Whether the first candidate may take it on the router's credit (``credits.py``)."""
        first = self.decision.worker_id
        return may_dispatch_directly(
            deadline=deadline,
            program_id=program_id,
            confirmed_blocks=self.confirmed.get(first, 0),
            predicted_blocks=self.expected.get(first, 0),
        )


def _usable_blocks(query: RouteQuery) -> int:
    """Blocks of the prompt an engine can serve from cache (the last token is always computed)."""
    return max(0, (query.prompt_tokens - 1) // query.block_size)


def _uncached_tokens(routed: Routed, worker_id: str) -> int:
    """Prompt tokens ``worker_id`` is expected to prefill for the request."""
    query = routed.query
    predicted = min(routed.expected.get(worker_id, 0), _usable_blocks(query))
    return query.prompt_tokens - predicted * query.block_size


def _expecting(candidate: Candidate, expected: dict[str, int]) -> Candidate:
    """``candidate`` with the prefix the router expects its worker to hold."""
    blocks = expected.get(candidate.worker_id, 0)
    return Candidate(worker_id=candidate.worker_id, score=candidate.score, overlap_blocks=blocks)


@dataclass(slots=True)
class FeedbackWindow:
    """Predicted vs found cached tokens of the runs verified since the last ``observe``."""

    predicted_tokens: int = 0
    hit_tokens: int = 0

    def false_hit_rate(self) -> float:
        if not self.predicted_tokens:
            return 0.0
        return max(0.0, 1.0 - self.hit_tokens / self.predicted_tokens)


class RouterCore:
    def __init__(
        self, params: RouterParams | None = None, *, timer: Callable[[], float] | None = None
    ) -> None:
        """``timer``: a monotonic clock in seconds to time each decision with (the service
        passes ``time.perf_counter``); None records 0."""
        self.params = p = params or RouterParams()
        self.timer = timer
        self.feeder = IndexFeeder(PrefixIndex(p.index_ttl_s))
        self.inflight = InflightPrefixes(p.inflight_ttl_s)
        self.approximate = PrefilledPrefixes(p.approximate_ttl_s)
        """Prompts prefilled on workers whose engines publish no KV events."""
        self._prefilling: OrderedDict[str, tuple[str, BlockHashes]] = OrderedDict()
        """Runs dispatched to an eventless worker, until their first token."""
        self.policy = POLICIES.create(p.policy, **p.policy_params)
        self._approximates = self.policy.keeps_approximate_cache()
        self._overlay = self.policy.reads_dispatch_overlay()
        # a peer that polls engine load (SMG, every 10 s) sees it as it would, live and replayed
        self.fleet = WorkerRegistry(load_poll_s=self.policy.load_poll_s())
        self.rng = random.Random(p.seed)
        self.verifier = Verifier(p.verify_capacity)
        self.window = FeedbackWindow()
        self.outputs = RunningMean(p.output_alpha, prior=float(p.prior_output_tokens))
        self._routed: OrderedDict[str, Routed] = OrderedDict()
        self.bookings = Bookings(self.fleet, self.policy, p.booking_ttl_s)
        self._hashers: dict[int, BlockHasher] = {}
        self._next_feedback: float | None = None

    # ---- fleet and index inputs ----------------------------------------------------------

    def register(self, registration: WorkerRegistration, now: float) -> bool:
        changed = self.fleet.register(registration, now)
        if changed:
            self.on_registered(registration.worker_id)
        return changed

    def on_registered(self, worker_id: str) -> None:
        """The fleet has a new registration of ``worker_id`` (the router service's fleet watch
        fills the registry itself and calls this)."""
        if self._approximates and not self._eventless(worker_id):  # its events say it all now
            self.approximate.forget(worker_id)

    def _eventless(self, worker_id: str) -> bool:
        state = self.fleet.get(worker_id)
        return state is not None and not state.registration.kv_events

    def report(self, load: LoadReport, now: float) -> bool:
        return self.fleet.report(load, now)

    def remove(self, worker_id: str) -> None:
        """The worker left (deregistered or lease lapsed): forget its cache and bookings."""
        self.fleet.remove(worker_id)
        self.feeder.forget(worker_id)
        self.inflight.forget(worker_id)
        self.approximate.forget(worker_id)

    def expire(self, now: float) -> list[str]:
        gone = self.fleet.expire(now)
        for worker_id in gone:
            self.remove(worker_id)
        return gone

    def apply_kv(self, batch: KvEventBatch, now: float) -> FeedOutcome:
        """A worker's cache events; blocks it reports gone also leave the in-flight overlay
        (a prefix evicted or moved away must not attract requests for the overlay's TTL)."""
        outcome = self.feeder.apply(batch, now)
        self.inflight.drop_removed(batch)
        return outcome

    # ---- hashing -------------------------------------------------------------------------

    def hash_tokens(
        self, token_ids: Sequence[int], block_size: int, salt: str | None = None,
        lora_name: str | None = None,
    ) -> BlockHashes:  # fmt: skip
        """The prompt's chained block hashes; a salt (tenant) and a LoRA adapter open their own
        namespace (``kv_namespace``), as the engine caches them."""
        if salt or lora_name:  # unbounded: such a hasher is built per call (two hashes)
            return BlockHasher(block_size, kv_namespace(salt, lora_name)).hash_tokens(token_ids)
        hasher = self._hashers.get(block_size)
        if hasher is None:
            hasher = self._hashers[block_size] = BlockHasher(block_size)
        return hasher.hash_tokens(token_ids)

    # ---- the decision --------------------------------------------------------------------

    def expected_output(self, max_tokens: int, hint: int | None = None) -> int:
        """The client's estimate when it gives one, else the running mean, within the budget."""
        guess = hint if hint is not None else round(self.outputs.get())
        return max(1, min(guess, max_tokens))

    def route(
        self,
        *,
        request_id: str,
        model: str,
        hashes: BlockHashes,
        prompt_tokens: int,
        block_size: int,
        expected_output_tokens: int,
        now: float,
        priority: int = 0,
        lora_name: str | None = None,
    ) -> Routed | None:
        """Rank the workers serving ``model`` (with LoRA adapter ``lora_name`` loaded, if named)
        for this prompt; None when none serves it. The answer is kept, and the request booked
        on its first candidate, until ``on_dispatched`` or ``forget`` (``_remember``)."""
        states = self.fleet.for_model(model, lora_name)
        if not states:
            return None
        started = self.timer() if self.timer is not None else 0.0
        serving = {s.worker_id for s in states}
        confirmed, flying = self._overlaps(hashes, now)
        expected = longer_matches(confirmed, flying)
        seen = expected if self._overlay else longer_matches(confirmed, self._recorded(flying))
        query = RouteQuery(
            request_id=request_id,
            prompt_tokens=prompt_tokens,
            block_size=block_size,
            block_hashes=hashes.primary,
            overlaps={w: n for w, n in seen.items() if w in serving},
            host_overlaps={w: n for w, n in self._any_tier(hashes, seen).items() if w in serving},
            expected_output_tokens=expected_output_tokens,
            priority=priority,
            now=now,
        )
        ranked = self.policy.rank(query, self._views(states), self.rng)
        if not self._overlay:  # what the router expects, whatever the policy was shown
            ranked = [_expecting(c, expected) for c in ranked]
        decision = self._decision(query, model, hashes, ranked, expected, started, lora_name)
        routed = Routed(decision, query, hashes, model, confirmed, expected)
        self._remember(routed, now)
        return routed

    def _decision(
        self,
        query: RouteQuery,
        model: str,
        hashes: BlockHashes,
        ranked: list[Candidate],
        expected: dict[str, int],
        started: float,
        lora_name: str | None,
    ) -> RouteDecision:
        """The answer on the wire: the first candidate, with the prefix the router expects it
        to hold, and how long the decision took."""
        best = ranked[0].worker_id
        overlap = expected.get(best, 0)
        return RouteDecision(
            request_id=query.request_id,
            model=model,
            worker_id=best,
            overlap_blocks=overlap,
            prompt_blocks=len(hashes.primary),
            candidates=ranked,
            policy=self.policy.name,
            decided_at=query.now,
            decision_us=(self.timer() - started) * 1e6 if self.timer is not None else 0.0,
            prefix_hash=hashes.primary[overlap - 1] if overlap else None,
            lora_name=lora_name,
        )

    def _views(self, states: Sequence[WorkerState]) -> list[WorkerView]:
        """What the policy sees of each worker, with how many blocks the index holds there."""
        held = self.feeder.gpu_index.block_counts()
        if self.approximate.holds_any():
            guessed = self.approximate.block_counts()
            held = {w: held.get(w, 0) + guessed.get(w, 0) for w in held.keys() | guessed.keys()}
        return [worker_view(s, held.get(s.worker_id, 0)) for s in states]

    def _remember(self, routed: Routed, now: float) -> None:
        """Keep the answer, and the request booked on its first candidate, until its dispatch
        notice; the oldest go past ``verify_capacity``."""
        self._routed[routed.decision.request_id] = routed
        first = routed.decision.worker_id
        self.bookings.book(routed.query, first, _uncached_tokens(routed, first), now)
        if len(self._routed) > self.params.verify_capacity:
            self.bookings.release(self._routed.popitem(last=False)[0])

    def _overlaps(self, hashes: BlockHashes, now: float) -> tuple[dict, dict]:
        """(The GPU prefix the engines have confirmed, or this router recorded for an
        eventless worker when its policy keeps such a record; the prefix of the prompts this
        replica has in flight there, assumed to land on the GPU), per worker."""
        primary, check = hashes
        if not primary:
            return {}, {}
        confirmed = self.feeder.gpu_index.overlap(primary, check)
        if self.approximate.holds_any():  # all a router knows of an eventless worker's cache
            confirmed = self.approximate.merge(confirmed, primary, check, now)
        flying = self.inflight.matches(primary, check, now)
        if offered := self.bookings.offered:
            flying = longer_matches(flying, offered.matches(primary, check))
        return confirmed, flying

    def _recorded(self, flying: dict[str, int]) -> dict[str, int]:
        """For a policy shown no in-flight overlay: the part of it that stands in for its own
        record of where it routed, on eventless workers (Dynamo's approximate mode counts a
        prompt from its routing; the record here starts at its first token)."""
        if not self._approximates or not flying:
            return {}
        return {w: n for w, n in flying.items() if self._eventless(w)}

    def _any_tier(self, hashes: BlockHashes, gpu: dict[str, int]) -> dict[str, int]:
        """Per worker, the prefix cached in any tier: at least its GPU prefix ``gpu``."""
        if self.feeder.gpu is None or not hashes.primary:
            return gpu
        any_tier = dict(self.feeder.index.overlap(hashes.primary, hashes.check))
        for worker, blocks in gpu.items():
            any_tier[worker] = max(any_tier.get(worker, 0), blocks)
        return any_tier

    # ---- what happened to it -------------------------------------------------------------

    def on_offered(self, request_id: str, worker_id: str) -> None:
        """The caller handed the request to ``worker_id`` itself (the credit path) and waits
        for its answer: its prompt counts as in flight there from now (``offered.py``).
        ``on_dispatched`` (taken) or ``on_offer_refused`` ends the wait."""
        routed = self._routed.get(request_id)
        if routed is not None:
            self.bookings.offered.add(request_id, worker_id, routed.hashes)

    def on_offer_refused(self, request_id: str) -> None:
        """The worker refused the offer, or gave no answer: the scheduler will place it."""
        self.bookings.offered.remove(request_id)

    def on_dispatched(self, request_id: str, worker_id: str, now: float) -> bool:
        """A run of the request went to ``worker_id``: book it there. False when this replica
        did not route the request (another replica did, or it was forgotten)."""
        booked_on = self.bookings.take(request_id)
        routed = self._routed.pop(request_id, None)
        if routed is None:
            return False
        query, hashes = routed.query, routed.hashes
        if booked_on != worker_id:  # taken elsewhere (or its booking lapsed): a re-dispatch
            self.policy.on_dispatched(query, worker_id)
        if hashes.primary:
            self.inflight.record(worker_id, hashes.primary, hashes.check, now)
            if self._approximates and self._eventless(worker_id):
                self._prefilling[request_id] = (worker_id, hashes)
                if len(self._prefilling) > self.params.verify_capacity:
                    self._prefilling.popitem(last=False)
        usable = _usable_blocks(query)
        predicted = min(routed.expected.get(worker_id, 0), usable)
        state = self.fleet.get(worker_id)
        if state is not None:
            state.assign(request_id, _uncached_tokens(routed, worker_id), query.prompt_tokens)
        best = min(max(query.overlaps.values(), default=0), usable)
        self.verifier.remember(
            request_id,
            Dispatch(
                worker_id=worker_id,
                predicted_blocks=predicted,
                block_size=query.block_size,
                best_blocks=best,
                model=routed.model,
            ),
        )
        return True

    def on_started(self, request_id: str, worker_id: str, now: float) -> None:
        """The run on ``worker_id`` gave its first token: its prompt is no longer queued prefill
        there. Reports come every fraction of a second; a prompt prefilled in a few ms would
        otherwise keep a cache holder looking busy until the next one (and keep its prefix from
        the requests that want it)."""
        if request_id in self._routed:  # the start overtook the news of its dispatch
            self.on_dispatched(request_id, worker_id, now)
        self._prefilled(request_id, worker_id, now)
        state = self.fleet.get(worker_id)
        if state is not None:
            state.started(request_id)
        self.policy.on_started(request_id, worker_id, now)

    def on_finished(
        self,
        request_id: str,
        worker_id: str,
        now: float,
        *,
        cached_tokens: int | None = None,
        completion_tokens: int | None = None,
    ) -> Verdict | None:
        """A run left ``worker_id``. A completed run (``cached_tokens`` given) is verified
        against the prediction (counted, never a change to the index). Its end may overtake the
        news of its dispatch (an engine that answers at once): it is booked first, so the
        in-flight overlay still learns where its prefix now lives."""
        if request_id in self._routed:
            self.on_dispatched(request_id, worker_id, now)
        # completed (``cached_tokens`` given): its prompt was prefilled, start seen or not
        self._prefilled(request_id, worker_id, now, done=cached_tokens is not None)
        state = self.fleet.get(worker_id)
        if state is not None:
            state.unassign(request_id)
        self.policy.on_finished(request_id, worker_id, now)
        if completion_tokens is not None:
            self.outputs.add(completion_tokens)
        if cached_tokens is None:
            self.verifier.forget(request_id)
            return None
        verdict = self.verifier.verify(request_id, worker_id, cached_tokens)
        if verdict is None:
            return None
        self.window.predicted_tokens += verdict.predicted_tokens
        self.window.hit_tokens += min(verdict.actual_tokens, verdict.predicted_tokens)
        return verdict

    def _prefilled(self, request_id: str, worker_id: str, now: float, done: bool = True) -> None:
        """An eventless worker has prefilled the run's prompt (``done``; False: the run ended
        before): the blocks SGLang would have announced enter the approximate index (or have
        their TTL renewed)."""
        sent = self._prefilling.pop(request_id, None)
        if done and sent is not None and sent[0] == worker_id and self._eventless(worker_id):
            hashes = sent[1]
            self.approximate.record(worker_id, hashes.primary, hashes.check, now)

    def forget(self, request_id: str) -> None:
        """This routing of the request will not be dispatched (rejected, failed before any
        worker took it, or a client's resend of a request that runs already: a run dispatched
        before keeps its record until it ends)."""
        self._routed.pop(request_id, None)
        self.bookings.release(request_id)

    # ---- time ----------------------------------------------------------------------------

    def tick(self, now: float) -> bool:
        """Periodic work; True when the policy got feedback this time."""
        if self._next_feedback is None:
            self._next_feedback = now + self.params.feedback_interval_s
        if now < self._next_feedback:
            return False
        self._next_feedback = now + self.params.feedback_interval_s
        self.feeder.expire(now)
        self.bookings.expire(now)
        depths = {s.worker_id: (v := worker_view(s)).running + v.queued for s in self.fleet.all()}
        feedback = RoutingFeedback(queue_depths=depths, false_hit_rate=self.window.false_hit_rate())
        self.policy.observe(feedback)
        self.window = FeedbackWindow()
        return True
