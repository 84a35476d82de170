"""Where one request's time goes: CPU µs per request of every process, the profiler's top
self-time functions and steps per service, and (with ``--trace-ratio``) the per-service wall time
of sampled requests from their spans.

Starts the embedded stack with instant engines (zero compute: one token at once), then, at a fixed
open-loop rate: (1) idle CPU of every process for ``--idle-s``; (2) ``--requests`` through the
stack over NATS with every process's CPU time and wake-ups (times put on a CPU) read from the
kernel before and after (less their idle rates); (3) the same requests straight to the engines
over HTTP (the added latency's reference); (4) the same load again under ``py-spy record`` on each
service process (unless ``--no-pyspy``).

    thunderagent bench profile --rate 200 --requests 2000 --json /tmp/profile.json \
        [--workers 2] [--trace-ratio 0.05] [--no-pyspy]

``--trace-ratio R`` runs every process with tracing on (``parentbased_traceidratio``, R) and an
OTLP receiver in this process: R=0 measures what tracing costs when every trace is sampled out,
R=1 when all are, and the sampled traces give the per-service breakdown.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import uvloop

from thunderagent.bench import loadgen, perf, procs, pyspy
from thunderagent.bench.cli import bench_parser
from thunderagent.bench.jsonfile import dumps, write_json
from thunderagent.bench.spans import SpanReceiver, breakdown
from thunderagent.client import ThunderClient
from thunderagent.embedded import nats_gomaxprocs
from thunderagent.shell.argtypes import at_least, output_file, positive
from thunderagent.stack.up import Stack, StackConfig, entry_point_settings
from thunderagent.stats import percentile

SERVICE_GROUPS = (("router", "router-"), ("worker", "worker-"), ("engine", "engine-"),
                  ("gateway", "gateway-"))  # fmt: skip
"""Processes summed into one figure per service (all adapters, all engines)."""
PROFILED = ("router-0", "scheduler", "worker-w0", "engine-0", "index", "migration")


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def code_version() -> str:
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                             text=True, timeout=5, cwd=Path(__file__).parent)  # fmt: skip
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def stack_pids(stack: Stack) -> dict[str, int]:
    """Every process of the stack by name: services, engines, NATS, Redis."""
    pids = {child.name: child.pid for child in stack.children if child.alive()}
    for server in stack.servers:
        if server.child is not None:
            pids[server.name] = server.child.pid
    return pids


def tracing_env(endpoint: str, ratio: float) -> dict[str, str]:
    """OTLP to ``endpoint``, parent-based ratio sampling, quick export batches."""
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": str(ratio),
        "OTEL_BSP_SCHEDULE_DELAY": "200",
    }


def start_stack(workers: int, name: str, routers: int = 1, via: str = "nats") -> Stack:
    """Instant engines, the stack's own defaults for everything else; a gateway only when the
    requests go through one (``via`` ``gateway``, or ``gateway-embedded``: the router inside
    it and no router service). Its run folder is its own (``thunderagent-<name>-*``): its logs
    stay, the NATS server's JetStream store goes when it stops."""
    settings = entry_point_settings(via, routers)
    config = StackConfig(workers=workers, engine="instant", run_dir_prefix=f"thunderagent-{name}-",
                         **settings)  # fmt: skip
    return Stack.start(config)


@dataclass
class Measured:
    load: loadgen.LoadResult
    cpu_us: dict[str, float] = field(default_factory=dict)
    kernel_share: dict[str, float] = field(default_factory=dict)
    wakeups: dict[str, float] = field(default_factory=dict)
    """Times each service was put on a CPU per request, less its idle rate."""

    def json(self) -> dict:
        return {**self.load.summary(), "cpu_us_per_req": self.cpu_us,
                "wakeups_per_req": self.wakeups, "kernel_share": self.kernel_share}  # fmt: skip


@dataclass
class Idle:
    """What each process does with no requests, per second: CPU ns and times put on a CPU."""

    ns_per_s: dict[str, float]
    runs_per_s: dict[str, float]


async def idle_rates(pids: dict[str, int], seconds: float) -> Idle:
    meter = procs.CpuMeter(pids)
    meter.start()
    await asyncio.sleep(seconds)
    used = meter.stop()
    return Idle(
        {name: ns / seconds for name, ns in used.items()},
        {name: n / seconds for name, n in meter.runs.items()},
    )


async def measured(pids: dict[str, int], idle: Idle, rate: float, count: int, send) -> Measured:
    meter = procs.CpuMeter(pids)
    meter.start()
    result = await loadgen.open_loop(rate, count, send)
    used = meter.stop()
    per = procs.per_request_us(used, count, idle_ns_per_s=idle.ns_per_s, seconds=result.wall_s)
    runs = procs.per_request(meter.runs, count, idle_per_s=idle.runs_per_s, seconds=result.wall_s)
    return Measured(
        result,
        procs.group(per, SERVICE_GROUPS),
        meter.kernel_share,
        procs.group(runs, SERVICE_GROUPS),
    )


