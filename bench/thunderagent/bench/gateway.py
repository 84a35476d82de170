"""What the HTTP gateway adds: the same chat request through the gateway and straight over NATS.

Starts the embedded stack (real NATS, Redis, service processes, one gateway process, simulated
engines with their clock sped up so the modelled GPU time is negligible), then:

- latency: N sequential chat requests, alternating HTTP (non-streamed, keep-alive) and
  ``ThunderClient`` over NATS (``stream=False``, the same messages), and the same pair streamed
  (time to the first token); the difference of the two distributions is the gateway's cost;
- saturation: ``--concurrency`` HTTP clients send ``--load-requests`` requests as fast as the
  gateway answers (and the same load straight over NATS), giving requests/s, latency, and the
  gateway process's CPU time per request (which does not depend on who else shares the cores).

    python -m thunderagent.bench.gateway [--requests 300] [--concurrency 64] [--json FILE]
"""

from __future__ import annotations

import asyncio
import os
import time

import aiohttp

from thunderagent import stats
from thunderagent.bench.cli import bench_parser
from thunderagent.bench.jsonfile import dumps, write_json
from thunderagent.client import ThunderClient
from thunderagent.schemas import ChatMessage, GenerateRequest, TokenChunk
from thunderagent.shell.argtypes import at_least, output_file, positive
from thunderagent.stack.up import Stack, StackConfig

SYSTEM = "You are a terse assistant that answers in one line. " * 4


def _messages(i: int) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"question {i}"}]


def _request(model: str, i: int, max_tokens: int, stream: bool) -> GenerateRequest:
    turns = [ChatMessage(role=m["role"], content=m["content"]) for m in _messages(i)]
    return GenerateRequest(model=model, messages=turns, max_tokens=max_tokens, stream=stream)


async def _http(http: aiohttp.ClientSession, url: str, body: dict) -> float:
    """Seconds to the whole answer (non-streamed) or to the first content chunk (streamed)."""
    started = time.perf_counter()
    async with http.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{resp.status}: {await resp.text()}")
        if not body["stream"]:
            await resp.read()
            return time.perf_counter() - started
        first = 0.0
        async for line in resp.content:  # read to the end, as a client would
            if not first and b'"content":"' in line and b'"content":""' not in line:
                first = time.perf_counter() - started
        return first


async def latency(stack: Stack, args) -> dict:
    url = stack.gateway_url + "/v1/chat/completions"
    client = await ThunderClient.connect(stack.nats_url, idle_timeout_s=30)
    out: dict = {}
    async with aiohttp.ClientSession() as http:
        for stream in (False, True):
            via_http, via_nats = [], []
            for i in range(args.requests + args.warmup):
                body = {"model": stack.config.model, "messages": _messages(i), "stream": stream,
                        "max_tokens": args.max_tokens}  # fmt: skip
                h = await _http(http, url, body)
                n = await _nats_once(
                    client, _request(stack.config.model, i, args.max_tokens, stream)
                )
                if i >= args.warmup:
                    via_http.append(h)
                    via_nats.append(n)
            key = "stream_ttft_ms" if stream else "chat_e2e_ms"
            added = {q: stats.percentile(via_http, p) - stats.percentile(via_nats, p)
                     for q, p in (("p50", 50), ("p99", 99))}  # fmt: skip
            out[key] = {
                "gateway": stats.summary(via_http, scale=1e3, digits=3),
                "nats": stats.summary(via_nats, scale=1e3, digits=3),
                "added": {q: round(v * 1e3, 3) for q, v in added.items()},
            }  # fmt: skip
    await client.close()
    return out


async def _nats_once(client: ThunderClient, req: GenerateRequest) -> float:
    """Seconds to the final reply, or to the first token when the request streams (the rest
    is read to the end, as an HTTP client would)."""
    started = time.perf_counter()
    first = 0.0
    async for reply in client.stream(req):
        if isinstance(reply, TokenChunk) and not first:
            first = time.perf_counter() - started
    return first if req.stream else time.perf_counter() - started


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _drive(n: int, concurrency: int, one) -> tuple[float, list[float]]:
    latencies: list[float] = []
    todo = iter(range(n))

    async def worker() -> None:
        for i in todo:
            latencies.append(await one(i))

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - started, latencies


async def saturation(stack: Stack, args) -> dict:
    url = stack.gateway_url + "/v1/chat/completions"
    model = stack.config.model
    gateway = next(c for c in stack.children if c.name.startswith("gateway"))
    connector = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def one_http(i: int) -> float:
            body = {"model": model, "messages": _messages(i), "max_tokens": args.max_tokens,
                    "stream": False}  # fmt: skip
            return await _http(http, url, body)

        await _drive(args.concurrency * 4, args.concurrency, one_http)  # warm up
        cpu0 = _cpu_s(gateway.popen.pid)
        wall, lat = await _drive(args.load_requests, args.concurrency, one_http)
        cpu = _cpu_s(gateway.popen.pid) - cpu0
    client = await ThunderClient.connect(stack.nats_url, idle_timeout_s=30)

    async def one_nats(i: int) -> float:
        return await _nats_once(client, _request(model, i, args.max_tokens, False))

    nats_wall, nats_lat = await _drive(args.load_requests, args.concurrency, one_nats)
    await client.close()
    return {
        "concurrency": args.concurrency,
        "requests": args.load_requests,
        "gateway": {
            "requests_per_s": round(args.load_requests / wall, 1),
            "latency_ms": stats.summary(lat, scale=1e3, digits=2),
            "gateway_cpu_us_per_request": round(cpu / args.load_requests * 1e6, 1),
        },
        "nats": {
            "requests_per_s": round(args.load_requests / nats_wall, 1),
            "latency_ms": stats.summary(nats_lat, scale=1e3, digits=2),
        },
    }


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser("gateway", __doc__)
    parser.add_argument(
        "--requests", type=at_least(1), default=300, help="sequential requests per path"
    )
    parser.add_argument("--warmup", type=at_least(0), default=20)
    parser.add_argument("--max-tokens", type=at_least(1), default=8)
    parser.add_argument("--concurrency", type=at_least(1), default=64)
    parser.add_argument("--load-requests", type=at_least(1), default=3000)
    parser.add_argument("--workers", type=at_least(1), default=2)
    parser.add_argument("--speedup", type=positive, default=1000.0)
    parser.add_argument("--json", dest="json_out", type=output_file, default=None)
    args = parser.parse_args(argv)
    config = StackConfig(workers=args.workers, speedup=args.speedup, gateways=1)
    stack = Stack.start(config)
    try:
        result = {
            "workers": args.workers,
            "engine_speedup": args.speedup,
            "max_tokens": args.max_tokens,
            "latency": asyncio.run(latency(stack, args)),
            "saturation": asyncio.run(saturation(stack, args)),
        }
    finally:
        stack.stop()
    print(dumps(result, indent=2))
    if args.json_out:
        write_json(args.json_out, result)


if __name__ == "__main__":
    main()
