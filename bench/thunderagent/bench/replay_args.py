"""``thunderagent bench replay``'s command line: its flags, and every check on them made before
any run (policy and scheduler overrides built once, lists without repeats, overrides no run
would use refused), so a bad one is a usage error, not a traceback mid-sweep."""

from __future__ import annotations

import argparse
from pathlib import Path

from thunderagent.bench import replay_migration as migration_cli
from thunderagent.engine.profiles import PRESETS
from thunderagent.fleet import LOAD_REPORT_INTERVAL_S
from thunderagent.prefix_index.prefilled import APPROXIMATE_TTL_S
from thunderagent.replay import SCHEDULERS
from thunderagent.routing import POLICIES
from thunderagent.shell.argtypes import (
    at_least,
    name_list,
    output_dir,
    output_file,
    param_value,
    positive,
    positive_list,
    sched_params,
)

ENGINE_PRICINGS = {
    "profile": {},
    "dynamo-mocker": {"prefix_attention": False, "shared_kv_once": True},
}
"""``--engine-pricing``: the profile's efficiency fields each pricing changes."""

DESCRIPTION = (
    "Trace replay in virtual time: every routing policy, the scheduler in front, side by side."
)


def _policies(text: str) -> list[str]:
    """``all``, or comma-separated routing policies (each once)."""
    return POLICIES.names() if text == "all" else name_list(POLICIES.names())(text)


def _params(items: list[str], p: argparse.ArgumentParser) -> dict[str, dict]:
    """``--param POLICY.FIELD=VALUE`` items -> {policy: {field: value}}."""
    out: dict[str, dict] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        policy, dot, name = key.partition(".")
        if not (sep and dot and policy and name):
            p.error(f"--param {item!r}: expected POLICY.FIELD=VALUE")
        out.setdefault(policy, {})[name] = param_value(raw)
    return out


def sched_overrides(items: list[str], p: argparse.ArgumentParser) -> dict:
    """``--sched-param FIELD=VALUE`` items -> SchedParams overrides, checked now."""
    try:
        return sched_params(items)
    except ValueError as err:
        p.error(f"--sched-param {err}")


def _workload_arguments(p: argparse.ArgumentParser) -> None:
    """What of the trace is replayed, and how many jittered copies of it."""
    p.add_argument("--limit", type=at_least(1), default=None, help="first N requests only")
    p.add_argument(
        "--max-output", type=at_least(1), default=None,
        help="cap each request's output tokens (bench live sends at most its --max-output, 16)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--repeats", type=at_least(1), default=1,
        help="run the sweep on N copies of the trace, seeds SEED..SEED+N-1, and report each "
        "cell's mean, sd, min and max over them (default: 1)",
    )  # fmt: skip
    p.add_argument(
        "--arrival-jitter-ms", type=positive, default=None,
        help="move each arrival by a uniform draw in ±J ms of trace time, seeded by the run's "
        "seed (a session keeps its order); with --repeats, each copy is jittered differently",
    )  # fmt: skip


def _engine_arguments(p: argparse.ArgumentParser) -> None:
    """The trace's block size, the index's TTL and how the simulated engines price a step."""
    p.add_argument("--block-size", type=at_least(1), default=512, help="tokens per trace block")
    p.add_argument("--index-ttl", type=positive, default=None, help="prefix index TTL s (off)")
    p.add_argument(
        "--engine-pricing", choices=sorted(ENGINE_PRICINGS), default="profile",
        help="how the replay's engines price a step: profile (default: attention over the "
        "cached prefix paid, each request reads its own KV) or dynamo-mocker (a what-if: a "
        "prefill by its new tokens alone, a shared page read once per decode step, as Dynamo "
        "1.6.1's mocker prices them); the SLO and the work ceiling stay the profile's",
    )  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="thunderagent bench replay", description=DESCRIPTION)
    p.add_argument("--trace", type=Path, required=True, help="Mooncake .jsonl or Azure .csv")
    p.add_argument("--workers", type=at_least(1), default=8)
    p.add_argument("--profile", default="llama-3.1-8b-h100", choices=sorted(PRESETS))
    p.add_argument(
        "--policies", type=_policies, default="all",
        help="comma list of routing policies, or all (default: all)",
    )  # fmt: skip
    p.add_argument(
        "--speed", type=positive_list, default=[1.0],
        help="arrival-rate multiplier(s), comma list (default: 1)",
    )  # fmt: skip
    _workload_arguments(p)
    _output_arguments(p)
    p.add_argument(
        "--scheduler", default=None, choices=SCHEDULERS.names(),
        help="one scheduler for every policy (default: each as deployed: thunder with its "
        "scheduler, every peer with direct dispatch)",
    )  # fmt: skip
    p.add_argument(
        "--slo-ttft-p99-ms", type=positive, default=None,
        help="TTFT SLO for capacity and goodput (default: the trace's p99 no-cache prefill "
        "time + 3 s)",
    )  # fmt: skip
    _message_timing_arguments(p)
    _engine_arguments(p)
    _kv_events_arguments(p)
    _override_arguments(p)
    migration_cli.add_arguments(p)
    return _checked(p.parse_args(argv), p)


