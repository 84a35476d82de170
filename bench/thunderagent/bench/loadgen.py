"""Open-loop load: requests start at a fixed rate whatever the answers do, over NATS (the
``ThunderClient``) or HTTP (``/generate`` on an engine or an HTTP router, aiohttp keep-alive).

The generator runs on uvloop and encodes each body once, up front; its own CPU time is measured
by the caller (``procs.CpuMeter``), and each request's start lag behind its schedule is kept, so a
generator that fell behind shows instead of passing for a slow system. Latency is measured from
the moment a request is actually sent.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import aiohttp
import msgspec

from thunderagent.client import ThunderClient
from thunderagent.schemas import ErrorReply, FinalReply, GenerateRequest, TokenChunk
from thunderagent.stats import percentile

VOCAB = 32_000


def prompts(count: int, tokens: int, unique: int, *, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of ``tokens`` ids: a prefix shared by all, then ``unique`` ids of each
    prompt's own (so each request stores ``unique / block_size`` new blocks at its engine)."""
    shared = [4 + (i * 31 + seed) % 250 for i in range(max(0, tokens - unique))]
    out = []
    for n in range(count):
        x = (n + 1 + seed * 1_000_003) * 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF
        own = []
        for _ in range(min(unique, tokens)):
            x = (x * 6364136223846793005 + 1442695040888963407) & 0xFFFFFFFFFFFFFFFF
            own.append(4 + (x >> 33) % (VOCAB - 4))
        out.append(shared + own)
    return out


@dataclass(slots=True)
class Sample:
    ttft_ms: float = -1.0
    e2e_ms: float = -1.0
    lag_ms: float = 0.0
    """How late the request started against its schedule."""
    error: str = ""


@dataclass
class LoadResult:
    rate: float
    samples: list[Sample] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def ok(self) -> list[Sample]:
        return [s for s in self.samples if not s.error and s.ttft_ms >= 0]

    def ttft(self) -> list[float]:
        return [s.ttft_ms for s in self.ok]

    def summary(self) -> dict:
        ok = self.ok
        ttft = [s.ttft_ms for s in ok]
        lag = [s.lag_ms for s in self.samples]
        errors = sorted({s.error for s in self.samples if s.error})
        return {
            "sent": len(self.samples),
            "completed": len(ok),
            "errors": len(self.samples) - len(ok),
            "first_errors": errors[:3],
            "error_codes": error_codes(s.error for s in self.samples),
            "achieved_rate": round(len(self.samples) / self.wall_s, 1) if self.wall_s else 0.0,
            "ttft_p50_ms": _q(ttft, 50),
            "ttft_p99_ms": _q(ttft, 99),
            "e2e_p50_ms": _q([s.e2e_ms for s in ok], 50),
            "start_lag_p99_ms": _q(lag, 99),
        }


def error_codes(errors: Iterable[str]) -> dict[str, int]:
    """How many requests ended with each error class (the text before the first colon):
    ``overloaded`` refusals, which carry a retry hint, apart from failures."""
    return dict(Counter(e.split(":")[0] for e in errors if e))


def _q(values: list[float], q: float) -> float:
    return round(percentile(values, q), 3) if values else -1.0


Send = Callable[[int, Sample], Awaitable[None]]


async def open_loop(rate: float, count: int, send: Send) -> LoadResult:
    """Start ``send(i, sample)`` for i in range(count) at ``rate`` per second; wait for all."""
    result = LoadResult(rate, [Sample() for _ in range(count)])
    tasks: set[asyncio.Task] = set()
    started = time.perf_counter()
    i = 0
    while i < count:
        now = time.perf_counter()
        while i < count and started + i / rate <= now:
            sample = result.samples[i]
            sample.lag_ms = (now - started - i / rate) * 1e3
            task = asyncio.ensure_future(send(i, sample))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            i += 1
        if i < count:
            await asyncio.sleep(max(0.0, started + i / rate - time.perf_counter()))
    if tasks:
        await asyncio.wait(set(tasks))
    result.wall_s = time.perf_counter() - started
    return result


def thunder_sender(client: ThunderClient, model: str, bodies: list[list[int]]) -> Send:
    """Requests over NATS; TTFT at the first token chunk, e2e at the final reply."""

    async def send(i: int, sample: Sample) -> None:
        request = GenerateRequest(
            model=model, token_ids=bodies[i % len(bodies)], max_tokens=1, stream=True
        )
        t0 = time.perf_counter()
        try:
            async for reply in client.stream(request):
                if isinstance(reply, TokenChunk):
                    if sample.ttft_ms < 0:
                        sample.ttft_ms = (time.perf_counter() - t0) * 1e3
                elif isinstance(reply, FinalReply):
                    sample.e2e_ms = (time.perf_counter() - t0) * 1e3
                    if sample.ttft_ms < 0:
                        sample.ttft_ms = sample.e2e_ms
                elif isinstance(reply, ErrorReply):
                    sample.error = f"{reply.code.value}: {reply.message[:100]}"
        except Exception as err:  # a broken generator must not hide the other requests
            sample.error = f"{type(err).__name__}: {err}"

    return send


def http_bodies(bodies: list[list[int]]) -> list[bytes]:
    """SGLang ``/generate`` bodies, encoded once."""
    enc = msgspec.json.Encoder()
    return [
        enc.encode({"input_ids": ids, "sampling_params": {"max_new_tokens": 1}, "stream": True})
        for ids in bodies
    ]


def completion_bodies(bodies: list[list[int]], model: str) -> list[bytes]:
    """OpenAI ``/v1/completions`` bodies (token-id prompts, streamed), encoded once: the same
    requests for ``thunderagent gateway``."""
    enc = msgspec.json.Encoder()
    return [
        enc.encode({"model": model, "prompt": ids, "max_tokens": 1, "stream": True})
        for ids in bodies
    ]


def http_sender(
    session: aiohttp.ClientSession, urls: list[str], bodies: list[bytes], path: str = "/generate"
) -> Send:
    """Streamed ``path`` on ``urls`` in turn; TTFT at the first ``data:`` line."""
    headers = {"Content-Type": "application/json"}
    targets = [u.rstrip("/") + path for u in urls]

    async def send(i: int, sample: Sample) -> None:
        t0 = time.perf_counter()
        try:
            async with session.post(
                targets[i % len(targets)], data=bodies[i % len(bodies)], headers=headers
            ) as resp:
                if resp.status != 200:
                    sample.error = f"HTTP {resp.status}: {(await resp.text())[:100]}"
                    return
                async for line in resp.content:
                    if line.startswith(b"data:") and sample.ttft_ms < 0:
                        sample.ttft_ms = (time.perf_counter() - t0) * 1e3
            sample.e2e_ms = (time.perf_counter() - t0) * 1e3
        except (aiohttp.ClientError, OSError, TimeoutError) as err:
            sample.error = f"{type(err).__name__}: {err}"

    return send


def http_session(*, force_close: bool = False) -> aiohttp.ClientSession:
    """Keep-alive (or a new connection per request), no connection cap (an open loop must not
    queue in the client)."""
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, force_close=force_close)
    timeout = aiohttp.ClientTimeout(total=30)
    return aiohttp.ClientSession(
        connector=connector, timeout=timeout, skip_auto_headers=["User-Agent"]
    )
