"""``thunderagent bench <name>``: benchmark entry points (each also runs as ``python -m``)."""

from __future__ import annotations

import argparse
import runpy
import sys

BENCHES = {
    "index": ("thunderagent.bench.index", "prefix index ingest and query speed (vs Dynamo)"),
    "live": ("thunderagent.bench.live", "a trace through the running stack, vs sglang-router"),
    "latency": (
        "thunderagent.bench.latency",
        "round trip through the stack vs straight to an engine",
    ),
    "replay": (
        "thunderagent.bench.replay",
        "trace replay through every routing policy, virtual time",
    ),
    "sched": ("thunderagent.bench.sched", "scheduler variants on seeded workloads, virtual time"),
}


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
