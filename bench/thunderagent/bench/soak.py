"""Soak: the whole stack at a steady request rate for a long time; memory, descriptors and
requests must all balance.

Starts the embedded stack as processes (NATS with its generated logins, Redis, index, scheduler,
router, migration, simulated engines and their adapters), sends requests open-loop at ``--rate``
per second for ``--duration`` seconds (a bounded set of multi-turn conversations from three
tenants, two of them salted, so caches fill and then stay full), and samples the resident memory
and open file descriptors of every process every ``--sample-s`` seconds from ``/proc``.

Pass criteria, after a warm-up (a quarter of the run, at most 120 s):
- no lost request: every request sent ended as completed or rejected (an error reply from the
  stack), or is still in flight when the run ends; none went unanswered (client timeout);
- memory flat: the least-squares slope of each process's RSS below ``--max-rss-slope`` MB/min
  (1), or its whole growth after warm-up below ``--max-rss-growth`` MB (4; a short run's slope
  is mostly noise);
- descriptors flat: each process's lowest count over the last quarter of the samples within
  ``--max-fd-growth`` (2) of its count at the end of warm-up. A keep-alive pool (the adapter's
  to its engine opens a connection per concurrent request) grows in a burst and shrinks once
  idle connections close; a leak raises the floor. The highest count is reported too.

Reported, not judged: each service's cyclic-GC pauses over the whole run, from its own
``/metrics`` at the end (full collections, the longest pause of any generation, the share of
time stopped).

    thunderagent bench soak [--duration 600] [--rate 30] [--json soak.json]
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from thunderagent.bench.cli import bench_parser
from thunderagent.bench.jsonfile import write_json
from thunderagent.client import RequestFailed, ThunderClient
from thunderagent.schemas import GenerateRequest
from thunderagent.shell.argtypes import at_least, output_file, positive
from thunderagent.stack.up import Stack, StackConfig

TENANTS = (None, "tenant-a", "tenant-b")
BLOCK = 16


@dataclass(kw_only=True)
class SoakConfig:
    duration_s: float = 600.0
    rate: float = 20.0
    workers: int = 2
    sample_s: float = 5.0
    conversations: int = 48
    turns: int = 6
    max_tokens: int = 16
    speedup: float = 20.0
    drain_s: float = 20.0
    """After the last request: how long in-flight requests may still finish."""
    idle_timeout_s: float = 30.0
    """A request with no reply for this long is lost."""
    max_rss_slope_mb_min: float = 1.0
    max_rss_growth_mb: float = 4.0
    max_fd_growth: int = 2
    seed: int = 1


@dataclass
class Counts:
    sent: int = 0
    completed: int = 0
    rejected: int = 0
    lost: int = 0
    """No reply within the client's idle timeout."""
    cached_tokens: int = 0
    prompt_tokens: int = 0
    errors: dict[str, int] = field(default_factory=dict)


# --- the workload -------------------------------------------------------------------------


def prompt(conversation: int, turn: int) -> list[int]:
    """A conversation's context at a turn: a shared system prompt, then its own turns."""
    system = [4 + (i * 7) % 250 for i in range(4 * BLOCK)]
    own = [4 + (conversation * 131 + i * 17) % 250 for i in range((turn + 2) * 2 * BLOCK)]
    return system + own + [4 + turn]


def request(rng: random.Random, cfg: SoakConfig, model: str) -> GenerateRequest:
    conv = rng.randrange(cfg.conversations)
    return GenerateRequest(
        model=model,
        token_ids=prompt(conv, rng.randrange(cfg.turns)),
        max_tokens=cfg.max_tokens,
        cache_salt=TENANTS[conv % len(TENANTS)],
    )


async def one(client: ThunderClient, req: GenerateRequest, counts: Counts) -> None:
    try:
        done = await client.generate(req)
    except RequestFailed as err:
        if err.error.service == "client":  # the client gave up waiting: nobody answered
            counts.lost += 1
        else:
            counts.rejected += 1
            key = err.error.code.value
            counts.errors[key] = counts.errors.get(key, 0) + 1
        return
    counts.completed += 1
    if done.final is not None:
        counts.cached_tokens += done.final.usage.cached_tokens
        counts.prompt_tokens += done.final.usage.prompt_tokens


