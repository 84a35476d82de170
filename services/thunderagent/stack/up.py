"""``thunderagent up``: start everything as child processes, wait until it serves, stop cleanly.

Every child dies with this process (PR_SET_PDEATHSIG) and is stopped with SIGTERM on Ctrl-C or
SIGTERM, so nothing is left behind. ``--nats`` / ``--redis`` use existing servers instead of
starting embedded ones.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from thunderagent.bus.connection import CREDS_ENV
from thunderagent.embedded import (
    ChildProcess,
    NatsServer,
    RedisServer,
    TlsFiles,
    free_port,
    preferred_port,
    spawn,
    stack_users,
    wait_for_port,
    write_credentials,
)
from thunderagent.shell.argtypes import sched_params
from thunderagent.stack.engine_flags import (
    DEFAULT_MODEL,
    adapter_names,
)
from thunderagent.stack.readiness import wait_until_ready

ENTRY_POINTS = ("nats", "gateway", "gateway-embedded")
"""Where benchmark clients send requests: NATS (router services), HTTP through a gateway in
front of router services, or HTTP through gateways that route themselves (no router service)."""


def entry_point_settings(via: str, routers: int = 1) -> dict:
    """``StackConfig`` fields for clients entering through ``via`` (``ENTRY_POINTS``)."""
    if via not in ENTRY_POINTS:
        raise ValueError(f"unknown entry point {via!r} (one of {', '.join(ENTRY_POINTS)})")
    embedded = via == "gateway-embedded"
    return {
        "gateways": 0 if via == "nats" else 1,
        "gateway_embed_router": embedded,
        "routers": 0 if embedded else routers,  # nothing else sends requests to a router
    }


@dataclass(kw_only=True)
class StackConfig:
    workers: int = 4
    nats_url: str | None = None
    redis_url: str | None = None
    model: str = DEFAULT_MODEL
    profile: str = "llama-3.1-8b-h100"
    block_size: int = 16
    policy: str = "thunder"
    routers: int = 1
    speedup: float = 1.0
    run_dir: Path | None = None
    run_dir_prefix: str = "thunderagent-"
    """Without ``run_dir``: the name the stack's own temp folder starts with (a benchmark's)."""
    metrics: bool = False
    auth: bool = True
    """Generate NATS logins (per role, per worker) for an embedded server; False: open bus."""
    tls_cert: Path | None = None
    tls_key: Path | None = None
    gateways: int = 0
    """HTTP gateway processes; ``up`` starts one (its flag's default), benchmarks opt in."""
    gateway_port: int = 8000
    gateway_embed_router: bool = False
    """Gateways run ``--embed-router`` (with the stack's policy and Redis)."""
    kv_pool: bool = False
    kv_pool_scale: int = 1
    kv_blocks: int | None = None
    engine: str = "timed"
    """Simulated engines' mode: ``timed`` (roofline model) or ``instant`` (zero compute)."""
    kv_events: bool = True
    """Whether the simulated engines publish KV events (SGLang's default is not to)."""
    dp_size: int = 1
    """Data-parallel ranks per simulated engine; each rank is a worker of the fleet."""
    lora_adapters: list[str] = field(default_factory=list)
    """LoRA adapters every simulated engine serves."""
    prefill_workers: int = 0
    """PD: the first this many workers prefill, the others decode (0: no PD)."""
    pd_via: str = "sglang"
    """``sglang``: engines in SGLang's PD modes; ``workers``: the workers move the KV."""
    scheduler_args: list[str] = field(default_factory=list)
    """Extra ``thunderagent scheduler`` flags (benchmarks: ``--param FIELD=VALUE``)."""
    migration_args: list[str] = field(default_factory=list)
    """Extra ``thunderagent migration`` flags (benchmarks: ``--orders-only``, ``--param``)."""
    engine_args: list[str] = field(default_factory=list)
    """Extra ``thunderagent simengine`` flags (benchmarks: ``--kv-pull-gbps``)."""
    pull_min_tokens: int | None = None
    """The scheduler's and routers' ``--pull-min-tokens`` (0: no pull at dispatch); None:
    their default."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> StackConfig:
        """Raises ``ValueError`` for flags that are wrong only together."""
        if (args.tls_cert is None) != (args.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together (NATS would run without TLS)")
        if args.prefill_workers and not 0 < args.prefill_workers < args.workers:
            raise ValueError("--prefill-workers must be below --workers (no decode worker left)")
        if args.prefill_workers and args.engine == "instant":
            raise ValueError("--prefill-workers needs timed engines (--engine instant has no PD)")
        try:  # as the stack's scheduler will build them
            sched_params(args.sched_param, "pd_uncapped" if args.prefill_workers else "thunder")
        except ValueError as err:
            raise ValueError(f"--sched-param {err}") from None
        return cls(
            workers=args.workers,
            nats_url=args.nats,
            redis_url=args.redis,
            model=args.model,
            profile=args.profile,
            block_size=args.block_size,
            policy=args.policy,
            routers=args.routers,
            speedup=args.speedup,
            run_dir=Path(args.run_dir) if args.run_dir else None,
            metrics=args.metrics,
            auth=args.auth,
            tls_cert=Path(args.tls_cert) if args.tls_cert else None,
            tls_key=Path(args.tls_key) if args.tls_key else None,
            gateways=args.gateways,
            gateway_port=args.gateway_port,
            gateway_embed_router=args.gateway_embed_router,
            kv_pool=args.kv_pool,
            kv_pool_scale=args.kv_pool_scale,
            kv_blocks=args.kv_blocks,
            engine=args.engine,
            kv_events=args.kv_events == "on",
            dp_size=args.dp_size,
            lora_adapters=adapter_names(args.lora_paths),
            prefill_workers=args.prefill_workers,
            pd_via=args.pd_via,
            scheduler_args=[f"--param={item}" for item in args.sched_param],
        )


@dataclass
class Stack:
    """A running stack; :meth:`stop` is idempotent."""

    config: StackConfig
    run_dir: Path
    nats_url: str = ""
    redis_url: str = ""
    children: list[ChildProcess] = field(default_factory=list)
    servers: list[NatsServer | RedisServer] = field(default_factory=list)
    engine_urls: list[str] = field(default_factory=list)
    metrics_ports: dict[str, int] = field(default_factory=dict)
    creds_dir: Path | None = None
    """One credentials file per login (mode 0600); None: the bus has no authentication."""
    _saved_creds_env: str | None = None
    gateway_url: str = ""

    @classmethod
    def start(cls, config: StackConfig) -> Stack:
        run_dir = config.run_dir or Path(tempfile.mkdtemp(prefix=config.run_dir_prefix))
        run_dir.mkdir(parents=True, exist_ok=True)
        stack = cls(config=config, run_dir=run_dir)
        try:
            stack._start_servers()
            stack._start_services()
            asyncio.run(
                wait_until_ready(
                    stack.nats_url,
                    stack.expected_services(),
                    config.workers * config.dp_size,
                    check=stack.raise_if_a_child_died,
                )
            )
            if stack.gateway_url:
                wait_for_port(int(stack.gateway_url.rsplit(":", 1)[1]), timeout_s=30)
        except BaseException:
            stack.stop()
            raise
        return stack

    def _start_servers(self) -> None:
        if self.config.nats_url:
            self.nats_url = self.config.nats_url
        else:
            # NATS's usual port when free, so `thunderagent request` finds it without --nats
            nats = self._embedded_nats()
            self.servers.append(nats.start())
            self.nats_url = nats.url
        if self.config.redis_url:
            self.redis_url = self.config.redis_url
        else:
            redis = RedisServer(self.run_dir / "redis").start()
            self.servers.append(redis)
            self.redis_url = redis.url

    def _embedded_nats(self) -> NatsServer:
        """NATS's usual port when free, logins for every role and worker unless ``--no-auth``;
        this process's own clients (readiness, demo, benchmarks) find them in the environment."""
        c = self.config
        tls = TlsFiles(c.tls_cert, c.tls_key) if c.tls_cert and c.tls_key else None
        users = stack_users((f"w{i}" for i in range(c.workers)), c.dp_size) if c.auth else []
        if users:
            self.creds_dir = write_credentials(
                self.run_dir / "creds", users, ca=tls.trust if tls else None
            )
            self._saved_creds_env = os.environ.get(CREDS_ENV)
            os.environ[CREDS_ENV] = str(self.creds_dir)
        return NatsServer(self.run_dir / "nats", port=preferred_port(4222), users=users, tls=tls)

    def _creds_env(self, name: str) -> dict[str, str]:
        """A child's own credentials file (router-1 -> router.json, worker-w0 -> worker-w0.json)."""
        if self.creds_dir is None or name.startswith("engine-"):
            return {}
        identity = name if name.startswith("worker-") else name.split("-")[0]
        return {CREDS_ENV: str(self.creds_dir / f"{identity}.json")}

    def _service(self, name: str, *argv: str) -> None:
        cmd = [sys.executable, "-m", "thunderagent.cli.main", *argv]
        if self.config.metrics and argv[0] != "simengine":
            port = free_port()
            self.metrics_ports[name] = port
            cmd += ["--metrics-port", str(port)]
        log_path = self.run_dir / f"{name}.log"
        self.children.append(spawn(name, cmd, log_path=log_path, env=self._creds_env(name)))

    def _start_services(self) -> None:
        c = self.config
        nats = ["--nats", self.nats_url]
        self._service("index", "index", *nats, "--redis", self.redis_url)
        pulls = [] if c.pull_min_tokens is None else ["--pull-min-tokens", str(c.pull_min_tokens)]
        pd = ["--policy", "pd_uncapped"] if c.prefill_workers else []
        self._service("scheduler", "scheduler", *nats, *pulls, *pd, *c.scheduler_args)
        for i in range(c.routers):
            self._service(f"router-{i}", "router", *nats, "--policy", c.policy,
                          "--redis", self.redis_url, *pulls)  # fmt: skip
        self._start_gateways()
        self._service("migration", "migration", *nats, *c.migration_args)
        self._start_workers(nats)

    def _start_workers(self, nats: list[str]) -> None:
        """A simulated engine and its worker adapter per worker."""
        c = self.config
        pool = ["--kv-pool", "--kv-pool-scale", str(c.kv_pool_scale)] if c.kv_pool else []
        if c.kv_blocks is not None:
            pool += ["--kv-blocks", str(c.kv_blocks)]
        for i in range(c.workers):
            port = free_port()
            events = json.dumps(
                {  # any free port: the engine reports what it bound in /server_info
                    "publisher": "zmq",
                    "endpoint": "tcp://127.0.0.1:*",
                    "replay_endpoint": "tcp://127.0.0.1:*",
                    "topic": "kv",
                    # SGLang connects a PUB socket to a concrete host; bind it here instead
                    "bind": True,
                }
                if c.kv_events
                else {"publisher": "null"}  # SGLang's default
            )
            self._service(
                f"engine-{i}", "simengine", "--port", str(port), "--model", c.model,
                "--profile", c.profile, "--page-size", str(c.block_size),
                "--kv-events-config", events, "--speedup", str(c.speedup), *pool,
                "--engine", c.engine, "--dp-size", str(c.dp_size), *c.engine_args,
                *(["--lora-paths", *c.lora_adapters] if c.lora_adapters else []),
                *self._pd_mode(i),
            )  # fmt: skip
            url = f"http://127.0.0.1:{port}"
            self.engine_urls.append(url)
            self._service(
                f"worker-w{i}", "worker", *nats, "--worker-id", f"w{i}", "--engine-url", url,
                *self._pd_role(i),
            )  # fmt: skip

    def _pd_side(self, i: int) -> str:
        return "prefill" if i < self.config.prefill_workers else "decode"

    def _pd_mode(self, i: int) -> list[str]:
        """Engine ``i``'s SGLang PD flag: its worker takes the role from it."""
        if not self.config.prefill_workers or self.config.pd_via != "sglang":
            return []
        return ["--disaggregation-mode", self._pd_side(i)]

    def _pd_role(self, i: int) -> list[str]:
        """Worker ``i``'s role when the workers move the KV (its engine is whole)."""
        if not self.config.prefill_workers or self.config.pd_via != "workers":
            return []
        return ["--role", self._pd_side(i)]

    def _start_gateways(self) -> None:
        """One port for every gateway process (SO_REUSEPORT): the kernel spreads connections."""
        if self.config.gateways <= 0:
            return
        port = preferred_port(self.config.gateway_port)
        share = ["--reuse-port"] if self.config.gateways > 1 else []
        if self.config.gateway_embed_router:
            share += ["--embed-router", "--policy", self.config.policy, "--redis", self.redis_url]
        for i in range(self.config.gateways):
            self._service(
                f"gateway-{i}", "gateway", "--nats", self.nats_url, "--port", str(port), *share
            )
        self.gateway_url = f"http://127.0.0.1:{port}"

    def expected_services(self) -> list[str]:
        gateway = ["gateway"] if self.config.gateways > 0 else []
        router = ["router"] if self.config.routers > 0 else []
        return ["index", "scheduler", *router, "migration", *gateway]

    def raise_if_a_child_died(self) -> None:
        dead = self.dead_children()
        if dead:
            child = dead[0]
            raise RuntimeError(
                f"{child.name} exited with {child.popen.returncode} while starting; "
                f"its log ({child.log_path}) ends with:\n{child.tail()}"
            )

    def dead_children(self) -> list[ChildProcess]:
        return [c for c in self.children if not c.alive()]

    def restart(self, child: ChildProcess) -> None:
        """Start an exited child again with the same command (an engine on the same HTTP
        port). A restarted engine binds new KV-event ports (``*``), which its adapter reads
        from ``/server_info`` only when it starts: the adapter is restarted after it."""
        self.children[self.children.index(child)] = child.respawn()
        if child.name.startswith("engine-"):
            name = f"worker-w{child.name.removeprefix('engine-')}"
            adapter = next((c for c in self.children if c.name == name), None)
            if adapter is not None:
                adapter.stop()
                self.children[self.children.index(adapter)] = adapter.respawn()

    def stop(self) -> None:
        # Workers and engines first, so adapters deregister while NATS is still up.
        for child in reversed(self.children):
            if child.alive():
                child.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for child in self.children:
            child.stop(grace_s=max(0.1, deadline - time.monotonic()))
        for server in reversed(self.servers):
            server.stop()
        self.children.clear()
        self.servers.clear()
        if self.config.run_dir is None:  # a folder of our own: its logs and creds stay, not the
            shutil.rmtree(self.run_dir / "nats" / "jetstream", ignore_errors=True)  # streams
        if self.creds_dir is not None and os.environ.get(CREDS_ENV) == str(self.creds_dir):
            if self._saved_creds_env is None:
                os.environ.pop(CREDS_ENV, None)
            else:
                os.environ[CREDS_ENV] = self._saved_creds_env


def _this_command() -> str:
    """How the user started ``thunderagent`` (``.venv/bin/thunderagent``: not on every PATH)."""
    launched = sys.argv[0] if sys.argv else ""
    return launched if Path(launched).name == "thunderagent" else "thunderagent"


def describe(stack: Stack) -> str:
    c = stack.config
    fleet = f"{c.workers} simulated worker{'' if c.workers == 1 else 's'}"
    if c.dp_size > 1:
        fleet = (f"{c.workers} simulated engine{'' if c.workers == 1 else 's'} x {c.dp_size} "
                 f"data-parallel ranks ({c.workers * c.dp_size} workers)")  # fmt: skip
    if c.prefill_workers:
        how = "SGLang's PD modes" if c.pd_via == "sglang" else "the workers moving the KV"
        fleet += (f" ({c.prefill_workers} prefill, {c.workers - c.prefill_workers} decode: "
                  f"{how})")  # fmt: skip
    lines = [
        f"ThunderAgent is up: {fleet} serving {c.model!r}",
        f"  NATS   {stack.nats_url}",
    ]
    if stack.gateway_url:
        lines.append(f"  OpenAI {stack.gateway_url}/v1  (HTTP gateway)")
    lines += [
        f"  Redis  {stack.redis_url}",
        f"  logs   {stack.run_dir}",
    ]
    creds = ""
    if stack.creds_dir is not None:
        lines.append(f"  creds  {stack.creds_dir}  (one 0600 file per login; clients: client.json)")
        creds = f" --creds {stack.creds_dir / 'client.json'}"
    lines += [
        "Try:",
        f"  {_this_command()} request --nats {stack.nats_url}{creds} --model {c.model} "
        "'Hello, ThunderAgent'",
    ]
    if stack.gateway_url:
        body = {"model": c.model, "messages": [{"role": "user", "content": "Hello"}],
                "max_tokens": 16}  # fmt: skip
        lines.append(f"  curl -s {stack.gateway_url}/v1/chat/completions "
                     f"-H 'Content-Type: application/json' -d '{json.dumps(body)}'")  # fmt: skip
    lines.append("Ctrl-C stops everything.")
    for name, port in stack.metrics_ports.items():
        lines.insert(4, f"  metrics {name}: http://127.0.0.1:{port}/metrics")
    return "\n".join(lines)


@dataclass
class RestartBudget:
    """``up`` restarts a child that exits, as compose's ``restart: on-failure`` would: the
    services are built to ride out a peer's restart (a router replica, the scheduler, an
    engine behind its adapter). A child that keeps exiting is a fault to report: past
    ``max_restarts`` within ``window_s`` the stack stops."""

    max_restarts: int = 5
    window_s: float = 60.0
    _recent: dict[str, list[float]] = field(default_factory=dict)

    def spend(self, name: str, now: float) -> bool:
        """May ``name``, which exited at ``now``, be started again?"""
        times = [t for t in self._recent.get(name, []) if now - t < self.window_s]
        if len(times) >= self.max_restarts:
            return False
        self._recent[name] = [*times, now]
        return True


def run_up(config: StackConfig) -> int:
    stop_requested = False

    def on_signal(signum, _frame) -> None:
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        stack = Stack.start(config)
    except Exception as err:
        print(f"thunderagent up failed: {err}", file=sys.stderr)
        return 1
    print(describe(stack), flush=True)
    budget = RestartBudget()
    try:
        while not stop_requested:
            for child in stack.dead_children():
                code, now = child.popen.returncode, time.monotonic()
                print(f"{child.name} exited ({code}):\n{child.tail()}", file=sys.stderr)
                if not budget.spend(child.name, now):
                    times = f"{budget.max_restarts + 1} times within {budget.window_s:g} s"
                    print(f"{child.name} exited {times}: stopping the stack", file=sys.stderr)
                    return 1
                print(f"restarting {child.name}; the rest of the stack keeps serving",
                      file=sys.stderr, flush=True)  # fmt: skip
                stack.restart(child)
            time.sleep(0.2)
        return 0
    finally:
        print("stopping ...", flush=True)
        stack.stop()
        print(f"stopped. Logs and credentials stay in {stack.run_dir}", flush=True)
