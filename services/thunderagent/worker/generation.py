"""One run of a request on the engine: stream tokens to the client, report its progress, stop
quietly when the scheduler preempts or the client cancels it.

Runs follow the shared run model (``thunderagent.fleet.runs``): a continuation
(``output_offset > 0``) carries the tokens the client already has at the end of its prompt, its
chunks continue the numbering and its usage counts the whole answer, so the client sees one
unbroken stream across a preemption or a PD hand-off.

PD hand-off, as the scheduler sees it: ``started`` from the prefill worker (first token out),
then ``transferred`` naming the decode worker (its engine holds the KV now and runs the rest of
the request as a continuation), then that worker's ``finished``. If the transfer or the hand-off
fails, the rest runs on the prefill worker instead (no ``transferred``): slower, not lost.
Under SGLang's own PD (the prefill engine reports a bootstrap port) the pairing replaces the
hand-off: the decode worker runs the whole request, its engine taking the KV from this one, and
``started`` and ``transferred`` follow this engine's prefill (the decode worker's ``finished``
may come first; the scheduler takes it from the worker the run was paired with).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import msgspec

from thunderagent.bus import Bus, BusError
from thunderagent.fleet import AcceptedRuns, client_output, continuation, engine_request_id
from thunderagent.schemas import (
    AbortRequest,
    Ack,
    ErrorCode,
    ErrorReply,
    FinalReply,
    FinishReason,
    KvTransfer,
    PdBootstrap,
    Preempted,
    ProgressBatch,
    RequestProgress,
    RunFailed,
    TokenChunk,
    Usage,
    WorkerGenerate,
    subjects,
)
from thunderagent.worker.engine_client import EngineChunk, EngineClient, EngineError
from thunderagent.worker.inferred_cache import InferredCache

log = logging.getLogger(__name__)

_RUN_NUMBERS = itertools.count()
HAND_BACK_TRIES = 4
HAND_BACK_PAUSE_S = 0.1
"""A failed run the scheduler does not know yet (dispatched on credit, its report in flight)
is offered again this many times, this far apart."""


@dataclass(eq=False)
class Generation:
    work: WorkerGenerate
    worker_id: str
    bus: Bus
    engine: EngineClient
    runs: AcceptedRuns
    """The adapter's accounting of accepted runs (inflight, prefill backlog)."""
    output: list[int] = field(default_factory=list)
    """Tokens this run produced."""
    stopped: bool = False
    """Aborted on purpose (preempted or cancelled): end without telling the client."""
    lost: str = ""
    """Why the adapter gave up on the engine under this run (it is handed back)."""
    max_request_s: float = 600.0
    """No run holds an engine slot longer than this (nor past the request's deadline)."""
    task: asyncio.Task | None = None
    final: FinalReply | None = None
    """The answer, once sent: a run stopped or broken after it (while the engine's stream
    drains) has nothing more to tell anyone."""
    held_start: RequestProgress | None = None
    """The start of a run whose first token is also its last: it goes with the run's end."""
    accepted_at: float = field(default_factory=time.monotonic)
    held: bool = False
    """The client was told ``HeldReply`` (once per run)."""
    prepare: Callable[[WorkerGenerate], Awaitable[None]] | None = None
    """Run before the engine gets the run, inside its time limit (a prefix copied in first:
    ``WorkerMigration.before_run``)."""
    inferred: InferredCache | None = None
    """An engine that publishes no KV events: told the token ids its cache holds now (the
    prompt at the first token, prompt and output at the end, as SGLang caches them), and at the
    first token how much of the prompt the engine reported found."""
    inferred_mark: int = 0
    """The shadow's clock when the run was handed to the engine."""
    run_no: int = field(default_factory=lambda: next(_RUN_NUMBERS))
    """This process's number for the run: part of its engine id, so no two runs share one."""

    @property
    def request_id(self) -> str:
        return self.work.request.request_id

    @property
    def engine_rid(self) -> str:
        return engine_request_id(self.request_id, self.work.output_offset, self.run_no)

    def owes_held_reply(self, now: float, after_s: float) -> bool:
        """Accepted ``after_s`` ago or more and nothing has reached the client yet (a streamed
        continuation's client has the earlier runs' tokens)."""
        if self.held or self.final is not None or now - self.accepted_at < after_s:
            return False
        return not (self.work.request.stream and (self.output or self.work.output_offset))

    def all_output(self) -> list[int]:
        """Every output token the client has: earlier runs' and this one's."""
        prompt = self.work.request.token_ids or []
        return client_output(prompt, self.work.output_offset, self.output)

    async def stop(self) -> None:
        """Stop streaming and abort at the engine (SGLang's ``/abort_request``; closing the
        stream also aborts it there, this just does not wait for the next token to notice)."""
        if self.final is not None:
            return  # answered: its stream is only draining, the engine has finished it
        self.stopped = True
        if self.task is None:  # not started: ``run`` ends at once, the engine never sees it
            return
        self.task.cancel()
        await self.engine.abort(self.engine_rid)

    def time_limit_s(self) -> float:
        """Seconds this run may take: the worker's cap, or less to meet the deadline."""
        deadline_ms = self.work.request.deadline_ms
        if deadline_ms is None:
            return self.max_request_s
        return min(self.max_request_s, deadline_ms / 1e3 - time.time())

    def abandon(self, reason: str) -> None:
        """The engine under this run stopped answering: stop waiting for it and hand the
        run back to the scheduler (it resumes elsewhere as a continuation)."""
        if self.final is not None:
            return  # answered: nothing to hand back
        self.lost = reason
        if self.task is not None:
            self.task.cancel()

    async def run(self) -> FinalReply | None:
        self.task = asyncio.current_task()
        if self.stopped:  # aborted between its hand-off and here: the engine never saw it
            await self._progress("aborted")
            return None
        limit = self.time_limit_s()
        try:
            async with asyncio.timeout(max(limit, 0.0)):
                if self.prepare is not None:
                    await self.prepare(self.work)
                if self.work.decode_worker and self.engine.bootstrap_port:
                    return await self._pair_with_decode()
                if self.work.decode_worker and self.work.request.max_tokens > 1:
                    return await self._prefill_then_hand_off()
                return await self._run()
        except asyncio.CancelledError:
            if self.final is not None and (self.stopped or self.lost):
                return self.final  # stopped while the stream drained: it had finished
            if self.lost:
                await self._fail(RuntimeError(self.lost))
                return None
            if not self.stopped:
                raise
            await self._progress("aborted")
            return None
        except TimeoutError:
            return await self._timed_out(limit)
        except Exception as err:  # a bug or an engine answer nobody foresaw: nobody waits on
            log.exception("request %s: run failed", self.request_id)  # it forever
            with contextlib.suppress(Exception):  # the engine may still be generating it
                await self.engine.abort(self.engine_rid)
            if self.final is not None:
                return self.final
            await self._fail(err)
            return None

    async def _timed_out(self, limit: float) -> FinalReply | None:
        """The time limit passed: free the engine slot, tell the client why (if unanswered)."""
        await self.engine.abort(self.engine_rid)
        if self.final is not None:
            return self.final
        if limit < self.max_request_s:
            why = "its deadline passed"
        else:
            why = f"it ran past the worker's limit of {self.max_request_s:g} s"
        await self._fail_with(ErrorCode.DEADLINE, f"request stopped: {why}")
        return None

    async def _run(self) -> FinalReply | None:
        req = self.work.request
        started = time.monotonic()
        first_token_at: float | None = None
        text_parts: list[str] = []
        meta: dict = {}
        self.inferred_mark = self.inferred.mark() if self.inferred is not None else 0
        try:
            stream = self.engine.generate(self.engine_rid, req.token_ids or [], _sampling(req),
                                          cache_salt=req.cache_salt, lora_name=req.lora_name,
                                          bootstrap=self.work.bootstrap)  # fmt: skip
            async for chunk in stream:
                meta = chunk.meta
                if chunk.new_token_ids:
                    if req.stream:  # the client's token before our own bookkeeping
                        await self.bus.publish(self.work.reply_subject, self._chunk(chunk))
                    else:
                        text_parts.append(chunk.new_text)
                    if first_token_at is None:
                        first_token_at = time.monotonic()
                        ends = self.final is None and chunk.finished
                        await self._started(chunk.meta, with_end=ends)
                    self.output.extend(chunk.new_token_ids)
                if self.final is None and chunk.finished:
                    # answer now: the stream's "[DONE]" and its end are read after, off the
                    # client's path (the connection goes back to the pool only once drained)
                    await self._finish(meta, text_parts, started, first_token_at)
        except (TimeoutError, EngineError, OSError) as err:
            if self.final is not None:  # the client has its answer; only the drain failed
                log.info("request %s: engine stream broke after its last token: %s",
                         self.request_id, err)  # fmt: skip
                return self.final
            await self._fail(err)
            return None
        if self.final is None:  # the stream ended without a finish reason
            await self._finish(meta, text_parts, started, first_token_at)
        return self.final

    async def _finish(
        self, meta: dict, text_parts: list[str], started: float, first_token_at: float | None
    ) -> None:
        finished = time.monotonic()
        final = self._final(meta, "".join(text_parts), started, first_token_at or finished)
        self.final = final
        # the run's end before the answer: a client's next turn (an agent loop sends it at
        # once) must find this worker freed in the routers' books. One connection, so NATS
        # delivers them in this order; both leave in the same socket write.
        await self._progress("finished", usage=final.usage)
        await self.bus.publish(self.work.reply_subject, final)
        if self.inferred is not None and self.output:  # the last token's KV was never computed
            prompt_and_output = [*(self.work.request.token_ids or []), *self.output[:-1]]
            await self.inferred.cached(prompt_and_output, self.work)

    async def _prefill_then_hand_off(self) -> FinalReply | None:
        """PD disaggregation: prefill here up to the first token, move the KV to the decode
        worker, hand it the rest as a continuation (the client's stream goes on from there)."""
        req = self.work.request
        decode = self.work.decode_worker
        self.inferred_mark = self.inferred.mark() if self.inferred is not None else 0
        try:
            prefill = {**_sampling(req), "max_new_tokens": 1}
            async for chunk in self.engine.generate(
                self.engine_rid, req.token_ids or [], prefill, cache_salt=req.cache_salt,
                lora_name=req.lora_name,
            ):  # fmt: skip
                if chunk.new_token_ids:
                    await self._started(chunk.meta)
                    if req.stream:
                        await self.bus.publish(self.work.reply_subject, self._chunk(chunk))
                    self.output.extend(chunk.new_token_ids)
        except (TimeoutError, EngineError, OSError) as err:
            await self._fail(err)
            return None
        rest = self._continuation()
        if await self._hand_to_decode(decode, rest):
            return None  # the decode worker answers the client from here
        here = Generation(
            rest, self.worker_id, self.bus, self.engine, self.runs,
            max_request_s=self.max_request_s,
        )  # fmt: skip
        self.runs.accept(here.engine_rid, 0)  # its KV was just computed here: ~nothing to prefill
        try:
            return await here.run()
        finally:
            self.runs.finished(here.engine_rid)

    async def _hand_to_decode(self, decode: str, rest: WorkerGenerate) -> bool:
        """The prompt's KV to ``decode``, then its continuation ``rest``; False when either was
        refused or got no answer (the run then goes on here)."""
        transfer = KvTransfer(
            request_id=self.request_id,
            token_ids=rest.request.token_ids or [],
            source_worker=self.worker_id,
            cache_salt=rest.request.cache_salt,
            lora_name=rest.request.lora_name,
        )
        try:
            ack = await self.bus.request(
                subjects.worker_kv_import(decode), transfer, Ack, timeout=30
            )
            if ack.accepted:
                ack = await self.bus.request(subjects.worker_generate(decode), rest, Ack, timeout=5)
            if ack.accepted:
                await self._progress("transferred", worker_id=decode, from_worker=self.worker_id)
                return True
            log.warning("PD hand-off of %s to %s refused: %s", self.request_id, decode, ack.reason)
        except BusError as err:
            log.warning("PD hand-off of %s to %s failed: %s", self.request_id, decode, err)
        return False

    async def _pair_with_decode(self) -> FinalReply | None:
        """SGLang's PD: the decode worker runs the whole request, its engine taking the KV from
        this prefill engine under a new room; this engine gets the same request and pairing at
        the same time (as SGLang's router sends both) and computes the prompt. Once it has, the
        run is the decode worker's (``started`` and ``transferred``, as a hand-off). A decode
        worker that refuses, or a prefill that fails, hands the run back to the scheduler (this
        engine cannot run a request alone)."""
        decode = self.work.decode_worker
        pairing = PdBootstrap(
            host=self.engine.host, port=self.engine.bootstrap_port, room=random.getrandbits(63),
            prefill_dp_rank=self.engine.dp_rank,
        )  # fmt: skip
        there = msgspec.structs.replace(self.work, decode_worker="", pull=None, bootstrap=pairing)
        offered = asyncio.ensure_future(self._offer(decode, there))
        prefill = asyncio.ensure_future(self._prefill_paired(pairing))
        try:
            ack = await offered
            if not ack.accepted:
                prefill.cancel()  # closing its stream aborts it at the engine too
                await asyncio.gather(prefill, return_exceptions=True)
                await self.engine.abort(self.engine_rid)
                await self._fail(RuntimeError(f"decode worker {decode} did not take it: "
                                              f"{ack.reason}"))  # fmt: skip
                return None
            failure = await prefill
        except asyncio.CancelledError:
            if self.stopped:  # preempted or cancelled before the hand-over: both sides stop
                await self._abort_paired(decode, "stopped at its prefill worker")
            raise
        finally:
            offered.cancel()
            prefill.cancel()
        if failure is not None:  # its engine would wait for KV that never comes
            await self._abort_paired(decode, "its prefill failed")
            await self._fail(failure)
            return None
        self.runs.started(self.engine_rid)
        await self._progress("started")
        await self._progress("transferred", worker_id=decode, from_worker=self.worker_id)
        return None

    async def _abort_paired(self, decode: str, reason: str) -> None:
        """Stop the decode side of this run's pairing (it tells its client nothing)."""
        abort = AbortRequest(request_id=self.request_id, reason=reason)
        with contextlib.suppress(BusError):
            await self.bus.request(subjects.worker_abort(decode), abort, Preempted, timeout=2)

    async def _offer(self, decode: str, work: WorkerGenerate) -> Ack:
        try:
            return await self.bus.request(subjects.worker_generate(decode), work, Ack, timeout=5)
        except BusError as err:
            return Ack(accepted=False, reason=str(err))

    async def _prefill_paired(self, pairing: PdBootstrap) -> Exception | None:
        """This engine's side of a pairing, to its end; the failure, if it failed."""
        req = self.work.request
        try:
            async for _ in self.engine.generate(
                self.engine_rid, req.token_ids or [], _sampling(req), cache_salt=req.cache_salt,
                lora_name=req.lora_name, bootstrap=pairing,
            ):  # fmt: skip
                pass
        except (TimeoutError, EngineError, OSError) as err:
            return err
        return None

    def _continuation(self) -> WorkerGenerate:
        """The rest of the request after this run's output, as the next run (continuations
        compose: this run's request already ends with earlier runs' output)."""
        return WorkerGenerate(
            request=continuation(self.work.request, self.output),
            reply_subject=self.work.reply_subject,
            predicted_cached_tokens=self.work.predicted_cached_tokens,
            attempt=self.work.attempt,
            output_offset=self.work.output_offset + len(self.output),
        )

    def _chunk(self, chunk: EngineChunk) -> TokenChunk:
        return TokenChunk(
            request_id=self.request_id,
            index=self.work.output_offset + len(self.output),
            token_ids=chunk.new_token_ids,
            text=chunk.new_text,
        )

    def _final(self, meta: dict, text: str, started: float, first_token_at: float) -> FinalReply:
        """Usage as the client sees it: a continuation's prompt ends with earlier output."""
        offset = self.work.output_offset
        prompt = int(meta.get("prompt_tokens", len(self.work.request.token_ids or []))) - offset
        finished = time.monotonic()
        return FinalReply(
            request_id=self.request_id,
            worker_id=self.worker_id,
            usage=Usage(
                prompt_tokens=prompt,
                cached_tokens=min(int(meta.get("cached_tokens", 0)), prompt),
                completion_tokens=offset + int(meta.get("completion_tokens", len(self.output))),
            ),
            ttft_ms=(first_token_at - started) * 1e3,
            e2e_ms=(finished - started) * 1e3,
            finish_reason=_finish_reason(meta),
            text=text,
            predicted_cached_tokens=self.work.predicted_cached_tokens,
            engine_ttft_ms=float(meta.get("engine_ttft_s", -0.001)) * 1e3,
        )

    async def _started(self, meta: dict, *, with_end: bool = False) -> None:
        """The first token is out. ``with_end``: it is also the last, so the start waits for
        the end (one message for both, sent before the answer)."""
        if self.engine_rid in self.runs and not self.output:
            self.runs.started(self.engine_rid)
            if with_end:
                self.held_start = self._event("started")
            else:
                await self._progress("started")
            if self.inferred is not None:
                await self.inferred.started(self.work, meta, self.inferred_mark)

    async def _fail(self, err: Exception) -> None:
        """The engine failed the run. The scheduler may resume it elsewhere as a
        continuation (the client's stream goes on); only if it will not is the client told."""
        log.warning("request %s failed at the engine: %s", self.request_id, err)
        failed = RunFailed(
            request_id=self.request_id, worker_id=self.worker_id,
            output_token_ids=self.all_output(), reason=str(err)[:500],
        )  # fmt: skip
        ack = Ack(accepted=False)
        for _ in range(HAND_BACK_TRIES):
            try:
                ack = await self.bus.request(
                    subjects.sched_run_failed(self.work.request.model), failed, Ack, timeout=2.0
                )
            except BusError:
                break
            if ack.accepted or ack.code != ErrorCode.UNAVAILABLE:
                break
            # a run the router dispatched on credit: its report may still be on its way
            await asyncio.sleep(HAND_BACK_PAUSE_S)
        if ack.accepted:
            await self._progress("failed")  # the run is over here; the request goes on
            return
        await self._fail_with(ErrorCode.ENGINE_ERROR, str(err))

    async def _fail_with(self, code: ErrorCode, message: str) -> None:
        await self._progress("failed")
        error = ErrorReply(
            code=code, message=message, request_id=self.request_id,
            service=f"worker/{self.worker_id}",
        )  # fmt: skip
        await self.bus.publish(self.work.reply_subject, error)

    async def _progress(
        self, phase: str, *, worker_id: str = "", from_worker: str = "", usage: Usage | None = None
    ) -> None:
        events = [self._event(phase, worker_id=worker_id, from_worker=from_worker, usage=usage)]
        if self.held_start is not None:
            events.insert(0, self.held_start)
            self.held_start = None
        batch = ProgressBatch(worker_id=self.worker_id, events=events)
        await self.bus.publish(subjects.progress(self.worker_id, ended=batch.ends_runs), batch)

    def _event(
        self, phase: str, *, worker_id: str = "", from_worker: str = "", usage: Usage | None = None
    ) -> RequestProgress:
        return RequestProgress(
            request_id=self.request_id,
            worker_id=worker_id or self.worker_id,
            phase=phase,  # type: ignore[arg-type]
            ts=time.time(),
            from_worker=from_worker,
            usage=usage,
        )


def _sampling(req) -> dict:
    """SGLang's sampling_params for a GenerateRequest."""
    sampling = {
        "max_new_tokens": req.max_tokens,
        "temperature": req.sampling.temperature,
        "top_p": req.sampling.top_p,
        "ignore_eos": req.sampling.ignore_eos,
    }
    if req.sampling.stop:
        sampling["stop"] = req.sampling.stop
    return sampling


def _finish_reason(meta: dict) -> FinishReason:
    reason = meta.get("finish_reason") or {}
    kind = reason.get("type") if isinstance(reason, dict) else str(reason)
    if kind == "stop":
        return FinishReason.STOP
    if kind == "abort":
        return FinishReason.ABORT
    return FinishReason.LENGTH