async def drive(stack: Stack, cfg: SoakConfig, sampler: Sampler) -> tuple[Counts, int]:
    """Open-loop arrivals at ``cfg.rate``; returns the counts and the requests still running."""
    client = await ThunderClient.connect(stack.nats_url, idle_timeout_s=cfg.idle_timeout_s)
    rng = random.Random(cfg.seed)
    counts = Counts()
    tasks: set[asyncio.Task] = set()
    loop = asyncio.get_running_loop()
    started = loop.time()
    next_sample = started
    try:
        while (now := loop.time()) - started < cfg.duration_s:
            if now >= next_sample:
                sampler.sample(now - started)
                next_sample += cfg.sample_s
            due = started + counts.sent / cfg.rate
            if due > now:
                await asyncio.sleep(min(due - now, max(0.0, next_sample - now)))
                continue
            task = asyncio.create_task(one(client, request(rng, cfg, stack.config.model), counts))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            counts.sent += 1
        sampler.sample(loop.time() - started)
        if tasks:
            await asyncio.wait(set(tasks), timeout=cfg.drain_s)
        return counts, len(tasks)
    finally:
        for task in tasks:
            task.cancel()
        await client.close()


# --- sampling -----------------------------------------------------------------------------


def proc_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def proc_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@dataclass
class Series:
    name: str
    pid: int
    t: list[float] = field(default_factory=list)
    rss_mb: list[float] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)


class Sampler:
    def __init__(self, processes: dict[str, int]) -> None:
        self.series = {name: Series(name, pid) for name, pid in processes.items()}

    def sample(self, t: float) -> None:
        for s in self.series.values():
            try:
                rss, fds = proc_rss_mb(s.pid), proc_fds(s.pid)
            except OSError:  # it died: the run fails on that, not here
                continue
            s.t.append(round(t, 2))
            s.rss_mb.append(round(rss, 2))
            s.fds.append(fds)


def stack_processes(stack: Stack) -> dict[str, int]:
    """Every process of the stack, and this one (the load generator)."""
    out = {c.name: c.pid for c in stack.children}
    for server in stack.servers:
        if server.child is not None:
            out[server.name] = server.child.pid
    out["load-generator"] = os.getpid()
    return out


# --- verdict ------------------------------------------------------------------------------


def slope_per_min(t: list[float], y: list[float]) -> float:
    """Least-squares slope of ``y`` per minute of ``t`` (seconds)."""
    n = len(t)
    if n < 2:
        return 0.0
    mt, my = sum(t) / n, sum(y) / n
    var = sum((x - mt) ** 2 for x in t)
    if var == 0:
        return 0.0
    return sum((x - mt) * (v - my) for x, v in zip(t, y, strict=True)) / var * 60


