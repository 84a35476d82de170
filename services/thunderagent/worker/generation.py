"""One request's run on the engine: stream tokens to the client, report progress to the
scheduler, stop quietly when the scheduler preempts it.

A continuation (``output_offset > 0``) carries the tokens the client already has at the end of
its prompt; its chunks continue the numbering and its usage counts the whole answer, so the
client sees one unbroken stream across a preemption.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import msgspec

from thunderagent.bus import Bus, BusError
from thunderagent.schemas import (
    Ack,
    ErrorCode,
    ErrorReply,
    FinalReply,
    FinishReason,
    KvTransfer,
    RequestProgress,
    TokenChunk,
    Usage,
    WorkerGenerate,
    subjects,
)
from thunderagent.worker.engine_client import EngineClient, EngineError

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Generation:
    work: WorkerGenerate
    worker_id: str
    bus: Bus
    engine: EngineClient
    output: list[int] = field(default_factory=list)
    """Tokens this run produced."""
    preempted: bool = False
    started: bool = False
    """The first token came out: its prefill is no longer queued work on the engine."""
    task: asyncio.Task | None = None

    @property
    def request_id(self) -> str:
        return self.work.request.request_id

    @property
    def engine_rid(self) -> str:
        """The engine's id for this run: a continuation must not collide with the aborted run,
        which the engine may not have dropped yet."""
        offset = self.work.output_offset
        return f"{self.request_id}#{offset}" if offset else self.request_id

    def all_output(self) -> list[int]:
        """Every output token the client has: earlier runs' (the prompt's tail) and this one's."""
        ids = self.work.request.token_ids or []
        offset = self.work.output_offset
        return [*ids[len(ids) - offset :], *self.output] if offset else list(self.output)

    async def preempt(self) -> None:
        """Stop streaming and abort at the engine (SGLang's ``/abort_request``; closing the
        stream also aborts it there, this just does not wait for the next token to notice)."""
        self.preempted = True
        if self.task is not None:
            self.task.cancel()
        await self.engine.abort(self.engine_rid)

    async def run(self) -> FinalReply | None:
        self.task = asyncio.current_task()
        try:
            if self.work.decode_worker and self.work.request.max_tokens > 1:
                return await self._prefill_then_hand_off()
            return await self._run()
        except asyncio.CancelledError:
            if not self.preempted:
                raise
            await self._progress("aborted")
            return None

    async def _run(self) -> FinalReply | None:
        req = self.work.request
        started = time.monotonic()
        first_token_at: float | None = None
        text_parts: list[str] = []
        meta: dict = {}
        try:
            stream = self.engine.generate(self.engine_rid, req.token_ids or [], _sampling(req))
            async for chunk in stream:
                meta = chunk.meta
                if not chunk.new_token_ids:
                    continue
                if first_token_at is None:
                    first_token_at = time.monotonic()
                    self.started = True
                    await self._progress("started")
                if req.stream:
                    await self.bus.publish(self.work.reply_subject, self._chunk(chunk))
                else:
                    text_parts.append(chunk.new_text)
                self.output.extend(chunk.new_token_ids)
        except (TimeoutError, EngineError, OSError) as err:
            await self._fail(err)
            return None
        finished = time.monotonic()
        final = self._final(meta, "".join(text_parts), started, first_token_at or finished)
        await self.bus.publish(self.work.reply_subject, final)
        await self.bus.publish(subjects.COMPLETIONS, final)
        await self._progress("finished")
        return final

    async def _prefill_then_hand_off(self) -> FinalReply | None:
        """PD disaggregation: prefill here up to the first token, move the KV to the decode
        worker, hand it the rest as a continuation (the client's stream goes on from there).
        If the transfer or the hand-off fails, the rest runs here instead: slower, not lost."""
        req = self.work.request
        decode = self.work.decode_worker
        first: list[int] = []
        try:
            prefill = {**_sampling(req), "max_new_tokens": 1}
            async for chunk in self.engine.generate(self.engine_rid, req.token_ids or [], prefill):
                if chunk.new_token_ids:
                    if not self.started:
                        self.started = True
                        await self._progress("started")
                    if req.stream:
                        await self.bus.publish(self.work.reply_subject, self._chunk(chunk))
                    first.extend(chunk.new_token_ids)
                    self.output.extend(chunk.new_token_ids)
        except (TimeoutError, EngineError, OSError) as err:
            await self._fail(err)
            return None
        context = [*(req.token_ids or []), *first]
        rest = self._continuation(context, len(first))
        transfer = KvTransfer(
            request_id=self.request_id, token_ids=context, source_worker=self.worker_id
        )
        try:
            ack = await self.bus.request(
                subjects.worker_kv_import(decode), transfer, Ack, timeout=30
            )
            await self._progress("transferred")
            if ack.accepted:
                ack = await self.bus.request(subjects.worker_generate(decode), rest, Ack, timeout=5)
            if ack.accepted:
                return None  # the decode worker answers the client from here
            log.warning("PD hand-off of %s to %s refused: %s", self.request_id, decode, ack.reason)
        except BusError as err:
            log.warning("PD hand-off of %s to %s failed: %s", self.request_id, decode, err)
            await self._progress("transferred")  # no transfer in flight any more
        return await Generation(rest, self.worker_id, self.bus, self.engine).run()

    def _continuation(self, context: list[int], generated: int) -> WorkerGenerate:
        req = self.work.request
        return WorkerGenerate(
            request=msgspec.structs.replace(
                req, token_ids=context, max_tokens=req.max_tokens - generated
            ),
            reply_subject=self.work.reply_subject,
            predicted_cached_tokens=self.work.predicted_cached_tokens,
            attempt=self.work.attempt,
            output_offset=self.work.output_offset + generated,
        )

    def _chunk(self, chunk) -> TokenChunk:
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

    async def _fail(self, err: Exception) -> None:
        log.warning("request %s failed at the engine: %s", self.request_id, err)
        await self._progress("failed")
        error = ErrorReply(
            code=ErrorCode.ENGINE_ERROR,
            message=str(err),
            request_id=self.request_id,
            service=f"worker/{self.worker_id}",
        )
        await self.bus.publish(self.work.reply_subject, error)

    async def _progress(self, phase: str) -> None:
        progress = RequestProgress(
            request_id=self.request_id, worker_id=self.worker_id, phase=phase, ts=time.time()
        )
        await self.bus.publish(subjects.SCHED_PROGRESS, progress)


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
