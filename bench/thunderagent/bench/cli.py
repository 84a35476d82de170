"""``thunderagent bench <name>``: benchmark entry points (each also runs as ``python -m``)."""

from __future__ import annotations

import argparse
import runpy
import sys

BENCHES = {
    "index": ("thunderagent.bench.index", "prefix index ingest and query speed (vs Dynamo)"),
    "live": ("thunderagent.bench.live", "a trace through the running stack, vs sglang-router, SMG"),
    "latency": (
        "thunderagent.bench.latency",
        "round trip through the stack vs straight to an engine",
    ),
    "replay": (
        "thunderagent.bench.replay",
        "trace replay through every routing policy, virtual time",
    ),
    "dynamo-sim": (
        "thunderagent.bench.dynamo_sim",
        "Dynamo's KV router in Dynamo's own simulator (1.6.1), beside the replay's model of it",
    ),
    "route": ("thunderagent.bench.route", "CPU µs of one routing decision in the router core"),
    "mirror": (
        "thunderagent.bench.mirror",
        "CPU µs of the adapter's KV mirror: events folded in, a chain looked up, a dump",
    ),
    "expiry": (
        "thunderagent.bench.expiry",
        "the prefix index's TTL expiry under periodic re-announcements: its longest call",
    ),
    "tune": ("thunderagent.bench.tune", "choose a thunder default on generated workloads"),
    "sched": ("thunderagent.bench.sched", "scheduler variants on seeded workloads, virtual time"),
    "pd": (
        "thunderagent.bench.pd",
        "PD through the stack: SGLang's pairing against the workers' hand-off (TTFT, end to end)",
    ),
    "gateway": (
        "thunderagent.bench.gateway",
        "the OpenAI HTTP gateway vs straight over NATS: added latency, requests/s",
    ),
    "transfer": (
        "thunderagent.bench.transfer",
        "move a prefix's KV between two engines with NIXL through the stack (GB/s, verified)",
    ),
    "live-hot": (
        "thunderagent.bench.live_hot",
        "a hot-spot trace's hot period through the stack, KV moves off and with NIXL copies",
    ),
    "gen": (
        "thunderagent.bench.gen",
        "write a generated Mooncake trace: agent, bursty, hotspot, coding, rag",
    ),
    "soak": (
        "thunderagent.bench.soak",
        "the stack at a steady rate for a long time: RSS, descriptors, no lost request",
    ),
    "profile": (
        "thunderagent.bench.profile",
        "where a request's time goes: CPU µs/request per service, py-spy self time, spans",
    ),
    "bus": (
        "thunderagent.bench.busbench",
        "per-message CPU of the bus (deliveries by trace context, request/reply, headers)",
    ),
    "messages": (
        "thunderagent.bench.messages",
        "NATS messages per request through the stack, by kind (instant engines)",
    ),
    "throughput": (
        "thunderagent.bench.throughput",
        "stepped open-loop rates vs instant engines: added latency, CPU/request, vs SMG",
    ),
}


def bench_parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    """``thunderagent bench NAME``'s own parser: usage and errors name the command (not
    ``live.py``), and the description is the module docstring's whole first paragraph (its
    first line alone stops mid-sentence)."""
    first = (doc or "").strip().split("\n\n")[0]
    return argparse.ArgumentParser(
        prog=f"thunderagent bench {name}", description=" ".join(first.split())
    )


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark", description="run a benchmark")
    p.add_argument(
        "name", choices=sorted(BENCHES), help="; ".join(f"{k}: {v[1]}" for k, v in BENCHES.items())
    )
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> None:
    module = BENCHES[args.name][0]
    sys.argv = [module, *args.rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