def added(stack: loadgen.LoadResult, direct: loadgen.LoadResult) -> dict:
    """TTFT percentiles through the system minus straight to the engines (None: no answers).
    Each is a difference of two measured percentiles, so it can come out slightly negative."""
    a, b = stack.ttft(), direct.ttft()
    if not a or not b:
        return {"p50": None, "p99": None}
    return {
        "p50": round(percentile(a, 50) - percentile(b, 50), 3),
        "p99": round(percentile(a, 99) - percentile(b, 99), 3),
    }


async def nats_rtt_us(url: str, count: int = 300) -> dict:
    """Request/reply over the stack's NATS server, both ends in this process (raw nats-py).
    The responder listens on an inbox subject, with a worker's login (a worker answers on
    inboxes; a client login may only request)."""
    from thunderagent.bus import connect

    nc = await connect(url, name="thunderagent-bench-ping", identity="worker-w0")
    subject = nc.new_inbox()

    async def pong(msg) -> None:
        await msg.respond(b"")

    await nc.subscribe(subject, cb=pong)
    out = []
    for _ in range(count):
        t0 = time.perf_counter()
        await nc.request(subject, b"", timeout=2)
        out.append((time.perf_counter() - t0) * 1e6)
    await nc.close()
    return {"p50": round(percentile(out, 50), 1), "p99": round(percentile(out, 99), 1)}


async def profile_services(
    pids: dict[str, int], args: argparse.Namespace, send, out_dir: Path
) -> dict:
    """One more run of the load under py-spy (Python frames) and perf (on-CPU samples by
    shared object) on each service process."""
    seconds = args.requests / args.rate + 1.0
    spy, perf_exe = (
        pyspy.available() if args.pyspy else None,
        perf.available() if args.perf else None,
    )
    running: dict[str, list] = {}
    for name in PROFILED + ("nats-server",):
        if name not in pids:
            continue
        if spy and name != "nats-server":
            out = out_dir / f"{name}.pyspy.txt"
            running.setdefault("pyspy", []).append(
                (name, pyspy.start(spy, pids[name], seconds, out, args.pyspy_rate), out)
            )
        if perf_exe:
            out = out_dir / f"{name}.perf.data"
            running.setdefault("perf", []).append(
                (name, perf.start(perf_exe, pids[name], seconds, out), out)
            )
    await asyncio.sleep(0.5)  # the profilers attach before the load starts
    await loadgen.open_loop(args.rate, args.requests, send)
    result: dict[str, dict] = {
        "pyspy": {} if spy else {"skipped": "py-spy not found: pip install py-spy"},
        "perf": {} if perf_exe else {"skipped": "perf not found (linux-perf)"},
    }
    for name, proc, out in running.get("pyspy", []):
        got = await asyncio.to_thread(pyspy.finish, proc, out, seconds + 30)
        result["pyspy"][name] = got.as_json() if isinstance(got, pyspy.Profile) else {"error": got}
    for name, proc, out in running.get("perf", []):
        result["perf"][name] = await asyncio.to_thread(
            perf.finish, perf_exe, proc, out, seconds + 60
        )
    return result


async def run(stack: Stack, args: argparse.Namespace, receiver: SpanReceiver | None) -> dict:
    pids = stack_pids(stack)
    model = stack.config.model
    warm = loadgen.prompts(200, args.prompt_tokens, args.unique_tokens, seed=1)
    bodies = loadgen.prompts(args.requests, args.prompt_tokens, args.unique_tokens)
    client = await ThunderClient.connect(stack.nats_url, idle_timeout_s=30)
    report: dict = {}
    try:
        await loadgen.open_loop(args.rate, len(warm), loadgen.thunder_sender(client, model, warm))
        await asyncio.sleep(0.5)
        idle = await idle_rates(pids, args.idle_s)
        report["idle_cpu_ms_per_s"] = {k: round(v / 1e6, 2) for k, v in idle.ns_per_s.items()}
        ours = await measured(pids, idle, args.rate, args.requests,
                              loadgen.thunder_sender(client, model, bodies))  # fmt: skip
        async with loadgen.http_session() as session:
            fresh = loadgen.prompts(args.requests, args.prompt_tokens, args.unique_tokens, seed=2)
            send = loadgen.http_sender(session, stack.engine_urls, loadgen.http_bodies(fresh))
            direct = await measured(pids, idle, args.rate, args.requests, send)
        report["through_stack"] = ours.json()
        report["direct_to_engines"] = direct.json()
        report["added_ttft_ms"] = added(ours.load, direct.load)
        report["nats_request_reply_us"] = await nats_rtt_us(stack.nats_url)
        if args.pyspy or args.perf:
            again = loadgen.prompts(args.requests, args.prompt_tokens, args.unique_tokens, seed=3)
            send = loadgen.thunder_sender(client, model, again)
            report |= await profile_services(pids, args, send, stack.run_dir)
        if receiver is not None:
            await asyncio.sleep(1.5)  # the last export batches
            report["spans"] = breakdown(receiver.snapshot())
    finally:
        await client.close()
    return report