def _message_timing_arguments(p: argparse.ArgumentParser) -> None:
    """How late the fleet's messages come: load reports, and workers' acks of hand-offs."""
    p.add_argument(
        "--load-interval", type=positive, default=None,
        help="virtual s between the engines' load reports (default: "
        f"{LOAD_REPORT_INTERVAL_S:g} s, the worker adapter's). A peer that polls the engines on "
        "its own schedule reads one load per poll: smg_cache_aware every 10 s, SMG's "
        "--load-monitor-interval (--param smg_cache_aware.load_monitor_interval_s=0: every "
        "report), llm_d every 0.05 s, llm-d's metrics scrape",
    )  # fmt: skip
    p.add_argument(
        "--handoff-ms", type=positive, default=None,
        help="virtual ms from a hand-off to a worker (the router's on credit, the scheduler's) "
        "to the worker's ack (default: at once; live, a NATS request/reply to the adapter: "
        "~1 ms idle, tens under load)",
    )  # fmt: skip


def _output_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", type=output_file, default=None, help="JSON results file")
    p.add_argument(
        "--requests-jsonl", type=output_file, default=None, metavar="FILE",
        help="one JSON line per request of every run: where the router put it first, when and "
        "where it ran, what it found cached, its first token",
    )  # fmt: skip
    p.add_argument("--report", type=output_file, default=None, help="markdown report file")
    p.add_argument("--plot", type=output_dir, default=None, help="directory for PNG plots")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _kv_events_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kv-events", choices=("on", "off"), default="on",
        help="off: the engines publish no KV events (SGLang without --kv-events-config): "
        "thunder's adapters announce what each run leaves cached, dynamo_kv keeps its own "
        "record (Dynamo's approximate mode) (default: on)",
    )  # fmt: skip
    p.add_argument(
        "--approximate-ttl", type=positive, default=APPROXIMATE_TTL_S,
        help="with --kv-events off: s dynamo_kv counts a prefilled prompt as cached on its "
        f"worker (default: {APPROXIMATE_TTL_S:g}, Dynamo's router_ttl_secs)",
    )  # fmt: skip


def _override_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--param", action="append", default=[], help="POLICY.FIELD=VALUE override (repeatable)"
    )
    p.add_argument(
        "--sched-param", action="append", default=[],
        help="FIELD=VALUE override of the scheduler's SchedParams (repeatable; runs with a "
        "scheduler other than direct)",
    )  # fmt: skip


def _checked(args: argparse.Namespace, p: argparse.ArgumentParser) -> argparse.Namespace:
    """What no flag's type can check alone: policies, and every override built once now (a bad
    name or value is a usage error, not a traceback mid-sweep)."""
    args.policy_list = args.policies
    args.params = _params(args.param, p)
    idle = sorted(set(args.params) - set(args.policy_list))
    if idle:  # a typo or a scheduler knob would otherwise be ignored without a word
        hint = "; scheduler knobs go to --sched-param" if "scheduler" in idle else ""
        replayed = ",".join(args.policy_list)
        p.error(f"--param names {idle}, which this run does not replay ({replayed}){hint}")
    for policy, values in args.params.items():
        try:
            POLICIES.create(policy, **values)
        except (ValueError, TypeError) as err:
            p.error(f"--param: {err}")
    args.sched_params = sched_overrides(args.sched_param, p)
    _sched_params_used(args, p)
    args.migration_params = migration_cli.overrides(args.migration_param, p)
    if args.migration_params and args.migration == "off":
        p.error("--migration-param: --migration is off, so no migration planner runs")
    if args.kv_events == "off" and args.migration != "off":
        p.error("--migration: the planner finds holders in the event-fed index; with "
                "--kv-events off it has none")  # fmt: skip
    return args


def _sched_params_used(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    """Scheduler knobs reach only runs with a scheduler: with every run on direct dispatch they
    would be recorded in the JSON and change nothing."""
    if not args.sched_params:
        return
    if any(scheduler_for(x, args.scheduler) != "direct" for x in args.policy_list):
        return
    p.error(
        f"--sched-param: no run here uses the thunder scheduler (policies "
        f"{','.join(args.policy_list)}, scheduler {args.scheduler or 'as deployed'}: each "
        "dispatches direct, which has no knobs)"
    )


DEPLOYED_SCHEDULER = {"thunder": "thunder"}
"""How each policy ships: ThunderAgent is its router and its scheduler; every peer dispatches
straight to the engines (their queues do the waiting)."""


def scheduler_for(policy: str, override: str | None) -> str:
    return override or DEPLOYED_SCHEDULER.get(policy, "direct")


def loads_seen_every(policy: str, params: dict, reports_s: float | None) -> float:
    """Virtual seconds between the engine loads ``policy`` reads: the adapters' reports
    (``reports_s``, default the live beat), or a peer's own poll of the engines, which does
    not wait for our adapters (SMG's ``--load-monitor-interval``, 10 s; llm-d's metrics
    scrape, 50 ms; the router core takes one report per poll, live and in the replay alike)."""
    reports = LOAD_REPORT_INTERVAL_S if reports_s is None else reports_s
    poll = POLICIES.create(policy, **params).load_poll_s()
    return poll if poll > 0 else reports


def report_interval(policy: str, params: dict, reports_s: float | None) -> float:
    """Virtual seconds between the load reports a replay of ``policy`` builds: the adapters'
    beat, or more often for a peer that scrapes the engines more often than that."""
    reports = LOAD_REPORT_INTERVAL_S if reports_s is None else reports_s
    return min(reports, loads_seen_every(policy, params, reports_s))
