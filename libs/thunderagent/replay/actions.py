"""The replay's handling of scheduler actions, and the PD runs a ``Dispatch`` can start.

``Replay`` (``driver.py``) owns the event loop, the engines and the router's view; this mixin
carries out what ``Scheduler.poll`` returns, as ``thunderagent/scheduling/README.md`` asks:

* ``Dispatch``: the request goes to the chosen worker's engine; with a decode worker it is a PD
  run (``pd.py``): prefill with one output token, KV transfer, decode on the other worker.
* ``Preempt``: the run is aborted keeping its computed blocks cached, and a continuation (prompt +
  generated tokens, same id, original arrival) is re-routed and re-submitted.
* ``Reject``: the request ends rejected.

It also asks the scheduler for its next wakeup and guards against one that keeps asking to wake
at the current instant.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from thunderagent.engine import Request
from thunderagent.scheduling import Dispatch, Preempt, Reject

if TYPE_CHECKING:
    from thunderagent.replay.driver import Record

INF = math.inf
STALL_STEP_S = 1e-6
STALL_LIMIT = 100
"""A scheduler asking to wake at the current instant more than this many times in a row is
broken (the replay would spin)."""


class SchedulerActions:
    """Mixin for ``Replay``: the scheduler's actions and the PD transfer path."""

    # ---- scheduler actions ---------------------------------------------------------------
    def _poll(self, t: float) -> None:
        for action in self.scheduler.poll(t):
            if isinstance(action, Dispatch):
                self._dispatch(action, t)
            elif isinstance(action, Preempt):
                self._preempt(action, t)
            elif isinstance(action, Reject):
                rec = self.records[action.request_id]
                rec.status, rec.finish = "rejected", t
                self._ended(rec, t)
        wake = self.scheduler.next_wakeup(t)
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

    def _dispatch(self, action: Dispatch, t: float) -> None:
        rec = self.records[action.request_id]
        w = self.slot[action.worker_id]
        primary, _ = self.keys[rec.request_id]
        overlaps = self.route_overlaps.pop(rec.request_id, None)
        if overlaps is not None:  # first dispatch: what the index said about this worker
            usable = (rec.prompt_tokens - 1) // self.block_size
            rec.predicted_tokens = min(overlaps.get(action.worker_id, 0), usable) * self.block_size
        generated = rec.completion_tokens
        new_tokens = rec.output_tokens - generated
        pd = action.decode_worker is not None and action.decode_worker != action.worker_id
        if pd:  # prefill here up to the first token; pd.py models the rest
            self.links.start(rec.request_id, action.decode_worker)
            new_tokens = 1
        request = Request(
            request_id=rec.request_id,
            prompt_len=rec.prompt_tokens + generated,
            block_hashes=primary,
            max_new_tokens=new_tokens,
        )
        self._add(rec, w, request, t)

    def _add(self, rec: Record, w: int, request: Request, t: float) -> None:
        rejected = self.cores[w].add(request, t)
        rec.worker = w
        self.pending[w] += 1
        if rejected is not None:
            rec.status, rec.finish = "rejected", t
            self.links.forget(rec.request_id)
            self.scheduler.on_finished(rec.request_id, self.ids[w], t)
            self._ended(rec, t)
            return
        rec.status = "running"
        if w not in self.inflight:
            self.dirty.add(w)

    def _preempt(self, action: Preempt, t: float) -> None:
        rec = self.records[action.request_id]
        w = self.slot[action.worker_id]
        if self.links.phase(rec.request_id) is not None:
            return  # a PD run is not preemptible here (the scheduler never picks one)
        fin = self.cores[w].abort(rec.request_id, t, keep_cache=True)
        if fin is None:
            return
        self._account_run(rec, fin.cached_tokens, fin.prompt_tokens)
        rec.completion_tokens += fin.completion_tokens
        rec.preemptions += 1 + fin.preemptions
        rec.sched_preemptions += 1
        rec.status, rec.worker = "queued", -1
        self.resuming.add(rec.request_id)
        primary, checks = self.keys[rec.request_id]
        overlaps = self.index.overlap(primary, checks)
        self.scheduler.submit(self._sched_request(rec, overlaps, t), t)

    def _account_run(self, rec: Record, cached: int, prompt: int) -> None:
        """Cache figures of one engine run: the first run's hit, or a continuation's resume."""
        if rec.request_id in self.resuming:
            self.resuming.discard(rec.request_id)
            rec.resume_prompt_tokens += prompt
            rec.resume_cached_tokens += cached
        elif rec.cached_tokens < 0:
            rec.cached_tokens = cached

    # ---- PD disaggregation (the model is described in pd.py) -----------------------------
    def _prefilled(self, rec: Record, w: int, context: int, t: float) -> None:
        """The prefill run ended with the first token: the KV goes over the link."""
        rid = rec.request_id
        decode = self.links.decode_worker(rid)
        if rec.completion_tokens >= rec.output_tokens:  # nothing left to decode
            self.scheduler.on_transfer_done(rid, decode, t)
            self._completed(rec, decode, t)
            return
        rec.status = "transferring"
        done = self.links.send(rid, self.ids[w], context, t)
        self._push_timer(done, "transfer", rid)

    def _transfer_landed(self, rid: str, t: float) -> None:
        rec = self.records[rid]
        decode = self.links.landed(rid)
        d = self.slot[decode]
        primary = self.keys[rid][0]
        context = rec.prompt_tokens + rec.completion_tokens - 1  # KV exists up to here
        self.cores[d].import_blocks(primary[: context // self.block_size])
        self.scheduler.on_transfer_done(rid, decode, t)
        request = Request(
            request_id=rid,
            prompt_len=rec.prompt_tokens + rec.completion_tokens,
            block_hashes=primary,
            max_new_tokens=rec.output_tokens - rec.completion_tokens,
        )
        self._add(rec, d, request, t)
