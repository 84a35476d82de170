"""The replay's handling of scheduler actions, and the PD runs a ``Dispatch`` can start.

``Replay`` (``driver.py``) owns the event loop, the engines and the router core; this mixin
carries out what ``Scheduler.poll`` returns, as ``thunderagent/scheduling/README.md`` asks and as
the scheduler service does live:

* ``Dispatch``: after the hand-off's delay (``ReplayConfig.handoff_s``, the worker's ack; 0 by
  default) the router core books the run on the chosen worker (``on_dispatched``), the worker
  accepts it (``AcceptedRuns``) and its engine queues it; with a decode worker it is a PD run
  (``pd.py``): prefill with one output token, KV transfer, decode on the other worker.
* ``Preempt``: the run is aborted keeping its computed blocks cached, the router core is told
  it ended, and a continuation (prompt + generated tokens, same id, original arrival) is
  re-routed and re-submitted.
* ``Reject``: the request ends rejected, with the scheduler's reason.

It also asks the scheduler for its next wakeup and guards against one that keeps asking to wake
at the current instant.
"""

from __future__ import annotations

import heapq
import math
from typing import TYPE_CHECKING

from thunderagent.engine import Request
from thunderagent.scheduling import Dispatch, Preempt, Reject

if TYPE_CHECKING:
    from thunderagent.replay.records import Record

INF = math.inf
STALL_STEP_S = 1e-6
STALL_LIMIT = 100
"""A scheduler asking to wake at the current instant more than this many times in a row is
broken (the replay would spin)."""


