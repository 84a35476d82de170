"""Parent-based sampling on the bus, against a real NATS server: a message gets a span only when
its sender's trace is sampled and this process traces; a sampled-out context is passed on as it
came; a message without trace context, or any message with tracing off, costs no span at all.
Request/reply over the bus's shared reply subscription."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap

import pytest

from thunderagent.bus import Bus, NoResponders, RequestTimeout, connect
from thunderagent.schemas import Ack, ResyncRequest

pytestmark = pytest.mark.integration

SAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
UNSAMPLED = "00-1af7651916cd43dd8448eb211c80319c-c7ad6b7169203331-00"

# Runs in its own process: the tracer provider is process-global and set once.
SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys
    import msgspec
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from thunderagent.bus import Bus, connect
    from thunderagent.schemas import Ack

    exporter = InMemorySpanExporter()
    provider = TracerProvider()  # the sampler comes from OTEL_TRACES_SAMPLER(_ARG)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)

    async def main():
        nc = await connect(sys.argv[1], name="svc")
        bus = Bus(nc, service="svc")
        onward = asyncio.Queue()

        async def handler(msg, delivery):
            await bus.publish("t.onward", Ack(accepted=True))

        async def on_onward(msg):
            onward.put_nowait(dict(msg.headers or {}))

        await nc.subscribe("t.onward", cb=on_onward)
        await bus.subscribe("t.in", Ack, handler)
        body = msgspec.json.encode(Ack(accepted=True))
        out = []
        for headers in (None, {"traceparent": sys.argv[2]}, {"traceparent": sys.argv[3]}):
            await nc.publish("t.in", body, headers=headers)
            out.append(await asyncio.wait_for(onward.get(), 5))
        spans = [
            {"name": s.name, "trace_id": format(s.context.trace_id, "032x"),
             "parent": format(s.parent.span_id, "016x") if s.parent else ""}
            for s in exporter.get_finished_spans()
        ]
        sampler = provider.sampler.get_description()
        print(json.dumps({"onward": out, "spans": spans, "sampler": sampler}))
        await nc.close()

    asyncio.run(main())
    """
)


def test_spans_only_for_sampled_senders_and_contexts_pass_on(nats_server):
    env = {**os.environ, "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
           "OTEL_TRACES_SAMPLER_ARG": "0.5"}  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, nats_server.url, SAMPLED, UNSAMPLED],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert "TraceIdRatioBased{0.5}" in result["sampler"]
    none, sampled, unsampled = result["onward"]
    # one span: the sampled sender's, continuing its trace
    assert [(s["name"], s["trace_id"], s["parent"]) for s in result["spans"]] == [
        ("svc in", SAMPLED.split("-")[1], SAMPLED.split("-")[2])
    ]
    assert "traceparent" not in none, "no context in, none out (and no header block)"
    assert sampled["traceparent"].split("-")[1] == SAMPLED.split("-")[1]
    assert sampled["traceparent"].endswith("-01")
    # sampled out: no span here, the same context goes on, still sampled out
    assert unsampled["traceparent"] == UNSAMPLED


class _NoSpans:
    """A tracer that fails the test if the bus asks it for a span."""

    def start_as_current_span(self, *args, **kwargs):
        raise AssertionError("the bus made a span with tracing off")

    start_span = start_as_current_span


async def test_tracing_off_makes_no_spans_and_passes_context_on(nats_server):
    nc = await connect(nats_server.url, name="svc")
    bus = Bus(nc, service="svc")
    bus._tracer = _NoSpans()
    onward: asyncio.Queue = asyncio.Queue()

    async def handler(msg: Ack, delivery) -> None:
        await bus.publish("t.onward", Ack(accepted=True))

    async def on_onward(msg) -> None:
        onward.put_nowait(msg.headers)

    await nc.subscribe("t.onward", cb=on_onward)
    await bus.subscribe("t.in", Ack, handler)
    got = []
    for headers in (None, {"traceparent": SAMPLED}, {"traceparent": UNSAMPLED}):
        await nc.publish("t.in", b'{"accepted": true}', headers=headers)
        got.append(await asyncio.wait_for(onward.get(), 5))
    await nc.close()
    assert got[0] is None, "no header block at all when there is no context"
    assert got[1]["traceparent"] == SAMPLED and got[2]["traceparent"] == UNSAMPLED
    assert bus.stats["t.in"].delivered == 3 and bus.stats["t.in"].handler_errors == 0


async def test_requests_share_one_reply_subscription(nats_server):
    nc = await connect(nats_server.url, name="svc")
    bus = Bus(nc, service="svc")

    async def echo(msg: ResyncRequest, delivery) -> None:
        await asyncio.sleep(0.01 * int(msg.worker_id))  # answer out of order
        await bus.publish(delivery.reply, Ack(accepted=True, reason=msg.worker_id))

    await bus.subscribe("t.echo", ResyncRequest, echo, concurrent=True)
    subs_before = len(nc._subs)
    asks = [ResyncRequest(worker_id=str(i), reason="x") for i in (5, 1, 3, 0, 2)]
    answers = await asyncio.gather(*(bus.request("t.echo", a, Ack, timeout=5) for a in asks))
    assert [a.reason for a in answers] == ["5", "1", "3", "0", "2"]
    assert len(nc._subs) == subs_before + 1, "one reply subscription for every request"
    with pytest.raises(NoResponders):
        await bus.request("t.nobody", Ack(accepted=True), Ack, timeout=5)

    async def ignore(msg) -> None:
        pass

    await nc.subscribe("t.silent", cb=ignore)
    with pytest.raises(RequestTimeout):
        await bus.request("t.silent", Ack(accepted=True), Ack, timeout=0.2)
    assert len(bus._replies) == 0, "nothing left waiting"
    await nc.close()
