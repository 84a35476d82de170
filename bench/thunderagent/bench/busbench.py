"""Per-message cost of the bus over a real nats-server, in one process: CPU µs to publish a
message and handle it through ``Bus.subscribe`` (with no trace context, a sampled-out one and a
sampled one; one at a time or a task per message), against a bare nats-py callback; CPU and wall
µs of a ``Bus.request`` round trip; and a publish without headers against an empty header block.

    thunderagent bench bus [--messages 20000] [--tracing] [--json FILE]

``--tracing`` installs an OTel SDK tracer provider (parent-based, no exporter) first, as a
service started with an OTLP endpoint has; without it the process has tracing off.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

import msgspec
import uvloop

from thunderagent.bench.cli import bench_parser
from thunderagent.bench.jsonfile import dumps, write_json
from thunderagent.bus import Bus, connect
from thunderagent.embedded import NatsServer
from thunderagent.schemas import Ack
from thunderagent.shell.argtypes import at_least, output_file

SAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
UNSAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
PAYLOAD = msgspec.json.encode(Ack(accepted=True))
CASES = (
    ("nats-py callback (reference)", None, False, True),
    ("bus, no trace context", None, False, False),
    ("bus, no trace context, task per message", None, True, False),
    ("bus, sampled-out context", {"traceparent": UNSAMPLED}, False, False),
    ("bus, sampled context", {"traceparent": SAMPLED}, False, False),
)
"""(case, headers, concurrent, raw nats-py subscription)."""


async def _deliveries(nc, bus: Bus, n: int, headers, concurrent: bool, raw: bool) -> float:
    """CPU µs per message: publish ``n`` and wait until the last one was handled."""
    subject = f"bench.bus.{time.monotonic_ns()}"
    done = asyncio.Event()
    count = 0

    def seen() -> None:
        nonlocal count
        count += 1
        if count == n:
            done.set()

    async def on_raw(msg) -> None:
        seen()

    async def on_decoded(msg: Ack, delivery) -> None:
        seen()

    if raw:
        await nc.subscribe(subject, cb=on_raw)
    else:
        await bus.subscribe(subject, Ack, on_decoded, concurrent=concurrent)
    await nc.flush()
    started = time.process_time()
    for i in range(n):
        await nc.publish(subject, PAYLOAD, headers=headers)
        if i % 500 == 499:  # let the reader run: the socket buffer is finite
            await asyncio.sleep(0)
    await asyncio.wait_for(done.wait(), 120)
    return (time.process_time() - started) / n * 1e6


async def _requests(nc, bus: Bus, n: int) -> dict:
    subject = f"bench.req.{time.monotonic_ns()}"

    async def pong(msg) -> None:
        await msg.respond(PAYLOAD)

    await nc.subscribe(subject, cb=pong)
    await nc.flush()
    for _ in range(100):
        await bus.request(subject, Ack(accepted=True), Ack)
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(n):
        await bus.request(subject, Ack(accepted=True), Ack)
    return {
        "cpu_us": round((time.process_time() - cpu) / n * 1e6, 2),
        "wall_us": round((time.perf_counter() - wall) / n * 1e6, 2),
    }


async def run(n: int, rounds: int) -> dict:
    server = NatsServer(Path(tempfile.mkdtemp(prefix="thunderagent-busbench-"))).start()
    try:
        nc = await connect(server.url, name="thunderagent-busbench")
        bus = Bus(nc, service="bench")
        deliveries: dict[str, list[float]] = {}
        for _ in range(rounds):
            for name, headers, concurrent, raw in CASES:
                us = await _deliveries(nc, bus, n, headers, concurrent, raw)
                deliveries.setdefault(name, []).append(round(us, 2))
            for name, headers in (("publish, no headers (PUB)", None),
                                  ("publish, empty headers (HPUB)", {})):  # fmt: skip
                us = await _deliveries(nc, bus, n, headers, False, True)
                deliveries.setdefault(name, []).append(round(us, 2))
        reqs = await _requests(nc, bus, max(1000, n // 10))
        await nc.close()
    finally:
        server.stop()
    return {"cpu_us_per_message": deliveries, "request_reply": reqs}


def main(argv: list[str] | None = None) -> None:
    p = bench_parser("bus", __doc__)
    p.add_argument("--messages", type=at_least(1), default=20_000)
    p.add_argument("--rounds", type=at_least(1), default=2)
    p.add_argument("--tracing", action="store_true", help="an SDK tracer provider, no exporter")
    p.add_argument("--json", dest="json_out", type=output_file, default=None)
    args = p.parse_args(argv)
    if args.tracing:
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider

        trace.set_tracer_provider(TracerProvider())
    from thunderagent.bench.profile import code_version, load_average

    report = {
        "tracing": args.tracing,
        "code_version": code_version(),
        "load_average": load_average(),
        **uvloop.run(run(args.messages, args.rounds)),
    }
    print(dumps(report, indent=2))
    if args.json_out:
        write_json(args.json_out, report)


if __name__ == "__main__":
    main()
