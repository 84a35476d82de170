"""``thunderagent <command>``: every service, the embedded stack, the client and the tools.

Imports are deferred to each command so that ``thunderagent request`` starts quickly and a
service process loads only what it runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from thunderagent.cli.simengine_command import add_simengine_command
from thunderagent.stack.engine_flags import DEFAULT_MODEL

DEFAULT_NATS = os.environ.get("THUNDERAGENT_NATS_URL", "nats://127.0.0.1:4222")
DEFAULT_REDIS = os.environ.get("THUNDERAGENT_REDIS_URL", "redis://127.0.0.1:6379/0")


def _nats_arg(p: argparse.ArgumentParser) -> None:
    from thunderagent.shell.argtypes import nats_url

    p.add_argument(
        "--nats", type=nats_url, default=DEFAULT_NATS, help="NATS URL (env THUNDERAGENT_NATS_URL)"
    )
    p.add_argument(
        "--creds", default=None,
        help="NATS credentials file or folder `thunderagent up` printed "
        "(env THUNDERAGENT_NATS_CREDS; or NATS_USER / NATS_PASSWORD)",
    )  # fmt: skip
    p.add_argument(
        "--nats-ca", default=None,
        help="CA certificate of a TLS NATS server (env THUNDERAGENT_NATS_CA)",
    )  # fmt: skip


def _metrics_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--metrics-port", type=int, default=None,
        help="serve Prometheus metrics on this port (0: any free port; default: off)",
    )  # fmt: skip


def _params(items: list[str]) -> dict:
    """``FIELD=VALUE`` pairs (VALUE as JSON, else a string) -> keyword parameters."""
    from thunderagent.shell.argtypes import field_values

    try:
        return field_values(items)
    except ValueError as err:
        raise SystemExit(f"--param {err}") from None


def _checked(command: str, build: Callable[[], object]) -> None:
    """Build what the service will build from its flags (a policy, a scheduler, planner
    parameters; pure) before it connects, so a bad ``--policy`` or ``--param`` is one line and
    exit status 2 here, not a traceback after the service has started."""
    try:
        build()
    except (ValueError, TypeError) as err:
        print(f"thunderagent {command}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def _param_arg(p: argparse.ArgumentParser, what: str, when: str = "") -> None:
    p.add_argument(
        "--param", action="append", default=[], metavar="FIELD=VALUE",
        help=f"{when}override a {what} parameter (repeatable; VALUE is JSON or a string)",
    )  # fmt: skip


def _policy(params) -> object:
    from thunderagent.routing import POLICIES

    return POLICIES.create(params.policy, **params.policy_params)


def _scheduler(name: str, params: dict) -> object:
    from thunderagent.scheduling import SCHEDULERS

    return SCHEDULERS.create(name, **params)


def _planner_params(params: dict) -> object:
    from thunderagent.migration.params import MigrationParams

    return MigrationParams.from_dict(params).validate()


def _cmd_router(args: argparse.Namespace) -> None:
    from thunderagent.router.service import RouterConfig, main
    from thunderagent.scheduling.handoff_limit import HandoffLimit
    from thunderagent.shell import run_service

    params = _router_params(args)
    _checked("router", lambda: _policy(params))
    handoffs = HandoffLimit(slow_s=args.handoff_slow_ms / 1e3)
    config = RouterConfig(
        params=params, redis_url=args.redis, pull=_pull_params(args), handoffs=handoffs
    )
    run_service("router", args.nats, lambda ctx: main(ctx, config), metrics_port=args.metrics_port)


def _cmd_scheduler(args: argparse.Namespace) -> None:
    from thunderagent.scheduler.service import SchedulerConfig, main
    from thunderagent.shell import run_service

    models = tuple(m for m in args.models.split(",") if m) if args.models else ()
    config = SchedulerConfig(
        scheduler=args.policy, params=_params(args.param), models=models, pull=_pull_params(args)
    )
    _checked("scheduler", lambda: _scheduler(config.scheduler, config.params))
    run_service(
        "scheduler", args.nats, lambda ctx: main(ctx, config), metrics_port=args.metrics_port
    )


def _pull_params(args: argparse.Namespace):
    from thunderagent.migration import MigrationParams

    return MigrationParams(pull_min_tokens=args.pull_min_tokens)


def _pull_arg(p: argparse.ArgumentParser) -> None:
    from thunderagent.shell.argtypes import at_least

    p.add_argument(
        "--pull-min-tokens", type=at_least(0), default=8192, metavar="N",
        help="with a run, order a copy of its prompt's prefix from a worker holding at least N "
        "more tokens of it than the one taking it (made only by engines with a NIXL KV pool; "
        "0: never)",
    )  # fmt: skip


def _cmd_index(args: argparse.Namespace) -> None:
    from thunderagent.index.service import IndexConfig, main
    from thunderagent.shell import run_service

    config = IndexConfig(redis_url=args.redis)
    run_service("index", args.nats, lambda ctx: main(ctx, config), metrics_port=args.metrics_port)


def _cmd_worker(args: argparse.Namespace) -> None:
    from thunderagent.schemas import WorkerRole
    from thunderagent.shell import run_service
    from thunderagent.worker.adapter import AdapterConfig
    from thunderagent.worker.service import main

    config = AdapterConfig(
        worker_id=args.worker_id,
        engine_url=args.engine_url,
        model=args.model or "",
        lease_s=args.lease_s,
        max_request_s=args.max_request_s,
        role=WorkerRole(args.role),
        tokenizer=args.tokenizer,
        kv_events_endpoint=args.kv_events,
        dp_rank=args.dp_rank,
    )
    run_service(
        f"worker-{args.worker_id}", args.nats, lambda ctx: main(ctx, config),
        metrics_port=args.metrics_port,
    )  # fmt: skip


def _cmd_gateway(args: argparse.Namespace) -> None:
    from thunderagent.gateway.protocol import Defaults
    from thunderagent.gateway.service import GatewayConfig, main
    from thunderagent.shell import run_service

    config = GatewayConfig(
        host=args.host,
        port=args.port,
        reuse_port=args.reuse_port,
        idle_timeout_s=args.idle_timeout_s,
        max_body_bytes=int(args.max_body_mb * 2**20),
        max_concurrent_requests=args.max_concurrent_requests,
        queue_size=args.queue_size,
        queue_timeout_s=args.queue_timeout_s,
        defaults=Defaults(chat_max_tokens=args.default_max_tokens),
    )
    if not args.embed_router:
        run_service(
            "gateway", args.nats, lambda ctx: main(ctx, config), metrics_port=args.metrics_port
        )
        return
    from thunderagent.router.service import RouterConfig

    params = _router_params(args)
    _checked("gateway", lambda: _policy(params))
    router = RouterConfig(params=params, redis_url=args.redis)
    run_service(
        "gateway", args.nats, lambda ctx: gateway_with_router(ctx, config, router),
        metrics_port=args.metrics_port,
    )  # fmt: skip


def _router_params(args: argparse.Namespace):
    from thunderagent.router_core import RouterParams

    return RouterParams(
        policy=args.policy, policy_params=_params(args.param), seed=args.seed,
        approximate_ttl_s=args.approximate_ttl_s,
    )  # fmt: skip


async def gateway_with_router(ctx, config, router_config) -> None:
    """The gateway with a router replica in its process: the replica keeps its index, fleet
    view and credit like any other (``serve_requests=False``), and the gateway calls it per
    request instead of publishing to the router queue group."""
    from thunderagent.gateway.service import Gateway
    from thunderagent.router.service import embedded_router

    async with embedded_router(ctx, router_config) as router:
        await Gateway(ctx.bus, config, route=router.handle).run(ctx.stop)


def _cmd_migration(args: argparse.Namespace) -> None:
    from thunderagent.migrator.executor import Timeouts
    from thunderagent.migrator.service import MigrationConfig, main
    from thunderagent.shell import run_service

    params = {"link_bytes_per_s": args.link_gbps * 1e9, **_params(args.param)}
    _checked("migration", lambda: _planner_params(params))
    config = MigrationConfig(
        params=params, auto=not args.orders_only,
        timeouts=Timeouts(pull_s=args.pull_timeout_s, hold_s=args.pull_timeout_s + 30),
    )  # fmt: skip
    run_service(
        "migration", args.nats, lambda ctx: main(ctx, config), metrics_port=args.metrics_port
    )


def _cmd_request(args: argparse.Namespace) -> None:
    from thunderagent.cli.request import run_request

    sys.exit(run_request(args))


def _cmd_schemas(args: argparse.Namespace) -> None:
    from pathlib import Path

    from thunderagent.schemas.catalog import JSON_DIR, write_json_schemas
    from thunderagent.schemas.reference import DOC_PATH

    out = Path(args.out) if args.out else JSON_DIR
    for path in write_json_schemas(out):
        print(path)
    from thunderagent.schemas.reference import write_reference

    print(write_reference(Path(args.out) / "messages.md" if args.out else DOC_PATH))


def _stack_commands(add) -> None:
    from thunderagent.shell.argtypes import at_least, positive
    from thunderagent.stack.commands import add_stack_commands

    add_stack_commands(add)
    p = add("request", "send one request and stream its tokens", _cmd_request)
    _nats_arg(p)
    p.add_argument("prompt", help="prompt text ('-' reads standard input)")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--max-tokens", type=at_least(1), default=64)
    p.add_argument("--priority", type=int, choices=range(10), default=0, help="0 most urgent .. 9")
    p.add_argument("--json", action="store_true", help="print the final reply as JSON")
    p.add_argument("--timeout", type=positive, default=60.0, help="idle timeout, seconds")
    p.add_argument("--lora", default=None, help="LoRA adapter, by the name the engines loaded it")
    p.add_argument(
        "--cache-salt", default=None,
        help="tenant: its prompt's KV is cached apart, shared only with the same salt",
    )  # fmt: skip


def _control_plane_commands(add) -> None:
    from thunderagent.shell.argtypes import positive

    p = add("router", "run a router replica", _cmd_router)
    _nats_arg(p)
    _metrics_arg(p)
    p.add_argument("--policy", default="thunder", help="routing policy (see docs)")
    _param_arg(p, "routing policy")
    p.add_argument("--seed", type=int, default=None, help="seed of the tie-breaking rng")
    _approximate_ttl_arg(p)
    p.add_argument(
        "--handoff-slow-ms", type=positive, default=250.0,
        help="a hand-off ack slower than this cuts the bound on the requests waiting for one "
        "(past it a request is answered overloaded, HTTP 429); docs/reliability.md, Limits",
    )  # fmt: skip
    _pull_arg(p)
    p.add_argument(
        "--redis",
        default=os.environ.get("THUNDERAGENT_REDIS_URL"),
        help="Redis URL of the index snapshot (env THUNDERAGENT_REDIS_URL; unset: full replay)",
    )

    p = add("scheduler", "run the scheduler", _cmd_scheduler)
    _nats_arg(p)
    _metrics_arg(p)
    p.add_argument(
        "--policy", default="thunder", help="scheduling policy (thunder, fcfs, direct, ...)"
    )
    p.add_argument(
        "--models", default="",
        help="comma-separated models this scheduler owns (default: all); run one scheduler "
        "per model group to partition the fleet",
    )  # fmt: skip
    _param_arg(p, "scheduling policy")
    _pull_arg(p)

    p = add("index", "run the KV index service", _cmd_index)
    _nats_arg(p)
    _metrics_arg(p)
    p.add_argument("--redis", default=DEFAULT_REDIS, help="Redis URL for snapshots")


def _migration_command(add) -> None:
    from thunderagent.shell.argtypes import positive

    p = add("migration", "run the migration service (hot prefixes copied and moved)",
            _cmd_migration)  # fmt: skip
    _nats_arg(p)
    _metrics_arg(p)
    _param_arg(p, "migration planner (MigrationParams)")
    p.add_argument(
        "--link-gbps", type=positive, default=25.0,
        help="worker-to-worker KV link in GB/s for the cost model (25 = a 200 Gb/s NIC)",
    )  # fmt: skip
    p.add_argument("--pull-timeout-s", type=positive, default=60.0,
                   help="give a move up after this long")  # fmt: skip
    p.add_argument("--orders-only", action="store_true",
                   help="move only what is ordered or drained; plan no copies")  # fmt: skip


def _gateway_command(add) -> None:
    from thunderagent.shell.argtypes import at_least, positive

    p = add("gateway", "run the OpenAI-compatible HTTP gateway (any number of replicas)",
            _cmd_gateway)  # fmt: skip
    _nats_arg(p)
    _metrics_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="listen address (0.0.0.0: all)")
    p.add_argument("--port", type=at_least(0), default=8000, help="HTTP port (0: any free port)")
    p.add_argument(
        "--reuse-port", action="store_true",
        help="SO_REUSEPORT: several gateway processes on one host share the port",
    )  # fmt: skip
    p.add_argument(
        "--idle-timeout-s", type=positive, default=120.0,
        help="no reply for this long: cancel the request and answer 504",
    )  # fmt: skip
    p.add_argument("--max-body-mb", type=positive, default=8.0, help="larger bodies get a 413")
    p.add_argument(
        "--max-concurrent-requests", type=at_least(-1), default=-1,
        help="generate requests held at once (-1: 1,024 per core, at least 4,096, SMG's "
        "default; 0: no bound)",
    )  # fmt: skip
    p.add_argument(
        "--queue-size", type=at_least(0), default=100,
        help="requests that may wait past that bound (0: 429 at once)",
    )  # fmt: skip
    p.add_argument(
        "--queue-timeout-s", type=positive, default=60.0,
        help="how long one may wait before it is answered 429",
    )  # fmt: skip
    p.add_argument(
        "--default-max-tokens", type=at_least(1), default=256,
        help="max_tokens of a chat request that gives none",
    )  # fmt: skip
    _embedded_router_args(p)


def _approximate_ttl_arg(p, when: str = "") -> None:
    from thunderagent.prefix_index.prefilled import APPROXIMATE_TTL_S
    from thunderagent.shell.argtypes import positive

    p.add_argument(
        "--approximate-ttl-s", type=positive, default=APPROXIMATE_TTL_S,
        help=f"{when}a policy that keeps its own record of workers whose engines publish no KV "
        "events (dynamo_kv): how long a prompt prefilled there counts as cached (Dynamo's "
        "router_ttl_secs; ThunderAgent's adapters announce such caches instead)",
    )  # fmt: skip


def _embedded_router_args(p) -> None:
    """The gateway's router replica in its own process (``--embed-router``)."""
    p.add_argument(
        "--embed-router", action="store_true",
        help="route in this process (a router replica with its own index; one NATS hop less "
        "per request) instead of through a router service",
    )  # fmt: skip
    p.add_argument("--policy", default="thunder", help="with --embed-router: routing policy")
    _param_arg(p, "routing policy", when="with --embed-router: ")
    p.add_argument("--seed", type=int, default=None, help="with --embed-router: tie-break seed")
    _approximate_ttl_arg(p, when="with --embed-router: ")
    p.add_argument(
        "--redis", default=os.environ.get("THUNDERAGENT_REDIS_URL"),
        help="with --embed-router: Redis URL of the index snapshot (unset: full replay)",
    )  # fmt: skip