class SchedulerActions:
    """Mixin for ``Replay``: the scheduler's actions and the PD transfer path."""

    # ---- scheduler actions ---------------------------------------------------------------
    def _poll(self, t: float) -> None:
        self._act(t)
        if self.scheduler.waiting() and self._next_load <= t:
            self._refresh_loads(t)
            self._act(t)
        wake = self.scheduler.next_wakeup(t)
        if self.scheduler.waiting():
            # Held requests wait for room that only a load report shows; live adapters report
            # on their own clock whether or not anything arrives, so the replay does too.
            wake = self._next_load if wake is None else min(wake, self._next_load)
        self._wake = INF if wake is None else max(wake, t)
        if self._wake > t:
            self._stalls = 0
            return
        # Asked to wake now again: a deadline that ``poll`` tests as ``now - since >= d`` but
        # reports as ``since + d`` can differ by one rounding step. Retry a microsecond later;
        # a scheduler that keeps asking is broken.
        self._stalls += 1
        self.stalled_wakeups += 1
        if self._stalls > STALL_LIMIT:
            raise RuntimeError(f"scheduler {self.cfg.scheduler!r} asked to wake now ({t}) again")
        self._wake = t + STALL_STEP_S

    def _act(self, t: float) -> None:
        for action in self.scheduler.poll(t):
            if isinstance(action, Dispatch):
                self._hand_off(action, t)
            elif isinstance(action, Preempt):
                self._preempt(action, t)
            elif isinstance(action, Reject):
                self._reject(self.records[action.request_id], action.reason, t)
        self._grant()

    def _reject(self, rec: Record, reason: str, t: float) -> None:
        rec.status, rec.finish, rec.reason = "rejected", t, reason
        self.router.forget(rec.request_id)
        self._ended(rec, t)

    def _push_timer(self, t: float, kind: str, payload: object) -> None:
        self._timer_seq += 1
        heapq.heappush(self.timers, (t, self._timer_seq, kind, payload))

    def _hand_off(self, action: Dispatch, t: float) -> None:
        """The run reaches its engine, and the router hears it was taken, ``handoff_s`` later
        (live: the worker's ack to the router's or the scheduler's offer; 0: at once)."""
        if self.cfg.handoff_s > 0:
            self._push_timer(t + self.cfg.handoff_s, "handoff", action)
        else:
            self._dispatch(action, t)

    def _dispatch(self, action: Dispatch, t: float) -> None:
        rec = self.records[action.request_id]
        rid, worker_id = rec.request_id, action.worker_id
        if math.isnan(rec.dispatched):  # its first run: where the router had put it first
            rec.dispatched = t
            decision = self.decisions.get(rid)
            rec.routed_to = self.slot.get(decision.worker_id, -1) if decision is not None else -1
        self.router.on_dispatched(rid, worker_id, t)
        overlaps = self.route_overlaps.pop(rid, {})
        run = rec.run
        if not run.output_offset:  # the first run: what the index said about this worker
            usable = (rec.prompt_tokens - 1) // self.block_size
            rec.predicted_tokens = min(overlaps.get(worker_id, 0), usable) * self.block_size
        new_tokens = rec.output_tokens - run.output_offset
        pd = action.decode_worker is not None and action.decode_worker != worker_id
        if pd:  # prefill here up to the first token; pd.py models the rest
            self.links.start(rid, action.decode_worker, t)
            new_tokens = 1
        request = Request(
            request_id=rid,
            prompt_len=run.context_tokens,
            block_hashes=self.keys[rid].primary,
            max_new_tokens=new_tokens,
        )
        predicted = min(overlaps.get(worker_id, 0), (run.context_tokens - 1) // self.block_size)
        rec.worker = self.slot[worker_id]
        if pd and self.links.via == "sglang":
            self._bootstrap(rec, request, t, predicted * self.block_size)
            return
        pull = self.migration is not None and not pd and not run.output_offset
        if pull and self.migration.pull(request, worker_id, self.decisions[rid].candidates, t):
            rec.status = "pulling"
            self.pulled_predicted[rid] = predicted * self.block_size
            return
        self._add(rec, self.slot[worker_id], request, t, predicted * self.block_size)

    def _pull_landed(self, rid: str, t: float) -> None:
        """The prefix a dispatched run copies is on its worker: the run starts there."""
        for request in self.migration.pull_landed(rid, t):
            rec = self.records[request.request_id]
            self._add(rec, rec.worker, request, t, self.pulled_predicted.pop(rec.request_id, 0))

    def _add(self, rec: Record, w: int, request: Request, t: float, predicted: int = 0) -> None:
        if self.shadows is not None:  # the adapter reads its shadow's clock at the hand-over
            self.shadows.handed_over(w, rec.request_id)
        refused = self.cores[w].add(request, t)
        rec.worker = w
        if refused is not None:
            self._refuse(rec, "prompt + output exceed the engine's KV pool", t)
            return
        self.accepted[w].accept(rec.request_id, request.prompt_len - predicted)
        rec.status = "running"
        if w not in self.inflight:
            self.dirty.add(w)

    def _refuse(self, rec: Record, reason: str, t: float) -> None:
        """The run can never fit its engine (``rec.worker``): the request ends rejected."""
        rid, worker_id = rec.request_id, self.ids[rec.worker]
        self._unpair(rid, t)
        self.router.on_finished(rid, worker_id, t)
        self.scheduler.on_failed(rid, worker_id, t)
        self._reject(rec, reason, t)

    def _preempt(self, action: Preempt, t: float) -> None:
        rec = self.records[action.request_id]
        w = self.slot[action.worker_id]
        if self.links.phase(rec.request_id) is not None:
            return  # a PD run is not preemptible here (the scheduler never picks one)
        fin = self.cores[w].abort(rec.request_id, t, keep_cache=True)
        if fin is None:
            return
        self.accepted[w].finished(rec.request_id)
        self.router.on_finished(rec.request_id, action.worker_id, t)
        self._account_run(rec, fin.cached_tokens, fin.prompt_tokens)
        rec.completion_tokens += fin.completion_tokens
        rec.preemptions += 1 + fin.preemptions
        rec.sched_preemptions += 1
        rec.status, rec.worker = "queued", -1
        self.resuming.add(rec.request_id)
        self.scheduler.submit(self._sched_request(rec), t)  # as live: the original decision

    def _account_run(self, rec: Record, cached: int, prompt: int) -> None:
        """Cache figures of one engine run: the first run's hit, or a continuation's resume."""
        if rec.request_id in self.resuming:
            self.resuming.discard(rec.request_id)
            rec.resume_prompt_tokens += prompt
            rec.resume_cached_tokens += cached
        elif rec.cached_tokens < 0:
            rec.cached_tokens = cached

    # ---- PD disaggregation (the model is described in pd.py) -----------------------------
    def _bootstrap(self, rec: Record, request: Request, t: float, predicted: int) -> None:
        """SGLang's PD: the decode worker takes the request as the prefill worker does and
        queues it for a reservation of its prompt's pages; the prefill starts once it has one."""
        rid = rec.request_id
        d = self.slot[self.links.decode_worker(rid)]
        keys = list(self.keys[rid].primary[: request.prompt_len // self.block_size])
        if len(keys) > self.cores[d].cache.capacity:  # no reservation could ever be made
            self._refuse(rec, "the prompt exceeds the decode engine's KV pool", t)
            return
        self.accepted[d].accept(rid, 0)  # the decode side prefills nothing
        rec.status = "bootstrapping"
        self.bootstrap_requests[rid] = (request, predicted)
        self._preallocate(d, t)

    def _preallocate(self, d: int, t: float) -> None:
        """Reserve pages on decode worker ``d`` for the runs in its prealloc queue, oldest first,
        while they fit; each one reserved starts its prefill."""
        decode, core = self.ids[d], self.cores[d]
        queue = self.links.prealloc_queue(decode)
        while queue:
            rid = queue[0]
            request, predicted = self.bootstrap_requests[rid]
            keys = list(self.keys[rid].primary[: request.prompt_len // self.block_size])
            present = core.reserve_for_decode(keys, self.cfg.pd_reserved_decode_tokens)
            if present is None:
                return  # the pool is full: this run and those behind it wait for room
            self.links.bootstrapped(rid, keys, present, t)
            del self.bootstrap_requests[rid]
            rec = self.records[rid]
            self._add(rec, rec.worker, request, t, predicted)

    def _unpair(self, rid: str, t: float) -> None:
        """A PD run ends before its KV landed: its decode worker's reservation is given back."""
        decode = self.links.decode_worker(rid) if self.links.phase(rid) is not None else None
        held = self.links.forget(rid)
        self.bootstrap_requests.pop(rid, None)
        if decode is None:
            return
        d = self.slot[decode]
        self.accepted[d].finished(rid)
        if held is not None:
            self.cores[d].abort_import(*held)
            self.dirty.add(d)
            self._preallocate(d, t)  # the room it gave back may fit the next in line

    def _prefilled(self, rec: Record, w: int, context: int, t: float) -> None:
        """The prefill run ended with the first token: the KV goes over the link."""
        rid = rec.request_id
        decode = self.links.decode_worker(rid)
        if rec.completion_tokens >= rec.output_tokens and not self.links.decode_streams_first_token:
            self.scheduler.on_transfer_done(rid, decode, t)  # nothing left to decode
            self.router.on_finished(rid, self.ids[w], t, cached_tokens=max(rec.cached_tokens, 0))
            self._completed(rec, decode, t)
            return
        rec.status = "transferring"
        if self.links.via == "sglang":  # the prefill engine's pages are the transfer's source
            keys = list(self.keys[rid].primary[: context // self.block_size])
            pinned, _ = self.cores[w].pin_prefix(keys, need_tokens=False)
            self.links.hold_source(rid, self.ids[w], pinned)
        done = self.links.send(rid, self.ids[w], context, t)
        self._push_timer(done, "transfer", rid)

    def _transfer_landed(self, rid: str, t: float) -> None:
        """The KV is on the decode worker: it takes the rest as a continuation (the router is
        not involved, as live: the prefill adapter hands it over)."""
        rec = self.records[rid]
        decode = self.links.landed(rid)
        d = self.slot[decode]
        run = rec.run
        context = run.context_tokens - 1  # KV exists up to the last generated token
        primary = self.keys[rid].primary
        source = self.links.release_source(rid)
        if source is not None:  # the prefill engine frees the pages it sent from
            s = self.slot[source[0]]
            self.cores[s].unpin_prefix(source[1])
            self.dirty.add(s)
        reserved = self.links.take_reservation(rid)
        if reserved is None:
            self.cores[d].import_blocks(primary[: context // self.block_size])
        else:  # SGLang's PD: into the pages its decode engine reserved
            self.cores[d].commit_import(*reserved, None)
        self.scheduler.on_transfer_done(rid, decode, t)
        if rec.completion_tokens >= rec.output_tokens:  # one token: the decode engine sends it
            rec.first_token, rec.worker = t, d
            self.accepted[d].finished(rid)
            cached = max(rec.cached_tokens, 0)
            self.router.on_finished(rid, self.ids[rec.worker], t, cached_tokens=cached)
            self._completed(rec, decode, t)
            return
        request = Request(
            request_id=rid,
            prompt_len=run.context_tokens,
            block_hashes=primary,
            max_new_tokens=rec.output_tokens - run.output_offset,
        )
        self._add(rec, d, request, t, predicted=context)  # the imported KV: nothing to prefill