def _parser() -> argparse.ArgumentParser:
    p = bench_parser("profile", __doc__)
    p.add_argument("--rate", type=positive, default=200.0, help="requests per second (open loop)")
    p.add_argument("--requests", type=at_least(1), default=2000)
    p.add_argument("--workers", type=at_least(1), default=2)
    p.add_argument("--prompt-tokens", type=at_least(1), default=64)
    p.add_argument(
        "--unique-tokens",
        type=int,
        default=16,
        help="tokens of each prompt no other prompt has (new KV blocks per request)",
    )
    p.add_argument("--idle-s", type=float, default=2.0)
    p.add_argument("--no-pyspy", dest="pyspy", action="store_false")
    p.add_argument("--no-perf", dest="perf", action="store_false", help="skip perf record")
    p.add_argument("--pyspy-rate", type=at_least(1), default=200, help="py-spy samples per second")
    p.add_argument(
        "--trace-ratio",
        type=float,
        default=None,
        help="tracing on in every process at this sampling ratio (default: off)",
    )
    p.add_argument("--json", dest="json_out", type=output_file, default=None)
    return p  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    receiver = SpanReceiver().__enter__() if args.trace_ratio is not None else None
    if receiver is not None:
        os.environ.update(tracing_env(receiver.endpoint, args.trace_ratio))
        from thunderagent.telemetry import setup_telemetry

        telemetry = setup_telemetry("thunderagent-bench")
    report = {
        "settings": {k: v for k, v in vars(args).items() if k != "json_out"},
        "engine": "instant",
        "code_version": code_version(),
        "nats_gomaxprocs": nats_gomaxprocs(),
        "cpus": os.cpu_count(),
        "load_average_before": load_average(),
    }
    started = time.perf_counter()
    print(f"starting the stack ({args.workers} instant engines) ...", file=sys.stderr)
    stack = start_stack(args.workers, "profile")
    try:
        report |= uvloop.run(run(stack, args, receiver))
    finally:
        stack.stop()
        if receiver is not None:
            telemetry.shutdown()
            receiver.__exit__(None, None, None)
    report["load_average_after"] = load_average()
    report["wall_s"] = round(time.perf_counter() - started, 1)
    print(render(report), file=sys.stderr)
    print(dumps(report, indent=2))
    if args.json_out:
        write_json(args.json_out, report)


def _by_size(figures: dict[str, float]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(figures.items(), key=lambda kv: -kv[1]))


def render(report: dict) -> str:
    """A short human summary (the JSON has everything)."""
    ours, direct = report["through_stack"], report["direct_to_engines"]
    lines = [
        f"load average {report['load_average_before']} -> {report['load_average_after']}",
        f"through the stack: TTFT p50 {ours['ttft_p50_ms']} ms p99 {ours['ttft_p99_ms']} ms "
        f"({ours['completed']}/{ours['sent']} ok, {ours['achieved_rate']} req/s)",
        f"direct to engines: TTFT p50 {direct['ttft_p50_ms']} ms p99 {direct['ttft_p99_ms']} ms",
        f"added: {report['added_ttft_ms']}",
        "CPU µs per request: " + _by_size(ours["cpu_us_per_req"]),
        "CPU µs per request, direct (the KV-event pipeline): " + _by_size(direct["cpu_us_per_req"]),
        "wake-ups per request: " + _by_size(ours["wakeups_per_req"]),
        "wake-ups per request, direct: " + _by_size(direct["wakeups_per_req"]),
    ]
    for name, prof in report.get("perf", {}).items():
        if isinstance(prof, dict) and "groups_pct" in prof:
            groups = ", ".join(f"{k} {v}%" for k, v in list(prof["groups_pct"].items())[:5])
            lines.append(f"perf {name}: {groups}")
    for name, prof in report.get("pyspy", {}).items():
        if isinstance(prof, dict) and "steps_pct" in prof:
            steps = ", ".join(f"{k} {v}%" for k, v in list(prof["steps_pct"].items())[:6])
            top = ", ".join(f"{f} {v}%" for f, v in prof["top_self_pct"][:4])
            lines.append(f"py-spy {name} (Python {100 - prof['outside_python_pct']:.0f}% of "
                         f"samples): {steps}\n    top: {top}")  # fmt: skip
    spans = report.get("spans", {}).get("stages_us", {})
    if spans:
        lines.append("sampled traces, per stage (µs p50 / p99):")
        lines += [f"  {k}: {v['p50']} / {v['p99']}" for k, v in spans.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