def _worker_command(add) -> None:
    from thunderagent.shell.argtypes import at_least, http_url, positive, worker_id, zmq_endpoint

    p = add("worker", "run a worker adapter in front of one engine", _cmd_worker)
    _nats_arg(p)
    _metrics_arg(p)
    p.add_argument(
        "--worker-id", type=worker_id, required=True,
        help="the engine's id in the fleet; an engine of N data-parallel ranks (its /server_info "
        "dp_size) is N workers, ID-dp0 ... ID-dp<N-1>",
    )  # fmt: skip
    p.add_argument(
        "--dp-rank", type=at_least(0), default=None,
        help="stand for this data-parallel rank only (a process per rank; default: every rank "
        "of the engine in this process)",
    )  # fmt: skip
    p.add_argument(
        "--engine-url",
        type=http_url,
        required=True,
        help="engine base URL, e.g. http://127.0.0.1:30000",
    )
    p.add_argument(
        "--kv-events",
        type=zmq_endpoint,
        default=None,
        help="engine ZMQ KV-event endpoint (tcp://host:port)",
    )
    p.add_argument("--model", default=None, help="model name (default: what the engine reports)")
    p.add_argument("--lease-s", type=positive, default=10.0)
    p.add_argument(
        "--max-request-s", type=positive, default=600.0,
        help="abort a run at the engine after this long (frees its slot; the client is told)",
    )  # fmt: skip
    p.add_argument("--role", default="both", choices=["both", "prefill", "decode"])
    p.add_argument("--tokenizer", default="thunderagent/bytes")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="thunderagent", description="KV-cache-aware control plane for LLM inference"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help_text: str, fn: Callable) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(func=fn)
        return p

    _stack_commands(add)
    _control_plane_commands(add)
    _migration_command(add)
    _gateway_command(add)
    _worker_command(add)
    add_simengine_command(add)
    from thunderagent.shell.argtypes import output_dir

    p = add("schemas", "write every message's JSON Schema and docs/messages.md", _cmd_schemas)
    p.add_argument(
        "--out", type=output_dir, default=None,
        help="folder (default: schemas/json in the checkout)",
    )  # fmt: skip

    from thunderagent.bench.cli import add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    # every NATS connection of this process (and its children) reads them from the environment
    for flag, env in (("creds", "THUNDERAGENT_NATS_CREDS"), ("nats_ca", "THUNDERAGENT_NATS_CA")):
        if getattr(args, flag, None):
            os.environ[env] = getattr(args, flag)
    try:
        args.func(args)
    except BrokenPipeError:
        # the reader left (``| head``): stop as other command-line tools do, without a
        # traceback, and without a second one when Python flushes stdout at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