def judge(series: Series, warmup_s: float, cfg: SoakConfig) -> dict:
    after = [i for i, x in enumerate(series.t) if x >= warmup_s]
    t = [series.t[i] for i in after]
    rss = [series.rss_mb[i] for i in after]
    fds = [series.fds[i] for i in after]
    slope = slope_per_min(t, rss)
    growth = (rss[-1] - rss[0]) if rss else 0.0
    fd_growth = (min(fds[-max(1, len(fds) // 4) :]) - fds[0]) if fds else 0
    rss_ok = slope < cfg.max_rss_slope_mb_min or growth < cfg.max_rss_growth_mb
    return {
        "pid": series.pid,
        "samples": len(t),
        "rss_start_mb": rss[0] if rss else None,
        "rss_end_mb": rss[-1] if rss else None,
        "rss_slope_mb_per_min": round(slope, 3),
        "rss_growth_mb": round(growth, 2),
        "fds_start": fds[0] if fds else None,
        "fds_max": max(fds) if fds else None,
        "fd_growth": fd_growth,
        "ok": bool(rss) and rss_ok and fd_growth <= cfg.max_fd_growth,
    }


def scrape_gc(ports: dict[str, int]) -> dict[str, dict[tuple[str, str], float]]:
    """Each service's GC series from its ``/metrics``, by (name, generation); a service that
    does not answer is left out. Reading resets the longest-pause gauges."""
    out = {}
    for name, port in ports.items():
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        except OSError:
            continue
        out[name] = {
            (sample.name, sample.labels["generation"]): sample.value
            for family in text_string_to_metric_families(text.decode())
            for sample in family.samples
            if sample.name in _GC_SERIES
        }
    return out


def gc_report(before: dict, after: dict, elapsed_s: float) -> dict[str, dict]:
    """Per service, between the two scrapes: full collections, the longest pause of any
    generation and the share of wall time spent collecting."""
    out = {}
    for name, end in after.items():
        start = before.get(name, {})
        grew = {key: v - start.get(key, 0.0) for key, v in end.items()}
        longest = max((v for (n, _), v in end.items() if n.endswith("max_seconds")), default=0.0)
        stopped = sum(v for (n, _), v in grew.items() if n.endswith("pause_seconds_total"))
        out[name] = {
            "full_collections": int(grew.get(("python_gc_collections_total", "2"), 0)),
            "longest_pause_ms": round(1000 * longest, 2),
            "stopped_share": round(stopped / elapsed_s, 5),
        }
    return out


_GC_SERIES = frozenset(
    (
        "thunderagent_gc_pause_seconds_total",
        "thunderagent_gc_pause_max_seconds",
        "python_gc_collections_total",
    )
)


def run(cfg: SoakConfig) -> dict:
    stack = Stack.start(
        StackConfig(workers=cfg.workers, speedup=cfg.speedup, gateways=0, metrics=True)
    )
    try:
        sampler = Sampler(stack_processes(stack))
        gc_before = scrape_gc(stack.metrics_ports)
        started = time.time()
        counts, in_flight = asyncio.run(drive(stack, cfg, sampler))
        elapsed = time.time() - started
        dead = [c.name for c in stack.dead_children()]
        gc = gc_report(gc_before, scrape_gc(stack.metrics_ports), elapsed)
    finally:
        stack.stop()
    warmup_s = min(cfg.duration_s / 4, 120.0)
    verdicts = {name: judge(s, warmup_s, cfg) for name, s in sampler.series.items()}
    balanced = counts.sent == counts.completed + counts.rejected + counts.lost + in_flight
    ok = balanced and counts.lost == 0 and not dead and all(v["ok"] for v in verdicts.values())
    return {
        "config": asdict(cfg),
        "elapsed_s": round(elapsed, 1),
        "warmup_s": warmup_s,
        "requests": {**asdict(counts), "in_flight": in_flight, "balanced": balanced},
        "achieved_rate": round(counts.sent / cfg.duration_s, 2),
        "cache_hit_ratio": round(counts.cached_tokens / max(counts.prompt_tokens, 1), 3),
        "dead_processes": dead,
        "processes": verdicts,
        "gc": gc,
        "series": {name: asdict(s) for name, s in sampler.series.items()},
        "ok": ok,
    }


def table(result: dict) -> str:
    r = result["requests"]
    lines = [
        f"soak: {result['config']['duration_s']:.0f} s at {result['config']['rate']:g} req/s "
        f"({result['achieved_rate']} sent/s): {r['sent']} sent, {r['completed']} completed, "
        f"{r['rejected']} rejected, {r['in_flight']} in flight, {r['lost']} lost; "
        f"cache hit ratio {result['cache_hit_ratio']}",
        f"after {result['warmup_s']:.0f} s warm-up:",
        "| process | RSS start MB | RSS end MB | slope MB/min | growth MB | FDs start | FDs max "
        "| ok |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, v in result["processes"].items():
        lines.append(
            f"| {name} | {v['rss_start_mb']} | {v['rss_end_mb']} | {v['rss_slope_mb_per_min']} "
            f"| {v['rss_growth_mb']} | {v['fds_start']} | {v['fds_max']} | {v['ok']} |"
        )
    if result.get("gc"):
        lines += [
            "cyclic GC over the run (reported, not judged):",
            "| service | full collections | longest pause ms | time stopped |",
            "|---|---|---|---|",
        ]
        for name, g in result["gc"].items():
            lines.append(
                f"| {name} | {g['full_collections']} | {g['longest_pause_ms']} "
                f"| {g['stopped_share']:.3%} |"
            )
    lines.append("PASS" if result["ok"] else "FAIL")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("soak", __doc__)
    p.add_argument("--duration", type=positive, default=600.0, help="seconds of load")
    p.add_argument("--rate", type=positive, default=30.0, help="requests per second")
    p.add_argument("--workers", type=at_least(1), default=2)
    p.add_argument("--sample-s", type=float, default=5.0)
    p.add_argument("--speedup", type=positive, default=20.0, help="simulated engines' clock")
    p.add_argument("--max-rss-slope", type=float, default=1.0, help="MB/min after warm-up")
    p.add_argument("--max-rss-growth", type=float, default=4.0, help="MB after warm-up")
    p.add_argument("--max-fd-growth", type=int, default=2)
    p.add_argument(
        "--json", dest="json_out", type=output_file, default=None, help="write the figures here"
    )
    args = p.parse_args(argv)
    cfg = SoakConfig(
        duration_s=args.duration, rate=args.rate, workers=args.workers, sample_s=args.sample_s,
        speedup=args.speedup, max_rss_slope_mb_min=args.max_rss_slope,
        max_rss_growth_mb=args.max_rss_growth, max_fd_growth=args.max_fd_growth,
    )  # fmt: skip
    result = run(cfg)
    print(table(result))
    if args.json_out:
        write_json(args.json_out, result, indent=1)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
