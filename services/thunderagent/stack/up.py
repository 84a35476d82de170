"""``thunderagent up``: start everything as child processes, wait until it serves, stop cleanly.

Every child dies with this process (PR_SET_PDEATHSIG) and is stopped with SIGTERM on Ctrl-C or
SIGTERM, so nothing is left behind. ``--nats`` / ``--redis`` use existing servers instead of
starting embedded ones.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from thunderagent.embedded import (
    ChildProcess,
    NatsServer,
    RedisServer,
    free_port,
    preferred_port,
    spawn,
)
from thunderagent.stack.readiness import wait_until_ready

DEFAULT_MODEL = "sim/llama-3.1-8b"


def add_stack_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=4, help="simulated workers to start")
    p.add_argument("--nats", default=None, help="use this NATS server instead of an embedded one")
    p.add_argument("--redis", default=None, help="use this Redis instead of an embedded one")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--profile", default="llama-3.1-8b-h100", help="simulated engine profile")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--policy", default="thunder", help="routing policy")
    p.add_argument("--routers", type=int, default=1, help="router replicas")
    p.add_argument(
        "--speedup", type=float, default=1.0, help="simulated engines run this much faster"
    )
    p.add_argument("--run-dir", default=None, help="logs and data (default: a new temp folder)")
    p.add_argument("--metrics", action="store_true", help="serve Prometheus metrics per service")


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
    metrics: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> StackConfig:
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

    @classmethod
    def start(cls, config: StackConfig) -> Stack:
        run_dir = config.run_dir or Path(tempfile.mkdtemp(prefix="thunderagent-"))
        run_dir.mkdir(parents=True, exist_ok=True)
        stack = cls(config=config, run_dir=run_dir)
        try:
            stack._start_servers()
            stack._start_services()
            asyncio.run(
                wait_until_ready(
                    stack.nats_url,
                    stack.expected_services(),
                    config.workers,
                    check=stack.raise_if_a_child_died,
                )
            )
        except BaseException:
            stack.stop()
            raise
        return stack

    def _start_servers(self) -> None:
        if self.config.nats_url:
            self.nats_url = self.config.nats_url
        else:
            # NATS's usual port when free, so `thunderagent request` finds it without --nats
            nats = NatsServer(self.run_dir / "nats", port=preferred_port(4222)).start()
            self.servers.append(nats)
            self.nats_url = nats.url
        if self.config.redis_url:
            self.redis_url = self.config.redis_url
        else:
            redis = RedisServer(self.run_dir / "redis").start()
            self.servers.append(redis)
            self.redis_url = redis.url

    def _service(self, name: str, *argv: str) -> None:
        cmd = [sys.executable, "-m", "thunderagent.cli.main", *argv]
        if self.config.metrics and argv[0] != "simengine":
            port = free_port()
            self.metrics_ports[name] = port
            cmd += ["--metrics-port", str(port)]
        log_path = self.run_dir / f"{name}.log"
        self.children.append(spawn(name, cmd, log_path=log_path))

    def _start_services(self) -> None:
        c = self.config
        nats = ["--nats", self.nats_url]
        self._service("index", "index", *nats, "--redis", self.redis_url)
        self._service("scheduler", "scheduler", *nats)
        for i in range(c.routers):
            self._service(
                f"router-{i}", "router", *nats, "--policy", c.policy, "--redis", self.redis_url
            )
        for i in range(c.workers):
            port, events_port, replay_port = free_port(), free_port(), free_port()
            events = json.dumps(
                {
                    "publisher": "zmq",
                    "endpoint": f"tcp://127.0.0.1:{events_port}",
                    "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
                    "topic": "kv",
                    # SGLang connects a PUB socket to a concrete host; bind it here instead
                    "bind": True,
                }
            )
            self._service(
                f"engine-{i}", "simengine", "--port", str(port), "--model", c.model,
                "--profile", c.profile, "--page-size", str(c.block_size),
                "--kv-events-config", events, "--speedup", str(c.speedup),
            )  # fmt: skip
            url = f"http://127.0.0.1:{port}"
            self.engine_urls.append(url)
            self._service(
                f"worker-w{i}", "worker", *nats, "--worker-id", f"w{i}", "--engine-url", url
            )

    def expected_services(self) -> list[str]:
        return ["index", "scheduler", "router"]

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


def describe(stack: Stack) -> str:
    c = stack.config
    lines = [
        f"ThunderAgent is up: {c.workers} simulated workers serving {c.model!r}",
        f"  NATS   {stack.nats_url}",
        f"  Redis  {stack.redis_url}",
        f"  logs   {stack.run_dir}",
        "Try:",
        f"  thunderagent request --nats {stack.nats_url} --model {c.model} 'Hello, ThunderAgent'",
        "Ctrl-C stops everything.",
    ]
    for name, port in stack.metrics_ports.items():
        lines.insert(4, f"  metrics {name}: http://127.0.0.1:{port}/metrics")
    return "\n".join(lines)


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
    try:
        while not stop_requested:
            dead = stack.dead_children()
            if dead:
                for child in dead:
                    print(f"{child.name} exited ({child.popen.returncode}):\n{child.tail()}",
                          file=sys.stderr)  # fmt: skip
                return 1
            time.sleep(0.2)
        return 0
    finally:
        print("stopping ...", flush=True)
        stack.stop()
        print("stopped.", flush=True)
