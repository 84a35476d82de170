"""A run answers its client as soon as the engine's chunk carries the finish reason; the rest of
the engine's stream (``[DONE]``, the end of the body) is read after, off the client's path. The
run's end reaches the routers and the scheduler before the client's answer does, and a run whose
first token is its last sends its start and end as one batch."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from thunderagent.bus import Bus, connect
from thunderagent.fleet import AcceptedRuns
from thunderagent.schemas import (
    REPLY_DECODER,
    FinalReply,
    GenerateRequest,
    ProgressBatch,
    TokenChunk,
    WorkerGenerate,
    subjects,
)
from thunderagent.worker.engine_client import EngineChunk, EngineError
from thunderagent.worker.generation import Generation

pytestmark = pytest.mark.integration

PROGRESS = msgspec.json.Decoder(ProgressBatch)
FINISHED = {"finish_reason": {"type": "length"}, "prompt_tokens": 4, "completion_tokens": 2}


class SlowEndEngine:
    """Streams two tokens, the second with its finish reason, then holds the stream open until
    ``release`` is set (an engine slow to send ``[DONE]``), then ends it or breaks it."""

    def __init__(self, *, break_after: bool = False, one_token: bool = False) -> None:
        self.release = asyncio.Event()
        self.one_token = one_token
        self.break_after = break_after
        self.drained = False
        self.aborted: list[str] = []

    bootstrap_port = 0  # no SGLang PD mode

    async def generate(
        self, rid, input_ids, sampling, *, cache_salt=None, lora_name=None, bootstrap=None
    ):
        if self.one_token:
            yield EngineChunk(
                new_token_ids=[7], new_text="a", meta={**FINISHED, "completion_tokens": 1}
            )
        else:
            yield EngineChunk(new_token_ids=[7], new_text="a", meta={"completion_tokens": 1})
            yield EngineChunk(new_token_ids=[8], new_text="b", meta=FINISHED)
        await self.release.wait()
        if self.break_after:
            raise EngineError(502, "connection reset after the last token")
        self.drained = True

    async def abort(self, rid: str) -> bool:
        self.aborted.append(rid)
        return True


async def start(nats_url: str, engine: SlowEndEngine, rid: str = "r1"):
    nc = await connect(nats_url, name="adapter")
    bus = Bus(nc, service="worker")
    client = await connect(nats_url, name="client")
    replies: asyncio.Queue = asyncio.Queue()
    phases: list[str | list[str]] = []
    """Each progress batch's phases, and "reply" where the client's final reply came: one
    subscription, so in the order the server delivered them."""

    async def on_message(msg):
        if msg.subject == f"reply.{rid}":
            await replies.put(msg)
            if isinstance(REPLY_DECODER.decode(msg.data), FinalReply):
                phases.append("reply")
        elif msg.subject.startswith(subjects.worker_progress("w0")[:-1]):
            batch = PROGRESS.decode(msg.data)
            assert msg.subject == subjects.progress(batch.worker_id, ended=batch.ends_runs)
            mine = [p.phase for p in batch.events if p.request_id == rid]
            if mine:
                phases.append(mine)

    await client.subscribe(">", cb=on_message)
    await client.flush()
    work = WorkerGenerate(
        request=GenerateRequest(model="m", token_ids=[1, 2, 3, 4], max_tokens=2, request_id=rid),
        reply_subject=f"reply.{rid}",
    )
    runs = AcceptedRuns()
    generation = Generation(work, "w0", bus, engine, runs)  # type: ignore[arg-type]
    runs.accept(generation.engine_rid, 4)
    task = asyncio.create_task(generation.run())
    return nc, client, replies, phases, generation, task


HANG_S = 30.0
"""A guard against a hang, not a timing target."""


async def read_until_final(replies: asyncio.Queue, task: asyncio.Task) -> list:
    """The client's replies up to the final one; a run that died first fails with its error."""
    got = []
    while not got or not isinstance(got[-1], FinalReply):
        reply = asyncio.ensure_future(replies.get())
        done, _ = await asyncio.wait({reply, task}, timeout=HANG_S,
                                     return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        if reply not in done:
            reply.cancel()
            if task in done:
                raise AssertionError(f"the run ended before its answer: {task.result()!r}")
            raise TimeoutError(f"no reply in {HANG_S:g} s after {got!r}")
        got.append(REPLY_DECODER.decode(reply.result().data))
    return got


async def test_final_reply_does_not_wait_for_the_end_of_the_engine_stream(nats_server):
    engine = SlowEndEngine()
    nc, client, replies, phases, _, task = await start(nats_server.url, engine)
    got = await read_until_final(replies, task)
    assert [type(r) for r in got] == [TokenChunk, TokenChunk, FinalReply]
    assert got[-1].usage.completion_tokens == 2
    assert not engine.drained and not task.done(), "answered while the stream was still open"
    engine.release.set()
    final = await asyncio.wait_for(task, HANG_S)
    assert final is got[-1] or final == got[-1]
    assert engine.drained
    await client.flush()
    await asyncio.sleep(0.1)
    assert phases == [["started"], ["finished"], "reply"], "the run's end before the answer"
    await nc.close()
    await client.close()


async def test_a_stream_broken_or_stopped_after_the_answer_reports_nothing_more(nats_server):
    broken = SlowEndEngine(break_after=True)
    nc, client, replies, phases, _, task = await start(nats_server.url, broken)
    await read_until_final(replies, task)
    broken.release.set()
    assert isinstance(await asyncio.wait_for(task, HANG_S), FinalReply)  # no failure, no hand-back

    stopped = SlowEndEngine()
    nc2, client2, replies2, phases2, generation2, task2 = await start(
        nats_server.url, stopped, "r2"
    )
    await read_until_final(replies2, task2)
    await generation2.stop()  # a preemption or cancel that arrives after the answer
    await asyncio.sleep(0.05)
    assert not task2.done() and not stopped.aborted, "an answered run is left to drain"
    stopped.release.set()
    assert isinstance(await asyncio.wait_for(task2, HANG_S), FinalReply)
    assert stopped.drained
    await client.flush()
    await asyncio.sleep(0.1)
    await client2.flush()
    assert phases == phases2 == [["started"], ["finished"], "reply"]
    assert replies.empty() and replies2.empty(), "nothing after the final reply"
    for c in (nc, client, nc2, client2):
        await c.close()


async def test_a_one_token_run_sends_its_start_and_end_together_before_the_answer(nats_server):
    engine = SlowEndEngine(one_token=True)
    nc, client, replies, phases, _, task = await start(nats_server.url, engine)
    got = await read_until_final(replies, task)
    assert [type(r) for r in got] == [TokenChunk, FinalReply]
    engine.release.set()
    await asyncio.wait_for(task, HANG_S)
    await client.flush()
    await asyncio.sleep(0.1)
    assert phases == [["started", "finished"], "reply"]
    await nc.close()
    await client.close()
